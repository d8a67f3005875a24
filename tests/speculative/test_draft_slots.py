"""DFlash slots: store start, bases, rebased reads, seeds, reuse, rollback, errors.

`DFlashDraftSlots` on a real draft manager, driven by the test executor
(tests/executor_fixture.py) where a test needs steps and actual pages written;
the pure rules are in test_slot_start.py.
"""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm_draftkv import LlmRequest, LlmRequestState, ScheduledRequests
from tensorrt_llm_draftkv.request import ContextView
from tensorrt_llm_draftkv.speculative import DFlashDraftSlots, NoFreeSlotError, SlotStart
from executor_fixture import DraftExecutor
from support import tokens


def ctx_req(rid: int, prompt: int, start: int = 0, chunk: int | None = None) -> LlmRequest:
    req = LlmRequest(rid, prompt, tokens=tokens(prompt, rid))
    req.target_view = ContextView(start, prompt - start if chunk is None else chunk)
    return req


def gen_req(rid: int, n: int) -> LlmRequest:
    return LlmRequest(rid, n - 1, tokens=tokens(n, rid), state=LlmRequestState.GENERATION_IN_PROGRESS)


def held(loop: DraftExecutor, rid: int, group: int = 0) -> set[int]:
    return set(loop.dm.get_cache(rid).held_pages(group))


# --------------------------------------------------------------------------- default seeding
def test_the_default_seeding_is_base_and_slot_local_is_opt_in():
    meta = DFlashDraftSlots(2, block_size=4, tokens_per_block=32)
    assert meta.seeding.value == "base"
    assert DFlashDraftSlots._ctx_reads_rebased_view is True
    with pytest.raises(ValueError, match="unknown DFlash seeding"):
        DFlashDraftSlots(2, block_size=4, tokens_per_block=32, seeding="absolute")


