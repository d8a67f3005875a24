"""The pure mirror-sizing rules (manager/rules.py), one rule at a time.

These pin the rule tables of docs/design.md "Mirror sizing" without a pool: which
view a mirror reads, what a context chunk asks for, which history goes with it,
what a disaggregated generation-init mirror asks for, the dummy hint, and the
trail page.
"""
from __future__ import annotations

import itertools

import pytest

from tensorrt_llm_draftkv import SpeculativeDecodingMode as Mode
from tensorrt_llm_draftkv.manager import rules
from tensorrt_llm_draftkv.manager.rules import DraftPoolTraits, MirrorSizing

ALL_MODES = list(Mode)
EXTERNAL = {Mode.PARD, Mode.DFLASH, Mode.DSPARK, Mode.DRAFT_TARGET_ONE_MODEL}
TRAILING = {Mode.DFLASH, Mode.DSPARK}


def test_the_mode_tables_are_the_documented_ones():
    # upstream's IntEnum: its 16 members in its order, so the integers an executor stores match
    assert [m.name for m in ALL_MODES] == [
        "MTP", "MTP_EAGLE", "MTP_EAGLE_ONE_MODEL", "EAGLE3", "EAGLE3_ONE_MODEL", "NGRAM", "SA", "DRAFT_TARGET",
        "DRAFT_TARGET_ONE_MODEL", "USER_PROVIDED", "SAVE_HIDDEN_STATES", "PARD", "DFLASH", "DSPARK", "NONE", "AUTO",
    ]
    assert [int(m) for m in ALL_MODES] == list(range(1, 17))
    assert {m for m in ALL_MODES if m.is_external_drafter()} == EXTERNAL
    assert {m for m in ALL_MODES if m.keeps_trail_page()} == TRAILING


# -- MirrorSizing --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [("history", MirrorSizing.HISTORY), ("HISTORY", MirrorSizing.HISTORY), ("Legacy", MirrorSizing.LEGACY)],
)
def test_sizing_parses_case_insensitively(text, expected):
    assert MirrorSizing.parse(text) is expected
    assert MirrorSizing.parse(expected) is expected


def test_unknown_sizing_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'history' or 'legacy'"):
        MirrorSizing.parse("window")


def test_history_is_the_default_rule_set():
    assert DraftPoolTraits(Mode.DFLASH).sizing is MirrorSizing.HISTORY
    assert DraftPoolTraits(Mode.DFLASH).joint_kv_cache_reuse is False


# -- which view ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("joint", [False, True])
def test_history_rules_send_only_external_drafters_to_the_target_view(mode, joint):
    policy = DraftPoolTraits(mode, MirrorSizing.HISTORY, joint)
    # A pool that joins the target's block reuse shares the target's progress: the target view for
    # every drafter (upstream's request_context(not joint, batch)); otherwise only external drafters.
    assert rules.mirror_uses_draft_view(policy) is (not joint and mode not in EXTERNAL)


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("joint", [False, True])
def test_only_external_drafters_pass_a_history_with_a_context_resize(mode, joint):
    # MTP, Eagle3 and two-engine drafters keep the old resize(capacity) whichever view they read
    policy = DraftPoolTraits(mode, MirrorSizing.HISTORY, joint)
    history = rules.context_history(policy, start=96, mirror_covers_start=True)
    assert history == (96 if mode in EXTERNAL else None)


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("joint", [False, True])
def test_legacy_rules_read_the_draft_view_unless_the_pool_joins_reuse(mode, joint):
    policy = DraftPoolTraits(mode, MirrorSizing.LEGACY, joint)
    assert rules.mirror_uses_draft_view(policy) is (not joint)


# -- capacity ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "start, chunk, last, draft, extra, expected",
    [
        (0, 8192, False, 7, 1, 8193),  # extra on every chunk, drafts only on the last
        (0, 8192, True, 7, 1, 8200),
        (8192, 8192, False, 7, 1, 16385),
        (122880, 8192, True, 7, 0, 131079),  # the 131k prompt's last chunk
        (100, 0, True, 3, 2, 105),
        (0, 0, False, 3, 2, 2),
    ],
)
def test_context_capacity_is_start_plus_chunk_plus_extra_plus_drafts_on_the_last_chunk(start, chunk, last, draft, extra, expected):
    assert rules.context_capacity(start, chunk, last, draft, extra) == expected


# -- history -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("start", [0, 1, 4096, 131072])
@pytest.mark.parametrize("covers", [False, True])
@pytest.mark.parametrize("joint", [False, True])
def test_context_history_table(mode, start, covers, joint):
    history_policy = DraftPoolTraits(mode, MirrorSizing.HISTORY, joint)
    got = rules.context_history(history_policy, start=start, mirror_covers_start=covers)
    if mode not in EXTERNAL:
        expected = None  # draft-view mirrors keep the old resize(capacity)
    elif covers or start == 0:
        expected = start  # continuation (or nothing below the chunk at all)
    elif mode in TRAILING:
        expected = start  # first seen past 0: the prefix is history DFlash/DSpark never read
    else:
        expected = None  # PARD / draft-target first seen past 0: old sizing
    assert got == expected
    legacy = DraftPoolTraits(mode, MirrorSizing.LEGACY, joint)
    assert rules.context_history(legacy, start=start, mirror_covers_start=covers) is None


# -- disaggregated generation init ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("prompt, draft, extra", [(65536, 3, 0), (131015, 7, 1), (1, 0, 0)])
def test_disagg_gen_init_is_absolute_with_the_prompt_as_history(mode, prompt, draft, extra):
    headroom = 1 + draft + extra
    policy = DraftPoolTraits(mode)
    got = rules.disagg_gen_init_sizing(
        policy, prompt_len=prompt, generation_headroom=headroom, draft_tokens=draft, extra_tokens=extra
    )
    assert got == (prompt + headroom, prompt)
    legacy = DraftPoolTraits(mode, MirrorSizing.LEGACY)
    got = rules.disagg_gen_init_sizing(
        legacy, prompt_len=prompt, generation_headroom=headroom, draft_tokens=draft, extra_tokens=extra
    )
    # Pre-fix: a whole-prompt context chunk from position 0, no history.
    assert got == (prompt + draft + extra, None)


# -- dummies and trail page ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("hint", [None, 0, 4095])
def test_dummy_history_passes_the_hint_only_under_history_rules(mode, hint):
    assert rules.dummy_history(DraftPoolTraits(mode), hint) == hint
    assert rules.dummy_history(DraftPoolTraits(mode, MirrorSizing.LEGACY), hint) is None


@pytest.mark.parametrize(
    "mode, sizing, windowed, trail_page, p",
    list(itertools.product(ALL_MODES, list(MirrorSizing), [False, True], [False, True], [1, 16, 32])),
)
def test_trail_tokens_are_one_page_only_on_windowed_dflash_dspark_history_pools(mode, sizing, windowed, trail_page, p):
    policy = DraftPoolTraits(mode, sizing)
    got = rules.draft_slot_trail_tokens(policy, tokens_per_block=p, any_windowed_group=windowed, trail_page=trail_page)
    on = mode in TRAILING and sizing is MirrorSizing.HISTORY and windowed and trail_page
    assert got == (p if on else 0)
