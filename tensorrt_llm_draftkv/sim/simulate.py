"""Run the embedded scenarios: legacy vs history sizing, aggregated and disaggregated.

Every run builds real pools sized by the estimator, a tiny target with paged
attention and the DFlash drafter over the draft pool, and reports what an
operator would look at: finished requests, resize failures, foreign-page
accesses seen by the ownership checker, peak draft pages per request against
the estimate, acceptance length, throughput, and whether the speculative
output equals the target-only output token for token.
"""
from __future__ import annotations

import json
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Callable

import torch

from ..config import KVPoolConfig, LayerGroupConfig
from ..manager import DraftKVCacheManagerV2, KVCacheManagerV2
from ..manager.budget import group_pages_per_request
from ..manager import rules
from ..manager.rules import MirrorSizing
from ..speculative.handoff import DrafterHandoff
from .disagg import NO_HANDOFF, HandoffSettings, RankPool, foreign_accesses, run_disaggregated
from .drafting import build_speculator
from .engine import Executor, RunStats
from .prompts import shared_prefix_prompts
from .scenario import RunSpec, Scenario, SimSetup, prompt_seeds
from .scheduler import Scheduler, SchedulerConfig
from .target_model import TinyTarget, TinyTargetConfig


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


# -- building one executor ----------------------------------------------------------------
def target_pages_per_request(setup: SimSetup) -> int:
    return group_pages_per_request(
        setup.target_window,
        setup.tokens_per_block,
        max_seq_len=setup.max_seq_len,
        chunk=setup.chunk,
        max_draft_len=setup.max_draft_len,
        chunk_alignment=True,
    )


def draft_pages_per_request(setup: SimSetup) -> int:
    """What the estimator charges a request in the draft pool under the fix."""
    trail = rules.draft_slot_trail_tokens(
        rules.MirrorPolicy(setup.drafter),
        tokens_per_block=setup.tokens_per_block,
        any_windowed_group=True,  # the simulator's draft pool is one windowed group
        trail_page=setup.trail_page,
    )
    return group_pages_per_request(
        setup.draft_window,
        setup.tokens_per_block,
        max_seq_len=setup.max_seq_len,
        chunk=setup.chunk,
        max_draft_len=setup.max_draft_len,
        num_extra_kv_tokens=setup.draft_extra_tokens,
        trail_tokens=trail,
        chunk_alignment=True,
    )


