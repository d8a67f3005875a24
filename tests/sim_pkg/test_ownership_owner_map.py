"""The ownership checker's own page -> owner map, fed by the pools' allocate and release events.

The checker must not take a request's block row as the truth: the block-offset
export is built from the same rows, so an allocator bug that put one page into
two rows would look owned from either. Every test below fails for a checker
that decided ownership from the rows:

* a row corrupted to hold another request's page is reported by `check_rows`,
  by a read or write through that entry, and by `check_export` of the export
  built from it;
* a pool that hands out a held page again is an accounting error;
* a rolled-back batch (restore through `take`) leaves the map equal to the rows;
* freeing every request empties the map; a corrupted export tensor is caught;
* the clean drafter scenarios stay clean under every check.

Coordinates: groups are the draft manager's layer-group indices, pages are page
indices of that group's pool, ordinals are block ordinals of a request's row.
"""
from __future__ import annotations

import gc
import random

import pytest
import torch

from tensorrt_llm_draftkv import (
    BAD_PAGE_INDEX,
    DraftKVCacheManagerV2,
    KVCacheResizeError,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    ScheduledRequests,
    SpeculativeDecodingMode,
)
from tensorrt_llm_draftkv.runtime import KVCache, LayerGroup, LifeCycle, PagePool
from draftkv_sim import DraftLoop, phrase_stream
from draftkv_sim.ownership import OwnershipChecker, OwnershipViolation




P = 8  # tokens per block


def _config(pages=(64, 40), guard_page: bool = False) -> KVPoolConfig:
    """Group 0: a 40-token window (releases low pages as history grows); group 1: full attention."""
    return KVPoolConfig(
        (LayerGroupConfig(1, window=40), LayerGroupConfig(1)),
        pages_per_group=pages,
        tokens_per_block=P,
        head_dim=2,
        max_seq_len=4096,
        guard_page=guard_page,
    )


def _manager(guard_page: bool = False, pages=(64, 40)) -> DraftKVCacheManagerV2:
    return DraftKVCacheManagerV2.from_pool_config(
        _config(pages, guard_page), spec_mode=SpeculativeDecodingMode.DFLASH, max_draft_len=3
    )


def _prefill(dm: DraftKVCacheManagerV2, rids, chunks: int, chunk: int = 48, prompt: int = 160) -> list[LlmRequest]:
    """Requests `rids` run `chunks` context chunks of `chunk` tokens (history follows, window pages go)."""
    reqs = [LlmRequest(rid, prompt_len=prompt) for rid in rids]
    for req in reqs:
        req.target_view.chunk_size = chunk
    for _ in range(chunks):
        dm.prepare_resources(ScheduledRequests(list(reqs)))
        for req in reqs:
            req.advance_context_chunk(chunk)
    return reqs


def _map_equals_rows(chk: OwnershipChecker, dm: DraftKVCacheManagerV2) -> bool:
    return all(
        chk.page_holders.owned_pages(rid, g) == sorted(dm.get_cache(rid).held_pages(g))
        for rid in dm.request_ids()
        for g in range(dm.num_pools)
    ) and len(chk.page_holders.holders_of) == sum(dm.get_cache(rid).num_held_pages() for rid in dm.request_ids())


def _clean(chk: OwnershipChecker, dm: DraftKVCacheManagerV2) -> None:
    ids = dm.request_ids()
    assert chk.check_accounting() == 0, chk.messages[-3:]
    assert chk.check_rows() == 0, chk.messages[-3:]
    for backend in ("cpp", "python"):
        assert chk.check_export(ids, dm.get_block_offsets(ids, backend), backend) == 0, chk.messages[-3:]
    assert _map_equals_rows(chk, dm)
    assert chk.violations == 0, chk.messages[:3]


def _read(chk: OwnershipChecker, rid: int, group: int, ordinal: int, page: int, **kw) -> None:
    """One token read by `rid` in layer 0 of `group` through `ordinal`, resolving to `page` (ownership only)."""
    chk.check_values = False  # nothing was stored: only the page matters here
    kv = torch.zeros(1, 1, 2, 1, 2)
    chk.record_read(
        rid, group, [0], torch.tensor([ordinal * P]), torch.tensor([ordinal]), torch.tensor([page]), kv, **kw
    )