# --------------------------------------------------------------------------- store start on a real pool
def test_store_start_of_a_tail_after_an_uncomputed_prefix_uses_the_prefix_pages_as_base():
    loop = DraftExecutor.build(windows=(64,), tokens_per_block=16, pages=64)
    req = ctx_req(1, 160, start=96, chunk=32)
    batch = ScheduledRequests(context_requests=[req])
    loop.dm.prepare_resources(batch)
    loop.meta.prepare_step(batch, loop.dm)
    assert loop.meta.slots.slot_state(1) == (96, 6) and loop.meta.slots.slot_offset(1) == 0
    row = loop.dm.get_cache(1).block_row(0)
    plan = loop.meta.advance_slot_for_context(req, range(96, 128))
    # the base for a store: target positions, onto row[s // P] -- pages the request holds
    assert plan.positions.tolist() == list(range(96, 128))
    assert plan.pages[0].tolist() == [row[s // 16] for s in range(96, 128)]
    assert set(plan.pages[0].tolist()) <= held(loop, 1)
    assert loop.meta.slots.slot_state(1) == (128, 6)
    prep = loop.meta.generation_prep()[0]
    # the rebased view: row[6:], 32 tokens, shifted by the base
    assert prep.shift.tolist() == [6]
    assert prep.read_lens.tolist() == [32]
    assert prep.read_rows[0, :2].tolist() == row[6:8]
    assert prep.query_pos[0].tolist() == [128, 129, 130, 131]


def test_a_continuation_chunk_goes_on_at_the_slot_length():
    loop = DraftExecutor.build(windows=(None,), tokens_per_block=16)
    loop.add_context_request(1, 100, chunk=40)
    loop.step(chunks={1: 40})
    assert loop.meta.slots.slot_state(1) == (40, 0)
    loop.step(chunks={1: 40})
    assert loop.meta.slots.slot_state(1) == (80, 0)
    assert loop.meta.seeds == {}  # continuations are not re-placed
    loop.ledger.assert_clean()


def test_paired_pool_stores_at_the_target_position_and_reads_from_position_0():
    loop = DraftExecutor.build(windows=(None,), tokens_per_block=16, joint_kv_cache_reuse=True)
    req = ctx_req(1, 160, start=96, chunk=64)
    batch = ScheduledRequests(context_requests=[req])
    loop.dm.prepare_resources(batch)
    loop.meta.prepare_step(batch, loop.dm)
    assert loop.meta.slots.slot_state(1) == (96, 0)
    # the prefix's drafter K/V is in the paired pool (block reuse); put it there
    loop.write_reused_prefix(1)
    loop.store_context(req, range(96, 160))
    prep = loop.meta.generation_prep()[0]
    row = loop.dm.get_cache(1).block_row(0)
    assert prep.shift.tolist() == [0] and prep.read_lens.tolist() == [160]
    assert prep.read_rows[0, :10].tolist() == row[:10]
    loop.propose()
    loop.ledger.assert_clean()
    assert loop.ledger.reads > 160 and set(range(160)) <= {p for _, pos, _ in loop.ledger.read_log for p in pos}


@pytest.mark.parametrize("joint", [False, True])
def test_unrebased_reader_opt_out_keeps_slot_local_numbering_except_on_a_paired_pool(joint):
    loop = DraftExecutor.build(windows=(None,), tokens_per_block=16, joint_kv_cache_reuse=joint)
    loop.meta._ctx_reads_rebased_view = False
    req = ctx_req(1, 160, start=96, chunk=64)
    batch = ScheduledRequests(context_requests=[req])
    loop.dm.prepare_resources(batch)
    loop.meta.prepare_step(batch, loop.dm)
    assert loop.meta.slots.slot_state(1) == ((96, 0) if joint else (0, 0))
    assert loop.meta.slots.slot_offset(1) == (0 if joint else 96)


# --------------------------------------------------------------------------- rebased reads, block writes
def test_block_is_written_into_pages_the_request_holds_through_the_rebased_view():
    # disaggregated request on a windowed pool: its low entries are released
    loop = DraftExecutor.build(windows=(64,), tokens_per_block=16, pages=64, backend="cpp")
    loop.add_disagg_request(1, 1000)
    row0 = loop.dm.get_cache(1).block_row(0)
    assert row0[0] == -1  # released: the cpp export shows page 0 there
    loop.step()
    L, b = loop.meta.slots.slot_state(1)
    assert b == 1000 // 16 and L == b * 16 + 1  # seeded at 992, one token stored
    prep = loop.meta.generation_prep()[0]
    row = loop.dm.get_cache(1).block_row(0)
    q = prep.query_pos[0].tolist()
    assert q == list(range(L, L + 4))
    pages = {row[p // 16] for p in q}
    assert pages <= held(loop, 1)
    # the block's K/V is there, at the in-page offsets
    for layer in range(3):
        storage = loop.dm.get_buffers(layer, "HND")
        for p in q:
            assert loop.ledger.kind_at(1, 0, p) == "block"
            value = loop.ledger.stored[(1, 0)][p][0]
            assert torch.equal(storage[row[p // 16], :, :, p % 16, :], torch.full_like(storage[0, :, :, 0, :], value))
    # reads: rebased rows start at the base, and cover only held pages
    assert prep.shift.tolist() == [b]
    n_read = -(-int(prep.read_lens[0]) // 16)
    assert set(prep.read_rows[0, :n_read].tolist()) <= held(loop, 1)
    loop.ledger.assert_clean()


# --------------------------------------------------------------------------- generation seeds
def test_generation_seed_is_page_aligned_on_a_pool_with_the_trail_page():
    loop = DraftExecutor.build(windows=(128,), tokens_per_block=32, pages=64)
    assert loop.dm._draft_slot_trail_tokens == 32
    loop.add_disagg_request(1, 1000)
    loop.step()
    assert loop.meta.seeds[1] == SlotStart(992, 31, 8)
    loop.ledger.assert_clean()


def test_generation_seed_is_position_aligned_on_a_windowed_pool_without_the_trail_page():
    loop = DraftExecutor.build(windows=(128,), tokens_per_block=32, pages=64, trail_page=False)
    loop.add_disagg_request(1, 1000)
    for _ in range(40):
        loop.step()
    assert loop.meta.seeds == {} and loop.meta.slots.slot_offset(1) == 0
    L, b = loop.meta.slots.slot_state(1)
    assert b == 32  # ceil(1000 / 32)
    loop.ledger.assert_clean()


@pytest.mark.parametrize("trail", [True, False])
def test_generation_seed_with_a_window_shorter_than_a_page(trail):
    loop = DraftExecutor.build(windows=(12,), tokens_per_block=32, pages=32, trail_page=trail)
    loop.add_disagg_request(1, 700)
    loop.step()
    first = loop.meta.seeds[1]
    assert first == (SlotStart(672, 21, 28) if trail else SlotStart(700, 22, 0))
    for _ in range(80):
        loop.step()
    loop.ledger.assert_clean()  # every read on a page the request holds, and what it stored
    loop.dm.check_accounting()


def test_generation_seed_in_a_private_arena_starts_at_zero():
    loop = DraftExecutor.build(windows=(None,), tokens_per_block=16, max_seq_len=512, private_arena=True)
    loop.add_disagg_request(1, 300)
    loop.step()
    assert loop.meta.seeds[1] == SlotStart(0, 0, 300)
    assert loop.meta.slots.private_arena
    for _ in range(20):
        loop.step()
    loop.ledger.assert_clean()


def test_a_clamped_context_stays_absolute_on_a_shared_pool_and_clamps_stores_in_an_arena():
    meta = DFlashDraftSlots(2, block_size=4, tokens_per_block=16, max_ctx_len=256)
    req = gen_req(1, 400)
    meta.prepare_step(ScheduledRequests(generation_requests=[req]), None)  # arena: (0, 0)
    assert meta.slots.slot_state(1) == (0, 0)
    prep = meta.prepare_generation({1: 3})[0]
    assert prep.new_ctx_len.tolist() == [3]
    loop = DraftExecutor.build(windows=(None,), tokens_per_block=16, max_seq_len=512, pages=64)
    loop.meta.slots.max_ctx_len = 250
    loop.add_disagg_request(1, 290)
    loop.step()
    # Shared pool: the seed is not clamped (p = 290 stays absolute, lag 2 < P) ...
    assert loop.meta.seeds[1] == SlotStart(288, 18, 2)
    for _ in range(12):
        loop.step()
    L, b = loop.meta.slots.slot_state(1)
    assert L + loop.meta.slots.slot_offset(1) == len(loop.requests[1].tokens) - 1  # ... nor are stores
    assert L - b * 16 <= 250
    loop.ledger.assert_clean()


# --------------------------------------------------------------------------- reuse, rollback
def test_a_reused_slot_starts_with_base_0():
    loop = DraftExecutor.build(windows=(64,), tokens_per_block=16, pages=64, max_batch_size=1)
    loop.add_disagg_request(1, 1000)
    loop.step()
    slot = loop.meta.slots.slot_of(1)
    assert loop.meta.slots.base_pages_host[slot] == 62
    loop.finish(1)
    assert loop.meta.slots.base_pages_host[slot] == 0 and int(loop.meta.slots.base_pages[slot]) == 0
    loop.add_context_request(2, 100)
    loop.step()
    assert loop.meta.slots.slot_of(2) == slot
    assert loop.meta.slots.slot_state(2) == (100, 0)
    loop.meta.slots.check_host_mirror()
    loop.ledger.assert_clean()


def test_a_slot_reused_without_an_explicit_free_also_starts_with_base_0():
    loop = DraftExecutor.build(windows=(64,), tokens_per_block=16, pages=64, max_batch_size=1)
    loop.add_disagg_request(1, 1000)
    loop.step()
    slot = loop.meta.slots.slot_of(1)
    # the request departs through the manager only; prepare() notices the missing mirror
    loop.dm.free_resources(1)
    loop.requests.pop(1)
    loop.add_context_request(2, 40)
    loop.step()
    assert not loop.meta.slots.has_slot(1)
    assert loop.meta.slots.slot_of(2) == slot and loop.meta.slots.slot_state(2) == (40, 0)
    loop.meta.slots.check_host_mirror()


def test_base_survives_a_rollback_and_is_rolled_back_with_the_lengths():
    loop = DraftExecutor.build(windows=(64,), tokens_per_block=16, pages=64)
    loop.add_disagg_request(1, 1000)
    loop.step()
    L0, b0 = loop.meta.slots.slot_state(1)
    snap = loop.meta.slots.snapshot()
    loop.meta.prepare_generation({1: 3})
    assert loop.meta.slots.slot_state(1) == (L0 + 3, b0)
    loop.meta.rollback(snap)
    assert loop.meta.slots.slot_state(1) == (L0, b0)  # the base survives
    loop.meta.slots.check_host_mirror()
    # a base changed after the snapshot (slot lost and reseeded elsewhere) comes back too
    loop.meta.evict(1)
    loop.requests[1].tokens.extend(tokens(1040, 1)[len(loop.requests[1].tokens) :])
    loop.meta.prepare_step(ScheduledRequests(generation_requests=[loop.requests[1]]), loop.dm)
    assert loop.meta.slots.slot_state(1)[1] != b0
    loop.meta.rollback(snap)
    assert loop.meta.slots.slot_state(1) == (L0, b0)
    assert loop.meta.slots.base_pages.tolist()[loop.meta.slots.slot_of(1)] == b0
    loop.meta.slots.check_host_mirror()


def test_an_optimistic_commit_rolled_back_reads_only_what_was_accepted():
    loop = DraftExecutor.build(windows=(None,), tokens_per_block=16)
    loop.add_context_request(1, 120)
    for i in range(30):
        loop.step(optimistic=[1], accepted={1: i % 3})
    loop.ledger.assert_clean()
    loop.meta.slots.check_host_mirror()
    assert loop.meta.slots.slot_state(1)[0] == len(loop.requests[1].tokens) - 1


# --------------------------------------------------------------------------- dummies
def test_each_dummy_row_gets_its_own_dummy_slot_and_touches_only_its_own_pages():
    loop = DraftExecutor.build(windows=(32,), tokens_per_block=16, pages=64)
    loop.add_context_request(1, 64)
    loop.step(dummies=2, dummy_tokens=50)
    dummy = loop.meta.dummy_slot
    assert [r.slot for r in loop.meta.rows if r.kind == "dummy"] == [dummy, dummy + 1]
    assert loop.meta.slots.slot_state(1)[0] == 64
    assert loop.meta.slots.ctx_len_host[dummy] == 48 and loop.meta.slots.base_pages_host[dummy] == 3
    loop.ledger.assert_clean()
    loop.dm.check_accounting()
    assert loop.dm.request_ids() == [1]


# --------------------------------------------------------------------------- errors
def state(meta: DFlashDraftSlots):
    return (
        meta.slots.live_requests(),
        meta.slots.free_slots,
        meta.slots.ctx_len_host,
        meta.slots.base_pages_host,
        meta.slots.ctx_len.tolist(),
        meta.slots.base_pages.tolist(),
    )


def test_no_free_slot_names_the_requests_and_counts_and_changes_nothing():
    loop = DraftExecutor.build(windows=(None,), tokens_per_block=16, max_batch_size=2)
    reqs = [ctx_req(i, 40) for i in range(1, 4)]
    batch = ScheduledRequests(context_requests=reqs)
    loop.dm.prepare_resources(batch)
    loop.meta.prepare_step(ScheduledRequests(context_requests=reqs[:1]), loop.dm)
    before = state(loop.meta)
    with pytest.raises(NoFreeSlotError, match=r"requests \[2, 3\]: 2 needed, 1 free of 2 slots") as info:
        loop.meta.prepare_step(batch, loop.dm)
    assert info.value.request_ids == [2, 3] and info.value.needed == 2 and info.value.free == 1
    assert state(loop.meta) == before


def test_unknown_request_ids_raise_key_errors_naming_them():
    meta = DFlashDraftSlots(2, block_size=4, tokens_per_block=16)
    for call in (meta.evict, meta.free, meta.slots.slot_of, meta.slots.slot_state, meta.row_index):
        with pytest.raises(KeyError, match="request 77"):
            call(77)
    meta.free(77, missing_ok=True)


def test_prepare_without_a_mirror_or_with_duplicates_raises_and_changes_nothing():
    loop = DraftExecutor.build(windows=(None,), tokens_per_block=16)
    req = ctx_req(5, 40)
    before = state(loop.meta)
    with pytest.raises(KeyError, match=r"requests \[5\] have no draft mirror"):
        loop.meta.prepare_step(ScheduledRequests(context_requests=[req]), loop.dm)
    loop.dm.prepare_resources(ScheduledRequests(context_requests=[req]))
    with pytest.raises(ValueError, match=r"requests \[5\] appear twice"):
        loop.meta.prepare_step(ScheduledRequests(context_requests=[req], generation_requests=[req]), loop.dm)
    assert state(loop.meta) == before


def test_a_store_that_does_not_continue_the_slot_raises_and_changes_nothing():
    loop = DraftExecutor.build(windows=(None,), tokens_per_block=16)
    req = ctx_req(1, 64, chunk=32)
    batch = ScheduledRequests(context_requests=[req])
    loop.dm.prepare_resources(batch)
    loop.meta.prepare_step(batch, loop.dm)
    before = state(loop.meta)
    with pytest.raises(ValueError, match="continue its slot at absolute position 0"):
        loop.meta.advance_slot_for_context(req, range(5, 37))
    with pytest.raises(ValueError, match="only generation rows commit"):
        loop.meta.prepare_generation({1: 2})
    assert state(loop.meta) == before


def test_a_block_past_the_mirror_capacity_is_refused_before_anything_changes():
    loop = DraftExecutor.build(windows=(None,), tokens_per_block=16)
    loop.dm.num_extra_kv_tokens = 0  # a manager that leaves no room for the block
    loop.add_disagg_request(1, 96)
    req = loop.requests[1]
    batch = ScheduledRequests(generation_requests=[req])
    loop.dm.prepare_resources(batch)
    loop.meta.prepare_step(batch, loop.dm)
    before = state(loop.meta)
    with pytest.raises(ValueError, match=r"request 1's block .* past its draft mirror's capacity"):
        loop.meta.prepare_generation({1: 4})
    assert state(loop.meta) == before


@pytest.mark.parametrize("trail", [True, False])
def test_the_drafter_reads_only_inside_its_slot_span(trail):
    """Context reads lie in [b*P, L), block reads in [L, L + block_size); nothing else."""
    loop = DraftExecutor.build(windows=(48,), tokens_per_block=16, pages=64, trail_page=trail)
    seen = loop.ledger.read_log
    loop.add_disagg_request(1, 1000 + 5)
    loop.add_context_request(2, 200, chunk=64, start=32)
    for _ in range(30):
        seen.clear()
        loop.step(chunks={2: 64})
        assert any(positions for _, positions, _ in seen)
        for rid, positions, _ in seen:
            L, b = loop.meta.slots.slot_state(rid)
            assert not positions or max(positions) < L + 4
            assert all(p >= b * 16 for p in positions if p < L)
    loop.ledger.assert_clean()


def test_rows_that_lost_their_slot_after_prepare_are_refused():
    loop = DraftExecutor.build(windows=(None,), tokens_per_block=16)
    loop.add_disagg_request(1, 100)
    req = loop.requests[1]
    batch = ScheduledRequests(generation_requests=[req])
    loop.dm.prepare_resources(batch)
    loop.meta.prepare_step(batch, loop.dm)
    loop.meta.evict(1)
    with pytest.raises(RuntimeError, match=r"requests \[1\] lost their slots after prepare"):
        loop.meta.prepare_generation({1: 1})
