"""The change log a `KVCache` keeps for a mirror (`cache.changes`, a `ChangeLog`): replaying it rebuilds the rows.

A mirror that saw the rows once, then applies every drained chunk in order (ordinal ->
page, `None` pages meaning unbacked, ordinals past the row's end meaning cut off), must
hold exactly the cache's rows after any sequence of resizes (growth, window releases,
shrinks), batch rollbacks and refused (out-of-pages) resizes; and the cache must report
itself to its sink whenever it logged something, and never after it stopped tracking.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorrt_llm_draftkv import BAD_PAGE_INDEX, KVCacheManagerV2, KVPoolConfig, LayerGroupConfig

P = 4


def _manager() -> KVCacheManagerV2:
    config = KVPoolConfig(
        layer_groups=(LayerGroupConfig(1, window=10, sink_blocks=1), LayerGroupConfig(1, window=None)),
        pages_per_group=(14, 22), tokens_per_block=P, num_kv_heads=1, head_dim=2, dtype=torch.float32,
        max_seq_len=40 * P,
    )
    return KVCacheManagerV2.from_pool_config(config)


def _replay(mirror: list[list[int]], chunks) -> None:
    for g, ordinals, pages in chunks:
        row = mirror[g]
        for i, o in enumerate(ordinals):
            page = BAD_PAGE_INDEX if pages is None else pages[i]
            if o >= len(row):
                row.extend([BAD_PAGE_INDEX] * (o + 1 - len(row)))
            row[o] = page


def _same(mirror: list[list[int]], cache) -> bool:
    """The mirror equals the rows where the rows reach; past them it holds only unbacked entries."""
    for g, row in enumerate(mirror):
        want = cache.block_row(g)
        if row[: len(want)] != want + [BAD_PAGE_INDEX] * (len(row[: len(want)]) - len(want)):
            return False
        if any(p != BAD_PAGE_INDEX for p in row[len(want):]):
            return False
        if len(row) < len(want):
            return False
    return True


steps = st.lists(
    st.tuples(st.sampled_from(["grow", "advance", "shrink", "rollback", "huge"]), st.integers(0, 12),
              st.integers(0, 12)),
    min_size=1, max_size=25,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=steps)
def test_replaying_the_log_rebuilds_the_rows(steps):
    mgr = _manager()
    other = mgr.caches.new(2)  # a neighbour competing for pages (refusals happen)
    assert other.resize(20, 0)
    mgr.caches[2] = other
    cache = mgr.caches.new(1)
    mgr.caches[1] = cache
    sink: set = set()
    cache.changes.start(sink)
    mirror = [cache.block_row(g) for g in range(mgr.num_pools)]
    for kind, a, b in steps:
        cap, hist = cache.capacity, cache.history_length
        if kind == "grow":
            cache.resize(cap + a, hist)
        elif kind == "advance":
            cache.resize(max(cap, hist + a) + b, hist + a)
        elif kind == "shrink":
            cache.resize(max(hist, cap - a), hist)
        elif kind == "huge":
            assert not cache.resize(cap + 400 * P, hist)  # out of pages: nothing changes, nothing logged
        else:
            with pytest.raises(RuntimeError):
                with mgr.caches.transaction([1]):
                    cache.resize(cap + a + 1, hist + min(a, b))
                    cache.resize(cache.capacity + b, cache.history_length + b // 2)
                    raise RuntimeError("the step failed")
        chunks = cache.changes.drain()
        assert (cache in sink) == bool(chunks) or not any(len(o) for _, o, _ in chunks)
        sink.discard(cache)
        _replay(mirror, chunks)
        assert _same(mirror, cache), (kind, a, b)
    cache.changes.stop()
    cache.resize(cache.capacity + P, cache.history_length)
    assert cache.changes.drain() == [] and not sink
