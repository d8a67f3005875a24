"""Run the embedded scenarios: legacy vs history sizing, aggregated and disaggregated.

Every run builds real pools sized by the estimator, a tiny target with paged
attention and the DFlash drafter over the draft pool, and reports what an
operator would look at: finished requests, resize failures, foreign-page
accesses seen by the ownership checker, peak draft pages per request against
the estimate, acceptance length, throughput, and whether the speculative
output equals the target-only output token for token.
"""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial

from tensorrt_llm_draftkv.manager.rules import MirrorSizing
from .disagg import RankPool, foreign_accesses, run_disaggregated
from .engine import RunStats
from .run_build import (
    build_executor, build_rank, draft_pages_per_request, handoff_for, run_prompts, target_only_outputs,
    warmup_tokens,
)
from .run_result import PlotTrace, RunResult, against_estimate, pair_reuse_runs, pair_runs
from .scenario import RunSpec, Scenario, SimSetup, prompt_seeds


class RunProgress:
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
    progress: bool | RunProgress = False,
    ranks: RankPool | None = None,
) -> tuple[RunStats, list[int]]:
    """One run. `progress`: draw a bar on stderr (True), or a `RunProgress` to report to (bar and trace);
    `ranks`: rank processes kept across disaggregated runs (else spawned for this run)."""
    setup = spec.setup_for(setup)
    prompts = run_prompts(setup, spec)
    slots = spec.drafter_slots or setup.drafter_slots
    bar = progress
    if not isinstance(bar, RunProgress):
        bar = RunProgress(f"{spec.name} ({sizing.value})", len(prompts), bool(progress))
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
                build_rank,
                setup=setup,
                sizing=sizing,
                max_concurrency=spec.max_concurrency,
                slots=slots,
                warmup=warmup_tokens(setup, spec.prompt_lengths),
            )
            stats = run_disaggregated(build, prompts, progress=bar.rank, pool=ranks, transport=setup.transport)
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
        bar = RunProgress(f"target-only reference ({new_tokens} new tokens)", len(keys), progress)
        try:
            references[new_tokens] = target_only_outputs(
                replace(scenario.setup, max_new_tokens=new_tokens), keys, progress=bar
            )
        finally:
            bar.close()
    results = []
    # Two rank processes for every disaggregated run: spawning them costs seconds each time.
    disaggregated = any(spec.mode == "disaggregated" for spec in scenario.runs)
    ranks = RankPool(transport=scenario.setup.transport) if disaggregated else None
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
        bar = RunProgress(f"{spec.name} ({sizing.value})", len(spec.prompts), progress, position=lanes[spec.mode])
        try:
            stats, _ = run_one(scenario.setup, spec, sizing, progress=bar, ranks=ranks)
        finally:
            bar.close()
        return index, result_row(scenario, spec, sizing, stats, references, bar)

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


def result_row(scenario: Scenario, spec, sizing: MirrorSizing, stats, references, bar: "RunProgress") -> RunResult:
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
        **_checker_fields(stats, ctx),
        slot_reseeds=stats.slot_reseeds,
        max_seed_lag_tokens=stats.max_seed_lag_tokens,
        peak_draft_pages_per_request=stats.peak_draft_pages_per_request,
        estimated_draft_pages_per_request=draft_pages_per_request(setup),
        acceptance_length=round(stats.acceptance_length, 3),
        output_matches_target=matches,
        skipped_warmups=stats.skipped_warmups,
        tokens_per_s=round(stats.tokens_per_s, 1),
        wall_s=round(stats.wall_s, 2),
        **_handoff_fields(spec, setup, sizing, stats),
        transport=stats.transport,
        transfer_failures=dict(stats.transfer_failures),
        **_reuse_fields(spec, setup, stats),
        pages_held_at_end=stats.pages_held_by_both,
        draft_pool_occupancy=stats.draft_pool_occupancy,
        **against_estimate(setup, stats.peak_draft_pages_per_request),
        setup=setup,
        max_concurrency=spec.max_concurrency,
        plot_trace=PlotTrace(
            bar.foreign_per_step, setup.pool_requests * draft_pages_per_request(setup),
            list(stats.draft_requests_per_step),
        ),
    )


def _checker_fields(stats: RunStats, ctx: RunStats) -> dict:
    """The ownership checker's counts of a row, the context worker's (``ctx``) added to the generation side's."""
    return dict(
        foreign_page_accesses=stats.foreign_page_accesses + ctx.foreign_page_accesses,
        stale_reads=stats.stale_reads + ctx.stale_reads,
        unbacked_accesses=stats.unbacked_accesses + ctx.unbacked_accesses,
        accounting_errors=stats.accounting_errors + ctx.accounting_errors,
        shared_page_writes=stats.shared_page_writes + ctx.shared_page_writes,
        reused_positions_checked=(
            stats.reused_positions_checked + stats.gen_reused_positions_checked + ctx.reused_positions_checked
        ),
    )


def _handoff_fields(spec: RunSpec, setup: SimSetup, sizing: MirrorSizing, stats: RunStats) -> dict:
    """What a row says of the handoffs: the drafter context's form and bytes, the target K/V bytes."""
    return dict(
        drafter_handoff=(
            handoff_for(setup, sizing).mode.value if spec.mode == "disaggregated" else None
        ),
        drafter_bytes_sent=stats.drafter_bytes_sent,
        full_drafter_bytes=stats.full_drafter_bytes,
        handoff_seeds=stats.handoff_seeds,
        reseeds_without_handoff=stats.reseeds_without_handoff,
        handoff_fallbacks=stats.handoff_fallbacks,
        handoff_bytes_sent=stats.handoff_bytes_sent,
        handoff_bytes_without_gen_reuse=stats.handoff_bytes_without_gen_reuse,
        handoff_bytes_saved=stats.handoff_bytes_saved,
    )


def _reuse_fields(spec: RunSpec, setup: SimSetup, stats: RunStats) -> dict:
    """What a row says of block reuse: tokens reused per request (in prompt order), pages left cached-free."""
    return dict(
        block_reuse=setup.block_reuse,
        shared_prefix=spec.shared_prefix,
        reused_tokens=[stats.reused_tokens.get(rid, 0) for rid in range(len(spec.prompts))],
        prefill_tokens_saved=stats.prefill_tokens_saved,
        gen_reused_tokens=(
            [stats.gen_reused_tokens.get(rid, 0) for rid in range(len(spec.prompts))]
            if spec.mode == "disaggregated" else []
        ),
        cached_free_pages_at_end=stats.cached_free_pages_at_end + (
            stats.context_worker.cached_free_pages_at_end if stats.context_worker else 0
        ),
    )
