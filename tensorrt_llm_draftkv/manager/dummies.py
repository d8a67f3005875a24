"""CUDA-graph warmup dummies, in upstream TensorRT-LLM's call shape.

Positions are absolute: a dummy of n tokens sits at position n - 1.
`add_dummy_requests` is a `KVCacheManagerV2` method (hence `self`), kept here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from ..request import LlmRequest, LlmRequestState

if TYPE_CHECKING:
    from .kv_cache_manager import KVCacheManagerV2


def add_dummy_requests(
    self: KVCacheManagerV2,
    request_ids: Iterable[int],
    token_nums: Iterable[int] | None = None,
    is_gen: bool = False,
    prepare_resource: bool = True,
    max_num_draft_tokens: int = 0,
    use_mrope: bool = False,
    max_beam_width: int = 1,
    num_extra_decoding_steps: int = 0,
    draft_kv_cache_manager: "KVCacheManagerV2 | None" = None,
    *,
    history_hint: int | None = None,
) -> list[LlmRequest]:
    """CUDA-graph warmup dummies, in upstream TensorRT-LLM's positional order.

    Dummy i holds `token_nums[i]` tokens (default `1 + max_num_draft_tokens`, as
    upstream) and room above them for `max_num_draft_tokens` drafts, this
    self's `num_extra_kv_tokens` and `num_extra_decoding_steps` (the extra
    autoregressive steps of a capturable drafting loop). `is_gen` (default False,
    as upstream) makes them generation requests, with `py_draft_tokens` of
    `max_num_draft_tokens` placeholders; `history_hint` lets a windowed pool back
    only the window (a generation dummy's history is the hint clamped to its
    own position, `tokens - 1`). `prepare_resource=False` builds the requests
    and reserves nothing, in either self.

    `draft_kv_cache_manager`: the same dummies (ids, token counts, `is_gen`,
    drafts) are added there too, sized by that self (its own extra tokens;
    the hint through its own `_dummy_history` rule; no extra decoding steps,
    as upstream). All or nothing across both managers: if either side fails,
    neither keeps a dummy and both pools' free lists are as they were.

    Differences from upstream: `use_mrope` is accepted and ignored (no
    multimodal positions here); `max_beam_width` must be 1 (no beam search
    here: ValueError otherwise); a dummy that does not fit raises
    `KVCacheResizeError` (nothing added) instead of returning None.
    """
    request_ids = list(request_ids)
    token_nums = [1 + max_num_draft_tokens] * len(request_ids) if token_nums is None else list(token_nums)
    _check_dummies(
        self, request_ids, token_nums, max_num_draft_tokens, max_beam_width, num_extra_decoding_steps,
        draft_kv_cache_manager,
    )
    made: list[LlmRequest] = []
    for rid, tokens in zip(request_ids, token_nums):
        req = LlmRequest(rid, prompt_len=tokens, is_dummy=True)
        if is_gen:
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
            req.py_draft_tokens = [1] * max_num_draft_tokens
        made.append(req)
    if not prepare_resource:
        return made
    with self._batch_transaction(request_ids):
        hint = self.sizing_rules.dummy_history(history_hint)
        for req, tokens in zip(made, token_nums):
            capacity = tokens + max_num_draft_tokens + self.num_extra_kv_tokens + num_extra_decoding_steps
            # A generation dummy's next token sits at tokens - 1: more history than
            # that would release pages its drafter slot, seeded there, still reads.
            history = None if hint is None else min(hint, tokens - 1 if is_gen else capacity)
            self._resize_or_raise(req, "dummy", lambda r, c, cap=capacity, h=history: (cap, h))
        if draft_kv_cache_manager is not None:
            # Raising here unwinds this self's dummies too (the transaction above).
            draft_kv_cache_manager.add_dummy_requests(
                request_ids,
                token_nums,
                is_gen,
                True,
                max_num_draft_tokens,
                use_mrope,
                max_beam_width,
                0,
                None,
                history_hint=history_hint,
            )
    return made


def _check_dummies(
    manager: KVCacheManagerV2,
    request_ids: list[int],
    token_nums: list[int],
    max_num_draft_tokens: int,
    max_beam_width: int,
    num_extra_decoding_steps: int,
    draft_kv_cache_manager: "KVCacheManagerV2 | None",
) -> None:
    """Every argument error, raised before any dummy exists (naming the numbers)."""
    if max_beam_width != 1:
        raise ValueError(
            f"{manager.error_label}: add_dummy_requests supports max_beam_width 1 only (no beam search here), "
            f"got max_beam_width={max_beam_width}"
        )
    if max_num_draft_tokens < 0 or num_extra_decoding_steps < 0:
        raise ValueError(
            f"{manager.error_label}: max_num_draft_tokens ({max_num_draft_tokens}) and "
            f"num_extra_decoding_steps ({num_extra_decoding_steps}) must be >= 0"
        )
    if draft_kv_cache_manager is not None:
        from .kv_cache_manager import KVCacheManagerV2  # a cycle at import time otherwise

        if not isinstance(draft_kv_cache_manager, KVCacheManagerV2):
            raise TypeError(
                f"draft_kv_cache_manager must be a KVCacheManagerV2, got {type(draft_kv_cache_manager).__name__}"
            )
        if draft_kv_cache_manager is manager:
            raise ValueError(f"{manager.error_label}: draft_kv_cache_manager is this manager itself")
    if len(token_nums) != len(request_ids):
        raise ValueError(f"{len(request_ids)} dummy ids but {len(token_nums)} token counts")
    taken = [rid for rid in request_ids if rid in manager._caches]
    repeated = sorted({rid for rid in request_ids if request_ids.count(rid) > 1})
    if taken or repeated:
        bad = taken or repeated
        raise ValueError(
            f"{manager.error_label}: dummy request {bad[0]} "
            + ("already has a cache" if taken else "is named twice")
            + (f" (also {bad[1:]})" if len(bad) > 1 else "")
            + "; no dummy was added"
        )
    for rid, tokens in zip(request_ids, token_nums):
        if tokens < 1:
            raise ValueError(f"dummy request {rid}: token count must be >= 1, got {tokens}")
