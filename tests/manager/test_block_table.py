"""The manager's device block table: a ring per pool that follows every cache's rows by their change logs.

Random resizes (growth, window releases, out-of-pages refusals), batch rollbacks,
frees and re-used request ids over a windowed group with a sink and a full-attention
group, on a table that starts one row by one column wide (so it grows and re-lays
out). After every step each live request's live span in the table (host mirror)
equals its cache's row, and its first/extent are the row's lowest backed ordinal and
backed extent. A second test pins that a step changes only what the resizes touched.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tensorrt_llm_draftkv import BAD_PAGE_INDEX, KVCacheManagerV2, KVPoolConfig, LayerGroupConfig
from tensorrt_llm_draftkv.manager.block_table import DeviceBlockTable

P = 4


def _manager(window: int = 12, sinks: int = 1, pages: tuple[int, int] = (24, 40), device: str = "cpu",
             *, one_group: bool = False) -> KVCacheManagerV2:
    """A windowed group and a full-attention one (`one_group`: the windowed one alone, as a draft pool)."""
    groups = (LayerGroupConfig(1, window=window, sink_blocks=sinks), LayerGroupConfig(1, window=None))
    config = KVPoolConfig(
        layer_groups=groups[:1] if one_group else groups, pages_per_group=pages[:1] if one_group else pages,
        tokens_per_block=P, num_kv_heads=1, head_dim=2, dtype=torch.float32,
        max_seq_len=60 * P, device=device,
    )
    return KVCacheManagerV2.from_pool_config(config)


def check_rows(table: DeviceBlockTable, mgr: KVCacheManagerV2, ids: list[int]) -> None:
    for rid in ids:
        cache = mgr.get_cache(rid)
        for g in range(mgr.num_pools):
            row = cache.block_row(g)
            backed = [o for o, page in enumerate(row) if page != BAD_PAGE_INDEX]
            first, extent, pages = table.host_row(g, rid)
            assert first == (backed[0] if backed else len(row)), (rid, g, row)
            assert extent == (backed[-1] + 1 if backed else 0), (rid, g, row)
            assert pages.tolist() == row[first:extent], (rid, g, first, extent, row)
            assert np.array_equal(table.device_row(g, rid), pages)


class RingFollowsRows(RuleBasedStateMachine):
    sinks = 1  # sink blocks of the windowed group (with one, its first backed ordinal never moves)
    one_group = False  # the windowed group alone: a page crossing logs one entry

    def __init__(self) -> None:
        super().__init__()
        self.mgr = _manager(sinks=self.sinks, one_group=self.one_group)
        # its own pushed copy, as on a GPU: `check_rows` reads it back against the host mirror
        self.table = DeviceBlockTable(self.mgr.num_pools, "cpu", rows=1, width=1, cpu_copy=True)
        self.next_id = 0

    def live(self) -> list[int]:
        return self.mgr.request_ids()

    @rule(capacity=st.integers(1, 40))
    def new_request(self, capacity: int) -> None:
        rid = self.next_id
        self.next_id += 1
        cache = self.mgr.caches.new(rid)
        if cache.resize(capacity, 0):
            self.mgr.caches[rid] = cache
        self.table.sync(self.live(), [self.mgr.get_cache(r) for r in self.live()])

    @rule(pick=st.integers(0, 1000), grow=st.integers(0, 24), advance=st.integers(0, 24))
    def resize(self, pick: int, grow: int, advance: int) -> None:
        if not self.live():
            return
        rid = self.live()[pick % len(self.live())]
        cache = self.mgr.get_cache(rid)
        history = min(cache.history_length + advance, cache.capacity + grow)
        cache.resize(max(cache.capacity, history) + grow, history)  # False (out of pages) changes nothing

    @rule(accepted=st.integers(1, 3), headroom=st.integers(1, 3))
    def generation_step(self, accepted: int, headroom: int) -> None:
        """Every live request moves on by a few tokens, as a generation step does: most rows change no
        page, some take one at their end, some give their oldest back (one-entry logs)."""
        for rid in self.live():
            cache = self.mgr.get_cache(rid)
            history = min(cache.history_length + accepted, cache.capacity)
            cache.resize(max(cache.capacity, history + headroom), history)

    @rule(picks=st.lists(st.integers(0, 1000), min_size=1, max_size=3), grow=st.integers(1, 30))
    def rolled_back_batch(self, picks: list[int], grow: int) -> None:
        self._roll_back(picks, lambda c: (c.capacity + grow, c.history_length + grow // 2), sync_inside=False)

    @rule(picks=st.lists(st.integers(0, 1000), min_size=1, max_size=3), grow=st.integers(0, 30),
          advance=st.integers(1, 30))
    def batch_rolled_back_after_a_sync(self, picks: list[int], grow: int, advance: int) -> None:
        """The table syncs inside the batch, then the batch rolls back: the next sync sees pages below the
        row's first backed again, and its top released where the batch grew it."""
        def size(c):
            history = c.history_length + advance
            return max(c.capacity, history) + grow, history

        self._roll_back(picks, size, sync_inside=True)

    def _roll_back(self, picks: list[int], size, *, sync_inside: bool) -> None:
        """Resize the picked requests to `size(cache)` in one batch (the table synced inside it or not), then
        fail the batch: every resize is undone."""
        if not self.live():
            return
        ids = sorted({self.live()[p % len(self.live())] for p in picks})
        with pytest.raises(RuntimeError):
            with self.mgr.caches.transaction(ids):
                for rid in ids:
                    cache = self.mgr.get_cache(rid)
                    cache.resize(*size(cache))
                if sync_inside:
                    self.table.sync(self.live(), [self.mgr.get_cache(r) for r in self.live()])
                raise RuntimeError("the step failed")

    @rule(pick=st.integers(0, 1000), drop=st.integers(1, 12))
    def drafts_rejected(self, pick: int, drop: int) -> None:
        """Capacity given back (rejected draft tokens): the row's top pages are released."""
        if not self.live():
            return
        cache = self.mgr.get_cache(self.live()[pick % len(self.live())])
        cache.resize(max(cache.history_length, cache.capacity - drop, 1), cache.history_length)

    @rule(pick=st.integers(0, 1000))
    def free(self, pick: int) -> None:
        if not self.live():
            return
        rid = self.live()[pick % len(self.live())]
        self.mgr.free_resources(_Req(rid))
        self.table.forget(rid)

    @rule(pick=st.integers(0, 1000), capacity=st.integers(1, 30))
    def replace_cache_under_the_same_id(self, pick: int, capacity: int) -> None:
        """A request id whose cache was dropped and made anew (a re-used id) is re-read whole."""
        if not self.live():
            return
        rid = self.live()[pick % len(self.live())]
        self.mgr.caches.pop(rid).free()
        cache = self.mgr.caches.new(rid)
        if cache.resize(capacity, 0):
            self.mgr.caches[rid] = cache
        else:
            self.table.forget(rid)

    @invariant()
    def table_matches_every_row(self) -> None:
        ids = self.live()
        self.table.sync(ids, [self.mgr.get_cache(r) for r in ids])
        check_rows(self.table, self.mgr, ids)


