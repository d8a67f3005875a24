"""Block reuse at a disaggregated generation worker's init (manager/gen_init_reuse.py, docs/block_reuse.md).

P = 4 throughout; ordinal i covers [4i, 4i + 4). Target: a full-attention group and a group with an
8-token window. A generation-init cache sits at history m (the prompt end), so the windowed group
needs, of a hit, only the ordinals [(m + 1 - 8) // 4, n) (plus sinks). Hits are worked out by hand.
"""
from __future__ import annotations

import pytest

from support import strict

from tensorrt_llm_draftkv import (
    BAD_PAGE_INDEX,
    DraftKVCacheManagerV2,
    KVCacheManagerV2,
    KVCacheResizeError,
    LlmRequest,
    LlmRequestState,
    SpeculativeDecodingMode as Mode,
)
from tensorrt_llm_draftkv.manager.diagnostics import MissingKVCacheError
from tensorrt_llm_draftkv.manager.gen_init_reuse import receive_start

from test_block_reuse import PREFIX, P, check, config

A_TAIL, B_TAIL = [1, 2, 3], [9, 9, 9, 9, 9]  # A: m = 31 (7 full pages + 3); B: m = 33 (8 full pages + 1)


def gen_request(rid: int, prompt: list[int]) -> LlmRequest:
    """A generation worker's new request: the prompt plus the first token (from the context worker)."""
    return LlmRequest(rid, prompt_len=len(prompt), tokens=list(prompt) + [7], state=LlmRequestState.DISAGG_GENERATION_INIT)


def serve(mgr: KVCacheManagerV2, rid: int, prompt: list[int], *others: KVCacheManagerV2) -> LlmRequest:
    """Generation init at its hit in every manager, the K/V 'written', the prompt's whole pages published."""
    req = gen_request(rid, prompt)
    hit = mgr.find_gen_init_hit(req)
    for m in (mgr, *others):
        assert m.prepare_disagg_gen_init(req, reused_tokens=hit)
        m.publish_gen_init(req)
    check(mgr, *others)
    return req


def snapshot(*managers) -> tuple:
    return tuple(
        (tuple(p.state() for p in m.pools()), tuple(sorted((rid, c.checkpoint()) for rid, c in m.caches.items())))
        for m in managers
    )


def test_the_hit_is_taken_at_the_prompt_end_and_adopts_the_published_pages_shared():
    mgr = KVCacheManagerV2.from_pool_config(config())
    a = serve(mgr, 1, PREFIX + A_TAIL)
    row_a = [mgr.get_cache(1).block_row(g) for g in (0, 1)]
    # A published: full group ordinals [0, 7); window group only ordinal 6 (it received [24, 31), so
    # its page 6 = [24, 28) is whole; page 7 is partial).
    assert [mgr.layer_groups[g].pool.is_published(p) for g in (0, 1) for p in row_a[g][:7] if p >= 0] == [True] * 8
    b = gen_request(2, PREFIX + B_TAIL)
    # The context rule (history = hit) would need window ordinal 5, which A never held: no hit there.
    assert mgr.find_prefix_hit(b) == 0
    # At history m = 33 the window reads only ordinals >= 6: the whole shared prefix (7 pages) is a hit.
    assert mgr.find_gen_init_hit(b) == 28
    assert mgr.prepare_disagg_gen_init(b, reused_tokens=28)
    check(mgr)
    row_b = [mgr.get_cache(2).block_row(g) for g in (0, 1)]
    assert row_b[0][:7] == row_a[0][:7]  # the full group shares every prefix page
    assert row_b[1][:6] == [BAD_PAGE_INDEX] * 6 and row_b[1][6] == row_a[1][6]
    pool0, pool1 = (mgr.layer_groups[g].pool for g in (0, 1))
    assert all(pool0.refcount(p) == 2 for p in row_a[0][:7]) and pool1.refcount(row_a[1][6]) == 2
    # Everything from ordinal 7 is fresh and held alone: the received K/V and generation go there.
    for g, pool in ((0, pool0), (1, pool1)):
        assert all(pool.is_writable(p) for p in row_b[g][7:] if p >= 0)
        assert set(row_b[g][7:]).isdisjoint(row_a[g])
    cache = mgr.get_cache(2)
    assert (cache.history_length, cache.committed) == (33, 28)
    # What the context worker must still send, per group: from the hit (the window starts lower).
    assert [receive_start(w, 33, 28) for w in (None, 8)] == [28, 28]
    assert [receive_start(w, 33, 0) for w in (None, 8)] == [0, 26]
    assert mgr.publish_gen_init(b) == 2  # ordinal 7 = [28, 32) in both groups (A published other tokens there)
    mgr.free_resources(a)
    mgr.free_resources(b)
    check(mgr)
    assert all(pool.num_held == 0 for pool in mgr.pools())