def _write(chk: OwnershipChecker, rid: int, group: int, ordinal: int, page: int) -> None:
    kv = torch.zeros(1, 1, 2, 1, 2)
    chk.record_write(rid, group, [0], torch.tensor([ordinal * P]), torch.tensor([ordinal]), torch.tensor([page]), kv)


# =============================================================================================
# The pool's listeners and the cache's owner.
# =============================================================================================
def test_pool_listeners_hear_allocate_take_and_release_with_the_owner():
    pool = PagePool(6, tokens_per_block=P)
    heard = []

    def listen(event, pages, owner):
        heard.append((event, pages, owner))

    pool.add_listener(listen)
    a = pool.allocate(2, owner="a")
    b = pool.allocate(1)  # positional, no owner: still heard, owner None
    pool.begin_journal()
    pool.release(a, owner="a")
    pool.rollback_journal()  # the undone release is heard as an allocation by the same owner
    pool.release(b)
    pool.allocate(0)  # nothing moves, nothing heard
    with pytest.raises(Exception):
        pool.allocate(99, owner="x")  # failed: nothing heard
    with pytest.raises(ValueError):
        pool.release([5], owner="x")
    assert heard == [
        ("allocate", a, "a"),
        ("allocate", b, None),
        ("release", a, "a"),
        ("allocate", sorted(a, reverse=True), "a"),  # undone latest first
        ("release", b, None),
    ]
    pool.remove_listener(listen)
    pool.release(a)
    assert len(heard) == 5
    pool.check_accounting()


def test_kv_cache_names_its_owner_in_every_pool_call():
    pool = PagePool(16, tokens_per_block=P)
    owners = []
    pool.add_listener(lambda event, pages, owner: owners.append((event, owner)))
    cache = KVCache([LayerGroup(LifeCycle(16), pool)], P, name="c", owner=7)
    assert cache.owner == 7
    assert cache.resize(40)
    cache.begin_journal()
    pool.begin_journal()
    assert cache.resize(48, 32)  # history releases window pages, growth allocates
    pool.rollback_journal()  # release what it gained, take back what it gave
    cache.rollback_journal()
    cache.free()
    assert {o for _, o in owners} == {7}
    assert {e for e, _ in owners} == {"allocate", "release"}
    assert KVCache([LayerGroup(LifeCycle(None), pool)], P).owner is None


def test_the_manager_names_the_request_as_owner():
    dm = _manager()
    _prefill(dm, [5], 1)
    assert dm.get_cache(5).owner == 5


# =============================================================================================
# The map follows the pools.
# =============================================================================================
def test_the_map_equals_the_rows_in_a_clean_run_and_empties_when_every_request_is_freed():
    dm = _manager()
    chk = OwnershipChecker(dm)
    reqs = _prefill(dm, [1, 2], 3)
    assert dm.get_cache(1).block_row(0)[0] == BAD_PAGE_INDEX  # the window released low pages
    _clean(chk, dm)
    for req in reqs:
        dm.free_resources(req)
    assert chk.page_holders.holders_of == {} and chk.check_accounting() == 0 and chk.check_rows() == 0
    assert chk.page_holders.owned == {}  # nothing kept for finished requests
    assert chk.page_holders.owned_pages(1, 0) == [] and chk.violations == 0


def test_a_checker_built_late_learns_the_live_pages():
    dm = _manager()
    _prefill(dm, [1, 2], 2)
    chk = OwnershipChecker(dm)
    _clean(chk, dm)
    _prefill(dm, [3], 2)
    _clean(chk, dm)


def test_a_rolled_back_batch_leaves_the_map_equal_to_the_rows(monkeypatch):
    dm = _manager()
    chk = OwnershipChecker(dm)
    running = _prefill(dm, [1, 2], 2)
    for req in running:  # the next, short chunk raises history past the window: releases more than it grows
        req.target_view.chunk_size = 8
    taken = []  # pages a pool's rollback hands back to an owner: the undo of a release is an "allocate"
    rolling_back = []
    for pool in dm.pools():
        real = pool.rollback_journal

        def spy(_real=real):
            rolling_back.append(True)
            try:
                return _real()
            finally:
                rolling_back.pop()

        def hear(event, pages, owner):
            if rolling_back and event == "allocate":
                taken.append((list(pages), owner))

        monkeypatch.setattr(pool, "rollback_journal", spy)
        pool.add_listener(hear)
    before = {rid: dm.get_cache(rid).checkpoint() for rid in dm.request_ids()}
    hog = LlmRequest(3, prompt_len=400)  # a fresh request the full-attention pool cannot hold
    with pytest.raises(KVCacheResizeError, match="request 3"):
        dm.prepare_resources(ScheduledRequests([*running, hog]))
    assert {rid: dm.get_cache(rid).checkpoint() for rid in dm.request_ids()} == before
    # the running requests released window pages and took them back
    assert any(pages and owner in (1, 2) for pages, owner in taken)
    _clean(chk, dm)
    dm.prepare_resources(ScheduledRequests(running))
    _clean(chk, dm)


