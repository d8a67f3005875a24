"""KVCache.resize and friends: every rule of docs/design.md "Core cache".

Expected rows are derived by brute force over positions: after a resize to
(capacity C, history h), ordinal i of a group with window W and `sinks` sink
blocks is backed iff i < ceil(C / P) and (i < sinks, or some position of
[i*P, (i+1)*P) is >= h + 1 - W); full attention backs every i < ceil(C / P).
"""
from __future__ import annotations

import random

import pytest

from tensorrt_llm_draftkv import BAD_PAGE_INDEX
from tensorrt_llm_draftkv.runtime import KVCache, LayerGroup, LifeCycle, PagePool

P = 4


def make_cache(specs, p=P, name="req"):
    """specs: list of (window, sinks, num_pages)."""
    groups = [
        LayerGroup(LifeCycle(w, s), PagePool(n, tokens_per_block=p, num_layers=2, head_dim=2)) for w, s, n in specs
    ]
    return KVCache(groups, p, name=name), groups


def needed(i: int, capacity: int, history: int, window, sinks: int, p: int) -> bool:
    if i * p >= capacity:
        return False
    if window is None or i < sinks:
        return True
    return any(pos >= history + 1 - window for pos in range(i * p, (i + 1) * p))


def expected_backed(capacity, history, window, sinks, p=P) -> list[bool]:
    nb = -(-capacity // p)
    return [needed(i, capacity, history, window, sinks, p) for i in range(nb)]


def check_rows(cache: KVCache, specs, p=P):
    for g, (w, s, _n) in enumerate(specs):
        row = cache.block_row(g)
        assert [x != BAD_PAGE_INDEX for x in row] == expected_backed(cache.capacity, cache.history_length, w, s, p), (
            g,
            row,
            cache.capacity,
            cache.history_length,
        )
        assert all(x == BAD_PAGE_INDEX or x >= 0 for x in row)
        backed = [o for o, x in enumerate(row) if x != BAD_PAGE_INDEX]
        for start in range(len(row) + 2):  # the table's one-call span, against the row itself
            first = next((o for o in backed if o >= start), max(start, len(row)))
            assert cache.backed_span(g, start) == (first, backed[-1] + 1 if backed else 0), (g, start, row)
        pool = cache.groups[g].pool
        held = cache.held_pages(g)
        assert len(set(held)) == len(held)
        assert all(pool.is_held(x) for x in held)
        pool.check_accounting()


def pools_state(groups):
    return [(g.pool.free_order(), g.pool.held_pages()) for g in groups]


def test_bad_page_index_is_minus_one():
    assert BAD_PAGE_INDEX == -1


def test_fresh_cache_is_empty():
    cache, groups = make_cache([(8, 0, 10), (None, 0, 10)])
    assert (cache.capacity, cache.history_length, cache.committed, cache.num_blocks) == (0, 0, 0, 0)
    assert cache.block_row(0) == [] and cache.block_row(1) == []
    assert cache.num_held_pages() == 0


def test_growth_backs_every_ordinal_of_a_fresh_cache():
    specs = [(8, 0, 10), (None, 0, 10)]
    cache, groups = make_cache(specs)
    assert cache.resize(10) is True
    assert (cache.capacity, cache.history_length, cache.num_blocks) == (10, 0, 3)
    check_rows(cache, specs)
    assert cache.num_held_pages(0) == 3 and cache.num_held_pages(1) == 3 and cache.num_held_pages() == 6
    assert [g.pool.num_free for g in groups] == [7, 7]


def test_block_row_is_a_copy():
    cache, _ = make_cache([(None, 0, 4)])
    cache.resize(4)
    row = cache.block_row(0)
    row[0] = 99
    assert cache.block_row(0)[0] != 99


def test_either_argument_may_be_none():
    specs = [(6, 0, 20), (None, 0, 20)]
    cache, groups = make_cache(specs)
    assert cache.resize(20, None)
    assert (cache.capacity, cache.history_length) == (20, 0)
    rows = [cache.block_row(0), cache.block_row(1)]
    assert cache.resize(None, 9)  # capacity unchanged
    assert (cache.capacity, cache.history_length) == (20, 9)
    check_rows(cache, specs)
    assert cache.resize(None, None)  # nothing changes
    assert (cache.capacity, cache.history_length) == (20, 9)
    assert cache.resize(24)  # history unchanged
    assert (cache.capacity, cache.history_length) == (24, 9)
    check_rows(cache, specs)
    # pages that stay backed keep their page
    for g in range(2):
        for i, page in enumerate(rows[g]):
            now = cache.block_row(g)[i]
            assert now in (page, BAD_PAGE_INDEX)


def test_history_never_decreases():
    cache, groups = make_cache([(6, 0, 20), (None, 0, 20)])
    cache.resize(16, 10)
    before, pools = cache.checkpoint(), pools_state(groups)
    with pytest.raises(ValueError, match=r"is 10, asked 9"):
        cache.resize(16, 9)
    with pytest.raises(ValueError, match=r"is 10, asked 0"):
        cache.resize(None, 0)
    assert cache.checkpoint() == before and pools_state(groups) == pools
    assert cache.resize(16, 10)  # equal is fine
    assert cache.checkpoint() == before


def test_capacity_below_history_rejected():
    cache, groups = make_cache([(6, 0, 20), (None, 0, 20)])
    cache.resize(12, 4)
    before, pools = cache.checkpoint(), pools_state(groups)
    with pytest.raises(ValueError, match=r"capacity 7 is below history length 8"):
        cache.resize(7, 8)
    with pytest.raises(ValueError, match=r"capacity 12 is below history length 13"):
        cache.resize(None, 13)  # capacity None = current 12
    with pytest.raises(ValueError, match=r"capacity 3 is below history length 4"):
        cache.resize(3)  # history None = current 4
    assert cache.checkpoint() == before and pools_state(groups) == pools
    assert cache.resize(4, 4)  # capacity == history is allowed


def test_negative_capacity_rejected():
    cache, groups = make_cache([(None, 0, 4)])
    before, pools = cache.checkpoint(), pools_state(groups)
    with pytest.raises(ValueError, match=r"got -1\b"):
        cache.resize(-1)
    assert cache.checkpoint() == before and pools_state(groups) == pools


def test_raising_history_releases_stale_pages_to_the_pool():
    specs = [(5, 0, 20), (None, 0, 20)]
    cache, groups = make_cache(specs)
    cache.resize(24)
    row0 = cache.block_row(0)
    assert cache.resize(None, 13)  # attends [9, 13]: blocks 0, 1 stale
    row = cache.block_row(0)
    assert row[:2] == [BAD_PAGE_INDEX, BAD_PAGE_INDEX]
    assert row[2:] == row0[2:]
    for page in row0[:2]:
        assert not groups[0].pool.is_held(page)
        assert page in groups[0].pool.free_order()
    assert groups[0].pool.num_free == 20 - 4
    # the full-attention group released nothing
    assert cache.num_held_pages(1) == 6
    check_rows(cache, specs)


def test_growth_allocates_only_non_stale_ordinals():
    specs = [(5, 0, 30), (None, 0, 30)]
    cache, groups = make_cache(specs)
    # a fresh cache asked for a long history at once: stale ordinals never get a page
    assert cache.resize(40, 30)  # attends [26, 30] -> blocks 6.. ; 10 blocks in all
    assert cache.num_held_pages(0) == 4
    assert groups[0].pool.num_held == 4
    assert cache.num_held_pages(1) == 10
    check_rows(cache, specs)
    # raising history and growing in one call: the released pages may back new ordinals
    assert cache.resize(60, 50)
    check_rows(cache, specs)
    assert groups[0].pool.num_held == cache.num_held_pages(0) == 4  # ordinals 11..14 (attends [46, 50])


def test_sink_blocks_are_kept():
    specs = [(4, 2, 30)]
    cache, groups = make_cache(specs)
    cache.resize(8)
    sinks = cache.block_row(0)[:2]
    cache.resize(40, 36)
    row = cache.block_row(0)
    assert row[:2] == sinks
    assert all(x == BAD_PAGE_INDEX for x in row[2:8])
    check_rows(cache, specs)


def test_capacity_shrink_releases_tail_pages():
    specs = [(100, 0, 20), (None, 0, 20)]
    cache, groups = make_cache(specs)
    cache.resize(20, 2)
    rows = [cache.block_row(0), cache.block_row(1)]
    assert cache.resize(9)  # 3 blocks
    for g in range(2):
        assert cache.block_row(g) == rows[g][:3]
        for page in rows[g][3:]:
            assert not groups[g].pool.is_held(page)
        assert groups[g].pool.num_free == 17
    assert cache.num_blocks == 3
    check_rows(cache, specs)
    assert cache.resize(2)  # down to history
    assert cache.block_row(0) == rows[0][:1]
    # regrow after a shrink
    assert cache.resize(12)
    check_rows(cache, specs)


def test_shrink_to_zero_then_regrow():
    cache, groups = make_cache([(None, 0, 5)])
    assert cache.resize(20)
    assert cache.resize(0)
    assert cache.block_row(0) == [] and groups[0].pool.num_free == 5
    assert cache.resize(20)
    assert groups[0].pool.num_free == 0


def test_out_of_pages_returns_false_and_changes_nothing():
    specs = [(6, 0, 7), (None, 0, 8)]
    cache, groups = make_cache(specs)
    assert cache.resize(16, 3)  # 4 pages in each group
    other = KVCache(groups, P, name="other")
    assert other.resize(8)  # 2 more in each group
    before, pools, other_before = cache.checkpoint(), pools_state(groups), other.checkpoint()
    # the full group would need 9 pages: it holds 4 and 2 are free
    assert cache.resize(36) is False
    assert cache.checkpoint() == before
    assert pools_state(groups) == pools
    assert other.checkpoint() == other_before
    # raising history together with an impossible growth: nothing is released either
    assert cache.resize(40, 20) is False
    assert cache.checkpoint() == before and pools_state(groups) == pools
    for g in groups:
        g.pool.check_accounting()


def test_multi_group_all_or_nothing():
    """One group short of pages: no group changes, not even those with room."""
    specs = [(None, 0, 100), (8, 0, 100), (None, 0, 3)]
    cache, groups = make_cache(specs)
    assert cache.resize(12)
    before, pools = cache.checkpoint(), pools_state(groups)
    assert cache.resize(16) is False  # group 2 would need a 4th page
    assert cache.checkpoint() == before and pools_state(groups) == pools
    # the windowed group short, the full ones with room
    specs = [(None, 0, 100), (4, 0, 2)]
    cache, groups = make_cache(specs)
    assert cache.resize(8)
    before, pools = cache.checkpoint(), pools_state(groups)
    assert cache.resize(12) is False  # windowed needs 3 blocks (history 0)
    assert cache.checkpoint() == before and pools_state(groups) == pools
    assert cache.resize(12, 7)  # with history 7 block 0 is stale: fits in 2 pages
    check_rows(cache, specs)


def test_released_pages_count_toward_the_same_resize():
    """A resize that releases k pages and needs k new ones fits a full pool."""
    specs = [(4, 0, 2)]
    cache, groups = make_cache(specs)
    assert cache.resize(8)  # 2 pages, pool empty now
    assert groups[0].pool.num_free == 0
    assert cache.resize(12, 8)  # attends [5, 8]: block 0 stale, block 2 new
    check_rows(cache, specs)
    assert groups[0].pool.num_free == 0


def test_commit_rules():
    cache, _ = make_cache([(None, 0, 10)])
    cache.resize(20, 10)
    assert cache.committed == 0
    cache.commit(4)
    assert cache.committed == 4
    cache.commit(4)
    cache.commit(10)  # up to history
    assert cache.committed == 10
    with pytest.raises(ValueError, match=r"\[10, 10\], got 11"):
        cache.commit(11)
    with pytest.raises(ValueError, match=r"got 9"):
        cache.commit(9)  # never goes back
    assert cache.committed == 10
    cache.resize(None, 15)
    with pytest.raises(ValueError, match=r"\[10, 15\], got 16"):
        cache.commit(16)
    cache.commit(15)
    assert cache.checkpoint()[:3] == (20, 15, 15)


def test_free_returns_everything_and_double_free_raises():
    specs = [(4, 1, 10), (None, 0, 10)]
    cache, groups = make_cache(specs)
    cache.resize(30, 20)
    cache.commit(5)
    assert cache.num_held_pages() > 0
    cache.free()
    assert [g.pool.num_free for g in groups] == [10, 10]
    assert [g.pool.num_held for g in groups] == [0, 0]
    assert cache.closed
    assert cache.checkpoint() == (0, 0, 0, ((), ()), (0, 0))
    pools = pools_state(groups)
    with pytest.raises(ValueError, match="already freed"):
        cache.free()
    with pytest.raises(ValueError, match="freed"):
        cache.resize(4)
    assert pools_state(groups) == pools


def test_name_in_errors():
    cache, _ = make_cache([(None, 0, 4)], name="request 42")
    with pytest.raises(ValueError, match="request 42"):
        cache.resize(-3)


def test_non_positive_tokens_per_block_rejected():
    groups = [LayerGroup(LifeCycle(None), PagePool(2, tokens_per_block=4))]
    for p in (0, -4):
        with pytest.raises(ValueError, match=f"got {p}"):
            KVCache(groups, p)


@pytest.mark.parametrize("seed", range(12))
def test_random_monotone_sequences_match_brute_force(seed):
    """Random valid (capacity, history) sequences: rows always match the brute-force rows,
    kept ordinals keep their page, and pages held == sum of backed entries."""
    rnd = random.Random(seed)
    p = rnd.choice([1, 2, 3, 4, 8])
    specs = [(rnd.choice([1, 2, p, p + 1, 3 * p + 2, 9]), rnd.choice([0, 0, 1, 2]), 1000), (None, 0, 1000)]
    cache, groups = make_cache(specs, p=p)
    history = 0
    capacity = 0
    for _ in range(60):
        history += rnd.choice([0, 0, 1, 2, p, 3 * p])
        capacity = max(history, capacity + rnd.randint(-2 * p, 3 * p))
        old = [cache.block_row(g) for g in range(2)]
        assert cache.resize(capacity, history)
        check_rows(cache, specs, p)
        for g in range(2):
            new = cache.block_row(g)
            for i in range(min(len(old[g]), len(new))):
                if old[g][i] != BAD_PAGE_INDEX and new[i] != BAD_PAGE_INDEX:
                    assert old[g][i] == new[i]
            assert groups[g].pool.num_held == cache.num_held_pages(g)
    cache.free()
    assert all(g.pool.num_held == 0 for g in groups)


def test_groups_sharing_one_pool_are_all_or_nothing():
    """Two layer groups drawing on one pool: the fit is judged on the pool, not per group,
    and one group's growth may use the pages another group's window gives back."""
    pool = PagePool(4, tokens_per_block=P)
    specs = [(None, 0, 4), (1, 0, 4)]
    groups = [LayerGroup(LifeCycle(None), pool), LayerGroup(LifeCycle(1), pool)]
    cache = KVCache(groups, P)
    before, free = cache.checkpoint(), pool.free_order()
    assert cache.resize(12) is False  # 3 + 3 pages from a pool of 4
    assert cache.checkpoint() == before and pool.free_order() == free
    assert cache.resize(8)  # 2 + 2: the pool is empty now
    assert pool.num_free == 0
    # W=1, h=11: the windowed group gives back blocks 0 and 1 and needs block 2;
    # the full group needs block 2 as well: 2 released, 2 needed
    assert cache.resize(12, 11)
    check_rows(cache, specs)
    assert pool.num_free == 0 and cache.num_held_pages(0) == 3 and cache.num_held_pages(1) == 1
    held = cache.held_pages(0) + cache.held_pages(1)
    assert sorted(held) == [0, 1, 2, 3]
    before, free = cache.checkpoint(), pool.free_order()
    assert cache.resize(16, 12) is False  # full +1, windowed +1 -1 (block 2 -> 3): one short
    assert cache.checkpoint() == before and pool.free_order() == free
    pool.check_accounting()


@pytest.mark.parametrize("seed", range(4))
def test_can_resize_predicts_resize_and_changes_nothing(seed):
    rnd = random.Random(seed)
    specs = [(5, 1, 9), (None, 0, 12)]
    cache, groups = make_cache(specs)
    for _ in range(80):
        cap = cache.capacity + rnd.randint(-6, 12)
        hist = cache.history_length + rnd.randint(-1, 6)
        before, pools = cache.checkpoint(), pools_state(groups)
        try:
            predicted = cache.can_resize(cap, hist)
        except ValueError:
            assert cache.checkpoint() == before and pools_state(groups) == pools
            with pytest.raises(ValueError):
                cache.resize(cap, hist)
            continue
        assert cache.checkpoint() == before and pools_state(groups) == pools
        assert cache.resize(cap, hist) is predicted
        if predicted:
            check_rows(cache, specs)
        else:
            assert cache.checkpoint() == before and pools_state(groups) == pools
