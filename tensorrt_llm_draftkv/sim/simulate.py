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
from dataclasses import asdict, dataclass, field, replace
from functools import partial

import torch

from ..config import KVPoolConfig, LayerGroupConfig
from ..manager import DraftKVCacheManagerV2, KVCacheManagerV2
from ..manager.budget import group_pages_per_request
from ..manager import rules
from ..manager.rules import MirrorSizing
from .disagg import run_disaggregated
from .drafting import build_speculator
from .engine import Executor, RunStats
from .prompts import phrase_prompt
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
    draft_pool_occupancy: list[int] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("draft_pool_occupancy")
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
    """`sizing=None` builds the target-only reference (no draft pool, no drafter)."""
    device = setup.device
    target_cfg = KVPoolConfig(
        (LayerGroupConfig(1, window=setup.target_window),),
        pages_per_group=(setup.pool_requests * target_pages_per_request(setup),),
        tokens_per_block=setup.tokens_per_block,
        num_kv_heads=1,
        head_dim=setup.target_dim,
        dtype=torch.float64,
        device=device,
        max_seq_len=setup.max_seq_len,
    )
    target = KVCacheManagerV2(target_cfg, max_draft_len=setup.max_draft_len)
    model = TinyTarget(TinyTargetConfig(vocab_size=setup.vocab_size, dim=setup.target_dim), target)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_tokens=setup.chunk + setup.pool_requests * (1 + setup.max_draft_len),
            max_num_requests=max_concurrency,
            max_batch_size=min(max_concurrency, drafter_slots) if sizing is not None else max_concurrency,
            chunk_size=setup.chunk,
            max_draft_len=setup.max_draft_len if sizing is not None else 0,
            reserve_context_row=reserve_context_row,
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
        )
        draft = DraftKVCacheManagerV2(
            draft_cfg,
            spec_mode=setup.drafter,
            max_draft_len=setup.max_draft_len,
            num_extra_kv_tokens=setup.draft_extra_tokens,
            sizing=sizing,
            trail_page=setup.trail_page,
        )
        speculator = build_speculator(setup, draft, sizing, drafter_slots)
    return Executor(
        target_manager=target,
        target_model=model,
        scheduler=scheduler,
        max_new_tokens=setup.max_new_tokens,
        draft_manager=draft,
        speculator=speculator,
    )


def _prompts(setup: SimSetup, lengths: tuple[int, ...]) -> list[torch.Tensor]:
    return [phrase_prompt(seed, n, vocab_size=setup.vocab_size) for seed, n in zip(prompt_seeds(lengths), lengths)]


def target_only_outputs(setup: SimSetup, keys: list[tuple[int, int]]) -> dict[tuple[int, int], list[int]]:
    """Greedy target-only outputs for (prompt seed, length) keys: the reference every run must equal."""
    executor = build_executor(setup, None, max_concurrency=4, drafter_slots=1)
    for rid, (seed, n) in enumerate(keys):
        executor.add_request(rid, phrase_prompt(seed, n, vocab_size=setup.vocab_size))
    stats = executor.run()
    return {keys[rid]: out for rid, out in stats.outputs.items()}


def warmup_tokens(setup: SimSetup, prompts: tuple[int, ...]) -> int:
    """Warmup dummies as long as the longest request will get."""
    return max(prompts) + setup.max_new_tokens


def _build_rank(
    rank: int, setup: SimSetup, sizing: MirrorSizing, max_concurrency: int, slots: int, warmup: int
) -> Executor:
    # The context worker computes the prompt with the target alone and emits the first token.
    if rank == 0:
        return build_executor(replace(setup, max_new_tokens=1), None, max_concurrency, slots)
    executor = build_executor(setup, sizing, max_concurrency, slots)
    executor.warmup(num_dummies=1, token_num=warmup)
    return executor


