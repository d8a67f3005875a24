"""The simulator's plot (`--plot`): draft pages held per executor step, one panel per row of the table."""
from __future__ import annotations

from .run_result import PlotTrace, RunResult
from .scenario import SimSetup


def write_plot(results: list[RunResult], path: str) -> None:
    """One panel per row of the table: draft pages held (all requests) per executor step.

    Each panel draws the pool's capacity and, per step, the per-request estimate times the requests then
    holding a mirror (`estimate_curve`: the sum the occupancy is comparable with) as lines,
    the drafter's foreign-page accesses (cumulative) on a secondary axis, and a
    run that died (resize failure) or refused requests with its error text.
    Rows of one run sit side by side when both sizings ran.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError as err:  # an optional extra
        raise SystemExit(f"--plot needs matplotlib (pip install -e '.[plot]'): {err}") from None
    n = max(len(results), 1)
    ncols = 2 if n > 1 else 1
    nrows = -(-n // ncols)
    header = 0.55 if ncols > 1 else 0.75  # inches above the panels: title and legend
    height = 3.0 * nrows + header
    fig, axes = plt.subplots(nrows, ncols, figsize=(7.2 * ncols, height), squeeze=False)
    for ax, r in zip(axes.flat, results):
        _plot_panel(ax, r)
    for ax in list(axes.flat)[len(results) :]:
        ax.set_visible(False)
    handles = [
        Line2D([], [], color="C0", lw=1.8, label="draft pages held (all requests)"),
        Line2D([], [], color="0.25", ls="--", lw=1.2, label="draft pool capacity"),
        Line2D([], [], color="C2", ls=":", lw=1.6, label="estimate x requests holding a mirror"),
        Line2D([], [], color="C3", lw=1.4, label="foreign accesses, cumulative (right axis)"),
    ]
    if any(r.resize_failures for r in results):
        handles.append(Line2D([], [], color="red", ls="-.", lw=1.2, label="the run died (resize failure)"))
    fig.suptitle(
        "Draft-pool occupancy per executor step (disaggregated runs: the generation worker)",
        y=1 - 0.08 / height, va="top", fontsize=10,
    )
    fig.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.32 / height),
        ncol=len(handles) if ncols > 1 else 3, fontsize=8, frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - header / height))
    panels = "; ".join(f"{r.name}/{r.sizing}" for r in results)
    metadata = {"Title": "Draft-pool occupancy", "Description": f"{len(results)} panels: {panels}"}
    fig.savefig(path, dpi=110, metadata=metadata)
    plt.close(fig)


def estimate_curve(r: RunResult) -> list[int]:
    """Per executor step, what the estimator charged the requests then holding a draft mirror: the
    per-request estimate times their number. The plot draws it against the all-requests occupancy (the
    per-request estimate alone is not comparable with a sum over requests). Without a per-step count
    (results built elsewhere), the estimate times the requests the run could have in flight."""
    est = r.estimated_draft_pages_per_request
    occupancy = list(r.draft_pool_occupancy)
    trace = getattr(r, "plot_trace", None)
    counts = list(trace.requests_per_step) if trace is not None else []
    if len(counts) == len(occupancy) and counts:
        return [est * n for n in counts]
    in_flight = min(len(r.prompt_tokens), r.max_concurrency or len(r.prompt_tokens))
    return [est * in_flight] * len(occupancy)


def _plot_panel(ax, r: RunResult) -> None:
    """One row of the table (see `write_plot`)."""
    from matplotlib.ticker import MaxNLocator

    occupancy = list(r.draft_pool_occupancy)
    trace = getattr(r, "plot_trace", None)
    est = r.estimated_draft_pages_per_request
    if trace is not None:
        capacity = trace.pool_pages
    else:  # results built elsewhere: the pool holds `pool_requests` charges
        capacity = (getattr(r, "setup", None) or SimSetup()).pool_requests * est
    steps = list(range(1, len(occupancy) + 1))
    ax.plot(steps, occupancy, color="C0", lw=1.8)
    ax.axhline(capacity, color="0.25", ls="--", lw=1.2)
    charged = estimate_curve(r)
    ax.plot(steps, charged, color="C2", ls=":", lw=1.6, drawstyle="steps-post")
    ax.text(1.0, capacity, f"pool {capacity}", transform=ax.get_yaxis_transform(), ha="right", va="bottom",
            fontsize=7, color="0.25")
    if charged:
        ax.text(1.0, max(charged), f"estimate {est} x requests", transform=ax.get_yaxis_transform(), ha="right",
                va="bottom", fontsize=7, color="C2")
    last = max(len(occupancy), 1)
    ax.set_xlim(0, last + max(1, last // 40))
    headroom = 1.35 if r.first_error else 1.12  # room for the error text above the capacity line
    ax.set_ylim(0, max(capacity, max(occupancy, default=0), max(charged, default=0)) * headroom)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("executor step", fontsize=8)
    ax.set_ylabel("draft pages held", fontsize=8)
    ax.tick_params(labelsize=7)
    total = len(r.prompt_tokens)
    ax.set_title(
        f"{r.name} / {r.sizing} ({r.mode}): {r.finished}/{total} finished, "
        f"peak {r.peak_draft_pages_per_request}/{est} pages per request, {r.foreign_page_accesses:,} foreign",
        fontsize=8.5,
    )
    _plot_foreign(ax, r, trace, last, headroom)
    if r.first_error:
        _plot_failure(ax, r, occupancy)


def _plot_foreign(ax, r: RunResult, trace: PlotTrace | None, last: int, headroom: float) -> None:
    """Foreign accesses per executor step on a twin axis of ``ax`` (without a trace: the total at step ``last``)."""
    from matplotlib.ticker import MaxNLocator

    # foreign accesses: their own axis (zero is a flat line at the bottom)
    twin = ax.twinx()
    foreign = list(trace.foreign_per_step) if trace is not None else []
    if foreign:
        twin.plot(range(1, len(foreign) + 1), foreign, color="C3", lw=1.4)
    elif r.foreign_page_accesses:  # no per-step trace: the total at the last step
        twin.plot([last], [r.foreign_page_accesses], "o", color="C3")
    top = max(foreign + [r.foreign_page_accesses])
    twin.set_ylim(0, max(top, 1) * headroom)
    twin.yaxis.set_major_locator(MaxNLocator(integer=True))
    twin.set_ylabel("foreign accesses", fontsize=8, color="C3")
    twin.tick_params(labelsize=7, colors="C3")


def _plot_failure(ax, r: RunResult, occupancy: list) -> None:
    """Mark where the run died (after ``len(occupancy)`` steps) and box its first error on ``ax``."""
    import textwrap

    died = r.resize_failures > 0
    if died:
        ax.axvline(len(occupancy) + 0.5, color="red", ls="-.", lw=1.2)
    head = ""
    if died:
        head = f"died after {len(occupancy)} steps: " if occupancy else "died before its first step: "
    color = "red" if died else "C1"
    ax.text(
        0.02, 0.97, textwrap.fill(head + r.first_error, width=70), transform=ax.transAxes, ha="left", va="top",
        fontsize=6.8, color=color, bbox=dict(boxstyle="round,pad=0.3", fc="white", ec=color, alpha=0.9),
    )
