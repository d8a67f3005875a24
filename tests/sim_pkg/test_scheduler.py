"""The executor's scheduler: chunked prefill under a token budget, generation first, fairness.

The scheduler is driven here the way the executor drives it: after each
`schedule()`, context requests advance past their chunk (the executor's
`advance_context_chunk`) and generating requests gain one token; nothing of the
executor itself is used, so every expectation is about the scheduler alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from draftkv_sim.scheduler import Scheduler, SchedulerConfig
from tensorrt_llm_draftkv.request import LlmRequest, LlmRequestState


@dataclass
class Trace:
    """What every step scheduled: (request id, chunk start, chunk size) and generation ids."""

    chunks: list[list[tuple[int, int, int]]] = field(default_factory=list)
    generation: list[list[int]] = field(default_factory=list)
    costs: list[int] = field(default_factory=list)
    active: list[int] = field(default_factory=list)


def _generating(rid: int, prompt_len: int = 8, max_new_tokens: int = 1 << 20) -> LlmRequest:
    return LlmRequest(
        rid,
        prompt_len=prompt_len,
        state=LlmRequestState.GENERATION_IN_PROGRESS,
        tokens=[1] * (prompt_len + 1),
        max_new_tokens=max_new_tokens,
    )


def drive(sched: Scheduler, max_steps: int, *, chunk_size: int) -> Trace:
    """Play the executor's side: advance chunks, append generated tokens, retire finished requests."""
    trace = Trace()
    draft = sched.config.max_draft_len
    for _ in range(max_steps):
        if not sched.has_work():
            break
        batch = sched.schedule()
        trace.active.append(len(sched.active))
        trace.chunks.append(
            [(r.py_request_id, r.target_view.position, r.target_view.chunk_size) for r in batch.context_requests]
        )
        trace.generation.append([r.py_request_id for r in batch.generation_requests])
        trace.costs.append(
            sum(r.target_view.chunk_size for r in batch.context_requests)
            + len(batch.generation_requests) * (1 + draft)
        )
        assert batch.batch_size > 0, "the scheduler made no progress"
        for req in batch.context_requests:
            end = req.target_view.position + req.target_view.chunk_size
            req.advance_context_chunk(chunk_size)
            if end >= req.prompt_len:
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
                req.tokens.append(7)
        for req in batch.generation_requests:
            req.tokens.append(7)
        for req in batch.all_requests():
            if req.num_generated >= req.max_new_tokens:
                req.state = LlmRequestState.GENERATION_COMPLETE
                sched.retire(req)
    return trace


