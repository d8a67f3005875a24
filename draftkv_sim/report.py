"""The simulator's report: the result table, the disaggregated and block-reuse comparisons, the JSON."""
from __future__ import annotations

import json
import textwrap

from tensorrt_llm_draftkv.speculative.handoff import DrafterHandoff
from .run_result import RunResult
from .scenario import Scenario


#: The compact table's width (a terminal's): every line fits; `--wide` gives every column on one line per row.
TABLE_WIDTH = 120


def format_table(results: list[RunResult], *, wide: bool = False) -> str:
    """The rows, under a caption naming the drafter and over a legend of the less obvious columns.

    Compact (default): every line fits `TABLE_WIDTH` columns; tok/s and warmup are left out (a skipped
    warmup is an event) and each row's events and first error go on indented lines below it. `wide`:
    every column and the events on the row's own line (as `--wide` prints it)."""
    caption = _caption(results)
    body = _wide_rows(results) if wide else _compact_rows(results)
    return "\n".join([*caption, *body, "", *_legend()])


def fit_lines(text: str, width: int = TABLE_WIDTH) -> str:
    """`text` with every line longer than `width` wrapped, its continuation indented 4 past the line's own."""
    out = []
    for line in text.splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        out.extend(textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False))
    return "\n".join(out)


def _caption(results: list[RunResult]) -> list[str]:
    drafters = sorted({r.setup.drafter.label for r in results if r.setup is not None})
    pools = sorted({r.setup.pool_requests for r in results if r.setup is not None})
    if not drafters:
        return []
    sized = f"; pools sized by the estimator for {'/'.join(map(str, pools))} requests" if pools else ""
    return [f"drafter: {', '.join(drafters)} (a DFlash-style toy drafter; docs/glossary.md){sized}"]


def _legend() -> list[str]:
    text = (
        "peak/est: most draft pages one request held / the estimator's charge. handoff: drafter context a "
        "disaggregated generation worker received, as a share of the whole prompts'. reused: prompt tokens block "
        "reuse saved (t target, T target-all, j joint; /g: on the generation worker). events: docs/glossary.md"
    )
    return textwrap.wrap(text, TABLE_WIDTH)


