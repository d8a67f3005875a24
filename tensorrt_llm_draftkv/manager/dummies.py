"""CUDA-graph warmup dummies: what `KVCacheManagerV2.add_dummy_requests` adds.

Positions are absolute: a dummy of n tokens sits at position n - 1. The
functions here read a manager only through `DummyHost`, what they need of it.
"""
from __future__ import annotations

from typing import Callable, Iterable, Protocol

from ..request import LlmRequest, LlmRequestState
from .request_caches import RequestCaches
from .rules import StepSizing


class DummyHost(Protocol):
    """What adding dummies reads and calls on a manager."""

    error_label: str
    num_extra_kv_tokens: int
    caches: RequestCaches

    @property
    def sizing_rules(self) -> StepSizing: ...

    def resize_or_raise(self, req: LlmRequest, phase: str, sizing: Callable) -> None: ...


def add_dummies(
    self: DummyHost,
    request_ids: Iterable[int],
    token_nums: Iterable[int] | None,
    *,
    is_gen: bool,
    materialize_history: bool,
    prepare_resource: bool,
    max_num_draft_tokens: int,
    kv_reserve_draft_tokens: int | None,
    max_beam_width: int,
    encoder_output_lens: list[int] | None,
    add_to_draft: Callable[[], None] | None,
    num_extra_decoding_steps: int,
    history_hint: int | None,
) -> list[LlmRequest]:
    """The dummies of `KVCacheManagerV2.add_dummy_requests`; a pool too small raises
    `KVCacheResizeError` (nothing added, in either manager), a bad argument ValueError.

    Dummy i holds `token_nums[i]` tokens (default `1 + max_num_draft_tokens`) and room above them
    for `kv_reserve_draft_tokens` drafts (default `max_num_draft_tokens`), the manager's extra
    tokens and `num_extra_decoding_steps`. History: a generation dummy's is its own position,
    `tokens - 1`, so a windowed pool backs only the window (`materialize_history=True`: none, the
    whole history backed); `history_hint` sets it for every dummy (clamped to `tokens - 1` for a
    generation dummy, whose drafter slot is seeded there). A legacy mirror drops the history.
    `add_to_draft`: adds the same dummies to the draft manager (raising if it cannot), inside this
    manager's transaction, so a failure there unwinds the dummies here too.
    """
    request_ids = list(request_ids)
    token_nums = [1 + max_num_draft_tokens] * len(request_ids) if token_nums is None else list(token_nums)
    reserve = max_num_draft_tokens if kv_reserve_draft_tokens is None else kv_reserve_draft_tokens
    if encoder_output_lens is not None:
        raise ValueError(f"{self.error_label}: no cross attention here (encoder_output_lens must be None)")
    _check_dummies(self, request_ids, token_nums, max(max_num_draft_tokens, reserve), max_beam_width,
                   num_extra_decoding_steps)
    made: list[LlmRequest] = []
    for rid, tokens in zip(request_ids, token_nums):
        req = LlmRequest(rid, prompt_len=tokens, is_dummy=True)
        if is_gen:
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
            req.py_draft_tokens = [1] * max_num_draft_tokens
        made.append(req)
    if not prepare_resource:
        return made
    with self.caches.transaction(request_ids):
        for req, tokens in zip(made, token_nums):
            capacity = tokens + reserve + self.num_extra_kv_tokens + num_extra_decoding_steps
            history = _dummy_history(self, tokens, capacity, is_gen, materialize_history, history_hint)
            self.resize_or_raise(req, "dummy", lambda r, c, cap=capacity, h=history: (cap, h))
        if add_to_draft is not None:
            add_to_draft()  # raising here unwinds this manager's dummies too (the transaction above)
    return made


def _dummy_history(
    manager: DummyHost, tokens: int, capacity: int, is_gen: bool, materialize: bool, hint: int | None
) -> int | None:
    """A dummy's history (see `add_dummies`), through the manager's dummy rule (legacy drops it)."""
    if hint is None and is_gen and not materialize:
        hint = tokens - 1  # upstream derives it: the dummy's next token sits there
    hint = manager.sizing_rules.dummy_history(hint)
    if hint is None:
        return None
    # More history than its own position would release pages a generation dummy's drafter slot,
    # seeded there, still reads.
    return min(hint, tokens - 1 if is_gen else capacity)


def _check_dummies(
    manager: DummyHost,
    request_ids: list[int],
    token_nums: list[int],
    max_num_draft_tokens: int,
    max_beam_width: int,
    num_extra_decoding_steps: int,
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
    if len(token_nums) != len(request_ids):
        raise ValueError(f"{len(request_ids)} dummy ids but {len(token_nums)} token counts")
    taken = [rid for rid in request_ids if rid in manager.caches]
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


__all__ = ["DummyHost", "add_dummies"]