def build_executor(
    setup: SimSetup,
    sizing: MirrorSizing | None,
    max_concurrency: int,
    drafter_slots: int,
    *,
    reserve_context_row: bool = False,
) -> Executor:
    """`sizing=None` builds the target-only reference (no draft pool, no drafter).

    `setup.block_reuse`: `target` turns block reuse on in the target pool with hits stopping short of the
    draft window (`keep_drafter_window`), `target-all` without that stop, `joint` in both pools too, with
    the draft manager's `joint_kv_cache_reuse` and `pair_joint_reuse`; either way a fresh prompt waits for
    an earlier one's prefill to finish (`SchedulerConfig.serial_prefill`), so its lookup sees every page.
    """
    device = setup.device
    reuse = setup.block_reuse != "off"
    joint = setup.block_reuse == "joint" and sizing is not None
    target_cfg = KVPoolConfig(
        (LayerGroupConfig(1, window=setup.target_window),),
        pages_per_group=(setup.pool_requests * target_pages_per_request(setup),),
        tokens_per_block=setup.tokens_per_block,
        num_kv_heads=1,
        head_dim=setup.target_dim,
        dtype=torch.float64,
        device=device,
        max_seq_len=setup.max_seq_len,
        enable_block_reuse=reuse,
    )
    target = KVCacheManagerV2.from_pool_config(target_cfg, max_draft_len=setup.max_draft_len)
    model = TinyTarget(TinyTargetConfig(vocab_size=setup.vocab_size, dim=setup.target_dim), target)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_tokens=setup.chunk + setup.pool_requests * (1 + setup.max_draft_len),
            max_num_requests=max_concurrency,
            max_batch_size=min(max_concurrency, drafter_slots) if sizing is not None else max_concurrency,
            chunk_size=setup.chunk,
            max_draft_len=setup.max_draft_len if sizing is not None else 0,
            reserve_context_row=reserve_context_row,
            serial_prefill=reuse,
        )
    )
    draft = speculator = None
    if sizing is not None:
        draft_cfg = KVPoolConfig(
            # One drafter layer per draft offset (see speculative/drafter.py).
            (LayerGroupConfig(setup.max_draft_len, window=setup.draft_window),),
            pages_per_group=(setup.pool_requests * draft_pages_per_request(setup),),
            tokens_per_block=setup.tokens_per_block,
            num_kv_heads=setup.draft_kv_heads,
            head_dim=setup.draft_head_dim,
            dtype=torch.float32,
            device=device,
            max_seq_len=setup.max_seq_len,
            enable_block_reuse=joint,
        )
        draft = DraftKVCacheManagerV2.from_pool_config(
            draft_cfg,
            spec_mode=setup.drafter,
            max_draft_len=setup.max_draft_len,
            num_extra_kv_tokens=setup.draft_extra_tokens,
            sizing=sizing,
            trail_page=setup.trail_page,
            joint_kv_cache_reuse=joint,
        )
        if joint:
            target.pair_joint_reuse(draft)
        elif setup.block_reuse == "target":
            target.keep_drafter_window(draft)  # the drafter computes every position it reads
        speculator = build_speculator(setup, draft, sizing, drafter_slots)
    return Executor(
        target_manager=target,
        target_model=model,
        scheduler=scheduler,
        max_new_tokens=setup.max_new_tokens,
        draft_manager=draft,
        speculator=speculator,
    )


def _prompts(setup: SimSetup, spec: RunSpec | tuple[int, ...]) -> list[torch.Tensor]:
    """A run's prompts (the shared prefix, if any, followed by each tail), or plain prompts of these lengths."""
    if isinstance(spec, RunSpec):
        return prompts_for(setup, spec.prompt_keys())
    return prompts_for(setup, list(zip(prompt_seeds(spec), spec)))


#: `(shared prefix tokens, tail seed, tail tokens)` (see `RunSpec.prompt_keys`), or `(seed, tokens)` for a
#: prompt without a shared prefix.
PromptKey = tuple[int, ...]


def prompts_for(setup: SimSetup, keys: list[PromptKey]) -> list[torch.Tensor]:
    """Prompt token ids for prompt keys, in order."""
    out: list[torch.Tensor] = []
    for key in keys:
        prefix, seed, n = key if len(key) == 3 else (0, *key)
        out.extend(shared_prefix_prompts(prefix, [n], [seed], vocab_size=setup.vocab_size))
    return out


def target_only_outputs(
    setup: SimSetup, keys: list[PromptKey], *, progress: Callable[[int, int], None] | None = None
) -> dict[PromptKey, list[int]]:
    """Greedy target-only outputs for prompt keys (`RunSpec.prompt_keys`): the reference every run must equal.

    Always without block reuse. `progress(steps, finished)` is called after every step."""
    executor = build_executor(replace(setup, block_reuse="off"), None, max_concurrency=4, drafter_slots=1)
    for rid, prompt in enumerate(prompts_for(setup, keys)):
        executor.add_request(rid, prompt)
    stats = executor.run(progress=progress)
    return {keys[rid]: out for rid, out in stats.outputs.items()}


def warmup_tokens(setup: SimSetup, prompts: tuple[int, ...]) -> int:
    """Warmup dummies as long as the longest request will get (`prompts`: whole prompt lengths)."""
    return max(prompts) + setup.max_new_tokens


def handoff_for(setup: SimSetup, sizing: MirrorSizing, *, fallback: bool = False) -> HandoffSettings:
    """The run's drafter handoff: the setup's under `history` sizing; `legacy` never sends one."""
    if sizing is not MirrorSizing.HISTORY or setup.drafter_handoff is DrafterHandoff.NONE:
        return NO_HANDOFF
    return HandoffSettings(setup.drafter_handoff, setup.handoff_form, fallback)