class _Req:
    def __init__(self, rid: int) -> None:
        self.py_request_id = rid


TestRingFollowsRows = RingFollowsRows.TestCase
TestRingFollowsRows.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


class RingFollowsSlidingRows(RingFollowsRows):
    """The same without a sink: the window's slide moves each row's first backed ordinal."""

    sinks = 0


class RingFollowsSlidingRowsInNumpy(RingFollowsSlidingRows):
    """The same, every sync taking the numpy pass (`SMALL_LOG` 0): spans settled over all changed rows at once."""

    def __init__(self) -> None:
        from tensorrt_llm_draftkv.manager import block_table

        super().__init__()
        self._small_log = block_table.SMALL_LOG
        block_table.SMALL_LOG = 0

    def teardown(self) -> None:
        from tensorrt_llm_draftkv.manager import block_table

        block_table.SMALL_LOG = self._small_log


class RingFollowsRowsInNumpy(RingFollowsSlidingRowsInNumpy):
    sinks = 1


class RingFollowsOneGroupSlidingRows(RingFollowsSlidingRows):
    """A draft pool's shape: one windowed group, so a generation step's page crossing logs one entry
    per row and the sync settles those rows together (`DeviceBlockTable._settle_crossings`)."""

    one_group = True


class RingFollowsOneGroupRows(RingFollowsOneGroupSlidingRows):
    """The same with a sink block: the window gives back ordinals above the row's first one."""

    sinks = 1


