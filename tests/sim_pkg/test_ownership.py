"""Invariants 1 and 2 on real pool tensors: the drafter touches only its request's pages
and reads back exactly what it stored.

* A disaggregated generation request of 65,536 tokens on a windowed draft pool,
  another request owning the pool's low pages, driven through the real
  `prepare()`, context store, commit, and the block decode's append and read —
  with and without a reuse-addressable pool, and across a slot loss and reseed.
* The same scenario with the pre-fix slot-local seeding: the checker reports
  foreign pages (page 0, another request's, behind the "cpp" export).
* A trailing slot (seeded on a page boundary) at 2, 7, 31 and 127 tokens of lag
  on 128-token pages over 600 generation steps: with the trail page every entry
  its window reads is held; without it the 7, 31 and 127 cases read released
  entries.
"""
from __future__ import annotations

import random

import pytest

from draftkv_sim import DraftLoop, phrase_stream




BIG = 65_536
P = 32
WINDOW = 512


def disagg_scenario(*, joint: bool, seeding: str = "base", fused: bool = False, device: str = "cpu") -> DraftLoop:
    """Request 1 (aggregated prefill) owns the pool's low pages; request 2 arrives gen-init at 65,536 tokens."""
    loop = DraftLoop.build(
        windows=(WINDOW,),
        tokens_per_block=P,
        pages=96,
        block_size=4,
        max_seq_len=BIG + 2048,
        joint_kv_cache_reuse=joint,
        seeding=seeding,
        fused=fused,
        backend="cpp",
        device=device,
    )
    other = phrase_stream(1200, vocab_size=64, phrase_len=12, num_phrases=4, seed=1)
    loop.add_context_request(1, other, 300, chunk=128)
    loop.step(chunks={1: 128})
    assert 0 in loop.dm.get_cache(1).held_pages(0)  # the other request owns page 0
    loop.add_disagg_request(2, phrase_stream(BIG + 800, vocab_size=64, phrase_len=12, num_phrases=4, seed=2), BIG)
    cache = loop.dm.get_cache(2)
    assert cache.history_length == BIG and cache.block_row(0)[0] == -1  # the window released the low pages
    assert loop.dm.get_block_offsets([2], "cpp")[0, 0, 0, 0] == 0  # ... which the cpp export turns into page 0
    return loop


def drive(loop: DraftLoop, steps: int, *, evict_at: int | None = None) -> list:
    """Steps with random acceptance; returns the seeds request 2's slot got."""
    seeds = []
    for s in range(steps):
        loop.step(chunks={1: 128}, accept_cap=lambda rid: random.Random(s * 7 + rid).randrange(4))
        if 2 in loop.meta.seeds:
            seeds.append(loop.meta.seeds[2])
        if s == evict_at:
            loop.evict(2)
        loop.dm.check_accounting()
    return seeds


@pytest.mark.parametrize("joint", [False, True], ids=["own-pool", "reuse-addressable-pool"])
@pytest.mark.parametrize("evict", [False, True], ids=["", "slot-loss-and-reseed"])
def test_disagg_generation_drafter_writes_stay_on_its_own_draft_pages(joint, evict):
    loop = disagg_scenario(joint=joint, fused=joint and not evict)
    seeds = drive(loop, 30, evict_at=14 if evict else None)
    chk = loop.checker
    assert chk.writes > 0 and chk.reads > 0
    assert chk.foreign_page_accesses == 0 and chk.unbacked_accesses == 0, chk.messages[:3]
    assert chk.stale_reads == 0, chk.messages[:3]  # the slot reads exactly what it stored
    L, b = loop.meta.slots.slot_state(2)
    assert b * P <= L and b >= BIG // P - 1  # absolute coordinates, base below the slot
    # seeded page-aligned at the first generation step (and again after the slot loss)
    assert len(seeds) == (2 if evict else 1)
    assert seeds[0].base_pages == BIG // P and seeds[0].ctx_len == BIG
    if evict:
        assert seeds[1].base_pages >= seeds[0].base_pages and seeds[1].ctx_len == seeds[1].base_pages * P
    assert loop.accepted_total > 0  # it drafts from what it read