def _build_rank(
    rank: int, setup: SimSetup, sizing: MirrorSizing, max_concurrency: int, slots: int, warmup: int,
    fallback: bool = False,
) -> Executor:
    handoff = handoff_for(setup, sizing, fallback=fallback)
    if rank == 0:
        # The context worker computes the prompt and emits the first token: with the target alone,
        # or, when it hands the drafter context over, with the drafter storing its context as well.
        with_drafter = sizing if handoff.mode is DrafterHandoff.WINDOW else None
        executor = build_executor(replace(setup, max_new_tokens=1), with_drafter, max_concurrency, slots)
    else:
        executor = build_executor(setup, sizing, max_concurrency, slots)
        executor.warmup(num_dummies=1, token_num=warmup)
    executor.drafter_handoff = handoff
    return executor


# -- running ------------------------------------------------------------------------------
@dataclass
class PlotTrace:
    """What the plot reads beside a run's `RunResult`: set by `simulate` as `result.plot_trace`.

    Not a `RunResult` field, so it stays out of the JSON records.
    """

    foreign_per_step: list[int]  # cumulative foreign accesses after each executor step
    pool_pages: int  # pages of the run's draft pool (its capacity)
    requests_per_step: list[int] = field(default_factory=list)  # requests holding a draft mirror, per step


class _Progress:
    """One run's progress bar (tqdm, on stderr) and its per-step trace of foreign accesses.

    Called after every executor step: in aggregated runs by the executor, in
    disaggregated runs with the reports of both ranks (`rank` 1, the generation
    worker, finishes requests; rank 0 only says how many prompts it has sent).
    The trace is kept whether or not the bar is drawn.
    """

    def __init__(self, label: str, total: int, enabled: bool, position: int = 0) -> None:
        from tqdm import tqdm

        self.total = total
        self.foreign_per_step: list[int] = []
        self._sent = 0
        self.bar = tqdm(
            total=total, desc=f"  {label}", unit="req", leave=False, disable=not enabled, file=sys.stderr,
            position=position,
            dynamic_ncols=True, bar_format="{desc}: {n_fmt}/{total_fmt} req |{bar}| {elapsed}{postfix}",
        )

    def __call__(self, steps: int, finished: int, foreign: int = 0) -> None:
        """The generation side (the executor, or rank 1) after step `steps`."""
        while len(self.foreign_per_step) < steps:
            self.foreign_per_step.append(foreign)
        parts = [f"step {steps}"]
        if self._sent:
            parts.insert(0, f"prompts sent {self._sent}/{self.total}")
        if foreign:
            parts.append(f"foreign {foreign}")
        self.bar.set_postfix_str(", ".join(parts), refresh=False)
        self.bar.update(max(finished - self.bar.n, 0))  # redraws at most every 0.1 s

    def rank(self, rank: int, steps: int, finished: int, foreign: int) -> None:
        """A disaggregated rank's report (see `disagg.RankProgress`)."""
        if rank == 1:
            self(steps, finished, foreign)
        elif finished != self._sent:
            self._sent = finished
            self.bar.set_postfix_str(f"prompts sent {finished}/{self.total}", refresh=False)
            self.bar.update(0)

    def close(self) -> None:
        self.bar.refresh()  # the final count and step once, whatever the redraw interval skipped
        self.bar.close()


