"""The ownership checker with block reuse: a holders map that follows shared prefix pages.

Real target and draft managers with `enable_block_reuse=True`, the draft pool in
joint reuse (`joint_kv_cache_reuse=True`, `target.pair_joint_reuse(draft)`), and
requests with real token ids that start with the same prefix. An
`OwnershipChecker(draft)` hears `allocate`, `release`, `share`, `unshare`,
`publish` and `evict`; after every manager call its map must equal the pools:
for every page, the holders it has are the live requests whose rows hold the
page, as many as `pool.refcount(page)`, and it has the page published exactly
when `pool.is_published(page)`.

Coordinates: P = 4 tokens per page; block ordinal i covers positions
[4i, 4i + 4). Draft layer group 0 is an 8-token window, group 1 full attention
(the group whose prefix pages are shared whole). Pages are page indices of the
group's pool.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tensorrt_llm_draftkv import (
    DraftKVCacheManagerV2,
    KVCacheManagerV2,
    KVCacheResizeError,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    ScheduledRequests,
    SpeculativeDecodingMode,
)
from draftkv_sim.ownership import OwnershipChecker, OwnershipViolation

P = 4
FULL = 1  # the draft manager's full-attention layer group
PREFIX = list(range(100, 128))  # 28 tokens: 7 full pages


def _config(groups, pages: int) -> KVPoolConfig:
    layer_groups = tuple(LayerGroupConfig(1, window=w, sink_blocks=s) for w, s in groups)
    return KVPoolConfig(
        layer_groups, (pages,) * len(layer_groups), tokens_per_block=P, head_dim=1, max_seq_len=256,
        enable_block_reuse=True,
    )


def _pair(draft_pages: int = 64, target_pages: int = 128) -> tuple[KVCacheManagerV2, DraftKVCacheManagerV2]:
    """A target manager (full + window) and a DFlash draft manager (window + full) in joint reuse."""
    target = KVCacheManagerV2.from_pool_config(_config(((None, 0), (8, 0)), target_pages), max_draft_len=2)
    draft = DraftKVCacheManagerV2.from_pool_config(
        _config(((8, 0), (None, 0)), draft_pages), spec_mode=SpeculativeDecodingMode.DFLASH, max_draft_len=2,
        joint_kv_cache_reuse=True,
    )
    target.pair_joint_reuse(draft)
    return target, draft


def _request(rid: int, tokens: list[int], chunk: int = 8) -> LlmRequest:
    req = LlmRequest(rid, prompt_len=len(tokens), tokens=list(tokens))
    req.target_view.chunk_size = min(chunk, len(tokens))
    return req


def _agree(chk: OwnershipChecker, draft: DraftKVCacheManagerV2) -> None:
    """The holders map equals the pools and the rows, page by page, and every check of the checker is clean."""
    rows: dict[tuple[int, int], set[int]] = {}  # (group, page) -> live requests whose row holds it
    for rid in draft.request_ids():
        for g in range(draft.num_pools):
            for page in draft.get_cache(rid).held_pages(g):
                rows.setdefault((g, page), set()).add(rid)
    for g, group in enumerate(draft.layer_groups):
        pool = group.pool
        for page in range(pool.total):
            holders = chk.page_holders.holders(g, page)
            assert len(holders) == pool.refcount(page), (g, page, holders, pool.refcount(page))
            assert holders == rows.get((g, page), set()), (g, page, holders)
            assert chk.page_holders.is_published(g, page) == pool.is_published(page), (g, page)
    ids = draft.request_ids()
    assert chk.check_accounting() == 0, chk.messages[-3:]
    assert chk.check_rows() == 0, chk.messages[-3:]
    for backend in ("cpp", "python"):
        assert chk.check_export(ids, draft.get_block_offsets(ids, backend), backend) == 0, chk.messages[-3:]
    assert chk.accounting_errors == 0, chk.messages[:3]


def _prefill(req: LlmRequest, target, draft, chk: OwnershipChecker, chunk: int = 8) -> None:
    """Chunked prefill through both managers in executor order, the map checked after every call."""
    while True:
        batch = ScheduledRequests([req])
        target.prepare_resources(batch)
        draft.prepare_resources(batch)
        _agree(chk, draft)
        last = req.is_last_context_chunk
        req.advance_context_chunk(chunk)
        target.update_context_resources(batch)
        draft.update_context_resources(batch)
        _agree(chk, draft)
        if last:
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
            return


def _finish(rid: int, target, draft, chk: OwnershipChecker) -> None:
    for mgr in (target, draft):
        if mgr.has_cache(rid):
            mgr.free_resources(rid)
            _agree(chk, draft)


def _access(chk: OwnershipChecker, what: str, rid: int, group: int, ordinal: int, page: int) -> None:
    """One token of `rid`, layer 0 of `group`, at the first position of `ordinal`, resolving to `page`."""
    chk.check_values = False  # nothing was stored: only the page matters here
    kv = torch.zeros(1, 1, 2, 1, 1)
    hook = chk.record_read if what == "read" else chk.record_write
    hook(rid, group, [0], torch.tensor([ordinal * P]), torch.tensor([ordinal]), torch.tensor([page]), kv)


def _snapshot(chk: OwnershipChecker, draft: DraftKVCacheManagerV2) -> tuple:
    return dict(chk.page_holders.holders_of), set(chk.page_holders.published), [p.state() for p in draft.pools()]


# =============================================================================================
# Shared prefix pages: reads fine, writes not.
# =============================================================================================
def test_a_shared_prefix_page_is_read_by_every_holder_and_written_by_none():
    target, draft = _pair()
    chk = OwnershipChecker(draft)
    first = _request(1, PREFIX + [1, 2, 3])
    _prefill(first, target, draft, chk)
    second = _request(2, PREFIX + [5, 6, 7])
    _prefill(second, target, draft, chk)
    assert second.prepopulated_prompt_len == 28
    row1, row2 = draft.get_cache(1).block_row(FULL), draft.get_cache(2).block_row(FULL)
    shared = row2[0]
    assert row1[:7] == row2[:7] and chk.page_holders.holders(FULL, shared) == {1, 2}
    assert chk.page_holders.owned_pages(2, FULL) == sorted(row2) and set(row1[:7]) <= set(chk.page_holders.owned_pages(1, FULL))

    # A read of a shared page through the holder's own row is owned.
    _access(chk, "read", 2, FULL, 0, shared)
    _access(chk, "read", 1, FULL, 6, row1[6])
    assert chk.violations == 0 and chk.reads == 2
    # A write to it is not: the page is shared and published.
    _access(chk, "write", 2, FULL, 0, shared)
    assert chk.shared_page_writes == 1 and chk.foreign_page_accesses == chk.foreign_page_writes == 0
    assert chk.violations == 1 and chk.summary()["shared_page_writes"] == 1
    assert "does not hold alone" in chk.messages[-1] and "held by 1, 2, published" in chk.messages[-1]
    # Its own tail page (partial, never published, held alone) takes a write.
    tail = row2[7]
    assert chk.page_holders.holders(FULL, tail) == {2} and not chk.page_holders.is_published(FULL, tail)
    _access(chk, "write", 2, FULL, 7, tail)
    assert chk.shared_page_writes == 1 and chk.violations == 1
    # Another request's page the reader does not hold is foreign, not shared.
    _access(chk, "read", 2, FULL, 7, row1[7])
    assert chk.foreign_page_reads == 1 and chk.shared_page_writes == 1 and chk.violations == 2
    assert "held by 1" in chk.messages[-1]
    with pytest.raises(OwnershipViolation, match="shared_page_writes"):
        chk.assert_clean()

    # A checker built now learns the shared pages from the rows and the table from the pools.
    late = OwnershipChecker(draft, raise_on_violation=True)
    assert late.page_holders.holders(FULL, shared) == {1, 2} and late.page_holders.is_published(FULL, shared)
    _agree(late, draft)
    with pytest.raises(OwnershipViolation, match="does not hold alone"):
        _access(late, "write", 1, FULL, 0, shared)
    late.detach()
    assert late.page_holders.holders_of == {} and late.page_holders.published == set()

    # The first request leaves: the page stays published, held by the second alone: still not writable.
    _finish(1, target, draft, chk)
    assert chk.page_holders.holders(FULL, shared) == {2} and chk.page_holders.is_published(FULL, shared)
    _access(chk, "write", 2, FULL, 0, shared)
    assert chk.shared_page_writes == 2
    _access(chk, "read", 2, FULL, 0, shared)
    assert chk.foreign_page_accesses == 1  # unchanged
    _finish(2, target, draft, chk)
    assert chk.page_holders.holders(FULL, shared) == frozenset() and chk.page_holders.is_published(FULL, shared)  # cached-free
    assert chk.page_holders.holders_of == {} and chk.page_holders.owned == {}


def test_a_later_request_revives_the_cached_free_prefix_pages():
    target, draft = _pair()
    chk = OwnershipChecker(draft)
    heard: list[tuple[int, str, object]] = []
    for g, pool in enumerate(draft.pools()):
        pool.add_listener(lambda event, pages, owner, g=g: heard.append((g, event, owner)))
    _prefill(_request(1, PREFIX + [1]), target, draft, chk)
    _finish(1, target, draft, chk)
    cached = draft.pools()[FULL].num_cached_free
    assert cached == 7
    heard.clear()
    third = _request(3, PREFIX + [9, 9])
    _prefill(third, target, draft, chk)
    assert third.prepopulated_prompt_len == 28 and (FULL, "allocate", 3) in heard and (FULL, "share", 3) not in heard
    row = draft.get_cache(3).block_row(FULL)
    assert all(chk.page_holders.holders(FULL, p) == {3} and chk.page_holders.is_published(FULL, p) for p in row[:7])
    _access(chk, "read", 3, FULL, 3, row[3])
    assert chk.violations == 0
    _access(chk, "write", 3, FULL, 3, row[3])  # held alone, but published
    assert chk.shared_page_writes == 1 and chk.foreign_page_writes == 0
    _finish(3, target, draft, chk)


def test_event_streams_the_pools_never_send_are_accounting_errors():
    """Each event, told to the checker as a buggy pool would send it, against a map of two requests
    sharing the 7 prefix pages: one accounting error each, the map following what the event says."""
    target, draft = _pair()
    chk = OwnershipChecker(draft)
    _prefill(_request(1, PREFIX + [1, 2, 3]), target, draft, chk)
    _prefill(_request(2, PREFIX + [5, 6, 7]), target, draft, chk)
    row2 = draft.get_cache(2).block_row(FULL)
    pool = draft.pools()[FULL]
    shared, own, free = row2[0], row2[7], pool.free_order()[-1]
    event = chk.page_holders.on_pool_event  # what a pool listener calls

    def errors(step, fragment: str) -> None:
        before = chk.accounting_errors
        step()
        assert chk.accounting_errors == before + 1 and fragment in chk.messages[-1], chk.messages[-1]

    errors(lambda: event(FULL, "share", [shared], 2), "already has among its holders (1, 2)")
    errors(lambda: event(FULL, "share", [free], 3), "has it free, not published (a share joins")
    assert chk.page_holders.holders(FULL, free) == {3}  # the pool said 3 holds it: the map follows
    errors(lambda: event(FULL, "release", [free], 4), "released by 4 but the owner map has it held by 3")
    assert chk.page_holders.holders(FULL, free) == frozenset() and chk.page_holders.owned_pages(3, FULL) == []
    errors(lambda: event(FULL, "unshare", [shared], 9), "unshared by 9 but the owner map has it held by 1, 2, published")
    assert chk.page_holders.holders(FULL, shared) == {1, 2}
    errors(lambda: event(FULL, "publish", [shared], 1), "published already")
    errors(lambda: event(FULL, "evict", [own], None), "evicted (owner None) but the owner map has it unpublished")
    errors(lambda: event(FULL, "publish", [free], 2), "published by 2, which the owner map does not have among")
    event(FULL, "evict", [free], 2)  # a rollback undoing that publish: fine
    assert not chk.page_holders.is_published(FULL, free)
    # The last holder leaving while the map has another: the pool says nobody holds it now.
    errors(lambda: event(FULL, "release", [shared], 1), "as its last holder, but the owner map also has it held by 2")
    assert chk.page_holders.holders(FULL, shared) == frozenset() and shared not in chk.page_holders.owned_pages(2, FULL)
    assert chk.check_rows() == 2  # both rows hold a page the map has free
    assert any("ordinal 0 -> page" in m and "which the owner map has free, published" in m for m in chk.messages)
    event(FULL, "allocate", [shared], 1)
    event(FULL, "share", [shared], 2)
    # One holder leaving as if others stayed, while it was the last: the map loses the page.
    errors(lambda: event(FULL, "unshare", [own], 2), "its last holder in the owner map, but the pool says others")
    event(FULL, "allocate", [own], 2)
    # A cached-free page the pool keeps but the map lost: the count check finds it.
    assert chk.check_rows() == 0 and chk.check_accounting() == 0  # the map is back in step with the pool
    for mgr in (target, draft):
        mgr.free_resources([1, 2])
    assert chk.check_accounting() == 0
    event(FULL, "evict", [shared], None)  # published, nobody holds it: an eviction the map cannot refute
    errors(lambda: chk.check_accounting(), "published page(s) nobody holds but the pool has 7 cached-free")
    assert chk.check_accounting() == 1  # still there
    assert chk.violations == chk.accounting_errors > 0


# =============================================================================================
# Evictions and a rolled-back batch.
# =============================================================================================
def test_eviction_under_pool_pressure_leaves_the_map_equal_to_the_pools():
    target, draft = _pair(draft_pages=16)
    chk = OwnershipChecker(draft)
    evicted: list[int] = []
    draft.pools()[FULL].add_listener(lambda event, pages, owner: evicted.extend(pages) if event == "evict" else None)
    _prefill(_request(1, PREFIX + [1]), target, draft, chk)
    _finish(1, target, draft, chk)
    published = [p for p in range(16) if chk.page_holders.is_published(FULL, p)]
    assert len(published) == 7
    # An unrelated request larger than the plain free pages: the pool evicts cached-free pages for it.
    _prefill(_request(4, list(range(500, 548)), chunk=16), target, draft, chk)
    assert evicted and set(evicted) <= set(published)
    assert set(evicted) <= set(chk.page_holders.owned_pages(4, FULL))  # (and published again, under request 4's keys)
    _finish(4, target, draft, chk)
    # The prefix lost pages in the draft pool: a joint hit is shorter (or none), and still consistent.
    late = _request(5, PREFIX + [2])
    _prefill(late, target, draft, chk)
    assert late.prepopulated_prompt_len < 28
    _finish(5, target, draft, chk)
    assert chk.page_holders.holders_of == {} and chk.violations == 0


def test_a_rolled_back_batch_plays_the_inverse_events_and_the_map_follows():
    target, draft = _pair(draft_pages=24)
    chk = OwnershipChecker(draft)
    _prefill(_request(1, PREFIX + [1]), target, draft, chk)  # 7 prefix pages, shared next
    _prefill(_request(6, list(range(600, 613))), target, draft, chk)
    _finish(6, target, draft, chk)  # its 3 full pages are cached-free: evicted by the filler below
    live = _request(2, PREFIX + [5, 6])
    target.prepare_resources(ScheduledRequests([live]))  # the target's hit: the mirror shares it
    assert live.prepopulated_prompt_len == 28
    filler = _request(7, list(range(700, 752)), chunk=52)  # more than the plain free pages left
    huge = _request(8, list(range(800, 1000)), chunk=200)  # more than the draft pool has: the batch fails
    heard: list[tuple[str, object]] = []
    draft.pools()[FULL].add_listener(lambda event, pages, owner: heard.append((event, owner)))
    before = _snapshot(chk, draft)
    with pytest.raises(KVCacheResizeError, match="request 8"):
        draft.prepare_resources(ScheduledRequests([live, filler, huge]))
    # It shared the prefix and evicted cached-free pages before it failed; the rollback undid both.
    assert ("share", 2) in heard and ("unshare", 2) in heard
    assert ("evict", None) in heard and ("publish", None) in heard
    assert _snapshot(chk, draft) == before
    _agree(chk, draft)
    _prefill(live, target, draft, chk)
    assert chk.page_holders.holders(FULL, draft.get_cache(2).block_row(FULL)[0]) == {1, 2}
    for rid in (1, 2):
        _finish(rid, target, draft, chk)
    assert chk.page_holders.holders_of == {} and chk.violations == 0


# =============================================================================================
# The map against the pools under random shared-prefix workloads.
# =============================================================================================
BASES = (list(range(1000, 1040)), list(range(2000, 2040)))
PREFIX_LENS = (0, 4, 8, 13, 20, 28, 28, 28)  # tokens taken from a base: 0 to 7 full pages shared
# (kind, a, b, c), weighted by repetition: see the loop below for what a, b and c mean per kind.
_op = st.tuples(
    st.sampled_from(["add"] * 3 + ["step"] * 4 + ["finish"] * 2 + ["pressure", "rollback"]),
    st.integers(0, 1),
    st.integers(0, 7),
    st.integers(1, 6),
)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(_op, min_size=10, max_size=40), chunk=st.sampled_from([4, 8, 12]))
def test_random_shared_prefix_workloads_keep_the_map_equal_to_the_pools(ops, chunk):
    target, draft = _pair(draft_pages=28, target_pages=64)  # 3 live requests of <= 9 pages fit
    chk = OwnershipChecker(draft)
    reqs: dict[int, LlmRequest] = {}
    next_id = 1

    def context() -> list[LlmRequest]:
        return [r for r in reqs.values() if r.state != LlmRequestState.GENERATION_IN_PROGRESS]

    def advance(batch: ScheduledRequests) -> None:
        for req in batch.context_requests:
            last = req.is_last_context_chunk
            req.advance_context_chunk(chunk)
            if last:
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
        target.update_context_resources(batch)
        draft.update_context_resources(batch)

    for kind, a, b, c in ops:
        if kind == "add" and len(reqs) < 3:  # base a, its first PREFIX_LENS[b] tokens, then c tokens of its own
            tail = [5000 + 10 * next_id + i for i in range(c)]
            reqs[next_id] = _request(next_id, BASES[a][: PREFIX_LENS[b]] + tail, chunk)
            next_id += 1
        elif kind == "step" and context():
            batch = ScheduledRequests(context())
            target.prepare_resources(batch)
            draft.prepare_resources(batch)
            _agree(chk, draft)
            advance(batch)
        elif kind == "finish" and reqs:  # the b-th live request, cyclically
            rid = sorted(reqs)[b % len(reqs)]
            del reqs[rid]
            _finish(rid, target, draft, chk)
        elif kind == "pressure":
            # Someone else takes every plain free page of draft pool a and b cached-free ones (evicted, least
            # recently used first), then gives them all back.
            pool = draft.pools()[a]
            pages = pool.allocate(pool.num_plain_free + min(b, pool.num_cached_free), owner="pressure")
            assert chk.page_holders.owned_pages("pressure", a) == sorted(pages)
            pool.release(pages, owner="pressure")
        elif kind == "rollback":
            # A new request (as "add") joins a step whose first draft attempt fails: a filler request evicts
            # cached-free pages (if the pool has them), a huge one cannot fit; the draft pool rolls back
            # shares, revivals, evictions and allocations alike. Then the step goes through.
            if len(reqs) < 3:
                tail = [5000 + 10 * next_id + i for i in range(c)]
                reqs[next_id] = _request(next_id, BASES[a][: PREFIX_LENS[b]] + tail, chunk)
                next_id += 1
            if not context():
                continue
            batch = ScheduledRequests(context())
            target.prepare_resources(batch)  # hits for fresh requests: the draft batch shares them
            before = _snapshot(chk, draft)
            filler = _request(998, list(range(9000, 9200)), chunk=P * (draft.pools()[FULL].num_plain_free + 1))
            huge = _request(999, [7] * 200, chunk=200)
            with pytest.raises(KVCacheResizeError):
                draft.prepare_resources(ScheduledRequests([*batch.context_requests, filler, huge]))
            assert _snapshot(chk, draft) == before
            _agree(chk, draft)
            draft.prepare_resources(batch)
            _agree(chk, draft)
            advance(batch)
        _agree(chk, draft)
    for rid in list(reqs):
        _finish(rid, target, draft, chk)
    assert chk.page_holders.holders_of == {} and chk.page_holders.owned == {} and chk.violations == 0
    for g, pool in enumerate(draft.pools()):
        assert sum(chk.page_holders.is_published(g, p) for p in range(pool.total)) == pool.num_cached_free
