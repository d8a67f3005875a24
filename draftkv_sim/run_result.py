"""One row of the simulator's table (`RunResult`) and how rows are paired with each other.

A row holds every counter of one (run, sizing) pair; `pair_runs` gives each
disaggregated row the aggregated row over the same prompts and geometry, and
`pair_reuse_runs` each block-reuse row the row without reuse.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .run_build import draft_pages_per_request
from .scenario import Scenario, SimSetup


@dataclass
class RunResult:
    name: str
    sizing: str
    mode: str
    prompt_tokens: list[int]
    finished: int
    resize_failures: int
    refused_requests: int
    first_error: str
    foreign_page_accesses: int
    stale_reads: int
    unbacked_accesses: int
    accounting_errors: int
    slot_reseeds: int
    max_seed_lag_tokens: int
    peak_draft_pages_per_request: int
    estimated_draft_pages_per_request: int
    acceptance_length: float
    output_matches_target: bool | None
    skipped_warmups: int
    tokens_per_s: float
    wall_s: float
    # Disaggregated handoff (None / 0 on aggregated rows): what the context worker sent for the drafter,
    # its bytes against the whole prompts' drafter context, and what the generation worker did with it.
    drafter_handoff: str | None = None
    drafter_bytes_sent: int = 0
    full_drafter_bytes: int = 0
    handoff_seeds: int = 0
    reseeds_without_handoff: int = 0
    handoff_fallbacks: int = 0
    # The aggregated run over exactly the same prompts and geometry, and this run's acceptance over its.
    paired_run: str | None = None
    acceptance_vs_paired: float | None = None
    # Block reuse: the mode, the common prefix of the prompts, each request's prefix hit (request order;
    # on the context worker when disaggregated) and their sum, the prompt tokens no worker computed.
    block_reuse: str = "off"
    shared_prefix: int = 0
    reused_tokens: list[int] = field(default_factory=list)
    prefill_tokens_saved: int = 0
    # Pages still held in any pool once every request finished (-1: not every request finished) and the
    # cached-free ones among the rest; the run without reuse over the same prompts and its acceptance ratio.
    pages_held_at_end: int = -1
    cached_free_pages_at_end: int = 0
    shared_page_writes: int = 0  # drafter writes to shared or published pages (must stay 0)
    reused_positions_checked: int = 0  # target K/V positions on reused pages checked against the tokens
    reuse_paired_run: str | None = None
    acceptance_vs_no_reuse: float | None = None
    # Disaggregated rows: the prefix each request's generation-init caches adopted on the generation worker
    # (request order), and the handoff's bytes (target K/V + drafter context) against what the same handoff
    # would have cost without the round trip that tells the context worker that hit.
    gen_reused_tokens: list[int] = field(default_factory=list)
    handoff_bytes_sent: int = 0
    handoff_bytes_without_gen_reuse: int = 0
    handoff_bytes_saved: int = 0
    transport: str | None = None  # disaggregated runs: the transfer engine, `nixl` or `torch`
    transfer_failures: dict[int, str] = field(default_factory=dict)  # request -> why its transfer failed
    # Against the estimate: did one request hold more draft pages than the estimator charges it, and how
    # many requests of that peak the pool (sized for `pool_requests` charges) holds at once: a run that
    # finishes only because its few requests had the pool to themselves shows here.
    peak_over_estimate: bool = False
    pool_requests: int = 0
    requests_pool_holds_at_peak: int = 0
    draft_pool_occupancy: list[int] = field(default_factory=list, repr=False)
    # The run's own geometry (the scenario's setup with the run's overrides) and its
    # in-flight limit; when unset, `to_json(scenario)` looks the run up by name.
    setup: SimSetup | None = field(default=None, repr=False)
    max_concurrency: int | None = None
    # What the plot reads beside the counters (foreign accesses per step, pool capacity); not in the JSON.
    plot_trace: "PlotTrace | None" = field(default=None, repr=False)

    def to_json(self, scenario: Scenario | None = None) -> dict:
        """The JSON record: every counter, plus the drafter, trail page, device and whole geometry (`setup`)."""
        setup, concurrency = self.setup, self.max_concurrency
        spec = next((s for s in scenario.runs if s.name == self.name), None) if scenario is not None else None
        if spec is not None:
            setup = setup or spec.setup_for(scenario.setup)
            concurrency = concurrency or spec.max_concurrency
        out = asdict(self)
        out.pop("draft_pool_occupancy")
        out.pop("plot_trace")
        out["max_concurrency"] = concurrency
        out["drafter"] = setup.drafter.label if setup else None
        out["trail_page"] = setup.trail_page if setup else None
        out["device"] = setup.device if setup else None
        out["setup"] = setup.to_dict() if setup else None
        return out


@dataclass
class PlotTrace:
    """What the plot reads beside a run's `RunResult`: set by `simulate` as `result.plot_trace`.

    Not a `RunResult` field, so it stays out of the JSON records.
    """

    foreign_per_step: list[int]  # cumulative foreign accesses after each executor step
    pool_pages: int  # pages of the run's draft pool (its capacity)
    requests_per_step: list[int] = field(default_factory=list)  # requests holding a draft mirror, per step


def against_estimate(setup: SimSetup, peak: int) -> dict:
    """`peak_over_estimate`, `pool_requests` and `requests_pool_holds_at_peak` of a run whose largest
    request held `peak` draft pages: the pool holds `pool_requests` estimator charges."""
    estimate = draft_pages_per_request(setup)
    pool_pages = setup.pool_requests * estimate
    holds = setup.pool_requests if peak <= 0 else min(setup.pool_requests, pool_pages // peak)
    return dict(peak_over_estimate=peak > estimate, pool_requests=setup.pool_requests,
                requests_pool_holds_at_peak=holds)


def pair_runs(results: list[RunResult]) -> None:
    """Give every disaggregated row the aggregated row of the same sizing over exactly the same prompts
    and geometry (`paired_run`), and its acceptance over that row's (`acceptance_vs_paired`).

    The number of drafter slots may differ (each run's own in-flight limit and slot count stay its own).
    """

    def geometry(setup: SimSetup | None) -> SimSetup | None:
        return None if setup is None else replace(setup, drafter_slots=1)

    for r in results:
        if r.mode != "disaggregated":
            continue
        for a in results:
            same_geometry = a.setup is None or r.setup is None or geometry(a.setup) == geometry(r.setup)
            if (
                a.mode == "aggregated" and a.sizing == r.sizing and a.prompt_tokens == r.prompt_tokens
                and a.shared_prefix == r.shared_prefix and a.block_reuse == r.block_reuse and same_geometry
            ):
                r.paired_run = a.name
                if a.acceptance_length > 0 and r.finished:
                    r.acceptance_vs_paired = round(r.acceptance_length / a.acceptance_length, 3)
                break


def pair_reuse_runs(results: list[RunResult]) -> None:
    """Give every row with block reuse the row without reuse over exactly the same prompts, mode, sizing and
    geometry (`reuse_paired_run`), and its acceptance over that row's (`acceptance_vs_no_reuse`)."""

    def geometry(setup: SimSetup | None) -> SimSetup | None:
        return None if setup is None else replace(setup, block_reuse="off")

    for r in results:
        if r.block_reuse == "off":
            continue
        for a in results:
            if (
                a.block_reuse == "off" and a.mode == r.mode and a.sizing == r.sizing
                and a.prompt_tokens == r.prompt_tokens and a.shared_prefix == r.shared_prefix
                and geometry(a.setup) == geometry(r.setup)
            ):
                r.reuse_paired_run = a.name
                if a.acceptance_length > 0 and r.finished:
                    r.acceptance_vs_no_reuse = round(r.acceptance_length / a.acceptance_length, 3)
                break