def run_one(
    setup: SimSetup,
    spec: RunSpec,
    sizing: MirrorSizing,
    *,
    progress: bool | _Progress = False,
    ranks: RankPool | None = None,
) -> tuple[RunStats, list[int]]:
    """One run. `progress`: draw a bar on stderr (True), or a `_Progress` to report to (bar and trace);
    `ranks`: rank processes kept across disaggregated runs (else spawned for this run)."""
    setup = spec.setup_for(setup)
    prompts = _prompts(setup, spec)
    slots = spec.drafter_slots or setup.drafter_slots
    bar = progress
    if not isinstance(bar, _Progress):
        bar = _Progress(f"{spec.name} ({sizing.value})", len(prompts), bool(progress))
    try:
        if spec.mode == "aggregated":
            executor = build_executor(
                setup, sizing, spec.max_concurrency, slots, reserve_context_row=spec.reserve_context_row
            )
            executor.warmup(num_dummies=1, token_num=warmup_tokens(setup, spec.prompt_lengths))
            for rid, prompt in enumerate(prompts):
                executor.add_request(rid, prompt)
            stats = executor.run(progress=lambda steps, finished: bar(steps, finished, foreign_accesses(executor)))
        else:
            build = partial(
                _build_rank,
                setup=setup,
                sizing=sizing,
                max_concurrency=spec.max_concurrency,
                slots=slots,
                warmup=warmup_tokens(setup, spec.prompt_lengths),
            )
            stats = run_disaggregated(build, prompts, progress=bar.rank, pool=ranks)
    finally:
        if bar is not progress:
            bar.close()
    return stats, prompt_seeds(spec.prompts)


def simulate(scenario: Scenario, sizings: list[MirrorSizing], *, progress: bool = False) -> list[RunResult]:
    # Target-only references, one per generation length the runs use.
    references: dict[int, dict] = {}
    for new_tokens in dict.fromkeys(spec.setup_for(scenario.setup).max_new_tokens for spec in scenario.runs):
        runs = [s for s in scenario.runs if s.setup_for(scenario.setup).max_new_tokens == new_tokens]
        keys = list(dict.fromkeys(key for s in runs for key in s.prompt_keys()))
        bar = _Progress(f"target-only reference ({new_tokens} new tokens)", len(keys), progress)
        try:
            references[new_tokens] = target_only_outputs(
                replace(scenario.setup, max_new_tokens=new_tokens), keys, progress=bar
            )
        finally:
            bar.close()
    results = []
    # Two rank processes for every disaggregated run: spawning them costs seconds each time.
    ranks = RankPool() if any(spec.mode == "disaggregated" for spec in scenario.runs) else None
    try:
        results = _run_all(scenario, sizings, references, progress, ranks)
    finally:
        if ranks is not None and not ranks.broken:
            ranks.close()
    return results


def _run_all(scenario: Scenario, sizings, references, progress, ranks) -> list[RunResult]:
    """Every (run, sizing) of the scenario, results in scenario order.

    The disaggregated runs work in the two rank processes, so they are driven
    from a thread of this process while this thread runs the aggregated ones:
    on two cores the two kinds overlap instead of taking turns.
    """
    jobs = [
        (spec, sizing)
        for spec in scenario.runs
        for sizing in sizings
        if spec.runs_under(sizing.value, scenario.setup)
    ]
    lanes = {"aggregated": 0, "disaggregated": 1}

    def execute(index: int) -> tuple[int, RunResult]:
        spec, sizing = jobs[index]
        bar = _Progress(f"{spec.name} ({sizing.value})", len(spec.prompts), progress, position=lanes[spec.mode])
        try:
            stats, _ = run_one(scenario.setup, spec, sizing, progress=bar, ranks=ranks)
        finally:
            bar.close()
        return index, _result(scenario, spec, sizing, stats, references, bar)

    disaggregated = [i for i, (spec, _) in enumerate(jobs) if spec.mode == "disaggregated"]
    aggregated = [i for i, (spec, _) in enumerate(jobs) if spec.mode != "disaggregated"]
    done: dict[int, RunResult] = {}
    with ThreadPoolExecutor(max_workers=1) as lane:
        remote = lane.submit(lambda: [execute(i) for i in disaggregated])
        try:
            done.update(execute(i) for i in aggregated)
        finally:
            done.update(remote.result())  # waits for the ranks; raises what they raised
    results = [done[i] for i in range(len(jobs))]
    pair_runs(results)
    pair_reuse_runs(results)
    return results