for _machine in (RingFollowsSlidingRows, RingFollowsSlidingRowsInNumpy, RingFollowsRowsInNumpy,
                 RingFollowsOneGroupSlidingRows, RingFollowsOneGroupRows):
    globals()["Test" + _machine.__name__] = _machine.TestCase
    _machine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_a_row_growing_a_page_a_step_past_its_ring_re_lays_it_out():
    """Full attention grows a row one page per crossing (one-entry logs, settled in one numpy pass): the
    step whose span passes the ring's width re-lays the ring out, and every step's row reads back whole."""
    config = KVPoolConfig(  # one group, as a draft pool: each crossing's log is one entry
        layer_groups=(LayerGroupConfig(1, window=None),), pages_per_group=(40,), tokens_per_block=P,
        num_kv_heads=1, head_dim=2, dtype=torch.float32, max_seq_len=60 * P, device="cpu",
    )
    mgr = KVCacheManagerV2.from_pool_config(config)
    table = DeviceBlockTable(mgr.num_pools, "cpu", rows=1, width=1)
    cache = mgr.caches.new(3)
    assert cache.resize(2 * P, P)  # two pages; the first sync lays the ring out 4 wide
    mgr.caches[3] = cache
    table.sync([3], [cache])
    widths = [table.width(0)]
    for tokens in range(2 * P + 1, 20 * P, P):
        assert cache.resize(tokens, tokens - 1)  # one new page
        table.sync([3], [cache])
        check_rows(table, mgr, [3])
        widths.append(table.width(0))
    assert widths[0] < widths[-1]  # the span outgrew the ring along the way


def test_the_crossing_settle_leaves_to_the_cache_what_the_ring_cannot_place():
    """`_settle_crossings` places only a page taken at a row's end and a first page given back whose next
    ordinal the ring holds backed; any other one-entry log (a page set inside the span, a first given back
    before a hole, a page given back inside the span) is returned for the cache to settle, its row's
    first/extent left as they were."""
    mgr = _manager(window=12, sinks=0, pages=(40, 40), one_group=True)
    table = DeviceBlockTable(mgr.num_pools, "cpu", width=16)
    ids = [1, 2, 3, 4]
    for rid in ids:
        cache = mgr.caches.new(rid)
        assert cache.resize(40, 30)  # window 12, P 4: ordinals 4..9 live
        mgr.caches[rid] = cache
    table.sync(ids, [mgr.get_cache(r) for r in ids])
    rows = [table.row_of(r) for r in ids]
    spans = [table.host_row(0, r)[:2] for r in ids]
    assert all(span == (4, 10) for span in spans)
    pool, C = table._pools[0], table.width(0)
    pool.host[rows[1], 5 % C] = BAD_PAGE_INDEX  # row 2's ring holds a hole right after its first
    left = table._settle_crossings(0, rows, [5, 4, 10, 7], [True, False, True, False])
    assert left == [0, 1, 3]  # a page set inside the span; a first given back before a hole; one given back inside
    assert [table.host_row(0, r)[:2] for r in ids] == [(4, 10), (4, 10), (4, 11), (4, 10)]  # only the end-growth