# -- running ------------------------------------------------------------------------------
class _Progress:
    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.enabled = label, total, enabled

    def __call__(self, steps: int, finished: int) -> None:
        if self.enabled and steps % 10 == 0:
            width = 24
            done = int(width * finished / max(self.total, 1))
            sys.stderr.write(f"\r  {self.label:<28} [{'#' * done}{'.' * (width - done)}] {finished}/{self.total} step {steps}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 80 + "\r")


def run_one(setup: SimSetup, spec: RunSpec, sizing: MirrorSizing, *, progress: bool = False) -> tuple[RunStats, list[int]]:
    setup = spec.setup_for(setup)
    prompts = _prompts(setup, spec.prompts)
    slots = spec.drafter_slots or setup.drafter_slots
    if spec.mode == "aggregated":
        executor = build_executor(setup, sizing, spec.max_concurrency, slots)
        executor.warmup(num_dummies=1, token_num=warmup_tokens(setup, spec.prompts))
        for rid, prompt in enumerate(prompts):
            executor.add_request(rid, prompt)
        bar = _Progress(f"{spec.name} ({sizing.value})", len(prompts), progress)
        stats = executor.run(progress=bar)
        bar.close()
    else:
        build = partial(
            _build_rank,
            setup=setup,
            sizing=sizing,
            max_concurrency=spec.max_concurrency,
            slots=slots,
            warmup=warmup_tokens(setup, spec.prompts),
        )
        stats = run_disaggregated(build, prompts)
    return stats, prompt_seeds(spec.prompts)


def simulate(scenario: Scenario, sizings: list[MirrorSizing], *, progress: bool = False) -> list[RunResult]:
    # Target-only references, one per generation length the runs use.
    references: dict[int, dict] = {}
    for new_tokens in dict.fromkeys(spec.setup_for(scenario.setup).max_new_tokens for spec in scenario.runs):
        runs = [s for s in scenario.runs if s.setup_for(scenario.setup).max_new_tokens == new_tokens]
        keys = list(dict.fromkeys((seed, n) for s in runs for seed, n in zip(prompt_seeds(s.prompts), s.prompts)))
        references[new_tokens] = target_only_outputs(replace(scenario.setup, max_new_tokens=new_tokens), keys)
    results = []
    for spec in scenario.runs:
        setup = spec.setup_for(scenario.setup)
        reference = references[setup.max_new_tokens]
        for sizing in sizings:
            stats, seeds = run_one(scenario.setup, spec, sizing, progress=progress)
            matches = None
            if stats.outputs:
                matches = all(
                    reference.get((seeds[rid], spec.prompts[rid])) == out for rid, out in stats.outputs.items()
                )
            results.append(
                RunResult(
                    name=spec.name,
                    sizing=sizing.value,
                    mode=spec.mode,
                    prompt_tokens=list(spec.prompts),
                    finished=stats.finished,
                    resize_failures=stats.resize_failures,
                    refused_requests=stats.refused_requests,
                    first_error=stats.first_error,
                    foreign_page_accesses=stats.foreign_page_accesses,
                    stale_reads=stats.stale_reads,
                    unbacked_accesses=stats.unbacked_accesses,
                    accounting_errors=stats.accounting_errors,
                    slot_reseeds=stats.slot_reseeds,
                    max_seed_lag_tokens=stats.max_seed_lag_tokens,
                    peak_draft_pages_per_request=stats.peak_draft_pages_per_request,
                    estimated_draft_pages_per_request=draft_pages_per_request(setup),
                    acceptance_length=round(stats.acceptance_length, 3),
                    output_matches_target=matches,
                    skipped_warmups=stats.skipped_warmups,
                    tokens_per_s=round(stats.tokens_per_s, 1),
                    wall_s=round(stats.wall_s, 2),
                    draft_pool_occupancy=stats.draft_pool_occupancy,
                )
            )
    return results


# -- reporting ------------------------------------------------------------------------------
def format_table(results: list[RunResult]) -> str:
    head = (
        f"{'run':<12} {'sizing':<8} {'mode':<6} {'finished':>9} {'resize fail':>11} {'foreign':>8} "
        f"{'peak/est pages':>15} {'warmup':>7} {'accept':>7} {'tok/s':>8} {'= target':>9}  events / first error"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        total = len(r.prompt_tokens)
        match = "-" if r.output_matches_target is None else ("yes" if r.output_matches_target else "NO")
        err = (r.first_error[:90] + "...") if len(r.first_error) > 90 else r.first_error
        err = "  ".join(x for x in (_events(r), err) if x)
        lines.append(
            f"{r.name:<12} {r.sizing:<8} {r.mode[:6]:<6} {f'{r.finished}/{total}':>9} {r.resize_failures:>11} "
            f"{r.foreign_page_accesses:>8} {f'{r.peak_draft_pages_per_request}/{r.estimated_draft_pages_per_request}':>15} "
            f"{('skipped' if r.skipped_warmups else 'ok'):>7} {r.acceptance_length:>7.3f} {r.tokens_per_s:>8.1f} "
            f"{match:>9}  {err}"
        )
    return "\n".join(lines)


def _events(r: RunResult) -> str:
    """The counters that are not zero: reseeds and seed lag (exercised), then any violation."""
    named = (
        ("reseeds", r.slot_reseeds),
        ("lag", r.max_seed_lag_tokens),
        ("stale", r.stale_reads),
        ("unbacked", r.unbacked_accesses),
        ("accounting", r.accounting_errors),
        ("refused", r.refused_requests),
    )
    return " ".join(f"{name}={value}" for name, value in named if value)


def write_json(results: list[RunResult], path: str) -> None:
    with open(path, "w") as f:
        json.dump([r.to_json() for r in results], f, indent=2)


def write_plot(results: list[RunResult], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # an optional extra
        raise SystemExit(f"--plot needs matplotlib (pip install -e '.[plot]'): {err}") from None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in results:
        ax.plot(r.draft_pool_occupancy, label=f"{r.name} / {r.sizing}")
    ax.set_xlabel("executor step")
    ax.set_ylabel("draft pages held (all requests)")
    ax.set_title("Draft-pool occupancy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