def _compact_rows(results: list[RunResult]) -> list[str]:
    w = max([12, *(len(r.name) for r in results)])
    head = (
        f"{'run':<{w}} {'sizing':<7} {'mode':<6} {'finished':>8} {'fail':>4} {'foreign':>8} {'peak/est':>9} "
        f"{'accept':>6} {'= target':>8} {'reused':>17} {'handoff':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        total = len(r.prompt_tokens)
        match = "-" if r.output_matches_target is None else ("yes" if r.output_matches_target else "NO")
        peak = f"{r.peak_draft_pages_per_request}/{r.estimated_draft_pages_per_request}"
        lines.append(
            f"{r.name:<{w}} {r.sizing:<7} {r.mode[:6]:<6} {f'{r.finished}/{total}':>8} {r.resize_failures:>4} "
            f"{r.foreign_page_accesses:>8} {peak:>9} {r.acceptance_length:>6.3f} {match:>8} {_reuse_cell(r):>17} "
            f"{_handoff_cell(r):>7}"
        )
        events = " ".join(x for x in (row_events(r), "warmup=skipped" if r.skipped_warmups else "") if x)
        if events:
            lines.extend(textwrap.wrap(events, TABLE_WIDTH, initial_indent="    events: ",
                                       subsequent_indent=" " * 12, break_on_hyphens=False))
        if r.first_error:
            first = r.first_error.splitlines()[0]
            lead = "    error: "
            room = TABLE_WIDTH - len(lead)
            lines.append(lead + (first if len(first) <= room else first[: room - 3] + "..."))
    return lines


def _wide_rows(results: list[RunResult]) -> list[str]:
    w = max([12, *(len(r.name) for r in results)])  # the run column fits the longest name
    head = (
        f"{'run':<{w}} {'sizing':<8} {'mode':<6} {'finished':>9} {'resize fail':>11} {'foreign':>8} "
        f"{'peak/est pages':>15} {'warmup':>7} {'accept':>7} {'tok/s':>8} {'= target':>9} {'handoff':>8} "
        f"{'reused':>17}  events / first error"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        total = len(r.prompt_tokens)
        match = "-" if r.output_matches_target is None else ("yes" if r.output_matches_target else "NO")
        err = (r.first_error[:90] + "...") if len(r.first_error) > 90 else r.first_error
        err = "  ".join(x for x in (row_events(r), err) if x)
        lines.append(
            f"{r.name:<{w}} {r.sizing:<8} {r.mode[:6]:<6} {f'{r.finished}/{total}':>9} {r.resize_failures:>11} "
            f"{r.foreign_page_accesses:>8} {f'{r.peak_draft_pages_per_request}/{r.estimated_draft_pages_per_request}':>15} "
            f"{('skipped' if r.skipped_warmups else 'ok'):>7} {r.acceptance_length:>7.3f} {r.tokens_per_s:>8.1f} "
            f"{match:>9} {_handoff_cell(r):>8} {_reuse_cell(r):>17}  {err}".rstrip()
        )
    return lines


def _reuse_cell(r: RunResult) -> str:
    """`-` without block reuse, else the mode's tag and the prefill tokens saved (`j:196608`, `t:0`;
    `T:` for target-all); a disaggregated row adds the generation worker's hits (`j:196608/g:196608`)."""
    if r.block_reuse == "off":
        return "-"
    tag = {"target": "t", "target-all": "T", "joint": "j"}[r.block_reuse]
    gen = f"/g:{sum(r.gen_reused_tokens)}" if r.mode == "disaggregated" else ""
    return f"{tag}:{r.prefill_tokens_saved}{gen}"


def _handoff_cell(r: RunResult) -> str:
    """`-` (aggregated), `none`, or the drafter bytes sent as a share of the whole prompts' drafter context."""
    if r.drafter_handoff is None:
        return "-"
    if r.drafter_handoff == DrafterHandoff.NONE.value:
        return "none"
    if not r.full_drafter_bytes:
        return "0"
    return f"{100.0 * r.drafter_bytes_sent / r.full_drafter_bytes:.2f}%"


def format_pairs(results: list[RunResult]) -> str:
    """One line per disaggregated row with an aggregated twin: both acceptances and their ratio."""
    lines = []
    for r in results:
        if r.paired_run is None or r.acceptance_vs_paired is None:
            continue
        twin = next(a for a in results if a.name == r.paired_run and a.sizing == r.sizing)
        sent = ""
        if r.drafter_handoff == DrafterHandoff.WINDOW.value:
            sent = f", drafter context {r.drafter_bytes_sent:,} of {r.full_drafter_bytes:,} bytes"
        # Each line starts with the numbers, never a run name: a table reader keyed on names skips it.
        lines.append(
            f"accept {r.acceptance_length:.3f} / {twin.acceptance_length:.3f} = {r.acceptance_vs_paired:.3f}: "
            f"{r.name} vs {twin.name} ({r.sizing}, handoff {r.drafter_handoff}){sent}"
        )
    out = "disaggregated vs aggregated over the same prompts:\n  " + "\n  ".join(lines) if lines else ""
    reuse = format_reuse_pairs(results)
    return "\n\n".join(x for x in (out, reuse) if x)


def format_reuse_pairs(results: list[RunResult]) -> str:
    """One line per row with block reuse and a twin without: both acceptances, their ratio, tokens saved."""
    lines = []
    for r in results:
        if r.reuse_paired_run is None or r.acceptance_vs_no_reuse is None:
            continue
        twin = next(a for a in results if a.name == r.reuse_paired_run and a.sizing == r.sizing)
        gen = ""
        if r.mode == "disaggregated":
            gen = (
                f"; generation worker reused {sum(r.gen_reused_tokens):,}, handoff {r.handoff_bytes_sent:,} of "
                f"{r.handoff_bytes_without_gen_reuse:,} bytes ({r.handoff_bytes_saved:,} saved)"
            )
        lines.append(
            f"accept {r.acceptance_length:.3f} / {twin.acceptance_length:.3f} = {r.acceptance_vs_no_reuse:.3f}: "
            f"{r.name} vs {twin.name} ({r.sizing}, {r.mode}, {r.block_reuse} reuse), "
            f"{r.prefill_tokens_saved:,} of {sum(r.prompt_tokens):,} prompt tokens reused{gen}"
        )
    if not lines:
        return ""
    return "with block reuse vs without, over the same prompts:\n  " + "\n  ".join(lines)


def row_events(r: RunResult) -> str:
    """The counters that are not zero: reseeds and seed lag (exercised), then any violation: a request
    above the estimate (`over_est=peak/est`) and a pool that holds fewer such requests than it was sized
    for (`pool_holds=n/N`) come first, since the other columns can look healthy then."""
    estimate = []
    if r.peak_over_estimate:
        estimate.append(f"over_est={r.peak_draft_pages_per_request}/{r.estimated_draft_pages_per_request}")
    if r.pool_requests and r.requests_pool_holds_at_peak < r.pool_requests:
        estimate.append(f"pool_holds={r.requests_pool_holds_at_peak}/{r.pool_requests}")
    named = (
        ("reseeds", r.slot_reseeds),
        ("reseeds_without_handoff", r.reseeds_without_handoff),
        ("lag", r.max_seed_lag_tokens),
        ("handoff_fallbacks", r.handoff_fallbacks),
        ("stale", r.stale_reads),
        ("unbacked", r.unbacked_accesses),
        ("accounting", r.accounting_errors),
        ("shared_writes", r.shared_page_writes),
        ("refused", r.refused_requests),
        ("held_at_end", max(r.pages_held_at_end, 0)),
    )
    return " ".join([*estimate, *(f"{name}={value}" for name, value in named if value)])


def write_json(results: list[RunResult], path: str, scenario: Scenario | None = None) -> None:
    """One record per row; with the `scenario` that ran, each record carries its run's geometry."""
    records = [r.to_json(scenario) for r in results]
    with open(path, "w") as f:
        json.dump(records, f, indent=2)
        f.write("\n")
