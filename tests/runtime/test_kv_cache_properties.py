"""Hypothesis: random resize / commit / free / write sequences over many requests
sharing a small real pool (two layer groups: one windowed with a sink, one full).

After every step: held + free = total in each pool, no page is held by two
caches, every row matches the brute-force row, an out-of-pages resize left every
cache and every free list bit-identical, and what a request wrote into its pages
(through its exported block offsets) is still there — nobody else wrote over it.
"""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from tensorrt_llm_draftkv import BAD_PAGE_INDEX, KVPoolConfig, KVCacheManagerV2, LayerGroupConfig, LlmRequest, ScheduledRequests
from tensorrt_llm_draftkv.manager import KVCacheResizeError

P = 3
WINDOW = 5
SINKS = 1
POOL_PAGES = (9, 14)


def make_manager(guard_page=False) -> KVCacheManagerV2:
    config = KVPoolConfig(
        layer_groups=(LayerGroupConfig(2, window=WINDOW, sink_blocks=SINKS), LayerGroupConfig(1, window=None)),
        pages_per_group=POOL_PAGES,
        tokens_per_block=P,
        num_kv_heads=2,
        head_dim=4,
        dtype=torch.float32,
        max_seq_len=30 * P,
        guard_page=guard_page,
    )
    return KVCacheManagerV2.from_pool_config(config)


