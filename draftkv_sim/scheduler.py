"""First-come-first-served scheduling with chunked prefill under a token budget.

Generation requests go first (each costs 1 + its draft slots); context chunks
fill the rest of the budget. With `reserve_context_row`, one batch row stays
free for a context chunk while a prompt waits, so new requests are not starved
by generating ones (and, with fewer drafter slots than requests in flight,
slots are evicted and reseeded). A chunk is never cut short by the budget (only
the prompt's last chunk is shorter), so every prefill chunk starts at a
multiple of the chunk size: the alignment the estimator's `chunk_alignment`
relies on. A request whose next chunk does not fit waits for the next step.

With `serial_prefill` (block reuse on), a prompt that has not started waits while
an earlier request is still in prefill: the earlier one publishes its prompt's
pages chunk by chunk, so a later request with the same prefix finds all of them
when its own prefix lookup runs (at its first scheduled step).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tensorrt_llm_draftkv.request import LlmRequest, LlmRequestState, ScheduledRequests


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_tokens: int = 16384
    max_num_requests: int = 8
    max_batch_size: int = 8
    chunk_size: int = 8192
    max_draft_len: int = 7
    reserve_context_row: bool = False
    serial_prefill: bool = False  # a fresh prompt waits while an earlier one is in prefill (block reuse)

    def __post_init__(self) -> None:
        for name in ("max_num_tokens", "max_num_requests", "max_batch_size", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_draft_len < 0:
            raise ValueError(f"max_draft_len must be >= 0, got {self.max_draft_len}")
        if self.chunk_size > self.max_num_tokens:
            raise ValueError(f"chunk_size {self.chunk_size} exceeds the step budget {self.max_num_tokens}")


@dataclass
class Scheduler:
    config: SchedulerConfig
    waiting: deque[LlmRequest] = field(default_factory=deque)
    active: list[LlmRequest] = field(default_factory=list)
    _rotation: int = 0

    def add(self, req: LlmRequest) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    def retire(self, req: LlmRequest) -> None:
        self.active.remove(req)

    def schedule(self) -> ScheduledRequests:
        while self.waiting and len(self.active) < self.config.max_num_requests:
            self.active.append(self.waiting.popleft())
        budget = self.config.max_num_tokens
        batch = ScheduledRequests()
        generating = [r for r in self.active if r.state == LlmRequestState.GENERATION_IN_PROGRESS]
        # Rotate so that more generating requests than batch slots all make progress.
        if generating:
            k = self._rotation % len(generating)
            generating = generating[k:] + generating[:k]
            self._rotation += 1
        gen_rows = self.config.max_batch_size
        prompt_waiting = any(r.state == LlmRequestState.CONTEXT_INIT for r in self.active)
        if self.config.reserve_context_row and prompt_waiting and gen_rows > 1:
            gen_rows -= 1
        for req in generating:
            cost = 1 + self.config.max_draft_len
            if len(batch.generation_requests) >= gen_rows or cost > budget:
                break
            batch.generation_requests.append(req)
            budget -= cost
        prefill_ahead = False  # an earlier request is still in prefill
        for req in self.active:
            if req.state != LlmRequestState.CONTEXT_INIT:
                continue
            fresh = req.target_view.position == 0 and req.prepopulated_prompt_len == 0
            held = self.config.serial_prefill and prefill_ahead and fresh
            prefill_ahead = True
            if held or batch.batch_size >= self.config.max_batch_size:
                continue
            view = req.target_view
            chunk = min(self.config.chunk_size, req.prompt_len - view.position)
            if chunk > budget:
                continue
            view.chunk_size = chunk
            batch.context_requests.append(req)
            budget -= chunk
        return batch