def test_a_prompt_that_differs_inside_the_prefix_only_adopts_the_pages_before_the_difference():
    mgr = KVCacheManagerV2.from_pool_config(config())
    serve(mgr, 1, PREFIX + A_TAIL)
    row_a = mgr.get_cache(1).block_row(0)
    other = list(PREFIX + B_TAIL)
    other[13] += 1  # ordinal 3 differs: every later key of the chain differs too
    req = gen_request(2, other)
    assert mgr.find_gen_init_hit(req) == 12
    assert mgr.prepare_disagg_gen_init(req, reused_tokens=12)
    row = mgr.get_cache(2).block_row(0)
    assert row[:3] == row_a[:3] and set(row[3:]).isdisjoint(row_a)
    # the window group reads nothing below 12 at m = 33: it adopted nothing
    assert mgr.get_cache(2).block_row(1)[:3] == [BAD_PAGE_INDEX] * 3
    check(mgr)


def test_no_hit_without_block_reuse_for_a_fresh_prompt_or_one_the_window_alone_would_adopt_nothing():
    assert KVCacheManagerV2.from_pool_config(config(reuse=False)).find_gen_init_hit(gen_request(1, PREFIX + A_TAIL)) == 0
    mgr = KVCacheManagerV2.from_pool_config(config())
    assert mgr.find_gen_init_hit(gen_request(1, PREFIX + A_TAIL)) == 0
    # A window-only pool: ordinals below (m + 1 - W) // P are stale at m, so an empty pool 'allows'
    # a hit there, but it would adopt no page: that is no hit.
    win = KVCacheManagerV2.from_pool_config(config(groups=((8, 0),)))
    assert win.find_gen_init_hit(gen_request(1, PREFIX + A_TAIL)) == 0


def test_a_failing_generation_init_leaves_pools_caches_and_the_request_as_they_were():
    mgr = KVCacheManagerV2.from_pool_config(config(pages=9))
    a = serve(mgr, 1, PREFIX + A_TAIL)  # capacity 32: the full group holds 8 pages of 9
    b = gen_request(2, PREFIX + B_TAIL)
    assert mgr.find_gen_init_hit(b) == 28
    before = snapshot(mgr)
    fields = (b.prepopulated_prompt_len, b.target_view, b.state, list(b.tokens))
    with pytest.raises(KVCacheResizeError) as err:  # B adopts 7 and needs ordinals 7, 8 afresh: 1 is free
        strict(mgr, mgr.prepare_disagg_gen_init(b, reused_tokens=28))
    assert err.value.request_id == 2 and err.value.phase == "generation"
    assert snapshot(mgr) == before and not mgr.has_cache(2)
    assert (b.prepopulated_prompt_len, b.target_view, b.state, list(b.tokens)) == fields
    mgr.free_resources(a)  # A's pages become cached-free: now it fits, on the same shared pages
    assert mgr.prepare_disagg_gen_init(b, reused_tokens=28)
    check(mgr)