def test_a_generation_step_writes_only_what_its_resize_changed():
    """Steps of a windowed request: each sync writes the columns of the ordinals its resize allocated or
    released (one entry each), never the row; a step that changes no page writes nothing."""
    mgr = _manager(window=12, sinks=0, pages=(40, 80))
    table = DeviceBlockTable(mgr.num_pools, "cpu", width=64)  # wide enough: no re-layout in this test
    cache = mgr.caches.new(7)
    assert cache.resize(100, 99)  # window: ordinals 22..24 live; full: 0..24
    mgr.caches[7] = cache
    assert table.sync([7], [cache]) == 3 + 25
    assert table.sync([7], [cache]) == 0
    assert cache.resize(101, 100)  # ordinal 25 allocated in both pools
    assert table.sync([7], [cache]) == 1 + 1
    assert cache.resize(104, 103)  # the window releases ordinal 22; no new block
    assert table.sync([7], [cache]) == 1
    assert cache.resize(105, 104)  # ordinal 26 in both pools
    assert table.sync([7], [cache]) == 1 + 1
    assert cache.resize(106, 105)  # inside the page: no row changes
    assert table.sync([7], [cache]) == 0
    check_rows(table, mgr, [7])
    assert table.relayouts == 0


@pytest.mark.parametrize("small_log", [0, 256])
@pytest.mark.parametrize("seed", range(4))
def test_one_sync_names_each_entry_once_with_its_page_now(seed, small_log, monkeypatch):
    """Random resizes, some logging one ordinal twice between two syncs (a page given and taken back): the
    delta of one sync holds each (pool, table row, ordinal) once, with the page the cache has there now,
    which the offsets writer relies on to skip its own keep-last."""
    from tensorrt_llm_draftkv.manager import block_table

    monkeypatch.setattr(block_table, "SMALL_LOG", small_log)
    rng = np.random.default_rng(seed)
    mgr = _manager(window=12, sinks=0, pages=(60, 120))
    table = DeviceBlockTable(mgr.num_pools, "cpu", width=64)
    for rid in range(5):
        cache = mgr.caches.new(rid)
        assert cache.resize(int(rng.integers(1, 40)), 0)
        mgr.caches[rid] = cache
    ids = mgr.request_ids()
    repeats = 0
    for step in range(40):
        for rid in ids:
            cache = mgr.get_cache(rid)
            before = cache.num_blocks
            grow = int(rng.integers(0, 6))
            history = min(cache.history_length + int(rng.integers(0, 5)), cache.capacity + grow)
            cache.resize(min(max(cache.capacity, history) + grow, 40 * P), min(history, 40 * P))
            grown = cache.num_blocks
            if rng.random() < 0.4:  # drafts rejected: the pages just given are taken back (ordinals logged twice)
                cache.resize(max(cache.history_length, cache.capacity - int(rng.integers(1, 9)), 1),
                             cache.history_length)
                repeats += grown > max(before, cache.num_blocks)
        epoch = table.epoch
        table.sync(ids, [mgr.get_cache(rid) for rid in ids])
        delta = table.changes_since(epoch)
        for g, rows, ordinals, pages in delta.entries:
            pairs = list(zip(rows.tolist(), ordinals.tolist()))
            assert len(set(pairs)) == len(pairs), (seed, step)
            row_of = {table.row_of(rid): rid for rid in ids}
            for (r, o), page in zip(pairs, pages.tolist()):
                assert page == mgr.get_cache(row_of[r]).block_entry(g, o), (seed, step, r, o)
    check_rows(table, mgr, ids)
    assert repeats >= 5  # the workload logged ordinals twice in one sync


def test_the_ring_of_a_windowed_pool_stays_narrow_whatever_the_prompt():
    """Ring width follows the window's live span, not the prompt: a 3,000-page prompt on a 3-page window."""
    mgr = _manager(window=12, sinks=0, pages=(40, 4000))
    table = DeviceBlockTable(mgr.num_pools, "cpu")
    cache = mgr.caches.new(1)
    assert cache.resize(3000 * P, 3000 * P - 1)
    mgr.caches[1] = cache
    table.sync([1], [cache])
    for step in range(40):
        assert cache.resize(3000 * P + 3 * step + 3, 3000 * P + 3 * step + 2)
        table.sync([1], [cache])
    check_rows(table, mgr, [1])
    assert table.width(0) <= 8
    assert table.width(1) >= 3000


