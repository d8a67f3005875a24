"""The block-offset export keeps numpy copies of each row and converts only what changed.

These tests drive caches through growth, window releases, shrinks, rolled-back
journals and frees, and after every change compare the export
(full width, the live width, and the page tables taken straight from the rows)
with a brute-force conversion of `block_row`. A memo that missed a change
would export a page the row no longer holds.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorrt_llm_draftkv import KVCacheManagerV2, KVPoolConfig, LayerGroupConfig
from tensorrt_llm_draftkv.kernels import decode_draft_block_table_reference
from tensorrt_llm_draftkv.manager import KVCacheResizeError

P = 4


def _manager(window: int | None, *, guard: bool, kv_factor: int = 2, max_seq_len: int = 256) -> KVCacheManagerV2:
    config = KVPoolConfig(
        layer_groups=(LayerGroupConfig(1, window=window, sink_blocks=1 if window else 0), LayerGroupConfig(1)),
        pages_per_group=(48, 80),
        tokens_per_block=P,
        num_kv_heads=1,
        head_dim=2,
        max_seq_len=max_seq_len,
        guard_page=guard,
        kv_factor=kv_factor,
    )
    return KVCacheManagerV2.from_pool_config(config)


def _brute(mgr: KVCacheManagerV2, ids: list[int], backend: str, width: int) -> np.ndarray:
    kv = mgr.config.kv_factor
    v_slot = 1 if kv > 1 else 0
    out = np.full((mgr.num_pools, len(ids), 2, width), -1, dtype=np.int64)
    for p, group in enumerate(mgr.layer_groups):
        guard = group.pool.guard_page_index
        fill = 0 if guard is None else guard * kv
        for b, rid in enumerate(ids):
            row = mgr.get_cache(rid).block_row(p)
            for i in range(width):
                page = row[i] if i < len(row) else -1
                if page >= 0:
                    out[p, b, 0, i], out[p, b, 1, i] = page * kv, page * kv + v_slot
                elif backend == "cpp":
                    out[p, b, 0, i], out[p, b, 1, i] = fill, fill + v_slot
    return out


def _check_export(mgr: KVCacheManagerV2, ids: list[int]) -> None:
    live = max((len(mgr.get_cache(r).block_row(p)) for r in ids for p in range(mgr.num_pools)), default=0)
    for backend in ("cpp", "python"):
        full = mgr.get_block_offsets(ids, backend)
        assert full.dtype == torch.int32
        assert np.array_equal(full.numpy(), _brute(mgr, ids, backend, mgr.config.max_blocks_per_seq)), backend
        narrow = mgr.get_block_offsets(ids, backend, width="live")
        assert narrow.shape[-1] == live
        assert torch.equal(narrow, full[..., :live])
        for p, (tables, extents) in enumerate(mgr.block_tables(ids, backend)):
            want = decode_draft_block_table_reference(narrow, p, len(ids), mgr.config.kv_factor, backend)
            assert torch.equal(tables, want.tables), (backend, p)
            assert torch.equal(extents, want.extents), (backend, p)


def _grow(mgr: KVCacheManagerV2, rid: int, capacity: int, history: int) -> None:
    """Resize within max_seq_len (a longer row could not be exported at all)."""
    cache = mgr.get_cache(rid)
    limit = mgr.config.max_blocks_per_seq * P
    history = min(max(history, cache.history_length), limit)
    cache.resize(min(max(capacity, history), limit), history)


@settings(max_examples=40, deadline=None)
@given(
    window=st.sampled_from([None, 9, 13, 16]),
    guard=st.booleans(),
    kv_factor=st.sampled_from([1, 2]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["grow", "shrink", "rollback", "free", "add"]),
            st.integers(0, 3),
            st.integers(0, 120),
            st.integers(0, 120),
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_export_follows_every_change_of_the_rows(window, guard, kv_factor, ops):
    mgr = _manager(window, guard=guard, kv_factor=kv_factor)
    next_id = 0

    def add() -> None:
        nonlocal next_id
        try:
            mgr.add_dummy_requests([next_id], [1 + next_id % 7])
        except KVCacheResizeError:
            # the grown rows hold the pool: the refused dummy must leave no cache behind
            assert next_id not in mgr.request_ids()
        next_id += 1

    add()
    for op, who, a, b in ops:
        ids = mgr.request_ids()
        if not ids:
            add()
            ids = mgr.request_ids()
        rid = ids[who % len(ids)]
        cache = mgr.get_cache(rid)
        if op == "grow":
            _grow(mgr, rid, cache.capacity + a, cache.history_length + b // 2)
        elif op == "shrink":
            cache.resize(max(cache.history_length, cache.capacity - a))
        elif op == "rollback":
            mgr.get_block_offsets(ids, "cpp")  # a memo taken before the changes that are undone
            cache.begin_journal()
            for pool in mgr.pools():
                pool.begin_journal()
            _grow(mgr, rid, cache.capacity + a, cache.history_length + b)
            mgr.get_block_offsets(ids, "python")  # ... and one taken in the middle
            cache.rollback_journal()
            for pool in mgr.pools():
                pool.rollback_journal()
                pool.end_journal()
        elif op == "free":
            mgr.free_resources(rid)
        else:
            add()
        ids = mgr.request_ids()
        if ids:
            _check_export(mgr, ids)
            _check_export(mgr, ids[::-1])


def test_long_rows_convert_only_their_live_tail():
    """A windowed row of 2,000 blocks: a step converts the ordinals from the settled mark
    on (a few), not the row; the memo records that mark."""
    config = KVPoolConfig(
        layer_groups=(LayerGroupConfig(1, window=16),), pages_per_group=(16,), tokens_per_block=P,
        num_kv_heads=1, head_dim=2, max_seq_len=8192,
    )
    mgr = KVCacheManagerV2.from_pool_config(config)
    mgr.add_dummy_requests([0], [1])
    cache = mgr.get_cache(0)
    assert cache.resize(8000, 7990)
    mgr.get_block_offsets([0], "python")
    memo = cache.export_memo[(0, "python")]
    assert memo.n == 2000 and memo.settled == cache.settled_blocks(0) == (7990 + 1 - 16) // P
    row_before = memo.k[: memo.settled].copy()
    _grow(mgr, 0, 8040, 8030)
    _check_export(mgr, [0])
    assert memo.n == 2010 and memo.settled == cache.settled_blocks(0) == (8030 + 1 - 16) // P
    assert np.array_equal(memo.k[: len(row_before)], row_before)


def test_live_width_and_bad_widths():
    mgr = _manager(None, guard=False)
    mgr.add_dummy_requests([1, 2], [5, 30])
    assert mgr.get_block_offsets([1, 2], width="live").shape == (2, 2, 2, 8)
    assert mgr.get_block_offsets([1], width="live").shape == (2, 1, 2, 2)
    assert mgr.get_block_offsets([1, 2], width=10).shape[-1] == 10
    with pytest.raises(ValueError, match="request 2 spans 8 blocks, more than width=7"):
        mgr.get_block_offsets([1, 2], width=7)
    with pytest.raises(ValueError, match="export width"):
        mgr.get_block_offsets([1, 2], width=-1)
    with pytest.raises(ValueError, match="backend"):
        mgr.block_tables([1], "rust")