def brute_backed(capacity: int, history: int, window, sinks: int, p: int = P) -> list[bool]:
    out = []
    for i in range(-(-capacity // p)):
        if window is None or i < sinks:
            out.append(True)
        else:
            out.append(any(pos >= history + 1 - window for pos in range(i * p, (i + 1) * p)))
    return out


def whole_state(mgr: KVCacheManagerV2):
    caches = {rid: mgr.get_cache(rid).checkpoint() for rid in mgr.request_ids()}
    pools = [(pool.free_order(), pool.held_pages()) for pool in mgr.pools()]
    return caches, pools


def flat(layer: torch.Tensor) -> torch.Tensor:
    """Storage viewed as [pages * kv_factor, heads, P, head_dim], as block offsets index it."""
    return layer.view(layer.shape[0] * layer.shape[1], *layer.shape[2:])


class ManyRequests(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        self.mgr = make_manager()
        self.next_id = 0
        self.freed: set[int] = set()
        # (group, page) -> (request id, tag written there)
        self.written: dict[tuple[int, int], tuple[int, float]] = {}
        self.tag = 1.0

    # -- helpers ----------------------------------------------------------------
    def prune_written(self, rid: int) -> None:
        held = (
            [set(self.mgr.get_cache(rid).held_pages(g)) for g in range(2)] if self.mgr.has_cache(rid) else [set(), set()]
        )
        for key in [k for k, v in self.written.items() if v[0] == rid]:
            if key[1] not in held[key[0]]:
                del self.written[key]

    # -- rules -------------------------------------------------------------------
    @rule(target=requests, prompt=st.integers(1, 40), chunk=st.integers(1, 12))
    def add(self, prompt, chunk):
        rid = self.next_id
        self.next_id += 1
        req = LlmRequest(rid, prompt_len=prompt)
        req.context_chunk_size = min(chunk, prompt)
        before = whole_state(self.mgr)
        try:
            self.mgr.prepare_resources(ScheduledRequests(context_requests=[req]))
        except KVCacheResizeError as err:
            event("add: out of pages")
            assert f"request {rid}" in str(err) and err.request_id == rid
            assert not self.mgr.has_cache(rid)
            assert whole_state(self.mgr) == before
            self.freed.add(rid)  # never admitted
            return rid
        cache = self.mgr.get_cache(rid)
        assert cache.capacity == min(chunk, prompt) and cache.history_length == 0
        return rid

    @rule(rid=requests, d_cap=st.integers(-8, 14), d_hist=st.integers(-2, 10), cap_none=st.booleans(), hist_none=st.booleans())
    def resize(self, rid, d_cap, d_hist, cap_none, hist_none):
        if not self.mgr.has_cache(rid):
            return
        cache = self.mgr.get_cache(rid)
        capacity = None if cap_none else cache.capacity + d_cap
        history = None if hist_none else cache.history_length + d_hist
        new_cap = cache.capacity if capacity is None else capacity
        new_hist = cache.history_length if history is None else history
        must_raise = new_cap < 0 or new_hist < cache.history_length or new_cap < new_hist
        before = whole_state(self.mgr)
        try:
            ok = cache.resize(capacity, history)
        except ValueError:
            event("resize: ValueError")
            assert must_raise
            assert whole_state(self.mgr) == before
            return
        assert not must_raise
        event("resize: out of pages" if not ok else "resize: ok")
        if not ok:
            # out of pages: every cache and every free list bit-identical
            assert whole_state(self.mgr) == before
            # and it really was short in some pool
            needs = [sum(brute_backed(new_cap, new_hist, w, s)) for w, s in ((WINDOW, SINKS), (None, 0))]
            frees = [pool.num_free + cache.num_held_pages(g) for g, pool in enumerate(self.mgr.pools())]
            assert any(n > f for n, f in zip(needs, frees)), (needs, frees)
            return
        assert (cache.capacity, cache.history_length) == (new_cap, new_hist)
        self.prune_written(rid)

    @rule(rid=requests, d_hist=st.integers(0, 6))
    def grow_past_the_pool(self, rid, d_hist):
        """A growth the full-attention pool cannot back: False, and nothing anywhere changes."""
        if not self.mgr.has_cache(rid):
            return
        cache = self.mgr.get_cache(rid)
        full = self.mgr.pools()[1]
        capacity = (cache.num_held_pages(1) + full.num_free + 1) * P
        before = whole_state(self.mgr)
        assert cache.resize(capacity, cache.history_length + d_hist) is False
        event("resize: out of pages")
        assert whole_state(self.mgr) == before

    @rule(rid=requests, extra=st.integers(0, 3))
    def commit(self, rid, extra):
        if not self.mgr.has_cache(rid):
            return
        cache = self.mgr.get_cache(rid)
        target = cache.committed + extra
        before = whole_state(self.mgr)
        if target <= cache.history_length:
            cache.commit(target)
            assert cache.committed == target
        else:
            try:
                cache.commit(target)
            except ValueError as err:
                assert str(target) in str(err)
            else:
                raise AssertionError("commit past history accepted")
            assert whole_state(self.mgr) == before

    @rule(rid=consumes(requests))
    def free(self, rid):
        if not self.mgr.has_cache(rid):
            return
        self.mgr.free_resources(rid)
        self.freed.add(rid)
        assert not self.mgr.has_cache(rid)
        self.prune_written(rid)
        before = whole_state(self.mgr)
        try:
            self.mgr.free_resources(rid)
        except KeyError as err:
            assert str(rid) in str(err)
        else:
            raise AssertionError("double free accepted")
        assert whole_state(self.mgr) == before

    @rule(rid=requests)
    def write(self, rid):
        """Write a fresh tag into every page the request holds, addressed by its block offsets."""
        if not self.mgr.has_cache(rid):
            return
        offsets = self.mgr.get_block_offsets([rid], backend="python")
        self.tag += 1.0
        for g, pool in enumerate(self.mgr.pools()):
            kv = offsets[g, 0]  # [2, max_blocks]
            for i in range(kv.shape[1]):
                k_off, v_off = int(kv[0, i]), int(kv[1, i])
                if k_off < 0:
                    assert v_off < 0
                    continue
                assert k_off % 2 == 0 and v_off == k_off + 1
                for layer in pool.layers:
                    flat(layer)[k_off].fill_(self.tag)
                    flat(layer)[v_off].fill_(-self.tag)
                self.written[(g, k_off // 2)] = (rid, self.tag)

    # -- invariants ----------------------------------------------------------------
    @invariant()
    def accounting(self):
        self.mgr.check_accounting()
        for pool in self.mgr.pools():
            pool.check_accounting()
            assert pool.num_held + pool.num_free == pool.total
        for g, pool in enumerate(self.mgr.pools()):
            owners = {}
            for rid in self.mgr.request_ids():
                for page in self.mgr.get_cache(rid).held_pages(g):
                    assert page not in owners, f"page {page} of group {g} held by {owners[page]} and {rid}"
                    owners[page] = rid
            assert len(owners) == pool.num_held

    @invariant()
    def rows_match_brute_force(self):
        for rid in self.mgr.request_ids():
            cache = self.mgr.get_cache(rid)
            assert cache.committed <= cache.history_length <= cache.capacity
            for g, (w, s) in enumerate(((WINDOW, SINKS), (None, 0))):
                row = cache.block_row(g)
                assert [x != BAD_PAGE_INDEX for x in row] == brute_backed(cache.capacity, cache.history_length, w, s)

    @invariant()
    def storage_untouched_by_others(self):
        for (g, page), (rid, tag) in self.written.items():
            assert self.mgr.has_cache(rid)
            assert page in self.mgr.get_cache(rid).held_pages(g)
            for layer in self.mgr.pools()[g].layers:
                assert torch.all(layer[page, 0] == tag), (g, page, rid, tag)
                assert torch.all(layer[page, 1] == -tag), (g, page, rid, tag)

    def teardown(self):
        for rid in self.mgr.request_ids():
            self.mgr.free_resources(rid)
        for pool in self.mgr.pools():
            assert pool.num_free == pool.total and pool.num_held == 0


ManyRequests.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestManyRequests = ManyRequests.TestCase


def test_storage_is_real_and_private():
    """A value written through one request's offsets lands in its own pages only."""
    mgr = make_manager()
    reqs = [LlmRequest(rid, prompt_len=6) for rid in range(3)]
    mgr.prepare_resources(ScheduledRequests(context_requests=reqs))
    offsets = mgr.get_block_offsets([0, 1, 2], backend="python")
    before = [[layer.clone() for layer in pool.layers] for pool in mgr.pools()]
    # request 1 writes 42.0 into the K half of all its blocks in both groups
    for g, pool in enumerate(mgr.pools()):
        for off in offsets[g, 1, 0].tolist():
            if off >= 0:
                for layer in pool.layers:
                    flat(layer)[off].fill_(42.0)
    for g, pool in enumerate(mgr.pools()):
        mine = set(mgr.get_cache(1).held_pages(g))
        assert mine
        for li, layer in enumerate(pool.layers):
            for page in range(pool.total):
                if page in mine:
                    assert torch.all(layer[page, 0] == 42.0)
                    assert torch.equal(layer[page, 1], before[g][li][page, 1])  # V untouched
                else:
                    assert torch.equal(layer[page], before[g][li][page])
        for other in (0, 2):
            for page in mgr.get_cache(other).held_pages(g):
                assert not torch.any(pool.layers[0][page] == 42.0)