def test_pre_fix_slot_local_seeding_makes_the_checker_report_a_foreign_page():
    loop = disagg_scenario(joint=False, seeding="slot_local")
    drive(loop, 6)
    chk = loop.checker
    assert loop.meta.slots.slot_state(2)[1] == 0 and loop.meta.slots.slot_offset(2) == BIG  # slot-local 0 = absolute BIG
    assert chk.foreign_page_writes > 0 and chk.foreign_page_reads > 0 and chk.unbacked_accesses > 0
    assert any("-> page 0" in m and m.startswith("request 2") for m in chk.messages)
    # page 0 belongs to request 1, whose reads then see what request 2 wrote there
    assert 0 in loop.dm.get_cache(1).held_pages(0)
    assert chk.stale_reads > 0


@pytest.mark.parametrize("trail", [True, False], ids=["trail-page", "no-trail-page"])
@pytest.mark.parametrize("lag", [2, 7, 31, 127])
def test_trailing_drafter_slot_reads_only_pages_its_request_holds(lag, trail):
    page = 128
    loop = DraftLoop.build(
        windows=(256,),
        tokens_per_block=page,
        pages=16,
        block_size=4,
        max_seq_len=8192,
        trail_page=trail,
        backend="python",  # released entries stay -1, so reading one is visible as such
        page_aligned_seed=True,  # the real seed of a DFlash pool, also where the trail page is missing
    )
    prompt = 8 * page + lag
    truth = phrase_stream(prompt + 2600, vocab_size=64, phrase_len=12, num_phrases=4, seed=lag)
    loop.add_disagg_request(1, truth, prompt)
    rng = random.Random(lag)
    for _ in range(600):
        loop.step(accept_cap=lambda rid: 0 if rng.random() < 0.5 else 3)
    assert loop.meta.slots.slot_offset(1) == lag  # the slot trails its request by the lag, all along
    assert len(loop.requests[1].tokens) > prompt + 600
    chk = loop.checker
    if trail or lag == 2:
        assert chk.foreign_page_accesses == 0 and chk.stale_reads == 0, chk.messages[:3]
    else:
        assert chk.unbacked_accesses > 0 and chk.foreign_page_reads > 0
        assert chk.foreign_page_writes == 0  # stores and block appends stay high; only the window's far edge
        assert any("its row has -1 there" in m for m in chk.messages)


@pytest.mark.cuda
@pytest.mark.parametrize("seeding", ["base", "slot_local"])
def test_disagg_ownership_scenario_on_cuda_tensors(seeding):
    loop = disagg_scenario(joint=False, seeding=seeding, fused=True, device="cuda")
    assert loop.drafter.device.type == "cuda" and loop.meta.slots.ctx_len.device.type == "cuda"
    drive(loop, 20, evict_at=9)
    chk = loop.checker
    if seeding == "base":
        assert chk.violations == 0, chk.messages[:3]
        assert loop.accepted_total > 0
    else:
        assert chk.foreign_page_accesses > 0
    loop.meta.slots.check_host_mirror()


def _peak_shadow(prompt: int, windows) -> int:
    from sim_pkg.sim_support import truth

    loop = DraftLoop.build(windows=windows, tokens_per_block=16, pages=512, max_seq_len=16384)
    loop.add_context_request(1, truth(prompt + 200, 1), prompt, chunk=64)
    for _ in range(prompt // 64 + 20):
        loop.step(chunks={1: 64})
    loop.checker.assert_clean()
    assert loop.checker.reads > 0
    return loop.checker.peak_shadow_tokens


def test_the_checker_memory_follows_the_window_not_the_prompt():
    """By the checker's own counter: a windowed pool's shadow stays the same size for a 10x longer prompt."""
    short, long = _peak_shadow(400, (48,)), _peak_shadow(4000, (48,))
    assert long == short
    assert long < 400
    # a full-attention pool reads everything, so there the shadow does follow the prompt
    assert _peak_shadow(4000, (None,)) >= 4000
