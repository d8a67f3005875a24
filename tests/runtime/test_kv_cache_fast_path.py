"""A resize that changes no row (same block count, no block newly stale) only moves cursors.

It must not touch a pool, must not bump the version the export's numpy rows
follow, must still settle full-attention rows, and must roll back like any
other resize; a resize that does change a row still takes the full path.
"""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tensorrt_llm_draftkv.runtime import KVCache, LayerGroup, LifeCycle, PagePool

P = 4


def _cache(window: int | None = 8, sinks: int = 0, *, full_group: bool = True):
    """A cache with a group of this life cycle and, with `full_group`, a full-attention group beside it."""
    events: list[tuple[str, list[int]]] = []
    groups = [
        LayerGroup(LifeCycle(window, sinks), PagePool(64, tokens_per_block=P, num_layers=1, head_dim=2)),
        LayerGroup(LifeCycle(None), PagePool(64, tokens_per_block=P, num_layers=1, head_dim=2)),
    ][: 2 if full_group else 1]
    for g in groups:
        g.pool.add_listener(lambda kind, pages, owner: events.append((kind, list(pages))))
    return KVCache(groups, P, name="r"), events


def test_a_step_inside_one_page_touches_no_pool_and_keeps_the_version():
    cache, events = _cache()
    assert cache.resize(21, 17)  # blocks 0..5; window 8 releases below (17+1-8)//4 = 2
    events.clear()
    version, rows = cache.version, [cache.block_row(g) for g in range(2)]
    assert cache.resize(23, 19)  # still 6 blocks; stale range [0, 3) vs settled 2: a block goes stale
    assert events, "block 2 went stale: the full path must release it"
    events.clear()
    version, rows = cache.version, [cache.block_row(g) for g in range(2)]
    assert cache.resize(24, 20)  # 6 blocks, stale hi (20+1-8)//4 = 3: nothing new
    assert events == [] and cache.version == version
    assert [cache.block_row(g) for g in range(2)] == rows
    assert (cache.capacity, cache.history_length) == (24, 20)
    assert cache.settled_blocks(1) == 5  # the full-attention row settles below its history


def test_cursor_moves_roll_back_with_the_journal():
    cache, _ = _cache(window=None)
    assert cache.resize(10, 6)
    before = cache.checkpoint()
    cache.begin_journal()
    for pool in {id(g.pool): g.pool for g in cache.groups}.values():
        pool.begin_journal()
    assert cache.resize(11, 8)  # cursors only
    assert cache.resize(14, 9)  # a new block
    assert cache.resize(15, 12)  # cursors only
    cache.rollback_journal()
    for pool in {id(g.pool): g.pool for g in cache.groups}.values():
        pool.rollback_journal()
        pool.end_journal()
    assert cache.checkpoint() == before


def test_fast_and_full_paths_agree_on_random_steps():
    """The same random generation-like walk on two caches, one forced through the full path."""
    rng = random.Random(5)
    for window, sinks in [(8, 0), (9, 1), (None, 0), (16, 2)]:
        fast, _ = _cache(window, sinks)
        full, _ = _cache(window, sinks)
        full._moves_only_cursors = lambda capacity, history: False  # type: ignore[method-assign]
        history = 0
        for _ in range(200):
            history += rng.randint(0, 3)
            capacity = history + rng.choice([1, 1, 5, 9])
            assert fast.resize(capacity, history) == full.resize(capacity, history)
            assert fast.checkpoint() == full.checkpoint()
            assert [g.pool.num_free for g in fast.groups] == [g.pool.num_free for g in full.groups]


def _rows_stay(cache: KVCache, capacity: int, history: int) -> bool:
    """The oracle, from the life cycles' stale ranges: no row changes when every row keeps its block count
    and no window's stale range reaches above the row's settled mark."""
    num_blocks = -(-capacity // P)
    for g, group in enumerate(cache.groups):
        if cache.row_length(g) != num_blocks:
            return False
        lo, hi = group.life_cycle.stale_range(history, P)
        if hi > max(lo, cache.settled_blocks(g)):
            return False
    return True


@settings(deadline=None, max_examples=60)
@given(
    window=st.sampled_from([None, 1, 3, 4, 5, 8, 9, 17]),
    sinks=st.integers(0, 2),
    walk=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=25),
    probes=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=1, max_size=12),
    full_group=st.booleans(),
)
def test_cursor_range_is_exactly_the_sizes_that_move_only_cursors(window, sinks, walk, probes, full_group):
    """After any walk of resizes (growth, window releases, rollbacks), a size lies inside `cursor_range()`
    exactly when no row would change (`_rows_stay`); a cached range follows every row change (version).
    With one group (a draft pool's usual shape) and with a full-attention group beside it."""
    cache, _ = _cache(window, sinks, full_group=full_group)
    history = 0
    for grow, advance in walk:
        history += advance
        if not cache.resize(history + grow, history):
            break
        span = cache.cursor_range()
        assert span.version == cache.version
        for extra, more in probes:
            h = cache.history_length + more
            c = h + extra
            inside = span.capacity_above < c <= span.capacity_max and h <= span.history_max
            assert inside == _rows_stay(cache, c, h), (c, h, span)
    cache.free()
    span = cache.cursor_range()
    assert span.capacity_max <= span.capacity_above  # a freed cache admits no size
