"""Side by side on one real windowed draft pool: `legacy` dies, `history` serves.

Geometry of the upstream report: a DSpark drafter (K = 7) with a 4,096-token
window, 32-token pages, 8,192-token context chunks, block reuse off. The pool
is sized by the estimator for 8 concurrent requests:
`8 * group_pages_per_request(..., trail_tokens=32, chunk_alignment=True)`.
"""
from __future__ import annotations


import pytest

from tensorrt_llm_draftkv import (
    DraftKVCacheManagerV2,
    KVCacheResizeError,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    ScheduledRequests,
    SpeculativeDecodingMode as Mode,
)
from tensorrt_llm_draftkv.manager.budget import group_pages_per_request
from tensorrt_llm_draftkv.request import ContextView

P, WINDOW, CHUNK, DRAFTS, CONCURRENCY = 32, 4096, 8192, 7, 8
MAX_SEQ_LEN = 524288 + 1024
GEN_STEPS = 12


def charge() -> int:
    return group_pages_per_request(
        WINDOW,
        P,
        max_seq_len=MAX_SEQ_LEN,
        chunk=CHUNK,
        max_draft_len=DRAFTS,
        trail_tokens=P,
        chunk_alignment=True,
    )


def test_the_estimator_charge_for_this_geometry_from_first_principles():
    # A chunk starts at s = k * 8192 with history s; the pool keeps W' = 4096 + 32.
    # Its queries read [s + 1 - W', s + 8192 + 7) (drafts on the last chunk):
    # ordinals floor((s - 4127) / 32) = s/32 - 129 up to ceil((s + 8199) / 32) - 1 = s/32 + 256.
    assert charge() == 129 + 256 + 1 == 386
    # Without the alignment knowledge the bound is looser, never tighter.
    loose = group_pages_per_request(WINDOW, P, max_seq_len=MAX_SEQ_LEN, chunk=CHUNK, max_draft_len=DRAFTS, trail_tokens=P)
    assert loose >= 386


def make_manager(sizing: str) -> DraftKVCacheManagerV2:
    pages = CONCURRENCY * charge()
    config = KVPoolConfig(
        layer_groups=(LayerGroupConfig(1, window=WINDOW),),
        pages_per_group=(pages,),
        tokens_per_block=P,
        num_kv_heads=1,
        head_dim=1,
        max_seq_len=MAX_SEQ_LEN,
    )
    return DraftKVCacheManagerV2.from_pool_config(
        config, spec_mode=Mode.DSPARK, max_draft_len=DRAFTS, joint_kv_cache_reuse=False, sizing=sizing
    )


class Executor:
    """The executor loop as the managers see it: prepare, forward, advance, update."""

    def __init__(self, mgr: DraftKVCacheManagerV2):
        self.mgr = mgr
        self.active: list[LlmRequest] = []
        self.gen_steps: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.finished: list[int] = []
        self.prepares = 0

    def add(self, rid: int, prompt: int) -> None:
        self.active.append(LlmRequest(rid, prompt_len=prompt, target_view=ContextView(0, CHUNK)))
        self.gen_steps[rid] = 0
        self.peak[rid] = 0

    def step(self) -> None:
        ctx = [r for r in self.active if r.is_context_init_state]
        gen = [r for r in self.active if r.is_generation_in_progress_state]
        batch = ScheduledRequests(context_requests=ctx, generation_requests=gen)
        self.mgr.prepare_resources(batch)  # raises on any resize failure
        self.prepares += 1
        for req in batch.all_requests():
            held = self.mgr.get_cache(req.py_request_id).num_held_pages()
            assert held <= charge(), (req.py_request_id, held)
            self.peak[req.py_request_id] = max(self.peak[req.py_request_id], held)
        # forward; then the executor advances every request
        for req in ctx:
            req.advance_context_chunk(CHUNK)
            if req.target_view.position >= req.prompt_len:
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
                req.tokens.append(1)  # the last chunk's token
        for req in gen:
            accepted = (req.py_request_id + self.gen_steps[req.py_request_id]) % (DRAFTS + 1)
            req.tokens += [1] * (1 + accepted)
            self.gen_steps[req.py_request_id] += 1
        self.mgr.update_context_resources(ScheduledRequests(context_requests=ctx))
        self.mgr.update_resources(batch)
        for req in list(self.active):
            cache = self.mgr.get_cache(req.py_request_id)
            if req.num_generated:
                assert cache.history_length == req.max_beam_num_tokens - 1
            if self.gen_steps[req.py_request_id] >= GEN_STEPS:
                self.mgr.free_resources(req)
                self.active.remove(req)
                self.finished.append(req.py_request_id)
        self.mgr.check_accounting()