def _result(scenario: Scenario, spec, sizing: MirrorSizing, stats, references, bar: "_Progress") -> RunResult:
    """One table row from a run's stats."""
    setup = spec.setup_for(scenario.setup)
    reference = references[setup.max_new_tokens]
    keys = spec.prompt_keys()
    ctx = stats.context_worker or RunStats()  # disaggregated: the context worker's checker counts too
    matches = None
    if stats.outputs:
        matches = all(reference.get(keys[rid]) == out for rid, out in stats.outputs.items())
    return RunResult(
        name=spec.name,
        sizing=sizing.value,
        mode=spec.mode,
        prompt_tokens=list(spec.prompt_lengths),
        finished=stats.finished,
        resize_failures=stats.resize_failures,
        refused_requests=stats.refused_requests,
        first_error=stats.first_error,
        foreign_page_accesses=stats.foreign_page_accesses + ctx.foreign_page_accesses,
        stale_reads=stats.stale_reads + ctx.stale_reads,
        unbacked_accesses=stats.unbacked_accesses + ctx.unbacked_accesses,
        accounting_errors=stats.accounting_errors + ctx.accounting_errors,
        slot_reseeds=stats.slot_reseeds,
        max_seed_lag_tokens=stats.max_seed_lag_tokens,
        peak_draft_pages_per_request=stats.peak_draft_pages_per_request,
        estimated_draft_pages_per_request=draft_pages_per_request(setup),
        acceptance_length=round(stats.acceptance_length, 3),
        output_matches_target=matches,
        skipped_warmups=stats.skipped_warmups,
        tokens_per_s=round(stats.tokens_per_s, 1),
        wall_s=round(stats.wall_s, 2),
        drafter_handoff=(
            handoff_for(setup, sizing).mode.value if spec.mode == "disaggregated" else None
        ),
        drafter_bytes_sent=stats.drafter_bytes_sent,
        full_drafter_bytes=stats.full_drafter_bytes,
        handoff_seeds=stats.handoff_seeds,
        reseeds_without_handoff=stats.reseeds_without_handoff,
        handoff_fallbacks=stats.handoff_fallbacks,
        block_reuse=setup.block_reuse,
        shared_prefix=spec.shared_prefix,
        reused_tokens=[stats.reused_tokens.get(rid, 0) for rid in range(len(spec.prompts))],
        prefill_tokens_saved=stats.prefill_tokens_saved,
        pages_held_at_end=stats.pages_held_by_both,
        shared_page_writes=stats.shared_page_writes + ctx.shared_page_writes,
        reused_positions_checked=(
            stats.reused_positions_checked + stats.gen_reused_positions_checked + ctx.reused_positions_checked
        ),
        gen_reused_tokens=(
            [stats.gen_reused_tokens.get(rid, 0) for rid in range(len(spec.prompts))]
            if spec.mode == "disaggregated" else []
        ),
        handoff_bytes_sent=stats.handoff_bytes_sent,
        handoff_bytes_without_gen_reuse=stats.handoff_bytes_without_gen_reuse,
        handoff_bytes_saved=stats.handoff_bytes_saved,
        cached_free_pages_at_end=stats.cached_free_pages_at_end + (
            stats.context_worker.cached_free_pages_at_end if stats.context_worker else 0
        ),
        draft_pool_occupancy=stats.draft_pool_occupancy,
        **against_estimate(setup, stats.peak_draft_pages_per_request),
        setup=setup,
        max_concurrency=spec.max_concurrency,
        plot_trace=PlotTrace(
            bar.foreign_per_step, setup.pool_requests * draft_pages_per_request(setup),
            list(stats.draft_requests_per_step),
        ),
    )


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


# -- reporting ------------------------------------------------------------------------------
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
        events = " ".join(x for x in (_events(r), "warmup=skipped" if r.skipped_warmups else "") if x)
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
        err = "  ".join(x for x in (_events(r), err) if x)
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


def _events(r: RunResult) -> str:
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
    import textwrap

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
    # the failure, with its error text
    if r.first_error:
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
