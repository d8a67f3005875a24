"""Building one run: its pools sized by the estimator, the tiny target, the drafter, its prompts.

`build_executor` is the aggregated executor (and each disaggregated worker's,
through `build_rank`); the pages-per-request helpers are the estimator's charge
per request in each pool; `target_only_outputs` is the reference every run must equal.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from tensorrt_llm_draftkv.config import KVPoolConfig, LayerGroupConfig
from tensorrt_llm_draftkv.manager import DraftKVCacheManagerV2, KVCacheManagerV2
from tensorrt_llm_draftkv.manager.budget import group_pages_per_request
from tensorrt_llm_draftkv.manager import rules
from tensorrt_llm_draftkv.manager.rules import MirrorSizing
from tensorrt_llm_draftkv.speculative.handoff import DrafterHandoff
from .disagg_transfer import NO_HANDOFF, HandoffSettings
from .engine import Executor
from .prompts import shared_prefix_prompts
from .scenario import RunSpec, SimSetup, prompt_seeds
from .scheduler import Scheduler, SchedulerConfig
from .speculator import build_speculator
from .target_model import TinyTarget, TinyTargetConfig


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
        rules.DraftPoolTraits(setup.drafter),
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
    joint = setup.block_reuse == "joint" and sizing is not None
    target = _target_manager(setup)
    model = TinyTarget(TinyTargetConfig(vocab_size=setup.vocab_size, dim=setup.target_dim), target)
    scheduler = _scheduler(setup, sizing, max_concurrency, drafter_slots, reserve_context_row)
    draft = speculator = None
    if sizing is not None:
        draft = _draft_manager(setup, sizing, joint)
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


def _target_manager(setup: SimSetup) -> KVCacheManagerV2:
    """The target's cache manager: one layer group, a pool sized for ``setup.pool_requests`` requests."""
    target_cfg = KVPoolConfig(
        (LayerGroupConfig(1, window=setup.target_window),),
        pages_per_group=(setup.pool_requests * target_pages_per_request(setup),),
        tokens_per_block=setup.tokens_per_block,
        num_kv_heads=1,
        head_dim=setup.target_dim,
        dtype=torch.float64,
        device=setup.device,
        max_seq_len=setup.max_seq_len,
        enable_block_reuse=setup.block_reuse != "off",
    )
    return KVCacheManagerV2.from_pool_config(target_cfg, max_draft_len=setup.max_draft_len)


def _scheduler(
    setup: SimSetup, sizing: MirrorSizing | None, max_concurrency: int, drafter_slots: int,
    reserve_context_row: bool,
) -> Scheduler:
    """The scheduler: token budget for one chunk plus every request's step; no drafts without a drafter."""
    return Scheduler(
        SchedulerConfig(
            max_num_tokens=setup.chunk + setup.pool_requests * (1 + setup.max_draft_len),
            max_num_requests=max_concurrency,
            max_batch_size=min(max_concurrency, drafter_slots) if sizing is not None else max_concurrency,
            chunk_size=setup.chunk,
            max_draft_len=setup.max_draft_len if sizing is not None else 0,
            reserve_context_row=reserve_context_row,
            serial_prefill=setup.block_reuse != "off",
        )
    )


def _draft_manager(setup: SimSetup, sizing: MirrorSizing, joint: bool) -> DraftKVCacheManagerV2:
    """The drafter's cache manager: one windowed group, a pool sized for ``setup.pool_requests`` requests."""
    draft_cfg = KVPoolConfig(
        # One drafter layer per draft offset (see toy_drafter.py).
        (LayerGroupConfig(setup.max_draft_len, window=setup.draft_window),),
        pages_per_group=(setup.pool_requests * draft_pages_per_request(setup),),
        tokens_per_block=setup.tokens_per_block,
        num_kv_heads=setup.draft_kv_heads,
        head_dim=setup.draft_head_dim,
        dtype=torch.float32,
        device=setup.device,
        max_seq_len=setup.max_seq_len,
        enable_block_reuse=joint,
    )
    return DraftKVCacheManagerV2.from_pool_config(
        draft_cfg,
        spec_mode=setup.drafter,
        max_draft_len=setup.max_draft_len,
        num_extra_kv_tokens=setup.draft_extra_tokens,
        sizing=sizing,
        trail_page=setup.trail_page,
        joint_kv_cache_reuse=joint,
    )


def run_prompts(setup: SimSetup, spec: RunSpec | tuple[int, ...]) -> list[torch.Tensor]:
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


def build_rank(
    rank: int, setup: SimSetup, sizing: MirrorSizing, max_concurrency: int, slots: int, warmup: int,
    fallback: bool = False,
) -> Executor:
    """The executor of disaggregated rank `rank`: 0 the context worker (one token, the target and, when it
    hands the drafter context over, the drafter), 1 the generation worker (warmed up, with the drafter)."""
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
