"""DraftLoop, the drafter's test harness: the executor, drafter only, a ground-truth oracle for the target.

A thin adapter over :class:`~.engine.Executor` (with
:class:`~.speculator.DFlashSpeculator` as its drafter and a
:class:`~.verify.TruthVerifier`): each request carries its ground-truth token
stream, the target's greedy next token at position ``p`` is ``truth[p + 1]``,
and hidden states come from :class:`TokenFeatures`. Only the draft side exists
(no target cache); the draft manager, the metadata, the drafter and the pool
tensors are the real ones. Every step runs every live request (or the ones
named), with no token budget, in the executor's call order (see engine.py).
The loop only configures that step: explicit batches and chunk sizes, capped
acceptance, optimistic commits, warmup dummies. Positions are absolute.
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch

from tensorrt_llm_draftkv.config import KVPoolConfig, LayerGroupConfig, SpeculativeDecodingMode
from tensorrt_llm_draftkv.manager import DraftKVCacheManagerV2
from tensorrt_llm_draftkv.request import ContextView, LlmRequest, LlmRequestState, ScheduledRequests
from tensorrt_llm_draftkv.speculative import DFlashDraftSlots, required_extra_kv_tokens
from .toy_drafter import DFlashDrafter
from .speculator import DFlashSpeculator, build_drafter
from .engine import Executor, StepResult
from .features import TokenFeatures
from .ownership import OwnershipChecker
from .scheduler import Scheduler, SchedulerConfig
from .verify import TruthVerifier

__all__ = ["DraftLoop"]


def _pool_config(
    windows: tuple, layers_per_group: tuple | None, pages: int | tuple, num_layers: int, **geometry
) -> KVPoolConfig:
    """One layer group per window; ``num_layers`` spread as ``layers_per_group`` says (default: all
    in the first group, one in each other); ``pages`` per group (one count for all, or one each)."""
    if layers_per_group is None:
        rest = len(windows) - 1
        layers_per_group = (num_layers - rest, *([1] * rest))
    if sum(layers_per_group) != num_layers or len(layers_per_group) != len(windows):
        raise ValueError(
            f"layers_per_group {layers_per_group} must cover {num_layers} layers in {len(windows)} groups"
        )
    return KVPoolConfig(
        layer_groups=tuple(LayerGroupConfig(n, window=w) for n, w in zip(layers_per_group, windows)),
        pages_per_group=(pages,) * len(windows) if isinstance(pages, int) else tuple(pages),
        **geometry,
    )


def _draft_manager(
    config: KVPoolConfig, spec_mode: SpeculativeDecodingMode, block_size: int, joint_kv_cache_reuse: bool,
    trail_page: bool,
) -> DraftKVCacheManagerV2:
    """The draft manager over ``config``, with room above history for a block of ``block_size`` tokens."""
    return DraftKVCacheManagerV2.from_pool_config(
        config,
        spec_mode=spec_mode,
        max_draft_len=block_size - 1,
        num_extra_kv_tokens=required_extra_kv_tokens(block_size),
        joint_kv_cache_reuse=joint_kv_cache_reuse,
        trail_page=trail_page,
    )


class DraftLoop:
    """A draft manager, a DFlashDraftSlots and a DFlashDrafter driven through the executor by a truth oracle."""

    def __init__(
        self,
        draft_manager: DraftKVCacheManagerV2,
        meta: DFlashDraftSlots,
        drafter: DFlashDrafter,
        features: TokenFeatures,
    ) -> None:
        if drafter.meta is not meta or drafter.features is not features:
            raise ValueError("the drafter must be built on this metadata and these features")
        self.dm = draft_manager
        self.meta = meta
        self.drafter = drafter
        self.features = features
        self.verifier = TruthVerifier()
        # Running out of slots raises (the caller evicts); the checker counts only what the steps do.
        self.speculator = DFlashSpeculator(draft_manager, drafter, evict_idle_slots=False, audit=False)
        self.executor = Executor(
            scheduler=Scheduler(SchedulerConfig(max_draft_len=meta.block_size - 1)),  # batches are explicit
            max_new_tokens=1 << 30,
            verifier=self.verifier,
            draft_manager=draft_manager,
            speculator=self.speculator,
        )
        self.requests: dict[int, LlmRequest] = {}
        self.accepted_total = 0
        self.drafted_total = 0
        self.generation_steps = 0

    @classmethod
    def build(
        cls,
        *,
        windows: tuple = (None,),
        layers_per_group: tuple | None = None,
        pages: int | tuple = 256,
        tokens_per_block: int = 16,
        block_size: int = 4,
        vocab_size: int = 64,
        feature_dim: int = 6,
        num_kv_heads: int = 1,
        head_dim: int = 8,
        max_seq_len: int = 4096,
        max_batch_size: int = 8,
        spec_mode: SpeculativeDecodingMode = SpeculativeDecodingMode.DFLASH,
        joint_kv_cache_reuse: bool = False,
        trail_page: bool = True,
        guard_page: bool = False,
        seeding: str = "base",
        fused: bool = False,
        backend: str = "cpp",
        page_aligned_seed: bool | None = None,
        checker: bool = True,
        raise_on_violation: bool = False,
        device: str = "cpu",
        feature_seed: int = 0,
        private_arena: bool = False,
        max_ctx_len: int | None = None,
    ) -> "DraftLoop":
        """A draft manager (one layer group per window), metadata, drafter, features and checker.

        The drafter has ``block_size - 1`` layers, spread over the groups as
        ``layers_per_group`` says (default: all in the first group, one in each
        other). The manager leaves room for the block
        (``num_extra_kv_tokens = required_extra_kv_tokens(block_size)``).
        """
        config = _pool_config(
            windows, layers_per_group, pages, block_size - 1,
            tokens_per_block=tokens_per_block, num_kv_heads=num_kv_heads, head_dim=head_dim, device=device,
            guard_page=guard_page, max_seq_len=max_seq_len,
        )
        dm = _draft_manager(config, spec_mode, block_size, joint_kv_cache_reuse, trail_page)
        drafter = build_drafter(
            dm,
            vocab_size=vocab_size,
            block_size=block_size,
            num_slots=max_batch_size,
            max_ctx_len=max_seq_len if max_ctx_len is None else max_ctx_len,
            feature_dim=feature_dim,
            seeding=seeding,
            page_aligned_seed=page_aligned_seed,
            fused=fused,
            backend=backend,
            feature_seed=feature_seed,
            private_arena=private_arena,
            checker=checker,
            raise_on_violation=raise_on_violation,
        )
        return cls(dm, drafter.meta, drafter, drafter.features)

    @property
    def checker(self) -> OwnershipChecker | None:
        return self.drafter.checker

    @property
    def block_size(self) -> int:
        return self.meta.block_size

    @property
    def truth(self) -> dict[int, list[int]]:
        """Each live request's ground-truth token stream (the verifier's)."""
        return self.verifier.truth

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_total / max(self.drafted_total, 1)

    # ------------------------------------------------------------------ requests
    def _track(self, req: LlmRequest, truth: list[int]) -> LlmRequest:
        self.requests[req.py_request_id] = req
        self.truth[req.py_request_id] = truth
        room = len(truth) - len(req.tokens) + self.meta.block_size + 1  # every truth token and a block of drafts
        self.executor.track(req, torch.tensor(req.tokens, dtype=torch.long), room=room)
        return req

    def add_context_request(
        self, rid: int, truth: list[int], prompt_len: int, *, chunk: int | None = None, start: int = 0
    ) -> LlmRequest:
        """A prefill request; ``start > 0``: a prefix this worker did not compute (e.g. a reuse hit)."""
        if not 0 <= start < prompt_len < len(truth):
            raise ValueError(f"need 0 <= start < prompt_len < len(truth), got {start}, {prompt_len}, {len(truth)}")
        req = LlmRequest(rid, prompt_len, tokens=list(truth[:prompt_len]))
        size = prompt_len - start if chunk is None else min(chunk, prompt_len - start)
        req.target_view = ContextView(start, size)
        return self._track(req, truth)

    def add_disagg_request(self, rid: int, truth: list[int], prompt_len: int) -> LlmRequest:
        """A generation worker's new request: prompt + first token arrive, the mirror is gen-init sized."""
        req = LlmRequest(
            rid, prompt_len, tokens=list(truth[: prompt_len + 1]), state=LlmRequestState.DISAGG_GENERATION_INIT
        )
        if not self.dm.prepare_disagg_gen_init(req):
            raise self.dm.last_refusal  # the pool cannot hold it; nothing was left behind
        req.state = LlmRequestState.GENERATION_IN_PROGRESS
        return self._track(req, truth)

    def finish(self, rid: int) -> None:
        """The request completes: its mirror, its slot and what the checker knows of it are freed."""
        self.executor.complete(self.requests.pop(rid))

    def evict(self, rid: int) -> None:
        """Take the request's slot away; its next row is seeded afresh."""
        self.speculator.evict(rid)

    def remaining(self, rid: int) -> int:
        """Truth tokens left after the request's tokens (a step may append up to block_size)."""
        return len(self.truth[rid]) - len(self.requests[rid].tokens)

    # ------------------------------------------------------------------ one step
    def step(
        self,
        rids: Iterable[int] | None = None,
        *,
        chunks: Mapping[int, int] | None = None,
        accept_cap: Mapping[int, int] | Callable[[int], int] | None = None,
        optimistic: Iterable[int] = (),
        dummies: int = 0,
        dummy_tokens: int | Iterable[int] = 1,
    ) -> StepResult:
        """One executor step over ``rids`` (default: every live request).

        ``chunks``: next chunk size of context requests after this one (default:
        the rest of the prompt). ``accept_cap``: most drafts a generation request
        may accept this step (forced rejections). ``optimistic``: generation
        requests whose every verified token is committed first (in one trial
        commit of the batch, the other rows at their accepted tokens), then rolled
        back to what was accepted. ``dummies``: warmup dummies of ``dummy_tokens``
        (one count for all, or one per dummy) join the draft rows for this step.
        """
        reqs = [self.requests[r] for r in (self.requests if rids is None else rids)]
        batch = ScheduledRequests(
            context_requests=[r for r in reqs if r.is_context_init_state],
            generation_requests=[r for r in reqs if r.is_generation_in_progress_state],
        )
        sizes = [dummy_tokens] * dummies if isinstance(dummy_tokens, int) else list(dummy_tokens)
        if dummies and len(sizes) != dummies:
            raise ValueError(f"{len(sizes)} dummy sizes for {dummies} dummies")
        self.verifier.accept_cap = accept_cap
        try:
            res = self.executor.step(
                batch, chunks=chunks or {}, optimistic=set(optimistic), dummy_tokens=sizes if dummies else ()
            )
        finally:
            self.verifier.accept_cap = None
        if res.drafted:
            self.generation_steps += 1
        self.accepted_total += sum(res.accepted.values())
        self.drafted_total += sum(res.drafted.values())
        return res