def test_groups_sharing_one_pool_are_heard_once():
    dm = _manager(pages=(64, 80))
    shared = dm.layer_groups[1].pool
    dm.layer_groups[0] = LayerGroup(dm.layer_groups[0].life_cycle, shared)  # both groups on one pool
    chk = OwnershipChecker(dm)
    _prefill(dm, [1, 2], 2)
    assert chk.check_accounting() == 0 and chk.check_rows() == 0
    held = sorted(p for rid in (1, 2) for g in (0, 1) for p in dm.get_cache(rid).held_pages(g))
    assert sorted(page for _, page in chk.page_holders.holders_of) == held
    assert chk.page_holders.owned_pages(1, 0) == chk.page_holders.owned_pages(1, 1)  # one pool, one set of pages
    assert chk.violations == 0


# =============================================================================================
# Rows the checker must not trust.
# =============================================================================================
@pytest.mark.parametrize("group", [0, 1])
def test_a_row_holding_another_requests_page_is_reported(group):
    dm = _manager()
    chk = OwnershipChecker(dm)
    _prefill(dm, [1, 2], 2)
    a, b = dm.get_cache(1), dm.get_cache(2)
    backed = [i for i, p in enumerate(a.block_row(group)) if p != BAD_PAGE_INDEX]
    ordinal, intact = backed[-1], backed[0]
    own_page = a.block_row(group)[ordinal]
    stolen = b.held_pages(group)[-1]
    a._rows[group][ordinal] = stolen  # the allocator bug: one page in two requests' rows
    assert a.block_row(group)[ordinal] == stolen  # the row agrees with the access below ...
    _read(chk, 1, group, intact, a.block_row(group)[intact])  # (an intact entry of the same row is owned)
    assert chk.violations == 0
    # ... and the pre-map check, the row as the truth, finds nothing wrong:
    _read(chk, 1, group, ordinal, stolen, owned_row=torch.tensor(a.block_row(group)))
    assert chk.violations == 0
    found = chk.check_rows()
    assert found == 2  # the entry on request 2's page, and request 1's own page no row holds now
    assert chk.foreign_row_entries == 1 and chk.accounting_errors == 2
    assert any("ordinal" in m and f"page {stolen}" in m and "held by 2" in m for m in chk.messages)
    assert any(f"page {own_page}" in m and "leaked" in m for m in chk.messages)
    # an access through that entry: the page the row holds, but not request 1's page
    _read(chk, 1, group, ordinal, stolen)
    _write(chk, 1, group, ordinal, stolen)
    assert chk.foreign_page_reads == 1 and chk.foreign_page_writes == 1 and chk.unbacked_accesses == 0
    assert any("held by 2" in m and m.startswith("request 1") for m in chk.messages)
    # the export built from the corrupted row points request 1 at request 2's page
    for backend in ("cpp", "python"):
        assert chk.check_export([1, 2], dm.get_block_offsets([1, 2], backend), backend) == 2  # its K and V
    assert chk.foreign_export_entries == 4
    assert chk.summary()["accounting_errors"] == chk.accounting_errors == 6
    with pytest.raises(OwnershipViolation):
        chk.assert_clean()


def test_an_access_to_an_unbacked_ordinal_is_still_counted_as_unbacked():
    dm = _manager()
    chk = OwnershipChecker(dm)
    _prefill(dm, [1, 2], 3)
    row = dm.get_cache(1).block_row(0)
    released = row.index(BAD_PAGE_INDEX)
    page0_owner = [rid for rid in (1, 2) if 0 in dm.get_cache(rid).held_pages(0)]
    _read(chk, 1, 0, released, 0)  # the cpp export's page 0 behind an unbacked entry
    assert chk.foreign_page_reads == 1 and chk.unbacked_accesses == 1
    assert any("its row has -1 there" in m and "-> page 0" in m for m in chk.messages)
    if page0_owner:
        assert f"held by {page0_owner[0]}" in chk.messages[-1]