@pytest.mark.parametrize("small_log", [0, 256])  # keep-last of the sync and the writer: numpy, or Python (few)
@pytest.mark.parametrize("seed", range(6))
def test_copy_batch_block_offsets_into_a_kept_tensor_equals_a_fresh_export(seed, small_log, monkeypatch):
    """Random steps (growth, releases, rollbacks, frees, new requests, shuffled and shortened batches) into
    one kept destination, poisoned first: after every call its rows equal a fresh "cpp" export, and a call
    after steps that changed few rows writes only those rows' changed entries."""
    from tensorrt_llm_draftkv.manager import block_table

    monkeypatch.setattr(block_table, "SMALL_LOG", small_log)  # the sync and the offsets writer both read it
    rng = np.random.default_rng(seed)
    mgr = _manager(window=12, sinks=1, pages=(60, 120))
    dst = torch.from_numpy(rng.integers(-5, 1000, size=(2, 6, 2, 40), dtype=np.int32))
    next_id = 0
    for step in range(60):
        live = mgr.request_ids()
        if len(live) < 6 and rng.random() < 0.3:
            cache = mgr.caches.new(next_id)
            if cache.resize(int(rng.integers(1, 60)), 0):
                mgr.caches[next_id] = cache
            next_id += 1
        for _ in range(2 if rng.random() < 0.4 else 1):  # twice: a sync in between (one ordinal changes twice)
            for rid in mgr.request_ids():
                cache = mgr.get_cache(rid)
                if rng.random() < 0.5:
                    grow = int(rng.integers(0, 4))
                    history = min(cache.history_length + int(rng.integers(0, 4)), cache.capacity + grow)
                    cache.resize(min(max(cache.capacity, history) + grow, 40 * P), min(history, 40 * P))
                elif rng.random() < 0.3:  # drafts rejected: pages an earlier sync logged are released again
                    cache.resize(max(cache.history_length, cache.capacity - int(rng.integers(1, 9)), 1),
                                 cache.history_length)
            if mgr.request_ids():
                mgr.sync_block_table(mgr.request_ids())  # the table moves on without this destination
        if rng.random() < 0.1 and mgr.request_ids():
            mgr.free_resources(_Req(int(rng.choice(mgr.request_ids()))))
        ids = mgr.request_ids()
        if rng.random() < 0.2:
            ids = list(rng.permutation(ids))[: int(rng.integers(0, len(ids) + 1))]
        ids = [int(i) for i in ids]
        serial = mgr.offset_destinations.serial(dst)
        mgr.copy_batch_block_offsets(dst, ids, 1, 0, len(ids), max_blocks=40)
        if ids:
            want = mgr.get_block_offsets(ids, "cpp", width=40)
            assert torch.equal(dst[:, : len(ids)], want), (seed, step)
        if serial is not None:
            # one write names each (row, pool, ordinal) once, with the K offset it holds now (on a device
            # a repeated index of one scatter would land in any order)
            _, rows, pools, ordinals, k_values = mgr.offset_destinations.written_since(dst, serial)
            triples = list(zip(rows.tolist(), pools.tolist(), ordinals.tolist()))
            assert len(set(triples)) == len(triples), (seed, step)
            for (b, g, o), k in zip(triples, k_values.tolist()):
                assert int(dst[g, b, 0, o]) == k, (seed, step, b, g, o)
    # the same batch twice: the second call writes nothing; then one request grows by a page
    ids = mgr.request_ids()
    mgr.copy_batch_block_offsets(dst, ids, 1, 0, len(ids), max_blocks=40)
    mgr.copy_batch_block_offsets(dst, ids, 1, 0, len(ids), max_blocks=40)
    assert mgr.offset_destinations.last_entries == 0 and mgr.offset_destinations.last_full_rows == 0
    for rid in ids[1:]:
        mgr.free_resources(_Req(rid))
    cache = mgr.get_cache(ids[0])
    assert cache.resize(min(cache.capacity + P, 40 * P), min(cache.history_length + P, cache.capacity))
    mgr.copy_batch_block_offsets(dst, ids[:1], 1, 0, 1, max_blocks=40)
    assert mgr.offset_destinations.last_full_rows == 0
    assert 0 < mgr.offset_destinations.last_entries <= 2 * 2 * 4  # pools x (K, V) x a few ordinals
    assert torch.equal(dst[:, :1], mgr.get_block_offsets(ids[:1], "cpp", width=40))