def test_a_hit_the_pool_does_not_hold_or_a_bad_hit_is_refused_naming_the_request_and_changes_nothing():
    mgr = KVCacheManagerV2.from_pool_config(config())
    serve(mgr, 1, PREFIX + A_TAIL)
    before = snapshot(mgr)
    fresh = gen_request(5, [50 + i for i in range(33)])
    with pytest.raises(KVCacheResizeError, match=r"request 5: .*reuses 8 prompt tokens.*block ordinals \[0, 1\]"):
        strict(mgr, mgr.prepare_disagg_gen_init(fresh, reused_tokens=8))
    for bad in (6, 36, -4):  # not a page multiple; past the last position to receive (m - 1 = 32); negative
        with pytest.raises(ValueError, match="request 5 reuses"):
            strict(mgr, mgr.prepare_disagg_gen_init(fresh, reused_tokens=bad))
    with pytest.raises(ValueError, match="request 1 already holds a cache"):
        assert mgr.prepare_disagg_gen_init(gen_request(1, PREFIX + A_TAIL), reused_tokens=28)
    assert snapshot(mgr) == before and not mgr.has_cache(5)


def test_publishing_an_unknown_request_raises_an_error_naming_it():
    mgr = KVCacheManagerV2.from_pool_config(config())
    serve(mgr, 1, PREFIX + A_TAIL)
    before = snapshot(mgr)
    with pytest.raises(MissingKVCacheError, match=r"publish_gen_init names request 77"):
        mgr.publish_gen_init(gen_request(77, PREFIX + B_TAIL))
    assert snapshot(mgr) == before


def test_a_joint_draft_pool_adopts_the_same_prefix_and_the_hit_needs_both_pools():
    target = KVCacheManagerV2.from_pool_config(config())
    draft = DraftKVCacheManagerV2.from_pool_config(config(groups=((8, 0),)), spec_mode=Mode.DFLASH, joint_kv_cache_reuse=True)
    target.pair_joint_reuse(draft)
    assert draft.draft_slot_trail_tokens == P  # the draft window is 8 + 4 = 12 tokens wide
    serve(target, 1, PREFIX + A_TAIL, draft)
    b = gen_request(2, PREFIX + B_TAIL)
    # draft window at m = 33 reads from (34 - 12) // 4 = 5, but A's draft mirror held only ordinals >= 5
    # at m = 31 ((32 - 12) // 4 = 5) and published [20, 28) = ordinals 5, 6 whole: the hit is 7 pages.
    assert target.find_gen_init_hit(b) == 28
    for m in (target, draft):
        assert m.prepare_disagg_gen_init(b, reused_tokens=28)
    row_a, row_b = draft.get_cache(1).block_row(0), draft.get_cache(2).block_row(0)
    assert row_b[5:7] == row_a[5:7] and row_b[:5] == [BAD_PAGE_INDEX] * 5
    assert all(draft.layer_groups[0].pool.refcount(p) == 2 for p in row_a[5:7])
    check(target, draft)
    # Without the draft pool's pages (evicted), the joint hit falls to what both hold.
    target.free_resources(b)
    draft.free_resources(b)
    pool = draft.layer_groups[0].pool
    for page in row_a[5:7]:
        assert pool.is_published(page)
    draft.free_resources(1)
    target.free_resources(1)
    pool.allocate(pool.num_free, owner="filler")  # evicts every cached-free draft page
    # The draft window at m = 33 reads ordinals >= 5, none left: the hit stops there (5 pages, which
    # the full target group still holds), and the draft mirror adopts nothing.
    c = gen_request(3, PREFIX + B_TAIL)
    assert target.find_gen_init_hit(c) == 20
    pool.release([p for p in range(pool.total) if pool.refcount(p)], owner="filler")
    for m in (target, draft):
        assert m.prepare_disagg_gen_init(c, reused_tokens=20)
    assert draft.get_cache(3).block_row(0)[:5] == [BAD_PAGE_INDEX] * 5
    check(target, draft)