def test_a_pool_that_hands_out_a_held_page_again_is_an_accounting_error(monkeypatch):
    dm = _manager()
    chk = OwnershipChecker(dm)
    _prefill(dm, [1], 1)
    pool = dm.layer_groups[1].pool
    victim = dm.get_cache(1).held_pages(1)[0]
    monkeypatch.setattr(pool._sets, "free", pool.free_order() + [victim])  # popped next: the bug
    assert chk.check_accounting() == 1  # the pool's free list now disagrees with the map
    _prefill(dm, [2], 1)
    assert victim in dm.get_cache(2).held_pages(1)  # both rows now hold it
    assert chk.accounting_errors == 2
    assert any(f"page {victim} allocated for 2" in m and "held by 1" in m and "held twice" in m for m in chk.messages)
    # the map keeps the first owner: request 2's row entry and its accesses through it are foreign
    assert chk.check_rows() == 1
    ordinal = dm.get_cache(2).block_row(1).index(victim)
    _read(chk, 2, 1, ordinal, victim)
    assert chk.foreign_page_reads == 1
    assert chk.violations > 0


def test_a_release_the_map_does_not_expect_is_an_accounting_error():
    dm = _manager()
    chk = OwnershipChecker(dm)
    _prefill(dm, [1, 2], 1)
    pool = dm.layer_groups[1].pool
    page = dm.get_cache(1).held_pages(1)[0]
    pool.release([page], owner=2)  # request 2 gives back request 1's page
    assert chk.accounting_errors == 1 and "held by 1" in chk.messages[-1]
    assert pool.allocate(1, owner=1) == [page]  # the page just freed is handed out first, to its row's owner
    assert chk.check_accounting() == 0 and chk.check_rows() == 0
    spare = pool.allocate(1)  # nobody's: no row holds it
    pool.release(spare)  # owner None, and the map has it held by None: fine
    assert chk.accounting_errors == 1


def test_debug_mode_raises_at_the_next_check_not_inside_the_pool(monkeypatch):
    dm = _manager()
    chk = OwnershipChecker(dm, raise_on_violation=True)
    _prefill(dm, [1], 1)
    pool = dm.layer_groups[1].pool
    monkeypatch.setattr(pool._sets, "free", pool.free_order() + [dm.get_cache(1).held_pages(1)[0]])
    _prefill(dm, [2], 1)  # the resize completes: the cache is consistent with its pool
    assert dm.has_cache(2) and dm.get_cache(2).capacity > 0
    with pytest.raises(OwnershipViolation, match="held twice"):
        chk.check_rows()


# =============================================================================================
# Exports.
# =============================================================================================
@pytest.mark.parametrize("guard_page", [False, True], ids=["page-0-fill", "guard-page-fill"])
@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_a_corrupted_export_tensor_is_caught(backend, guard_page):
    dm = _manager(guard_page=guard_page)
    chk = OwnershipChecker(dm)
    _prefill(dm, [1, 2], 3)
    ids = [1, 2]
    offsets = dm.get_block_offsets(ids, backend)
    assert chk.check_export(ids, offsets, backend) == 0
    kv = dm.config.kv_factor
    row = dm.get_cache(1).block_row(0)
    backed = max(i for i, p in enumerate(row) if p != BAD_PAGE_INDEX)
    unbacked = row.index(BAD_PAGE_INDEX)
    theirs = dm.get_cache(2).held_pages(0)[0]
    bad = offsets.clone()
    bad[0, 0, 0, backed] = theirs * kv  # a backed entry on request 2's page
    bad[0, 0, 1, unbacked] = theirs * kv + 1  # an unbacked entry that is no placeholder
    assert chk.check_export(ids, bad, backend) == 2
    assert chk.foreign_export_entries == 2 and chk.accounting_errors == 2
    assert "held by 2" in chk.messages[-1] or "held by 2" in chk.messages[-2]
    if backend == "python":
        # a placeholder where the row backs the ordinal is no placeholder
        bad = offsets.clone()
        bad[1, 1, 0, 0] = -1
        assert chk.check_export(ids, bad, backend) == 1
    with pytest.raises(ValueError):
        chk.check_export([1], offsets, backend)  # B does not match


