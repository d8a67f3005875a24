"""The request model the managers read: states, the two context views, batches.

A request carries two (position, chunk) views of its prompt: the target view,
advanced by the executor chunk by chunk, and the draft view, advanced only by a
separate draft engine. `use_draft_model` selects which one the context
properties read; `request_context(is_draft=True, batch)` flips it for a batch.
All positions are absolute token positions.
"""
from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from typing import Iterator


class LlmRequestState(enum.Enum):
    CONTEXT_INIT = "context_init"
    GENERATION_IN_PROGRESS = "generation_in_progress"
    GENERATION_COMPLETE = "generation_complete"
    DISAGG_GENERATION_INIT = "disagg_generation_init"
    DISAGG_GENERATION_TRANS_COMPLETE = "disagg_generation_trans_complete"


@dataclass
class ContextView:
    """Where a prefill stands: the next chunk is `[position, position + chunk_size)`."""

    position: int = 0
    chunk_size: int = 0


@dataclass
class LlmRequest:
    """One request. `tokens` holds prompt then generated tokens (ids or placeholders)."""

    py_request_id: int
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    state: LlmRequestState = LlmRequestState.CONTEXT_INIT
    target_view: ContextView = field(default_factory=ContextView)
    draft_view: ContextView | None = None
    use_draft_model: bool = False
    py_draft_tokens: list[int] = field(default_factory=list)
    py_num_accepted_draft_tokens: int = 0
    is_dummy: bool = False
    max_new_tokens: int = 1 << 30
    #: Prompt tokens whose K/V a prefix hit supplied (a whole number of pages from
    #: position 0): the executor computes the prompt from here on (upstream's name).
    prepopulated_prompt_len: int = 0

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            raise ValueError(f"request {self.py_request_id}: prompt_len must be >= 0, got {self.prompt_len}")
        if not self.tokens:
            self.tokens = [0] * self.prompt_len
        elif len(self.tokens) < self.prompt_len:
            raise ValueError(
                f"request {self.py_request_id}: {len(self.tokens)} tokens for a {self.prompt_len}-token prompt"
            )
        if self.target_view.chunk_size == 0 and self.state == LlmRequestState.CONTEXT_INIT:
            self.target_view = ContextView(0, self.prompt_len)
        if self.draft_view is None:
            # Only a separate draft engine advances this view; a one-engine drafter
            # leaves it at position 0 with the whole prompt as one chunk.
            self.draft_view = ContextView(0, self.prompt_len)

    # -- the active view ------------------------------------------------------------
    @property
    def _view(self) -> ContextView:
        assert self.draft_view is not None
        return self.draft_view if self.use_draft_model else self.target_view

    @property
    def context_current_position(self) -> int:
        return self._view.position

    @context_current_position.setter
    def context_current_position(self, value: int) -> None:
        self._view.position = value

    @property
    def context_chunk_size(self) -> int:
        return self._view.chunk_size

    @context_chunk_size.setter
    def context_chunk_size(self, value: int) -> None:
        self._view.chunk_size = value

    @property
    def is_first_context_chunk(self) -> bool:
        return self.context_current_position == 0

    @property
    def is_last_context_chunk(self) -> bool:
        return self.context_current_position + self.context_chunk_size >= self.prompt_len

    @property
    def is_context_init_state(self) -> bool:
        return self.state == LlmRequestState.CONTEXT_INIT

    @property
    def is_disagg_generation_init_state(self) -> bool:
        return self.state == LlmRequestState.DISAGG_GENERATION_INIT

    @property
    def is_generation_in_progress_state(self) -> bool:
        return self.state == LlmRequestState.GENERATION_IN_PROGRESS

    @property
    def is_finished(self) -> bool:
        return self.state == LlmRequestState.GENERATION_COMPLETE

    # -- token bookkeeping --------------------------------------------------------
    @property
    def max_beam_num_tokens(self) -> int:
        """Tokens the request holds (prompt + generated); the last has no KV yet."""
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def num_draft_tokens(self) -> int:
        return len(self.py_draft_tokens)

    def advance_context_chunk(self, next_chunk: int | None = None) -> None:
        """Move the active view past its current chunk and set the next chunk's size."""
        if next_chunk is not None and next_chunk < 1:
            raise ValueError(f"request {self.py_request_id}: the next chunk must be >= 1 token, got {next_chunk}")
        view = self._view
        view.position += view.chunk_size
        remaining = self.prompt_len - view.position
        view.chunk_size = remaining if next_chunk is None else min(next_chunk, remaining)

    def get_tokens(self, beam: int = 0) -> list[int]:
        """Prompt and generated token ids (upstream's accessor; one beam here)."""
        if beam != 0:
            raise ValueError(f"request {self.py_request_id}: one beam here, asked for beam {beam}")
        return self.tokens

    def set_prepopulated_prompt_len(self, prepopulated_prompt_len: int, kv_tokens_per_block: int) -> None:
        """Upstream's setter: `[0, prepopulated_prompt_len)` came from a prefix hit (whole pages)."""
        if prepopulated_prompt_len % kv_tokens_per_block or not 0 <= prepopulated_prompt_len < max(self.prompt_len, 1):
            raise ValueError(
                f"request {self.py_request_id}: a prefix hit of {prepopulated_prompt_len} tokens must be whole "
                f"{kv_tokens_per_block}-token pages below the {self.prompt_len}-token prompt"
            )
        self.prepopulated_prompt_len = prepopulated_prompt_len

    def sync_draft_view(self) -> None:
        """A drafter that runs with the target (MTP, Eagle3) keeps its view in step."""
        self.draft_view = ContextView(self.target_view.position, self.target_view.chunk_size)