def test_a_destination_written_by_someone_else_or_replaced_is_written_whole():
    """The memory of a destination trusts only the same tensor object, untouched since: a write through a
    view, or a new tensor (even one at the same address), gets every row again."""
    mgr = _manager(window=12, sinks=0, pages=(40, 80))
    for rid in (1, 2):
        cache = mgr.caches.new(rid)
        assert cache.resize(50, 49)
        mgr.caches[rid] = cache
    dst = torch.zeros((2, 2, 2, 20), dtype=torch.int32)
    mgr.copy_batch_block_offsets(dst, [1, 2], 1, 0, 2, max_blocks=20)
    mgr.copy_batch_block_offsets(dst, [1, 2], 1, 0, 2, max_blocks=20)
    assert mgr.offset_destinations.last_full_rows == 0
    dst[:, :, :, 3:5].fill_(-9)  # someone else's write, through a view
    mgr.copy_batch_block_offsets(dst, [1, 2], 1, 0, 2, max_blocks=20)
    assert mgr.offset_destinations.last_full_rows == 2
    assert torch.equal(dst, mgr.get_block_offsets([1, 2], "cpp", width=20))
    fresh = torch.full_like(dst, -3)  # a new tensor: nothing known of it
    mgr.copy_batch_block_offsets(fresh, [1, 2], 1, 0, 2, max_blocks=20)
    assert mgr.offset_destinations.last_full_rows == 2
    assert torch.equal(fresh, dst)


def _with_requests(ids: tuple[int, ...]) -> KVCacheManagerV2:
    """A manager (windowed group without sinks, full group) holding these requests at 20 tokens, 19 of history."""
    mgr = _manager(window=12, sinks=0, pages=(40, 80))
    for rid in ids:
        cache = mgr.caches.new(rid)
        assert cache.resize(20, 19)
        mgr.caches[rid] = cache
    return mgr


def test_a_sync_visits_only_the_caches_that_changed_and_catches_up_absent_ones():
    """After the first sync, a step that changes one request's row writes only that row's entries, even
    when the request is outside the synced batch (every attached cache reports its own changes); a freed
    request's cache no longer reports to the table."""
    mgr = _with_requests((1, 2, 3))
    table = mgr.sync_block_table([1, 2, 3])
    assert mgr.sync_block_table([1, 2, 3]) is table and table.sync([1, 2, 3], mgr.caches.require([1, 2, 3], "t")) == 0
    two = mgr.get_cache(2)
    assert two.resize(two.capacity + P, two.history_length + P)  # one page more (and one released)
    written = table.sync([1], mgr.caches.require([1], "t"))  # request 2 is not in this batch
    assert 0 < written <= 2 * 3
    check_rows(table, mgr, [1, 2, 3])
    assert table.sync([2], mgr.caches.require([2], "t")) == 0  # already caught up
    mgr.free_resources(_Req(3))
    table.forget(3)
    assert table.sync([1, 2], mgr.caches.require([1, 2], "t")) == 0
    check_rows(table, mgr, [1, 2])


def test_a_kept_destination_with_a_request_in_two_rows_updates_both():
    """An id that fills two rows of the batch (a padded batch, say) has both rows rewritten when it changes."""
    mgr = _with_requests((1, 2))
    dst = torch.full((2, 3, 2, 20), -7, dtype=torch.int32)
    ids = [1, 2, 1]
    mgr.copy_batch_block_offsets(dst, ids, 1, 0, 3, max_blocks=20)
    one = mgr.get_cache(1)
    assert one.resize(one.capacity + 2 * P, one.history_length + 2 * P)
    mgr.copy_batch_block_offsets(dst, ids, 1, 0, 3, max_blocks=20)
    assert torch.equal(dst, mgr.get_block_offsets(ids, "cpp", width=20))


