"""Where a DFlash drafter slot starts, as small pure functions.

A *slot* is the drafter's per-request context state ``(ctx_len L, base_pages b)``
(docs/design.md, "DFlash slots"). The slot holds context at slot positions
``[b*P, L)``; a token stored at slot position ``s`` lands on ordinal ``s // P``
of the request's (unrebased) block-table row, reads go through the row rebased
past the base, ``row[b:]``, with context length ``L - b*P``.

Every function here returns a :class:`SlotStart`: the slot's ``ctx_len`` and
``base_pages`` plus ``offset``, the absolute token position of slot position 0
(``absolute = slot + offset``). The offset is host-side bookkeeping only: it
lets the metadata check that the hidden states an executor hands over are the
ones the slot continues with. In the base design slot positions are absolute
positions (``offset == 0``) except after a page-aligned generation seed, where
the slot trails its request by ``offset = p - b*P <= P - 1`` tokens.

Nothing here touches a tensor or a manager; the metadata calls these rules.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from ..config import ParsableEnum


class Seeding(ParsableEnum):
    """How a fresh slot is placed.

    ``BASE`` (the fix, default): absolute positions, an empty context is a base.
    ``SLOT_LOCAL`` (pre-fix behaviour, kept to reproduce the foreign-page bug):
    every fresh slot starts at slot-local position 0 with base 0.
    """

    BASE = "base"
    SLOT_LOCAL = "slot_local"

    @classmethod
    def _kind(cls) -> str:
        return "DFlash seeding"


class SlotStart(NamedTuple):
    ctx_len: int
    base_pages: int
    offset: int  # absolute position of slot position 0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check(position: int, tokens_per_block: int, max_ctx: int) -> None:
    if position < 0:
        raise ValueError(f"a slot cannot start at a negative position ({position})")
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    if max_ctx < 0:
        raise ValueError(f"max_ctx must be >= 0, got {max_ctx}")


def page_aligned_seed(*, windows: tuple, trail_tokens: int, tokens_per_block: int) -> bool:
    """Does a generation seed start on the page holding its position?

    Yes when every window of the bound pool is backed below by the trail page
    the V2 draft manager keeps (``trail_tokens >= P``), or when the pool has no
    window at all (nothing below the slot is ever released). A windowed pool
    without the trail page (a V1 manager) takes the position-aligned seed.
    """
    if not any(w is not None for w in windows):
        return True
    return trail_tokens >= tokens_per_block


def generation_seed(
    position: int,
    *,
    tokens_per_block: int,
    max_ctx: int,
    page_aligned: bool = True,
    private_arena: bool = False,
    seeding: "str | Seeding" = Seeding.BASE,
) -> SlotStart:
    """The empty slot a generation row gets when it has none.

    ``position`` is the row's absolute position ``p`` (its history: the first
    position the slot will store). The first step on a disaggregated generation
    worker and a request whose slot was evicted both land here.

    * page-aligned (pool keeps a trail page, or has no window): ``b = p // P``,
      ``L = b*P``; the slot trails the request by ``p - b*P <= P - 1`` tokens.
    * position-aligned (windowed pool without a trail page): ``L = p``,
      ``b = ceil(p / P)``; reads start at the next page boundary, the partial
      page below it is stored but never read.
    * private per-slot arena (no shared pool): ``L = 0``, ``b = 0``.
    * ``seeding="slot_local"`` (pre-fix): ``L = 0``, ``b = 0`` on any pool.

    ``p`` is clamped to ``max_ctx`` first.
    """
    seeding = Seeding.parse(seeding)
    _check(position, tokens_per_block, max_ctx)
    if private_arena or seeding is Seeding.SLOT_LOCAL:
        return SlotStart(0, 0, position)
    p = min(position, max_ctx)
    if page_aligned:
        base = p // tokens_per_block
        return SlotStart(base * tokens_per_block, base, position - base * tokens_per_block)
    return SlotStart(p, _ceil_div(p, tokens_per_block), position - p)


def context_store_start(
    start: int,
    *,
    tokens_per_block: int,
    max_ctx: int,
    paired_pool: bool = False,
    rebased_view: bool = True,
    private_arena: bool = False,
    seeding: "str | Seeding" = Seeding.BASE,
) -> SlotStart:
    """Where a context chunk ``[start, ...)`` is stored when its slot is fresh.

    (A chunk that continues its slot, ``start == L + offset``, simply goes on at
    ``L``; the metadata handles that before asking.)

    * ``start == 0``: ``(0, 0)``.
    * pool paired with the target's block reuse (``joint_kv_cache_reuse``; the
      prefix's drafter K/V is in the pool): the target position with base 0,
      ``(start, 0)`` — also for workers that read the unrebased table.
    * a tail after a prefix this worker did not compute, base design: the
      target position with the prefix pages as base, ``(start, ceil(start/P))``.
    * a worker that reads the unrebased table (``rebased_view=False``), the
      pre-fix ``slot_local`` seeding, or a private arena: slot-local numbering,
      ``(0, 0)``.

    ``start`` is clamped to ``max_ctx``.
    """
    seeding = Seeding.parse(seeding)
    _check(start, tokens_per_block, max_ctx)
    if start == 0:
        return SlotStart(0, 0, 0)
    if private_arena:
        return SlotStart(0, 0, start)
    s = min(start, max_ctx)
    if paired_pool:
        return SlotStart(s, 0, start - s)
    if not rebased_view or seeding is Seeding.SLOT_LOCAL:
        return SlotStart(0, 0, start)
    return SlotStart(s, _ceil_div(s, tokens_per_block), start - s)


def context_seed(lo: int, end: int, *, tokens_per_block: int) -> SlotStart:
    """The slot of a generation row whose drafter context ``[lo, end)`` was received (absolute tokens).

    A disaggregated generation worker that got the drafter context of its
    prompt (``end`` = the prompt length ``m``, ``lo`` = the first position
    received) seeds the slot at the prompt end with the received positions as
    its context: ``L = end`` and ``b = lo // P`` (the first received page), in
    absolute positions (``offset = 0``). Compare :func:`generation_seed`, whose
    context is empty. Positions of the first page below ``lo`` are never read:
    the drafter reads at most its window below ``L``, which starts above ``lo``.
    """
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    if lo < 0 or lo > end:
        raise ValueError(f"a seeded context [{lo}, {end}) must start at or after 0 and not above its end")
    return SlotStart(end, lo // tokens_per_block, 0)


@dataclasses.dataclass(frozen=True)
class StartRules:
    """The start rules above bound to one step's pool: ``generation(p)`` and ``context(start)``.

    ``store_limit`` is the ``max_ctx`` both rules clamp to (slot positions, tokens).
    """

    tokens_per_block: int
    store_limit: int
    paired_pool: bool
    page_aligned: bool
    private_arena: bool
    rebased_view: bool
    seeding: Seeding

    def generation(self, position: int) -> SlotStart:
        """:func:`generation_seed` of a row at absolute position ``position``."""
        return generation_seed(
            position,
            tokens_per_block=self.tokens_per_block,
            max_ctx=self.store_limit,
            page_aligned=self.page_aligned,
            private_arena=self.private_arena,
            seeding=self.seeding,
        )

    def context(self, start: int) -> SlotStart:
        """:func:`context_store_start` of a chunk at absolute position ``start``."""
        return context_store_start(
            start,
            tokens_per_block=self.tokens_per_block,
            max_ctx=self.store_limit,
            paired_pool=self.paired_pool,
            rebased_view=self.rebased_view,
            private_arena=self.private_arena,
            seeding=self.seeding,
        )

def read_window_start(read_len: int, block_size: int, window: int | None) -> int:
    """First context token (rebased index) the block decode attends.

    The block of ``block_size`` queries sits right after the context and is
    decoded non-causally, as one unit: with a window ``W`` the block and its
    context together span the last ``W`` positions up to the block's end, so the
    context read is ``[max(0, read_len + block_size - W), read_len)``.
    """
    if window is None:
        return 0
    return max(0, read_len + block_size - window)

