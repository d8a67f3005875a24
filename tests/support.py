"""Helpers the test modules share (import as `from support import ...`; tests/conftest.py puts this folder on the path).

Library helpers only: nothing here imports the simulator (its tests' helpers are in tests/sim/sim_support.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tensorrt_llm_draftkv import LlmRequestState


def strict(manager, result):
    """Upstream's calls answer a refusal with False (`prepare_disagg_gen_init`) or None
    (`add_dummy_requests`); this raises the manager's explicit `last_refusal` instead, so a test
    can match its message. Anything else passes through."""
    if result is False or result is None:
        assert manager.last_refusal is not None, "refused without saying why"
        raise manager.last_refusal
    return result


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def tokens(n: int, seed: int = 0) -> list[int]:
    """`n` token ids of a deterministic stream (64-token vocabulary); a longer stream extends a shorter one."""
    return [(31 * seed + 7 * i) % 64 for i in range(n)]


@dataclass
class UpstreamRequest:
    """Only what upstream's LlmRequest offers the KV cache managers."""

    py_request_id: int
    prompt_len: int
    tokens: list[int]
    context_current_position: int = 0
    context_chunk_size: int = 0
    state: LlmRequestState = LlmRequestState.CONTEXT_INIT
    py_draft_tokens: list[int] = field(default_factory=list)
    is_dummy: bool = False
    max_new_tokens: int = 64
    prepopulated_prompt_len: int = 0
    use_draft_model: bool = False

    def get_tokens(self, beam: int) -> list[int]:
        return self.tokens

    def set_prepopulated_prompt_len(self, n: int, tokens_per_block: int) -> None:
        self.prepopulated_prompt_len = n

    @property
    def max_beam_num_tokens(self) -> int:
        return len(self.tokens)

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
    def is_generation_in_progress_state(self) -> bool:
        return self.state == LlmRequestState.GENERATION_IN_PROGRESS

    @property
    def is_disagg_generation_init_state(self) -> bool:
        return self.state == LlmRequestState.DISAGG_GENERATION_INIT