def test_changed_entries_land_in_a_strided_view_and_nowhere_else():
    """A destination that is a view into a wider tensor (rows and columns offset): the delta writes follow its
    strides; every element of the base outside the view keeps its poison."""
    mgr = _with_requests((1, 2))
    base = torch.full((2, 4, 2, 30), -9, dtype=torch.int32)
    dst = base[:, 1:3, :, 3:23]
    inside = torch.zeros_like(base, dtype=torch.bool)
    inside[:, 1:3, :, 3:23] = True
    delta_writes = 0
    for step in range(12):
        for rid in (1, 2):
            cache = mgr.get_cache(rid)
            assert cache.resize(min(cache.capacity + 3, 20 * P), min(cache.history_length + 3, 20 * P - 1))
        mgr.copy_batch_block_offsets(dst, [1, 2], 1, 0, 2, max_blocks=20)
        if step:
            delta_writes += mgr.offset_destinations.last_entries > 0 and mgr.offset_destinations.last_full_rows == 0
        assert torch.equal(dst, mgr.get_block_offsets([1, 2], "cpp", width=20)), step
        assert bool((base[~inside] == -9).all()), step
    assert delta_writes >= 5


def test_a_repeated_batch_lookup_still_sees_a_dropped_or_replaced_cache():
    """`caches.require` answers a repeated batch from its last answer only while no cache was registered or
    dropped: a freed request is then named as missing, a replaced cache is the new one."""
    from tensorrt_llm_draftkv.manager.diagnostics import MissingKVCacheError

    mgr = _with_requests((1, 2))
    first = mgr.caches.require([1, 2], "t")
    assert mgr.caches.require([1, 2], "t") is first
    fresh = mgr.caches.new(2)
    old = mgr.caches.pop(2)
    old.free()
    assert fresh.resize(8, 7)
    mgr.caches[2] = fresh
    assert mgr.caches.require([1, 2], "t")[1] is fresh
    mgr.free_resources(_Req(1))
    with pytest.raises(MissingKVCacheError, match="request 1"):
        mgr.caches.require([1, 2], "t")


def test_lookup_shares_the_memo_and_answers_none_for_a_missing_id():
    """`caches.lookup` (the managers' per-step path) gives the same memoised list as `require`, a fresh one
    after a registration or a drop, and None, changing nothing, when any id holds no cache."""
    mgr = _with_requests((1, 2))
    first = mgr.caches.lookup([1, 2])
    assert first == [mgr.get_cache(1), mgr.get_cache(2)]
    assert mgr.caches.lookup([1, 2]) is first and mgr.caches.require([1, 2], "t") is first
    assert mgr.caches.lookup([2, 1]) == [mgr.get_cache(2), mgr.get_cache(1)]
    assert mgr.caches.lookup([1, 7]) is None
    mgr.free_resources(_Req(2))
    assert mgr.caches.lookup([1, 2]) is None
    assert mgr.caches.lookup([1]) == [mgr.get_cache(1)]


def test_get_caches_answers_a_batch_in_order_and_names_the_missing():
    mgr = _with_requests((1, 2, 3))
    assert mgr.get_caches([3, 1]) == [mgr.get_cache(3), mgr.get_cache(1)]
    with pytest.raises(KeyError, match=r"requests \[7, 9\] have no cache here"):
        mgr.get_caches([1, 7, 9])