def test_legacy_dies_on_the_first_131k_prompt():
    mgr = make_manager("legacy")
    assert mgr._draft_slot_trail_tokens == 0 and mgr.windows == (WINDOW,)
    ex = Executor(mgr)
    ex.add(1, 131072)
    with pytest.raises(KVCacheResizeError) as info:
        ex.step()
    msg = str(info.value)
    # Pre-fix: the untouched draft view presents the whole prompt (plus drafts) from position 0.
    assert msg.startswith(
        "Draft KV cache context resize failed for request 1: could not resize to 131079 tokens"
    ), msg
    assert f"group 0: {CONCURRENCY * charge()}/{CONCURRENCY * charge()}" in msg
    assert mgr.request_ids() == []  # the failed fresh mirror was not left behind
    mgr.check_accounting()


@pytest.mark.parametrize("prompt", [131072, 262144, 524288])
def test_history_completes_each_long_prompt_alone(prompt):
    mgr = make_manager("history")
    assert mgr._draft_slot_trail_tokens == P and mgr.windows == (WINDOW + P,)
    ex = Executor(mgr)
    ex.add(1, prompt)
    while ex.active:
        ex.step()
    assert ex.finished == [1]
    assert ex.prepares == prompt // CHUNK + GEN_STEPS
    assert ex.peak[1] == charge()
    assert mgr.free_pages() == (CONCURRENCY * charge(),)


def test_history_serves_long_prompts_concurrently_chunk_by_chunk():
    prompts = [131072, 262144, 524288, 131072, 262144, 524288, 131072, 262144]
    assert len(prompts) == CONCURRENCY
    mgr = make_manager("history")
    ex = Executor(mgr)
    peak_pool = 0
    # Staggered arrivals: request i joins at step 3 * i, so prefill chunks of some
    # requests interleave with generation steps of others.
    step = 0
    pending = list(enumerate(prompts, start=1))
    while pending or ex.active:
        while pending and pending[0][0] * 3 - 3 <= step:
            rid, prompt = pending.pop(0)
            ex.add(rid, prompt)
        ex.step()
        peak_pool = max(peak_pool, mgr.layer_groups[0].pool.num_held)
        step += 1
    assert sorted(ex.finished) == list(range(1, CONCURRENCY + 1))
    # Every request reached exactly the estimator's charge at its peak, never more.
    assert ex.peak == {rid: charge() for rid in range(1, CONCURRENCY + 1)}
    assert peak_pool <= CONCURRENCY * charge()
    assert mgr.free_pages() == (CONCURRENCY * charge(),) and mgr.request_ids() == []


def test_the_same_pool_under_legacy_fails_where_history_does_not():
    for sizing in ("history", "legacy"):
        mgr = make_manager(sizing)
        ex = Executor(mgr)
        for rid, prompt in enumerate([131072, 262144], start=1):
            ex.add(rid, prompt)
        failures = 0
        while ex.active:
            try:
                ex.step()
            except KVCacheResizeError as err:
                failures += 1
                assert err.capacity == 131072 + DRAFTS and err.history is None
                break
        assert failures == (0 if sizing == "history" else 1), sizing
