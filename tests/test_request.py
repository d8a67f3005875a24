"""request.py: the two context views, request_context, chunk bookkeeping, batches."""
from __future__ import annotations

import pytest

from tensorrt_llm_draftkv import LlmRequest, LlmRequestState, ScheduledRequests, request_context
from tensorrt_llm_draftkv.request import ContextView


def test_states_are_named_as_upstream():
    assert {s.name for s in LlmRequestState} == {
        "CONTEXT_INIT",
        "GENERATION_IN_PROGRESS",
        "GENERATION_COMPLETE",
        "DISAGG_GENERATION_INIT",
        "DISAGG_GENERATION_TRANS_COMPLETE",
    }


def test_defaults_whole_prompt_in_both_views():
    req = LlmRequest(3, prompt_len=100)
    assert req.tokens == [0] * 100
    assert req.target_view == ContextView(0, 100)
    assert req.draft_view == ContextView(0, 100)
    assert req.target_view is not req.draft_view
    assert not req.use_draft_model
    assert (req.context_current_position, req.context_chunk_size) == (0, 100)
    assert req.is_first_context_chunk and req.is_last_context_chunk
    assert req.is_context_init_state and not req.is_dummy
    assert (req.max_beam_num_tokens, req.num_generated, req.num_draft_tokens) == (100, 0, 0)


def test_given_tokens_and_explicit_target_view_are_kept():
    req = LlmRequest(1, prompt_len=3, tokens=[5, 6, 7, 8], target_view=ContextView(0, 2))
    assert req.tokens == [5, 6, 7, 8] and req.num_generated == 1
    assert req.target_view == ContextView(0, 2)
    gen = LlmRequest(2, prompt_len=4, state=LlmRequestState.DISAGG_GENERATION_INIT)
    assert gen.is_disagg_generation_init_state
    assert gen.target_view == ContextView(0, 0)  # no context chunk to run on a generation worker


def test_views_follow_use_draft_model():
    req = LlmRequest(1, prompt_len=64)
    req.target_view = ContextView(32, 16)
    assert (req.context_current_position, req.context_chunk_size) == (32, 16)
    assert not req.is_first_context_chunk and not req.is_last_context_chunk
    req.use_draft_model = True
    assert (req.context_current_position, req.context_chunk_size) == (0, 64)
    assert req.is_first_context_chunk and req.is_last_context_chunk
    # setters write the active view only
    req.context_current_position = 8
    req.context_chunk_size = 4
    assert req.draft_view == ContextView(8, 4) and req.target_view == ContextView(32, 16)
    req.use_draft_model = False
    req.context_chunk_size = 32
    assert req.target_view == ContextView(32, 32) and req.draft_view == ContextView(8, 4)
    assert req.is_last_context_chunk


def test_request_context_flips_and_restores():
    a, b, c = (LlmRequest(i, prompt_len=10) for i in range(3))
    b.use_draft_model = True  # already on: must come back on
    batch = ScheduledRequests(context_requests=[a], generation_requests=[b, c])
    with request_context(True, batch) as got:
        assert got is batch
        assert [r.use_draft_model for r in (a, b, c)] == [True, True, True]
    assert [r.use_draft_model for r in (a, b, c)] == [False, True, False]
    with request_context(False, batch):
        assert [r.use_draft_model for r in (a, b, c)] == [False, False, False]
    assert [r.use_draft_model for r in (a, b, c)] == [False, True, False]


def test_request_context_restores_on_exception():
    a, b = LlmRequest(1, prompt_len=4), LlmRequest(2, prompt_len=4)
    b.use_draft_model = True
    batch = ScheduledRequests(context_requests=[a, b])

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with request_context(True, batch):
            assert a.use_draft_model
            raise Boom
    assert (a.use_draft_model, b.use_draft_model) == (False, True)
    with pytest.raises(Boom):
        with request_context(False, batch):
            assert not b.use_draft_model
            raise Boom
    assert (a.use_draft_model, b.use_draft_model) == (False, True)


def test_request_context_reads_the_draft_view_inside():
    req = LlmRequest(1, prompt_len=50)
    req.target_view = ContextView(40, 10)
    batch = ScheduledRequests(context_requests=[req])
    with request_context(True, batch):
        assert (req.context_current_position, req.context_chunk_size) == (0, 50)
    assert (req.context_current_position, req.context_chunk_size) == (40, 10)


def test_advance_context_chunk_walks_the_prompt():
    req = LlmRequest(1, prompt_len=20)
    req.context_chunk_size = 8
    seen = []
    while True:
        seen.append((req.context_current_position, req.context_chunk_size, req.is_first_context_chunk, req.is_last_context_chunk))
        if req.is_last_context_chunk:
            req.advance_context_chunk(8)
            break
        req.advance_context_chunk(8)
    assert seen == [(0, 8, True, False), (8, 8, False, False), (16, 4, False, True)]
    assert (req.context_current_position, req.context_chunk_size) == (20, 0)
    # the draft view never moved
    assert req.draft_view == ContextView(0, 20)


def test_advance_context_chunk_without_size_takes_the_rest():
    req = LlmRequest(1, prompt_len=20)
    req.context_chunk_size = 5
    req.advance_context_chunk()
    assert (req.context_current_position, req.context_chunk_size) == (5, 15)
    assert req.is_last_context_chunk
    req.advance_context_chunk(100)
    assert (req.context_current_position, req.context_chunk_size) == (20, 0)


def test_advance_context_chunk_moves_the_active_view_only():
    req = LlmRequest(1, prompt_len=30)
    req.use_draft_model = True
    req.context_chunk_size = 10
    req.advance_context_chunk(10)
    assert req.draft_view == ContextView(10, 10)
    assert req.target_view == ContextView(0, 30)


def test_sync_draft_view_copies_not_aliases():
    req = LlmRequest(1, prompt_len=30)
    req.target_view = ContextView(12, 6)
    req.sync_draft_view()
    assert req.draft_view == ContextView(12, 6)
    req.target_view.position = 18
    assert req.draft_view.position == 12


def test_token_bookkeeping():
    req = LlmRequest(1, prompt_len=5)
    req.tokens.extend([1, 2])
    req.py_draft_tokens = [9, 9, 9]
    assert (req.max_beam_num_tokens, req.num_generated, req.num_draft_tokens) == (7, 2, 3)
    req.state = LlmRequestState.GENERATION_COMPLETE
    assert req.is_finished and not req.is_generation_in_progress_state


def test_scheduled_requests():
    a, b, c = (LlmRequest(i, prompt_len=2) for i in range(3))
    batch = ScheduledRequests(context_requests=[a], generation_requests=[b, c])
    assert batch.all_requests() == [a, b, c]
    assert batch.batch_size == 3
    assert ScheduledRequests().all_requests() == [] and ScheduledRequests().batch_size == 0


def test_bad_requests_name_their_numbers():
    with pytest.raises(ValueError, match=r"request 4: prompt_len must be >= 0, got -1"):
        LlmRequest(4, prompt_len=-1)
    with pytest.raises(ValueError, match=r"request 5: 2 tokens for a 3-token prompt"):
        LlmRequest(5, prompt_len=3, tokens=[1, 2])


def test_advance_context_chunk_rejects_a_non_positive_next_chunk():
    from tensorrt_llm_draftkv import LlmRequest

    req = LlmRequest(4, prompt_len=100)
    req.target_view.chunk_size = 30
    with pytest.raises(ValueError, match=r"request 4: .* got 0"):
        req.advance_context_chunk(0)
    assert (req.target_view.position, req.target_view.chunk_size) == (0, 30)
