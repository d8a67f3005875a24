"""Real traffic: the corner cases a curated scenario never reached, one test per rule.

Each test here failed on the first release: a prompt length one short of a
window boundary, a generation request without a mirror, a batch naming an
unknown id, a clamped drafter context, a worker that reads the unrebased
table, and warmup dummies of several sizes in one step.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from tensorrt_llm_draftkv import (
    DFlashDraftSlots,
    DraftKVCacheManagerV2,
    KVCacheManagerV2,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    MissingKVCacheError,
    ScheduledRequests,
    SpeculativeDecodingMode,
)
from draftkv_sim import RunSpec
from draftkv_sim.disagg_transfer import admit_transfer, transfer_from, transfer_range
from draftkv_sim.prompts import phrase_prompt
from draftkv_sim.run_build import build_executor, target_only_outputs
from draftkv_sim.simulate import run_one
from tensorrt_llm_draftkv.manager.rules import MirrorSizing
from tensorrt_llm_draftkv.request import ContextView
from tensorrt_llm_draftkv.runtime import BAD_PAGE_INDEX
from tensorrt_llm_draftkv.speculative.handoff import DrafterHandoff
from draftkv_sim import DraftLoop

from sim_pkg.sim_support import SMALL, truth

pytestmark = pytest.mark.usefixtures("reference_kernels")  # the kernels' torch reference: fast on CPU


Mode = SpeculativeDecodingMode




def full_state(mgr: KVCacheManagerV2):
    caches = {rid: mgr.get_cache(rid).checkpoint() for rid in mgr.request_ids()}
    return caches, [(sorted(p.free_order()), sorted(p.held_pages())) for p in mgr.pools()]


# ============================================================================ (1) transfer
def _disagg_in_process(setup, prompt_len: int):
    """Context worker and generation worker in one process: the transfer, then generation to the end."""
    prompt = phrase_prompt(11 * prompt_len, prompt_len, vocab_size=setup.vocab_size)
    context = build_executor(replace(setup, max_new_tokens=1), None, 1, 1)
    sent = []
    context.on_complete = lambda req, ex: sent.append(transfer_from(req, ex))
    context.add_request(0, prompt)
    context.run()
    generation = build_executor(setup, MirrorSizing.HISTORY, 1, 1)
    req = admit_transfer(sent[0], generation)
    target_cache = generation.target_manager.get_cache(0)
    backed = [
        target_cache.block_row(0)[pos // setup.tokens_per_block] != BAD_PAGE_INDEX
        for pos in range(sent[0].group_lo[0], prompt_len)
    ]
    stats = generation.run()
    return sent[0], backed, stats, req


def test_a_transfer_sends_exactly_what_the_generation_window_reads_for_every_prompt_residue():
    setup = replace(SMALL, max_new_tokens=6)
    P, W = setup.tokens_per_block, setup.target_window
    for m in range(600, 600 + P):  # a whole page of residues of m, the (m + 1 - W) % P == 0 one included
        item, backed, stats, _ = _disagg_in_process(setup, m)
        assert item.group_lo == [max(0, m + 1 - W)], m
        assert item.keys[0].shape[0] == min(m, W - 1)
        assert all(backed), f"prompt {m}: a sent position lands on a page the generation-init cache released"
        assert stats.finished == 1 and stats.resize_failures == 0, (m, stats.first_error)
        assert stats.foreign_page_accesses == 0


def test_transfer_range_is_the_first_generation_querys_window():
    assert transfer_range(131071, 4096) == (131071 + 1 - 4096, 131071)
    assert transfer_range(100, 4096) == (0, 100)
    assert transfer_range(100, None) == (0, 100)
    # one position more (m - W) would be on the page the generation-init cache released
    m, W, P = 131071, 4096, 32
    from tensorrt_llm_draftkv.runtime import LifeCycle

    lo, hi = LifeCycle(W).stale_range(m, P)
    assert (m - W) // P < hi <= (m + 1 - W) // P


def test_two_process_run_survives_prompts_one_short_of_a_window_boundary():
    P = SMALL.tokens_per_block
    odd = [607, 622]  # 607 + 1 - 256 is a page boundary; 622 is not a page multiple either
    assert (odd[0] + 1 - SMALL.target_window) % P == 0
    spec = RunSpec("odd-disagg", "disaggregated", tuple(odd), 2)
    setup = replace(SMALL, max_new_tokens=12)
    stats, seeds = run_one(setup, spec, MirrorSizing.HISTORY)
    assert stats.finished == 2 and stats.resize_failures == 0, stats.first_error
    assert stats.foreign_page_accesses == 0
    keys = list(zip(seeds, spec.prompts))
    assert {keys[rid]: out for rid, out in stats.outputs.items()} == target_only_outputs(setup, keys)


@pytest.mark.parametrize("trail_page", [True, False])
def test_the_trail_page_is_what_keeps_a_seeded_window_on_its_own_pages(trail_page):
    """A seed 31 tokens past its page and a generation longer than the draft window:
    with the trail page every read is owned; without it (same seed) the far edge is not. The empty seed
    is what is tested: no drafter context is handed over (a handed-over context seeds at the prompt end)."""
    setup = replace(
        SMALL, trail_page=trail_page, draft_window=64, max_new_tokens=120, drafter_handoff=DrafterHandoff.NONE
    )
    spec = RunSpec("seeded-window", "disaggregated", (16 * 40 - 1,), 1)
    stats, _ = run_one(setup, spec, MirrorSizing.HISTORY)
    assert stats.finished == 1 and stats.max_seed_lag_tokens == 15
    assert stats.accounting_errors == 0
    if trail_page:
        assert stats.foreign_page_accesses == stats.unbacked_accesses == stats.stale_reads == 0
    else:
        assert stats.unbacked_accesses > 0 and stats.foreign_page_accesses > 0


# ============================================================================ (2) missing mirror
def _draft_mgr(windows=(64,), pages=64, mode=Mode.DFLASH, **kw) -> DraftKVCacheManagerV2:
    cfg = KVPoolConfig(
        tuple(LayerGroupConfig(1, window=w) for w in windows),
        pages_per_group=(pages,) * len(windows),
        tokens_per_block=16,
        head_dim=2,
        max_seq_len=1 << 16,
    )
    return DraftKVCacheManagerV2.from_pool_config(cfg, spec_mode=mode, max_draft_len=3, num_extra_kv_tokens=4, **kw)


@pytest.mark.parametrize("draft", [True, False])
def test_a_generation_request_without_a_mirror_is_refused_and_nothing_is_created(draft):
    mgr = _draft_mgr() if draft else KVCacheManagerV2.from_pool_config(_draft_mgr().config)
    known = LlmRequest(1, prompt_len=40)
    mgr.prepare_resources(ScheduledRequests(context_requests=[known]))
    stranger = LlmRequest(7, prompt_len=10_000, state=LlmRequestState.GENERATION_IN_PROGRESS)
    stranger.tokens.append(3)
    before = full_state(mgr)
    label = "draft KV cache" if draft else "KV cache"
    with pytest.raises(MissingKVCacheError, match=rf"^Missing {label} for generation request 7") as info:
        mgr.prepare_resources(ScheduledRequests(context_requests=[LlmRequest(2, 30)], generation_requests=[stranger]))
    assert info.value.request_ids == [7]
    assert full_state(mgr) == before and not mgr.has_cache(7) and not mgr.has_cache(2)


# ============================================================================ (3) atomic batches
def _live_batch(mgr):
    a = LlmRequest(1, prompt_len=100)
    b = LlmRequest(2, prompt_len=300, state=LlmRequestState.DISAGG_GENERATION_INIT)
    b.tokens.append(5)
    mgr.prepare_resources(ScheduledRequests(context_requests=[a]))
    assert mgr.prepare_disagg_gen_init(b)
    b.state = LlmRequestState.GENERATION_IN_PROGRESS
    b.tokens.extend([1, 2, 3])  # accepted tokens: update_resources would advance its history
    a.target_view.position = 100  # the executor advanced the view: update_context_resources would too
    a.target_view.chunk_size = 0
    return a, b


def _manager_for(draft: bool):
    return _draft_mgr(windows=(32, None)) if draft else KVCacheManagerV2.from_pool_config(_draft_mgr(windows=(32, None)).config)


def _stranger() -> LlmRequest:
    stranger = LlmRequest(99, prompt_len=50, state=LlmRequestState.GENERATION_IN_PROGRESS)
    stranger.tokens.append(1)
    stranger.target_view = ContextView(50, 0)
    return stranger


@pytest.mark.parametrize("draft", [True, False])
def test_freeing_a_list_with_an_unknown_id_is_all_or_nothing(draft):
    mgr = _manager_for(draft)
    a, b = _live_batch(mgr)
    before = full_state(mgr)
    with pytest.raises(KeyError, match="request 99"):
        mgr.free_resources([a, b, 99])
    assert full_state(mgr) == before
    mgr.free_resources([a, b])  # the same call without the stranger frees (so the test above could fail)
    assert mgr.request_ids() == []
    mgr.check_accounting()


@pytest.mark.parametrize("draft", [True, False])
@pytest.mark.parametrize("call", ["update_resources", "update_context_resources"])
def test_updates_skip_a_request_without_a_cache_and_update_the_rest(draft, call):
    # Upstream's convention: an update skips what it holds no cache for. The rest of the batch is
    # updated exactly as without the stranger (a twin manager shows what that is).
    mgr, twin = _manager_for(draft), _manager_for(draft)
    a, b = _live_batch(mgr)
    ta, tb = _live_batch(twin)
    before = full_state(mgr)
    if call == "update_context_resources":
        batch, alone = ScheduledRequests(context_requests=[a, _stranger()]), ScheduledRequests(context_requests=[ta])
    else:
        batch, alone = ScheduledRequests(generation_requests=[b, _stranger()]), ScheduledRequests(generation_requests=[tb])
    getattr(mgr, call)(batch)
    getattr(twin, call)(alone)
    assert full_state(mgr) == full_state(twin) != before
    assert not mgr.has_cache(99)
    mgr.check_accounting()


def test_free_resources_of_a_batch_refuses_a_repeated_id_and_frees_nothing():
    mgr = _draft_mgr()
    a, b = _live_batch(mgr)
    before = full_state(mgr)
    with pytest.raises(KeyError, match="request 1: it is named twice"):
        mgr.free_resources([a, 1])
    assert full_state(mgr) == before


# ============================================================================ (4) clamped contexts
@pytest.mark.parametrize("windows", [(None,), (48,)])
def test_a_clamped_drafter_context_takes_every_prefill_chunk_and_reads_only_its_own_pages(windows):
    loop = DraftLoop.build(windows=windows, tokens_per_block=16, pages=96, max_ctx_len=50, backend="cpp")
    loop.add_context_request(1, truth(400, 1), 200, chunk=100)
    for _ in range(30):
        loop.step(chunks={1: 100})
        L, b = loop.meta.slots.slot_state(1)
        assert L - b * 16 <= 50  # the clamp bounds what the slot reads ...
        req = loop.requests[1]
        at = req.target_view.position if req.is_context_init_state else len(req.tokens) - 1
        assert L + loop.meta.slots.slot_offset(1) == at  # ... never where it stores
    assert loop.requests[1].is_generation_in_progress_state
    loop.checker.assert_clean()
    assert loop.checker.reads > 0 and loop.checker.unbacked_accesses == 0
    loop.dm.check_accounting()


def test_a_clamped_seed_on_a_windowed_pool_keeps_its_lag_under_a_page():
    loop = DraftLoop.build(windows=(48,), tokens_per_block=16, pages=96, max_ctx_len=50, backend="cpp")
    loop.add_context_request(2, truth(600, 3), 100)  # another request owns the pool's low pages
    loop.step()
    loop.add_disagg_request(1, truth(900, 2), 517)
    for step in range(25):
        loop.step()
        if step == 10:
            loop.evict(1)  # reseeded next step
        seed = loop.meta.seeds.get(1)
        if seed is not None:
            assert seed.offset < 16, seed
    loop.checker.assert_clean()
    assert loop.checker.unbacked_accesses == 0


def test_a_clamped_arena_context_continues_its_chunks():
    loop = DraftLoop.build(windows=(None,), tokens_per_block=16, max_ctx_len=50, private_arena=True)
    loop.add_context_request(1, truth(400, 1), 200, chunk=100)
    for _ in range(12):
        loop.step(chunks={1: 100})
        assert loop.meta.slots.slot_state(1)[0] <= 50  # the arena holds max_ctx_len tokens
    loop.checker.assert_clean()


# ============================================================================ (5) unrebased readers
class UnrebasedReader(DFlashDraftSlots):
    _ctx_reads_rebased_view = False


def test_an_unrebased_reader_is_refused_on_a_windowed_pool_at_construction():
    dm = _draft_mgr(windows=(64,))
    with pytest.raises(ValueError, match=r"unrebased table.*windows \[64\].*16-token pages"):
        UnrebasedReader(4, block_size=4, tokens_per_block=16, draft_manager=dm)
    # ... and when bound later, before anything changes
    meta = UnrebasedReader(4, block_size=4, tokens_per_block=16)
    req = LlmRequest(1, prompt_len=300)
    req.target_view = ContextView(200, 100)
    batch = ScheduledRequests(context_requests=[req])
    dm.prepare_resources(batch)
    with pytest.raises(ValueError, match="unrebased table"):
        meta.prepare_step(batch, dm)
    assert meta.slots.live_requests() == {} and meta.rows == []


@pytest.mark.parametrize("windows, joint", [((None,), False), ((64,), True)])
def test_an_unrebased_reader_stays_on_its_own_pages_where_it_is_allowed(windows, joint):
    loop = DraftLoop.build(windows=windows, tokens_per_block=16, pages=96, joint_kv_cache_reuse=joint)
    loop.meta._ctx_reads_rebased_view = False
    loop.add_context_request(2, truth(500, 3), 120)
    loop.step()
    loop.add_context_request(1, truth(700, 1), 400, start=208)  # a prefix this worker did not compute
    for _ in range(20):
        loop.step()
    loop.checker.assert_clean()


# ============================================================================ (6) dummies
@pytest.mark.parametrize("backend", ["cpp", "python"])
@pytest.mark.parametrize("guard_page", [False, True])
def test_dummies_of_several_sizes_in_one_step_address_only_their_own_pages(backend, guard_page):
    loop = DraftLoop.build(windows=(32,), tokens_per_block=16, pages=128, backend=backend, guard_page=guard_page)
    loop.add_context_request(1, truth(500, 1), 200)
    loop.add_disagg_request(2, truth(600, 2), 333)
    for step in range(6):
        loop.step(dummies=4, dummy_tokens=[5, 50, 333, 17 + step])
        dummy_rows = [r for r in loop.meta.rows if r.kind == "dummy"]
        assert len({r.slot for r in dummy_rows}) == 4
        for row in dummy_rows:
            p = row.request.max_beam_num_tokens - 1
            assert loop.meta.seeds[row.request_id].ctx_len == p - p % 16
    loop.checker.assert_clean()
    assert loop.checker.writes > 0 and loop.checker.unbacked_accesses == 0
    loop.dm.check_accounting()
    assert loop.dm.request_ids() == [1, 2]


def test_more_dummies_than_dummy_slots_are_refused_before_anything_changes():
    loop = DraftLoop.build(windows=(None,), tokens_per_block=16, max_batch_size=2)
    loop.add_context_request(1, truth(200, 1), 64)
    with pytest.raises(Exception, match=r"3 warmup dummies .* only 2 dummy slots"):
        loop.step(dummies=3, dummy_tokens=20)
    assert loop.meta.slots.live_requests() == {}


# ============================================================================ (8) target sizing
@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("sizing", ["history", "legacy"])
def test_a_target_manager_sizes_the_same_whatever_drafter_runs(mode, sizing):
    cfg = _draft_mgr(windows=(40, None)).config
    plain = KVCacheManagerV2.from_pool_config(cfg, max_draft_len=3, num_extra_kv_tokens=4)
    flagged = DraftKVCacheManagerV2.from_pool_config(
        cfg, spec_mode=mode, max_draft_len=3, num_extra_kv_tokens=4, sizing=sizing, is_draft=False
    )
    for mgr in (plain, flagged):
        first = LlmRequest(1, prompt_len=300)
        first.target_view = ContextView(0, 128)
        past = LlmRequest(2, prompt_len=300)
        past.target_view = ContextView(160, 64)  # first seen past 0
        gen = LlmRequest(3, prompt_len=90, state=LlmRequestState.DISAGG_GENERATION_INIT)
        gen.tokens.append(1)
        batch = ScheduledRequests(context_requests=[first, past])
        mgr.prepare_resources(batch)
        for req in (first, past):
            req.advance_context_chunk(64)
        mgr.update_context_resources(batch)
        mgr.prepare_resources(batch)
        assert mgr.prepare_disagg_gen_init(gen)
        gen.state = LlmRequestState.GENERATION_IN_PROGRESS
        mgr.update_resources(ScheduledRequests(generation_requests=[gen]))
        mgr.add_dummy_requests([9], [70], is_gen=True, max_num_draft_tokens=3, history_hint=69)
    assert full_state(plain) == full_state(flagged)
