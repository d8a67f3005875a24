"""Sizing rules for a request's draft mirror, as small pure functions.

Two rule sets: `history` (the fix, default) and `legacy` (pre-fix behaviour,
kept selectable to reproduce the failures side by side). Every position is an
absolute token position; capacities and histories are token counts from 0.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from ..config import SpeculativeDecodingMode


class MirrorSizing(enum.Enum):
    HISTORY = "history"
    LEGACY = "legacy"

    @classmethod
    def parse(cls, value: "str | MirrorSizing") -> "MirrorSizing":
        if isinstance(value, MirrorSizing):
            return value
        try:
            return cls(value.lower())
        except ValueError:
            raise ValueError(f"unknown mirror sizing {value!r}; use 'history' or 'legacy'") from None


@dataclass(frozen=True)
class MirrorPolicy:
    """What the draft manager knows about itself when it sizes a mirror."""

    mode: SpeculativeDecodingMode
    sizing: MirrorSizing = MirrorSizing.HISTORY
    joint_kv_cache_reuse: bool = False


def mirror_uses_draft_view(policy: MirrorPolicy) -> bool:
    """Does the draft mirror read the request's draft view (else the target view)?

    The fix: only an external drafter (PARD, DFlash, DSpark, draft-target one-model)
    reads the target view, because no separate engine advances its draft view.
    Legacy: the draft view for every drafter unless the pool joins the target's
    block reuse.
    """
    if policy.sizing is MirrorSizing.LEGACY:
        return not policy.joint_kv_cache_reuse
    return not policy.mode.is_external_drafter()


def context_capacity(start: int, chunk: int, is_last_chunk: bool, draft_tokens: int, extra_tokens: int) -> int:
    """Tokens the mirror must hold for the chunk `[start, start + chunk)`: extra always, drafts on the last."""
    return start + chunk + extra_tokens + (draft_tokens if is_last_chunk else 0)


def context_history(policy: MirrorPolicy, *, start: int, mirror_covers_start: bool) -> int | None:
    """History to pass with a context resize, or None for the old `resize(capacity)`.

    `mirror_covers_start`: the mirror already holds `[0, start)` (it computed the
    earlier chunks, or the pool holds them through joint block reuse).
    """
    if policy.sizing is MirrorSizing.LEGACY or mirror_uses_draft_view(policy):
        return None
    if mirror_covers_start or start == 0:
        return start
    # First seen past 0: DFlash/DSpark store the chunk at its target position over
    # a base hiding the prefix, so the prefix is history they never read.
    if policy.mode.keeps_trail_page():
        return start
    return None


def disagg_gen_init_sizing(
    policy: MirrorPolicy, *, prompt_len: int, generation_headroom: int, draft_tokens: int, extra_tokens: int
) -> tuple[int, int | None]:
    """(capacity, history) of a generation worker's new mirror.

    The fix: absolute coordinates, the transferred prompt is history (its drafter
    K/V does not exist here), so a window trims the mirror to its tail. Legacy:
    presented like a whole-prompt context chunk from position 0.
    """
    if policy.sizing is MirrorSizing.LEGACY:
        return context_capacity(0, prompt_len, True, draft_tokens, extra_tokens), None
    return prompt_len + generation_headroom, prompt_len


def dummy_history(policy: MirrorPolicy, history_hint: int | None) -> int | None:
    """The fix gives a warmup dummy's mirror the target's history hint; legacy drops it."""
    return None if policy.sizing is MirrorSizing.LEGACY else history_hint


def draft_slot_trail_tokens(
    policy: MirrorPolicy, *, tokens_per_block: int, any_windowed_group: bool, trail_page: bool = True
) -> int:
    """Tokens kept below every window of a DFlash/DSpark draft pool (one page), else 0.

    A drafter slot seeded at the first position of the page holding its request's
    position trails the request by up to P - 1 tokens; the extra page keeps the far
    edge of its window on pages the request holds.
    """
    if not trail_page or policy.sizing is MirrorSizing.LEGACY:
        return 0
    if not policy.mode.keeps_trail_page() or not any_windowed_group:
        return 0
    return tokens_per_block
