"""KVCacheManagerV2 (the target side): sizing per phase, dummies, freeing, export.

Expected rows come from a brute-force definition over positions (see
`backed`); capacities from the sizing rules of docs/design.md:
context chunk  capacity = position + chunk + extra (+ drafts on the last chunk)
generation     capacity = history + 1 + drafts + extra, history = tokens - 1
disagg init    capacity = prompt + 1 + drafts + extra, history = prompt
"""
from __future__ import annotations

import pytest

from support import strict
import torch

from tensorrt_llm_draftkv import (
    BAD_PAGE_INDEX,
    KVPoolConfig,
    KVCacheManagerV2,
    KVCacheResizeError,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    ScheduledRequests,
    request_context,
)
from tensorrt_llm_draftkv.manager.rules import step_headroom


def make_mgr(window=8, sinks=0, p=4, pages=(64, 64), draft=0, extra=0, guard=False, max_seq_len=256, kv_factor=2):
    config = KVPoolConfig(
        layer_groups=(LayerGroupConfig(2, window=window, sink_blocks=sinks), LayerGroupConfig(1, window=None)),
        pages_per_group=pages,
        tokens_per_block=p,
        num_kv_heads=1,
        head_dim=2,
        max_seq_len=max_seq_len,
        guard_page=guard,
        kv_factor=kv_factor,
    )
    return KVCacheManagerV2.from_pool_config(config, max_draft_len=draft, num_extra_kv_tokens=extra)


