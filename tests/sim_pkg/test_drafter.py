"""The toy DFlash drafter: token features, phrase continuation, and misaddressed reads.

A drafter that reads the right pages continues repeated phrases; the same
drafter reading foreign pages or ignoring its base drafts visibly worse, and
the ownership checker sees it.
"""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm_draftkv.speculative import DFlashDraftSlots
from draftkv_sim import DFlashDrafter, DFlashDrafterConfig, DraftLoop, OwnershipViolation, TokenFeatures, acceptance, phrase_stream




# --------------------------------------------------------------------------- features
def test_hidden_states_are_history_sections_then_the_next_token():
    f = TokenFeatures(32, 4, 3, seed=5)
    tokens = torch.tensor([3, 9, 4, 7, 1])
    h = f.hidden_states(tokens, torch.tensor([0, 2, 4]), torch.tensor([9, 7, 30]))
    assert h.shape == (3, 16)
    E = f.E
    assert torch.equal(h[1, f.section(0)], E[4]) and torch.equal(h[1, f.section(1)], E[9])
    assert torch.equal(h[1, f.section(2)], E[3]) and torch.equal(h[1, f.section(3)], E[7])
    assert torch.equal(h[0, f.section(1)], torch.zeros(4)) and torch.equal(h[0, f.section(2)], torch.zeros(4))
    assert torch.equal(h[2, f.section(3)], E[30])  # the target's next token, whatever it is
    assert torch.equal(TokenFeatures(32, 4, 3, seed=5).E, E)  # deterministic
    assert torch.allclose(E.norm(dim=1), torch.ones(32, dtype=E.dtype))
    assert TokenFeatures(64, 6, 3).max_cross_similarity() < 0.8  # near-orthogonal as 6 dims allow
    with pytest.raises(IndexError):
        f.hidden_states(tokens, torch.tensor([5]), torch.tensor([0]))


def test_phrase_stream_and_acceptance():
    s = phrase_stream(200, vocab_size=64, phrase_len=8, num_phrases=3, seed=1)
    assert len(s) == 200 and len(set(s[:8])) == 8
    assert acceptance([1, 2, 3], [1, 2, 4]) == 2 and acceptance([], [1]) == 0


# --------------------------------------------------------------------------- drafting
def _loop(**kw) -> DraftLoop:
    kw.setdefault("windows", (256,))
    kw.setdefault("tokens_per_block", 16)
    kw.setdefault("pages", 200)
    loop = DraftLoop.build(**kw)
    t = phrase_stream(1500, vocab_size=64, phrase_len=12, num_phrases=4, seed=10)
    loop.add_context_request(0, t, 200, chunk=128)
    for r in (1, 2):
        t = phrase_stream(3000, vocab_size=64, phrase_len=12, num_phrases=4, seed=10 + r)
        loop.add_disagg_request(r, t, 1000 + 37 * r)
    return loop


def _run(loop: DraftLoop, steps: int = 60) -> float:
    for _ in range(steps):
        loop.step(chunks={0: 128})
    return loop.acceptance_rate


def test_the_drafter_continues_repeated_phrases():
    loop = DraftLoop.build(windows=(None,), tokens_per_block=16)
    loop.add_context_request(0, phrase_stream(900, vocab_size=64, phrase_len=12, num_phrases=4, seed=3), 300, chunk=128)
    rate = _run(loop, 40)
    assert rate > 0.6, rate
    loop.checker.assert_clean()


def test_reading_foreign_pages_or_ignoring_the_base_lowers_acceptance():
    good = _loop()
    rate = _run(good)
    good.checker.assert_clean()
    assert rate > 0.4, rate

    foreign = _loop()  # every row reads another request's rebased row
    foreign.drafter.debug_read_rows_hook = lambda g, rows: rows.roll(1, dims=0)
    rate_foreign = _run(foreign)
    assert rate_foreign < 0.6 * rate, (rate_foreign, rate)
    assert foreign.checker.foreign_page_reads > 0 and foreign.checker.stale_reads > 0

    nobase = _loop()  # wrong positions: the unrebased row read as if it were rebased
    nobase.drafter.debug_read_rows_hook = lambda g, rows: nobase.meta.tables[g].tables
    rate_nobase = _run(nobase)
    assert rate_nobase < 0.7 * rate, (rate_nobase, rate)
    assert nobase.checker.foreign_page_reads > 0


