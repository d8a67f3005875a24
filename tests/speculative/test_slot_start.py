"""The pure DFlash slot rules of `slot_start`: store start, generation seed, trail page, read window.

No draft manager, no metadata, no executor: each test calls the rule functions directly.
"""
from __future__ import annotations

import pytest

from tensorrt_llm_draftkv.speculative import SlotStart, context_store_start, generation_seed, page_aligned_seed


# --------------------------------------------------------------------------- pure rules
@pytest.mark.parametrize(
    "start, paired, rebased, seeding, want",
    [
        (0, False, True, "base", SlotStart(0, 0, 0)),
        (0, True, True, "base", SlotStart(0, 0, 0)),
        (96, False, True, "base", SlotStart(96, 3, 0)),  # prefix pages as base
        (100, False, True, "base", SlotStart(100, 4, 0)),  # base rounded up past a partial page
        (96, True, True, "base", SlotStart(96, 0, 0)),  # paired pool: target position, base 0
        (96, True, False, "base", SlotStart(96, 0, 0)),  # ... even reading the unrebased table
        (96, False, False, "base", SlotStart(0, 0, 96)),  # opt-out: slot-local numbering
        (96, False, True, "slot_local", SlotStart(0, 0, 96)),  # pre-fix
    ],
)
def test_context_store_start_rules(start, paired, rebased, seeding, want):
    got = context_store_start(
        start, tokens_per_block=32, max_ctx=1 << 20, paired_pool=paired, rebased_view=rebased, seeding=seeding
    )
    assert got == want


@pytest.mark.parametrize(
    "p, aligned, arena, seeding, max_ctx, want",
    [
        (1000, True, False, "base", 1 << 20, SlotStart(992, 31, 8)),  # page-aligned, trails by 8
        (992, True, False, "base", 1 << 20, SlotStart(992, 31, 0)),
        (1000, False, False, "base", 1 << 20, SlotStart(1000, 32, 0)),  # position-aligned, base rounded up
        (1024, False, False, "base", 1 << 20, SlotStart(1024, 32, 0)),
        (1000, True, True, "base", 1 << 20, SlotStart(0, 0, 1000)),  # private arena
        (1000, True, False, "slot_local", 1 << 20, SlotStart(0, 0, 1000)),  # pre-fix
        (5000, True, False, "base", 4010, SlotStart(4000, 125, 1000)),  # clamped, page-aligned
        (5000, False, False, "base", 4010, SlotStart(4010, 126, 990)),  # clamped, position-aligned
    ],
)
def test_generation_seed_rules(p, aligned, arena, seeding, max_ctx, want):
    got = generation_seed(
        p, tokens_per_block=32, max_ctx=max_ctx, page_aligned=aligned, private_arena=arena, seeding=seeding
    )
    assert got == want
    assert got.ctx_len <= max_ctx


def test_page_aligned_seed_needs_the_trail_page_on_windowed_pools():
    assert page_aligned_seed(windows=(None,), trail_tokens=0, tokens_per_block=32)
    assert page_aligned_seed(windows=(256, None), trail_tokens=32, tokens_per_block=32)
    assert not page_aligned_seed(windows=(256,), trail_tokens=0, tokens_per_block=32)


def test_read_window_start():
    from tensorrt_llm_draftkv.speculative.slot_start import read_window_start

    assert read_window_start(100, 4, None) == 0
    assert read_window_start(100, 4, 64) == 40  # the block and its context span the last 64 positions
    assert read_window_start(10, 4, 64) == 0