@dataclass
class ScheduledRequests:
    """One executor step's batch."""

    context_requests: list[LlmRequest] = field(default_factory=list)
    generation_requests: list[LlmRequest] = field(default_factory=list)

    def all_requests(self) -> list[LlmRequest]:
        return [*self.context_requests, *self.generation_requests]

    @property
    def batch_size(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)


@contextlib.contextmanager
def request_context(is_draft: bool, scheduled_requests: ScheduledRequests) -> Iterator[ScheduledRequests]:
    """Within the block, every request of `batch` presents its draft view if `is_draft`, else its target view.

    What switches is the (position, chunk) view the request's context properties
    read (`context_current_position`, `context_chunk_size`, `is_first_context_chunk`,
    `is_last_context_chunk`, `advance_context_chunk`) and so whatever sizes from
    them, such as a draft manager's draft-view mirror. Leaving the block, also on an
    exception, puts every request's `use_draft_model` back as it was (blocks nest).
    Unlike upstream, `is_draft=False` is not a no-op: it forces the target view.
    """
    saved = [(req, getattr(req, "use_draft_model", False)) for req in scheduled_requests.all_requests()]
    try:
        for req, _ in saved:
            req.use_draft_model = bool(is_draft)
        yield scheduled_requests
    finally:
        for req, flag in saved:
            req.use_draft_model = flag


# -- the protocol the managers read -----------------------------------------------------------
# The managers read a request only through upstream LlmRequest's attributes, so an executor's own
# request objects work unchanged: `py_request_id`, `prompt_len`, `context_current_position` and
# `context_chunk_size` (switched by `use_draft_model`), `max_beam_num_tokens`, `py_draft_tokens`,
# `get_tokens(0)`, `prepopulated_prompt_len` / `set_prepopulated_prompt_len`, the state predicates,
# `is_dummy`. These helpers are the only places that read more than one of them.
@contextlib.contextmanager
def _target_side(req) -> Iterator[None]:
    """Within the block the request presents its target view, whatever `use_draft_model` says."""
    flag = getattr(req, "use_draft_model", False)
    if flag:
        req.use_draft_model = False
    try:
        yield
    finally:
        if flag:
            req.use_draft_model = flag


def target_view(req) -> ContextView:
    """The request's target (position, chunk): what the executor's own prefill advances."""
    with _target_side(req):
        return ContextView(req.context_current_position, req.context_chunk_size)


def set_target_view(req, position: int, chunk: int) -> None:
    """Move the target view (a prefix hit, or putting one back)."""
    with _target_side(req):
        req.context_current_position = position
        req.context_chunk_size = chunk


def reused_prefix(req) -> int:
    """Prompt tokens a prefix hit supplied (0 without one)."""
    return int(getattr(req, "prepopulated_prompt_len", 0) or 0)


def generated_tokens(req) -> int:
    """Tokens the request holds past its prompt."""
    return req.max_beam_num_tokens - req.prompt_len


def skip_reused_prefix(req, tokens: int, tokens_per_block: int) -> None:
    """A prefix hit: `[0, tokens)` is reused, so the target view's first chunk starts at `tokens` (same
    chunk size, clipped to the prompt). ValueError, changing nothing, unless the view is still at
    position 0 and at least one prompt token is left to compute."""
    view = target_view(req)
    if not 0 <= tokens < req.prompt_len or view.position != 0:
        raise ValueError(
            f"request {req.py_request_id}: cannot skip {tokens} reused tokens of a {req.prompt_len}-token "
            f"prompt with the target view at position {view.position} (needs 0 <= tokens < prompt and the view at 0)"
        )
    remaining = req.prompt_len - tokens
    req.set_prepopulated_prompt_len(tokens, tokens_per_block)
    set_target_view(req, tokens, remaining if view.chunk_size <= 0 else min(view.chunk_size, remaining))