def test_two_kv_heads_and_two_layer_groups():
    loop = DraftLoop.build(windows=(None, 128), layers_per_group=(2, 1), tokens_per_block=16, num_kv_heads=2)
    assert loop.drafter.num_groups == 2 and loop.drafter.windows == (None, None, 128)
    loop.add_context_request(0, phrase_stream(900, vocab_size=64, phrase_len=12, num_phrases=4, seed=3), 300)
    loop.add_disagg_request(1, phrase_stream(900, vocab_size=64, phrase_len=12, num_phrases=4, seed=4), 500)
    rate = _run(loop, 30)
    assert rate > 0.4, rate
    loop.checker.assert_clean()
    loop.dm.check_accounting()


def test_private_arena_drafter():
    loop = DraftLoop.build(windows=(None,), tokens_per_block=16, private_arena=True, max_seq_len=1024)
    loop.add_context_request(0, phrase_stream(900, vocab_size=64, phrase_len=12, num_phrases=4, seed=3), 300)
    rate = _run(loop, 30)
    assert rate > 0.5, rate
    loop.checker.assert_clean()


def test_drafts_are_minus_one_for_rows_that_do_not_propose():
    loop = DraftLoop.build(windows=(None,), tokens_per_block=16)
    loop.add_context_request(0, phrase_stream(400, vocab_size=64, phrase_len=8, num_phrases=4, seed=3), 200, chunk=64)
    res = loop.step(chunks={0: 64})
    assert res.drafts == {} and loop.requests[0].py_draft_tokens == []
    assert loop.drafter.propose().tolist() == [[-1, -1, -1]]


def test_debug_mode_raises_at_the_first_foreign_access():
    loop = DraftLoop.build(windows=(64,), tokens_per_block=16, pages=64, seeding="slot_local", raise_on_violation=True)
    loop.add_context_request(1, phrase_stream(400, vocab_size=64, phrase_len=8, num_phrases=4, seed=1), 100)
    loop.step()
    loop.add_disagg_request(2, phrase_stream(1400, vocab_size=64, phrase_len=8, num_phrases=4, seed=2), 1000)
    with pytest.raises(OwnershipViolation, match="request 2"):
        loop.step()


def test_the_drafter_checks_its_geometry():
    f = TokenFeatures(64, 6, 3)
    meta = DFlashDraftSlots(2, block_size=4, tokens_per_block=16)
    with pytest.raises(ValueError, match="head_dim"):
        DFlashDrafterConfig(64, 4, head_dim=7)
    with pytest.raises(ValueError, match="history"):
        meta5 = DFlashDraftSlots(2, block_size=5, tokens_per_block=16)
        DFlashDrafter(DFlashDrafterConfig(64, 5), TokenFeatures(64, 6, 3), meta5)
    with pytest.raises(ValueError, match="block_size"):
        DFlashDrafter(DFlashDrafterConfig(64, 3), TokenFeatures(64, 6, 3), meta)
    loop = DraftLoop.build(windows=(None,), tokens_per_block=16, block_size=3)  # 2-layer pool
    with pytest.raises(ValueError, match="the draft pool has 2 layers, the drafter 3"):
        DFlashDrafter(DFlashDrafterConfig(64, 4), f, meta, loop.dm)
    with pytest.raises(ValueError, match=r"hidden states must be \[2, 24\]"):
        d = DFlashDrafter(DFlashDrafterConfig(64, 4), f, meta, None)
        d.store_context(0, [0, 1], torch.zeros(2, 5))