# -- chunked prefill ---------------------------------------------------------------------------
@given(
    prompts=st.lists(st.integers(1, 3000), min_size=1, max_size=6),
    chunk=st.sampled_from([16, 64, 100, 512]),
    extra_budget=st.integers(0, 300),
    max_draft_len=st.integers(0, 7),
    max_batch_size=st.integers(1, 4),
    max_num_requests=st.integers(1, 5),
    max_new_tokens=st.integers(1, 6),
)
def test_chunks_are_never_cut_by_the_budget(
    prompts, chunk, extra_budget, max_draft_len, max_batch_size, max_num_requests, max_new_tokens
):
    budget = max(chunk, 1 + max_draft_len) + extra_budget
    cfg = SchedulerConfig(
        max_num_tokens=budget,
        max_num_requests=max_num_requests,
        max_batch_size=max_batch_size,
        chunk_size=chunk,
        max_draft_len=max_draft_len,
    )
    sched = Scheduler(cfg)
    reqs = [LlmRequest(i, prompt_len=n, max_new_tokens=max_new_tokens) for i, n in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    bound = sum(-(-n // chunk) for n in prompts) + len(prompts) * (max_new_tokens + 1) + 10
    trace = drive(sched, bound, chunk_size=chunk)

    assert not sched.has_work(), "every request finishes"
    covered: dict[int, int] = {}
    for step, chunks in enumerate(trace.chunks):
        assert trace.costs[step] <= budget
        assert len(chunks) + len(trace.generation[step]) <= max_batch_size
        assert trace.active[step] <= max_num_requests
        for rid, start, size in chunks:
            n = prompts[rid]
            assert start % chunk == 0, f"request {rid}: chunk starts at {start}, not a multiple of {chunk}"
            assert size == chunk or start + size == n, f"request {rid}: chunk [{start}, {start + size}) was cut"
            assert size > 0
            assert covered.get(rid, 0) == start, "chunks tile the prompt in order"
            covered[rid] = start + size
    assert covered == {i: n for i, n in enumerate(prompts)}


def test_a_chunk_that_does_not_fit_waits_instead_of_shrinking():
    # Two generating requests cost 2 * 8 = 16 of a 520-token budget: 504 left, less than a chunk.
    cfg = SchedulerConfig(max_num_tokens=520, max_num_requests=4, max_batch_size=4, chunk_size=512, max_draft_len=7)
    sched = Scheduler(cfg)
    for rid in (0, 1):
        sched.active.append(_generating(rid))
    ctx = LlmRequest(2, prompt_len=2000)
    sched.add(ctx)
    batch = sched.schedule()
    assert [r.py_request_id for r in batch.generation_requests] == [0, 1]
    assert batch.context_requests == []
    assert ctx.target_view.position == 0
    # ...but a prompt's last, shorter chunk that fits is scheduled.
    short = LlmRequest(3, prompt_len=600)
    short.target_view.position = 512  # its first chunk already ran
    sched.active.append(short)
    batch = sched.schedule()
    assert [(r.py_request_id, r.target_view.chunk_size) for r in batch.context_requests] == [(3, 88)]


def test_one_generating_request_leaves_room_for_a_full_chunk():
    cfg = SchedulerConfig(max_num_tokens=520, max_num_requests=4, max_batch_size=4, chunk_size=512, max_draft_len=7)
    sched = Scheduler(cfg)
    sched.active.append(_generating(0))
    sched.add(LlmRequest(1, prompt_len=2000))
    batch = sched.schedule()
    assert [r.py_request_id for r in batch.generation_requests] == [0]
    assert [(r.py_request_id, r.target_view.position, r.target_view.chunk_size) for r in batch.context_requests] == [
        (1, 0, 512)
    ]


# -- generation first, batch cap ---------------------------------------------------------------------
def test_generation_goes_first_under_the_token_budget():
    # The budget holds either one chunk or the generation step, never both.
    cfg = SchedulerConfig(max_num_tokens=512, max_num_requests=4, max_batch_size=4, chunk_size=512, max_draft_len=7)
    sched = Scheduler(cfg)
    ctx = LlmRequest(0, prompt_len=4096)
    sched.add(ctx)  # arrived first
    sched.active.append(sched.waiting.popleft())
    sched.active.append(_generating(1))
    batch = sched.schedule()
    assert [r.py_request_id for r in batch.generation_requests] == [1]
    assert batch.context_requests == []


def test_generation_goes_first_under_the_batch_cap():
    cfg = SchedulerConfig(max_num_tokens=4096, max_num_requests=4, max_batch_size=1, chunk_size=512, max_draft_len=7)
    sched = Scheduler(cfg)
    sched.add(LlmRequest(0, prompt_len=100))
    sched.active.append(sched.waiting.popleft())
    sched.active.append(_generating(1))
    batch = sched.schedule()
    assert [r.py_request_id for r in batch.all_requests()] == [1]


def test_batch_size_and_admission_caps():
    cfg = SchedulerConfig(max_num_tokens=100000, max_num_requests=3, max_batch_size=2, chunk_size=64, max_draft_len=3)
    sched = Scheduler(cfg)
    for rid in range(6):
        sched.add(LlmRequest(rid, prompt_len=10, max_new_tokens=3))
    trace = drive(sched, 100, chunk_size=64)
    assert not sched.has_work()
    assert max(len(c) + len(g) for c, g in zip(trace.chunks, trace.generation)) == 2
    assert max(trace.active) == 3
    # first come, first served: a request is only admitted after an earlier one retired
    first_step = {}
    for step, chunks in enumerate(trace.chunks):
        for rid, _, _ in chunks:
            first_step.setdefault(rid, step)
    assert sorted(first_step, key=first_step.get) == list(range(6))


# -- rotation -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_generating, cap", [(3, 2), (5, 2), (4, 3), (7, 1)])
def test_rotation_lets_every_generating_request_progress(num_generating, cap):
    cfg = SchedulerConfig(max_num_tokens=4096, max_num_requests=16, max_batch_size=cap, chunk_size=512, max_draft_len=7)
    sched = Scheduler(cfg)
    for rid in range(num_generating):
        sched.active.append(_generating(rid))
    rounds = 3
    trace = drive(sched, rounds * num_generating, chunk_size=512)
    counts = {rid: 0 for rid in range(num_generating)}
    for step, gen in enumerate(trace.generation):
        assert len(gen) == cap
        for rid in gen:
            counts[rid] += 1
        if step + 1 == num_generating:
            assert all(counts.values()), f"within {num_generating} steps every request ran: {counts}"
    # fair: over whole rounds every request got the same number of steps
    assert set(counts.values()) == {rounds * cap}


def test_rotation_also_applies_when_the_token_budget_is_the_limit():
    # 8 tokens per generating request, a 24-token budget: three of five per step
    cfg = SchedulerConfig(max_num_tokens=24, max_num_requests=8, max_batch_size=8, chunk_size=16, max_draft_len=7)
    sched = Scheduler(cfg)
    for rid in range(5):
        sched.active.append(_generating(rid))
    trace = drive(sched, 5, chunk_size=16)
    assert all(len(g) == 3 for g in trace.generation)
    counts = [sum(rid in g for g in trace.generation) for rid in range(5)]
    assert counts == [3] * 5


def test_rotation_finishes_every_request():
    cfg = SchedulerConfig(max_num_tokens=4096, max_num_requests=6, max_batch_size=2, chunk_size=512, max_draft_len=7)
    sched = Scheduler(cfg)
    reqs = [_generating(rid, max_new_tokens=5 + rid) for rid in range(6)]
    for r in reqs:
        sched.active.append(r)
    drive(sched, 200, chunk_size=512)
    assert not sched.has_work()
    assert [r.num_generated for r in reqs] == [5 + rid for rid in range(6)]


def test_config_rejects_a_chunk_larger_than_the_budget():
    with pytest.raises(ValueError, match="exceeds the step budget"):
        SchedulerConfig(max_num_tokens=100, chunk_size=128)
    with pytest.raises(ValueError, match="max_batch_size"):
        SchedulerConfig(max_batch_size=0)