@pytest.mark.parametrize("small_log", [0, 256])
def test_an_entry_changed_by_two_syncs_before_a_write_lands_as_its_last_change(small_log, monkeypatch):
    """A page gained in one sync and given back in the next, both before the kept destination is written
    again: the write puts the entry's last state (unbacked), not the page it held in between."""
    from tensorrt_llm_draftkv.manager import block_table

    monkeypatch.setattr(block_table, "SMALL_LOG", small_log)
    mgr = _with_requests((1, 2))
    dst = torch.full((2, 2, 2, 20), -9, dtype=torch.int32)
    mgr.copy_batch_block_offsets(dst, [1, 2], 1, 0, 2, max_blocks=20)
    cache = mgr.get_cache(1)
    capacity, history = cache.capacity, cache.history_length
    assert cache.resize(capacity + 2 * P, history)  # two more pages ...
    mgr.sync_block_table([1, 2])
    assert cache.resize(capacity, history)  # ... given back (rejected drafts)
    mgr.sync_block_table([1, 2])
    mgr.copy_batch_block_offsets(dst, [1, 2], 1, 0, 2, max_blocks=20)
    assert mgr.offset_destinations.last_full_rows == 0
    assert torch.equal(dst, mgr.get_block_offsets([1, 2], "cpp", width=20))


@pytest.mark.cuda
@pytest.mark.parametrize("one_group", [False, True], ids=["two-groups", "one-group"])
def test_the_device_table_and_a_kept_destination_follow_many_steps_cuda(one_group):
    """On the GPU, where every push and every single-entry write goes through a kept pinned arena reused
    many times over: after each of 300 random steps of sliding rows (window without sinks, and a full
    group; or the window alone, whose crossings the sync settles from the ring) the device ring equals
    the host mirror and the kept destination equals a fresh export."""
    from tensorrt_llm_draftkv.staging import PinnedStager

    mgr = _manager(window=12, sinks=0, pages=(80, 160), device="cuda", one_group=one_group)
    table = mgr.device_block_table
    table._stager = PinnedStager("cuda", capacity=256)  # small arenas: a full turn every few steps
    dst_stager = mgr.offset_destinations._stagers[torch.device("cuda", torch.cuda.current_device())] = \
        PinnedStager("cuda", capacity=256)
    _follow_many_steps(mgr, "cuda")
    assert table._stager.turns > 8 and dst_stager.turns > 8


@pytest.mark.parametrize("one_group", [False, True], ids=["two-groups", "one-group"])
def test_a_pushed_cpu_copy_and_a_kept_destination_follow_many_steps(one_group):
    """The GPU test's walk on the CPU, the table keeping its own pushed copy (`cpu_copy`): each push
    (entries, and first/extent where they moved) is checked on every CI run, not only on a GPU."""
    mgr = _manager(window=12, sinks=0, pages=(80, 160), one_group=one_group)
    mgr._block_table = DeviceBlockTable(mgr.num_pools, "cpu", cpu_copy=True)
    _follow_many_steps(mgr, "cpu")


def _follow_many_steps(mgr: KVCacheManagerV2, device: str) -> None:
    """300 random steps of six requests (a finished one replaced under its id); after each, the kept
    destination equals a fresh export and every pushed row equals its host mirror."""
    rng = np.random.default_rng(7)
    dst = torch.full((mgr.num_pools, 6, 2, 40), -9, dtype=torch.int32, device=device)
    for rid in range(6):
        cache = mgr.caches.new(rid)
        assert cache.resize(int(rng.integers(1, 40)), 0)
        mgr.caches[rid] = cache
    ids = list(range(6))
    table = mgr.device_block_table
    for step in range(300):
        for rid in ids:
            cache = mgr.get_cache(rid)
            if cache.capacity >= 38 * P:  # a finished request makes room for a fresh one under its id
                mgr.caches.pop(rid).free()
                cache = mgr.caches.new(rid)
                assert cache.resize(int(rng.integers(1, 20)), 0)
                mgr.caches[rid] = cache
            elif rng.random() < 0.6:
                history = cache.history_length + int(rng.integers(1, 4))
                cache.resize(max(cache.capacity, history) + int(rng.integers(0, 3)), history)
        mgr.copy_batch_block_offsets(dst, ids, 1, 0, len(ids), max_blocks=40)
        assert torch.equal(dst.cpu(), mgr.get_block_offsets(ids, "cpp", width=40)), step
        for rid in ids:
            for g in range(mgr.num_pools):
                assert np.array_equal(table.device_row(g, rid), table.host_row(g, rid)[2]), (step, rid, g)