def backed(capacity, history, window, sinks, p):
    out = []
    for i in range(-(-capacity // p)):
        if window is None or i < sinks:
            out.append(True)
        else:
            out.append(any(pos >= history + 1 - window for pos in range(i * p, (i + 1) * p)))
    return out


def check_rows(mgr, rid):
    cache = mgr.get_cache(rid)
    p = mgr.tokens_per_block
    for g, group in enumerate(mgr.layer_groups):
        lc = group.life_cycle
        row = cache.block_row(g)
        assert [x != BAD_PAGE_INDEX for x in row] == backed(cache.capacity, cache.history_length, lc.window, lc.sink_blocks, p)
    mgr.check_accounting()


def state(mgr):
    return (
        {rid: mgr.get_cache(rid).checkpoint() for rid in mgr.request_ids()},
        # free pages as a set: a rollback returns the same pages, not necessarily in the same order
        [(sorted(pool.free_order()), pool.held_pages()) for pool in mgr.pools()],
    )


def ctx_batch(*reqs):
    return ScheduledRequests(context_requests=list(reqs))


def gen_batch(*reqs):
    return ScheduledRequests(generation_requests=list(reqs))


def run_prefill(mgr, req, chunk, *, check=None):
    """Chunked prefill in fixed chunks; returns the (capacity, history) seen at each prepare."""
    req.target_view.chunk_size = min(chunk, req.prompt_len)
    seen = []
    while True:
        mgr.prepare_resources(ctx_batch(req))
        cache = mgr.get_cache(req.py_request_id)
        seen.append((cache.capacity, cache.history_length))
        if check:
            check(req, cache)
        last = req.is_last_context_chunk
        req.advance_context_chunk(chunk)
        mgr.update_context_resources(ctx_batch(req))
        if last:
            break
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    return seen


# -- context ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt,chunk,draft,extra", [(30, 8, 2, 1), (32, 8, 3, 0), (5, 8, 1, 2), (17, 1, 0, 0)])
def test_context_chunks_capacity_and_history(prompt, chunk, draft, extra):
    mgr = make_mgr(draft=draft, extra=extra)
    req = LlmRequest(7, prompt_len=prompt)

    def check(r, cache):
        start, size = r.target_view.position, r.target_view.chunk_size
        last = start + size >= prompt
        # history follows the position (set by update_context_resources after the previous chunk)
        assert cache.history_length == start
        if last:
            assert cache.capacity == start + size + draft + extra
        else:  # extra on every chunk, drafts only on the last
            assert cache.capacity == start + size + extra
        check_rows(mgr, 7)

    seen = run_prefill(mgr, req, chunk, check=check)
    assert len(seen) == -(-prompt // chunk)
    # after the last chunk: history is the whole prompt
    cache = mgr.get_cache(7)
    assert cache.history_length == prompt
    check_rows(mgr, 7)


def test_context_extra_tokens_on_every_chunk_per_design():
    mgr = make_mgr(draft=2, extra=1)
    req = LlmRequest(1, prompt_len=30)
    req.target_view.chunk_size = 8
    mgr.prepare_resources(ctx_batch(req))
    assert mgr.get_cache(1).capacity == 0 + 8 + 1


def test_context_reads_the_target_view_even_inside_a_draft_request_context():
    mgr = make_mgr()
    req = LlmRequest(3, prompt_len=40)
    req.target_view.position, req.target_view.chunk_size = 0, 16
    req.draft_view.position, req.draft_view.chunk_size = 0, 40  # the stale draft view: whole prompt
    batch = ctx_batch(req)
    with request_context(True, batch):
        mgr.prepare_resources(batch)
    assert mgr.get_cache(3).capacity == 16


def test_windowed_group_holds_window_plus_chunk_during_prefill():
    """The whole point of history: a long prompt in chunks never holds the whole prompt."""
    window, p, chunk = 8, 4, 8
    mgr = make_mgr(window=window, p=p, pages=(8, 64))  # 8 windowed pages: not enough for the 128-token prompt
    req = LlmRequest(1, prompt_len=128)
    peak = 0

    def check(r, cache):
        nonlocal peak
        peak = max(peak, cache.num_held_pages(0))
        check_rows(mgr, 1)

    run_prefill(mgr, req, chunk, check=check)
    assert peak <= -(-(window + chunk - 2) // p) + 1


# -- generation -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft,extra", [(0, 0), (3, 0), (3, 2)])
def test_generation_capacity_and_update_resources_rewind(draft, extra):
    mgr = make_mgr(window=6, p=4, draft=draft, extra=extra)
    req = LlmRequest(5, prompt_len=21)
    run_prefill(mgr, req, 8)
    req.tokens.append(0)  # the first generated token
    mgr.update_resources(ctx_batch(req))
    cache = mgr.get_cache(5)
    assert (cache.capacity, cache.history_length) == (22, 21)
    check_rows(mgr, 5)
    for accepted in [0, draft, min(1, draft), draft, 0, draft]:
        history = req.max_beam_num_tokens - 1
        mgr.prepare_resources(gen_batch(req))
        assert cache.history_length == history  # prepare never moves history
        assert cache.capacity == history + 1 + draft + extra
        check_rows(mgr, 5)
        req.tokens.extend([0] * (accepted + 1))
        req.py_num_accepted_draft_tokens = accepted
        mgr.update_resources(gen_batch(req))
        # rejected drafts rewound; history = tokens - 1 (the last token has no KV yet)
        assert cache.history_length == req.max_beam_num_tokens - 1
        assert cache.capacity == req.max_beam_num_tokens
        check_rows(mgr, 5)


def test_update_resources_skips_unfinished_context_and_dummies():
    mgr = make_mgr()
    req = LlmRequest(1, prompt_len=20)
    req.target_view.chunk_size = 8
    mgr.prepare_resources(ctx_batch(req))
    (dummy,) = mgr.add_dummy_requests([99], [5], is_gen=True)
    before = state(mgr)
    mgr.update_resources(ScheduledRequests(context_requests=[req], generation_requests=[dummy]))
    assert state(mgr) == before


def test_measured_headroom_is_step_headroom():
    """Pin the headroom the estimators charge: the most tokens a step puts above history.

    Expected by hand: non-last chunks put c + extra above their start, the last chunk
    its own size plus drafts and extra, a generation step 1 + drafts + extra. The last
    three cases are ones where a non-last chunk's extra decides the maximum.
    """
    cases = [(40, 8, 3, 1), (40, 1, 3, 1), (7, 16, 0, 0), (33, 5, 2, 0), (35, 5, 2, 0),
             (41, 8, 2, 3), (41, 8, 0, 2), (17, 4, 0, 1)]
    for prompt, chunk, draft, extra in cases:
        mgr = make_mgr(draft=draft, extra=extra, pages=(200, 200))
        req = LlmRequest(1, prompt_len=prompt)
        worst = 0

        def check(r, cache):
            nonlocal worst
            worst = max(worst, cache.capacity - cache.history_length)

        run_prefill(mgr, req, chunk, check=check)
        req.tokens.append(0)
        mgr.update_resources(gen_batch(req))
        for _ in range(5):
            mgr.prepare_resources(gen_batch(req))
            cache = mgr.get_cache(1)
            worst = max(worst, cache.capacity - cache.history_length)
            req.tokens.append(0)
            mgr.update_resources(gen_batch(req))
        last_chunk = prompt - (-(-prompt // chunk) - 1) * chunk
        non_last = chunk + extra if prompt > chunk else 0
        expected = max(non_last, last_chunk + draft + extra, 1 + draft + extra)
        assert worst == expected
        assert worst <= step_headroom(chunk, draft, extra)
        if prompt % chunk == 0:  # a full last chunk reaches the charged headroom
            assert worst == step_headroom(chunk, draft, extra)
        if draft == 0 and prompt > chunk:  # without drafts, any non-last chunk reaches it too
            assert worst == step_headroom(chunk, draft, extra)


# -- disaggregated generation init ------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [1, 7, 8, 100, 131])
def test_prepare_disagg_gen_init(prompt):
    draft, extra, window, p = 3, 1, 8, 4
    mgr = make_mgr(window=window, p=p, draft=draft, extra=extra)
    req = LlmRequest(11, prompt_len=prompt, state=LlmRequestState.DISAGG_GENERATION_INIT)
    req.tokens.append(0)  # the first token came with the transfer
    assert mgr.prepare_disagg_gen_init(req)
    cache = mgr.get_cache(11)
    assert (cache.capacity, cache.history_length) == (prompt + 1 + draft + extra, prompt)
    check_rows(mgr, 11)
    # the windowed group holds only the tail
    lo = max(0, (prompt + 1 - window) // p)
    assert cache.held_pages(0) == [x for x in cache.block_row(0)[lo:]]
    assert cache.num_held_pages(0) == -(-cache.capacity // p) - lo
    assert cache.num_held_pages(1) == -(-cache.capacity // p)
    # generation continues in absolute coordinates
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    mgr.update_resources(gen_batch(req))
    assert cache.history_length == prompt
    mgr.prepare_resources(gen_batch(req))
    req.tokens.extend([0, 0])
    mgr.update_resources(gen_batch(req))
    assert (cache.capacity, cache.history_length) == (prompt + 3, prompt + 2)
    check_rows(mgr, 11)


def test_disagg_gen_init_out_of_pages_raises_and_leaves_nothing():
    mgr = make_mgr(pages=(64, 4))
    req = LlmRequest(12, prompt_len=100, state=LlmRequestState.DISAGG_GENERATION_INIT)
    before = state(mgr)
    with pytest.raises(KVCacheResizeError, match=r"generation resize failed for request 12: could not resize to 101"):
        strict(mgr, mgr.prepare_disagg_gen_init(req))
    assert state(mgr) == before and not mgr.has_cache(12)


# -- dummies -------------------------------------------------------------------------------------------------
def test_add_dummy_requests_history_hint_backs_only_the_window():
    window, p = 8, 4
    mgr = make_mgr(window=window, p=p, pages=(64, 128))
    dummies = mgr.add_dummy_requests([100, 101], [200, 200], is_gen=True, max_num_draft_tokens=3, history_hint=199)
    assert [d.py_request_id for d in dummies] == [100, 101]
    assert all(d.is_dummy and d.state == LlmRequestState.GENERATION_IN_PROGRESS for d in dummies)
    for rid in (100, 101):
        cache = mgr.get_cache(rid)
        assert (cache.capacity, cache.history_length) == (203, 199)
        check_rows(mgr, rid)
        assert cache.num_held_pages(0) == -(-203 // p) - (200 - window) // p
        assert cache.num_held_pages(1) == -(-203 // p)
    # without a hint, as upstream: a generation dummy's history is its own position (tokens - 1),
    # so the windowed group backs only the window (it used to back all 10 blocks)
    mgr.add_dummy_requests([102], [40], is_gen=True)
    assert mgr.get_cache(102).history_length == 39
    assert mgr.get_cache(102).num_held_pages(0) == 10 - (40 - window) // p
    # materialize_history=True: the whole history is backed
    mgr.add_dummy_requests([105], [40], is_gen=True, materialize_history=True)
    assert mgr.get_cache(105).num_held_pages(0) == 10 and mgr.get_cache(105).history_length == 0
    # a hint past the dummy's own position (tokens - 1) is clamped there
    mgr.add_dummy_requests([103], [10], is_gen=True, history_hint=50)
    assert (mgr.get_cache(103).capacity, mgr.get_cache(103).history_length) == (10, 9)
    check_rows(mgr, 103)
    ctx = mgr.add_dummy_requests([104], [3], is_gen=False)
    assert ctx[0].state == LlmRequestState.CONTEXT_INIT


def test_add_dummy_requests_errors_roll_back():
    mgr = make_mgr(pages=(64, 10))
    mgr.add_dummy_requests([1], [4])
    before = state(mgr)
    with pytest.raises(ValueError, match=r"dummy request 3: token count must be >= 1, got 0"):
        mgr.add_dummy_requests([2, 3], [4, 0])
    assert state(mgr) == before
    with pytest.raises(ValueError, match=r"request 1 already has a cache"):
        mgr.add_dummy_requests([5, 1], [4, 4])
    assert state(mgr) == before
    with pytest.raises(ValueError, match=r"2 dummy ids but 1 token counts"):
        mgr.add_dummy_requests([5, 6], [4])
    assert state(mgr) == before
    with pytest.raises(KVCacheResizeError, match=r"dummy resize failed for request 7"):
        strict(mgr, mgr.add_dummy_requests([6, 7], [8, 40]))  # the second needs 10 full pages, 7 free after the first
    assert state(mgr) == before


# -- freeing ----------------------------------------------------------------------------------------------
def test_free_resources_returns_every_page():
    mgr = make_mgr(window=6, p=4, pages=(20, 20))
    reqs = [LlmRequest(i, prompt_len=10 + i) for i in range(3)]
    mgr.prepare_resources(ctx_batch(*reqs))
    mgr.free_resources(reqs[1])
    assert not mgr.has_cache(1)
    mgr.check_accounting()
    mgr.free_resources(0)  # by id
    mgr.free_resources(reqs[2])
    assert [pool.num_free for pool in mgr.pools()] == [20, 20]
    assert mgr.request_ids() == []
    with pytest.raises(KeyError, match="request 2"):
        mgr.free_resources(2)


# -- out of pages during prepare ----------------------------------------------------------------------------
def test_generation_out_of_pages_error_is_explicit_and_changes_nothing():
    mgr = make_mgr(window=None, p=4, pages=(64, 6), draft=2)
    req = LlmRequest(4, prompt_len=20)
    run_prefill(mgr, req, 8)
    req.tokens.append(0)
    mgr.update_resources(gen_batch(req))
    req.tokens.extend([0, 0, 0])  # tokens 24: needs ceil((23 + 3) / 4) = 7 full pages, pool has 6
    before = state(mgr)
    with pytest.raises(KVCacheResizeError) as info:
        mgr.prepare_resources(gen_batch(req))
    err = info.value
    assert (err.request_id, err.phase, err.capacity, err.history) == (4, "generation", 26, None)
    text = str(err)
    assert "generation resize failed for request 4: could not resize to 26 tokens" in text
    assert "request 4: capacity=21 history=20" in text
    assert "group 1: 0/6" in text
    assert state(mgr) == before


def test_context_out_of_pages_drops_the_fresh_cache():
    mgr = make_mgr(pages=(64, 3))
    before = state(mgr)
    req = LlmRequest(8, prompt_len=40)
    with pytest.raises(KVCacheResizeError, match=r"context resize failed for request 8: could not resize to 40"):
        mgr.prepare_resources(ctx_batch(req))
    assert not mgr.has_cache(8) and state(mgr) == before


# -- export -------------------------------------------------------------------------------------------------
def exported_expectation(mgr, ids):
    """[num_pools, B, 2, width] with -1 kept, built from the rows by hand."""
    width = mgr.config.max_blocks_per_seq
    kv = mgr.config.kv_factor
    out = torch.full((mgr.num_pools, len(ids), 2, width), -1, dtype=torch.int32)
    for b, rid in enumerate(ids):
        for g in range(mgr.num_pools):
            for i, page in enumerate(mgr.get_cache(rid).block_row(g)):
                if page >= 0:
                    out[g, b, 0, i] = page * kv
                    out[g, b, 1, i] = page * kv + (1 if kv > 1 else 0)
    return out


def test_a_k_only_pool_exports_the_same_slot_for_k_and_v():
    """kv_factor 1 (K only): there is no V slot, so the V entry must not point at the next page."""
    mgr = make_mgr(window=None, p=4, max_seq_len=64, kv_factor=1)
    req = LlmRequest(1, prompt_len=20)
    run_prefill(mgr, req, 8)
    for backend in ("python", "cpp"):
        offsets = mgr.get_block_offsets([1], backend=backend)
        assert torch.equal(offsets[:, :, 0], offsets[:, :, 1])
    assert torch.equal(mgr.get_block_offsets([1], backend="python"), exported_expectation(mgr, [1]))


def test_get_block_offsets_python_keeps_minus_one():
    mgr = make_mgr(window=5, p=4, max_seq_len=64)
    reqs = [LlmRequest(i, prompt_len=30) for i in (3, 1)]
    for r in reqs:
        run_prefill(mgr, r, 8)
    offsets = mgr.get_block_offsets([1, 3], backend="python")
    assert offsets.dtype == torch.int32
    assert tuple(offsets.shape) == (2, 2, 2, 16)
    assert torch.equal(offsets, exported_expectation(mgr, [1, 3]))
    assert (offsets[0, :, :, :6] == -1).all()  # released by the window (history 30, window 5)
    assert (offsets[:, :, :, 8:] == -1).all()  # past the capacity


def test_get_block_offsets_cpp_maps_unbacked_to_page_zero():
    mgr = make_mgr(window=5, p=4, max_seq_len=64)
    req = LlmRequest(3, prompt_len=30)
    run_prefill(mgr, req, 8)
    python = mgr.get_block_offsets([3], backend="python")
    cpp = mgr.get_block_offsets([3])  # the default backend is cpp
    assert cpp.dtype == torch.int32 and cpp.shape == python.shape
    unbacked = python < 0
    assert torch.equal(cpp[~unbacked], python[~unbacked])
    assert (cpp[:, :, 0][unbacked[:, :, 0]] == 0).all()  # K of page 0
    assert (cpp[:, :, 1][unbacked[:, :, 1]] == 1).all()  # V of page 0
    assert (cpp >= 0).all()
    # page 0 is a real page somebody holds: the hazard
    assert any(0 in mgr.get_cache(3).held_pages(g) for g in range(2))


def test_get_block_offsets_cpp_with_guard_page():
    p, pages = 4, (6, 8)
    mgr = make_mgr(window=5, p=p, pages=pages, guard=True, max_seq_len=64)
    assert [pool.total for pool in mgr.pools()] == list(pages)
    assert [pool.guard_page_index for pool in mgr.pools()] == list(pages)
    run_prefill(mgr, LlmRequest(1, prompt_len=30), 8)
    python = mgr.get_block_offsets([1], backend="python")
    cpp = mgr.get_block_offsets([1], backend="cpp")
    for g, guard in enumerate(pages):
        un = python[g] < 0
        assert un.any()
        assert torch.equal(cpp[g][~un], python[g][~un])
        assert (cpp[g, :, 0][un[:, 0]] == guard * 2).all()
        assert (cpp[g, :, 1][un[:, 1]] == guard * 2 + 1).all()
        # the guard page's storage exists and belongs to no request
        assert mgr.pools()[g].layers[0].shape[0] == guard + 1


def test_guard_page_never_handed_out_when_the_pool_is_full():
    p, pages = 4, 6
    mgr = make_mgr(window=None, p=p, pages=(pages, pages), guard=True)
    mgr.add_dummy_requests([1], [pages * p])  # every page of both pools
    assert [pool.num_free for pool in mgr.pools()] == [0, 0]
    for g, pool in enumerate(mgr.pools()):
        assert sorted(mgr.get_cache(1).held_pages(g)) == list(range(pages))
        assert pool.guard_page_index == pages and not pool.is_held(pages)
        assert pool.num_held + pool.num_free == pool.total == pages
    before = state(mgr)
    with pytest.raises(KVCacheResizeError, match="request 2"):
        strict(mgr, mgr.add_dummy_requests([2], [1]))
    assert state(mgr) == before


def test_get_block_offsets_errors():
    mgr = make_mgr(max_seq_len=16, p=4, window=None)
    req = LlmRequest(1, prompt_len=20)
    mgr.prepare_resources(ctx_batch(req))  # 5 blocks, max_blocks_per_seq 4
    with pytest.raises(ValueError, match=r"request 1 spans 5 blocks, more than max_blocks_per_seq=4"):
        mgr.get_block_offsets([1])
    with pytest.raises(ValueError, match="'triton'"):
        mgr.get_block_offsets([1], backend="triton")
    with pytest.raises(KeyError, match="request 2"):
        mgr.get_block_offsets([1, 2], backend="python")


def test_pool_diagnostic_lists_caches_and_windows():
    mgr = make_mgr(window=8, p=4, pages=(30, 40))
    req = LlmRequest(9, prompt_len=20)
    run_prefill(mgr, req, 8)
    text = mgr.pool_diagnostic()
    assert "[8, None]" in text
    cache = mgr.get_cache(9)
    assert f"request 9: capacity={cache.capacity} history=20 logical_blocks={cache.num_blocks}" in text
    assert f"group 0: {30 - cache.num_held_pages(0)}/30" in text
    assert "live caches: 1" in text


def test_check_accounting_catches_a_page_held_twice():
    mgr = make_mgr()
    for rid in (1, 2):
        mgr.prepare_resources(ctx_batch(LlmRequest(rid, prompt_len=8)))
    mgr.check_accounting()
    mgr.get_cache(2)._rows[1][0] = mgr.get_cache(1)._rows[1][0]
    with pytest.raises(AssertionError, match="held by requests 1 and 2"):
        mgr.check_accounting()


def test_manager_rejects_negative_draft_or_extra():
    config = KVPoolConfig(layer_groups=(LayerGroupConfig(1),), pages_per_group=(4,), tokens_per_block=4)
    with pytest.raises(ValueError, match=r"max_draft_len \(-1\)"):
        KVCacheManagerV2.from_pool_config(config, max_draft_len=-1)
    with pytest.raises(ValueError, match=r"num_extra_kv_tokens \(-2\)"):
        KVCacheManagerV2.from_pool_config(config, num_extra_kv_tokens=-2)