# =============================================================================================
# The drafter's clean scenarios stay clean under every check.
# =============================================================================================
def _checked_steps(loop: DraftLoop, steps: int, backend: str, *, evict_at: int | None = None) -> None:
    chk, dm = loop.checker, loop.dm
    for s in range(steps):
        loop.step(chunks={1: 64}, accept_cap=lambda rid: random.Random(s * 7 + rid).randrange(4))
        if s == evict_at:
            loop.evict(2)
        ids = dm.request_ids()
        assert chk.check_accounting() == 0 and chk.check_rows() == 0, chk.messages[:3]
        assert chk.check_export(ids, dm.get_block_offsets(ids, backend), backend) == 0, chk.messages[:3]
        assert _map_equals_rows(chk, dm)


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_a_clean_disaggregated_drafter_run_passes_every_check(backend):
    big = 4096
    loop = DraftLoop.build(
        windows=(256,), tokens_per_block=32, pages=64, block_size=4, max_seq_len=big + 1024,
        backend=backend,
    )
    loop.add_context_request(1, phrase_stream(800, vocab_size=64, phrase_len=12, num_phrases=4, seed=1), 300, chunk=64)
    loop.step(chunks={1: 64})
    assert 0 in loop.dm.get_cache(1).held_pages(0)  # page 0 is request 1's, behind request 2's cpp fill
    loop.add_disagg_request(2, phrase_stream(big + 400, vocab_size=64, phrase_len=12, num_phrases=4, seed=2), big)
    _checked_steps(loop, 16, backend, evict_at=7)
    chk = loop.checker
    assert chk.reads > 0 and chk.writes > 0
    assert chk.violations == 0 and chk.unbacked_accesses == 0, chk.messages[:3]
    assert chk.summary()["accounting_errors"] == 0
    for rid in list(loop.requests):
        loop.finish(rid)
    assert chk.page_holders.holders_of == {} and chk.page_holders.owned == {} and chk.check_accounting() == 0


def test_the_pre_fix_seeding_is_still_reported_as_foreign():
    big = 4096
    loop = DraftLoop.build(
        windows=(256,), tokens_per_block=32, pages=64, block_size=4, max_seq_len=big + 1024,
        backend="cpp", seeding="slot_local",
    )
    loop.add_context_request(1, phrase_stream(800, vocab_size=64, phrase_len=12, num_phrases=4, seed=1), 300, chunk=64)
    loop.step(chunks={1: 64})
    loop.add_disagg_request(2, phrase_stream(big + 400, vocab_size=64, phrase_len=12, num_phrases=4, seed=2), big)
    for _ in range(4):
        loop.step(chunks={1: 64})
    chk = loop.checker
    assert chk.foreign_page_writes > 0 and chk.unbacked_accesses > 0
    assert any("-> page 0" in m and "held by 1" in m for m in chk.messages)
    # the pools and rows themselves are fine: the fault is the drafter's addressing
    assert chk.accounting_errors == 0 and chk.check_rows() == 0 and chk.check_accounting() == 0


# =============================================================================================
# Unsubscribing.
# =============================================================================================
def test_detach_unsubscribes_and_a_dropped_checker_leaves_the_pools():
    dm = _manager()
    chk = OwnershipChecker(dm)
    assert chk.page_holders.attached and all(len(p.listeners) == 1 for p in dm.pools())
    chk.detach()
    assert not chk.page_holders.attached and chk.page_holders.holders_of == {}
    assert all(p.listeners == () for p in dm.pools())
    _prefill(dm, [1], 1)
    assert chk.page_holders.holders_of == {} and chk.accounting_errors == 0
    chk.detach()  # idempotent
    dropped = OwnershipChecker(dm)
    del dropped
    gc.collect()
    _prefill(dm, [2], 1)  # the next event finds the checker gone and unsubscribes it
    assert all(p.listeners == () for p in dm.pools())


def test_a_private_arena_checker_keeps_the_given_row_as_the_truth():
    chk = OwnershipChecker(None)
    assert not chk.page_holders.attached and chk.check_rows() == 0
    row = torch.arange(4, 8)
    _read(chk, 1, 0, 1, 5, owned_row=row)
    assert chk.violations == 0
    _read(chk, 1, 0, 1, 6, owned_row=row)
    assert chk.foreign_page_reads == 1
