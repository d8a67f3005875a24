"""What one resize does to one layer group's row: a pure function of the row and the new sizes.

Coordinates: capacity and history are token counts from absolute position 0;
the row maps block ordinals to pages (`BAD_PAGE_INDEX` where unbacked).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .life_cycle import LifeCycle
from .page_pool import BAD_PAGE_INDEX


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class GroupPlan(NamedTuple):
    """What one resize does to one group's row (ordinals are block ordinals)."""

    release: list[int]  # pages given back
    clear: list[int]  # ordinals that lose their page (stay inside the row)
    allocate: list[int]  # ordinals that get a fresh page
    new_len: int  # the row's length afterwards (ceil(capacity / P))
    settled: int  # ordinals below this never change again


class ResizePlan(NamedTuple):
    """One cache's planned resize (`KVCache.plan_resize`): the new sizes in tokens, and per layer
    group what changes in its row (None: no row changes, only the cursors move)."""

    capacity: int
    history: int
    plans: list[GroupPlan] | None


class CursorRange(NamedTuple):
    """The sizes (absolute tokens) a resize serves by moving only the cursors, for one row state
    (`KVCache.cursor_range`): capacity in `(capacity_above, capacity_max]` (the same block count in
    every row) and history at most `history_max` (no windowed block goes newly stale). `version` is
    the cache's version it was computed at."""

    capacity_above: int
    capacity_max: int
    history_max: int
    version: int


def plan_group_resize(
    row: Sequence[int], settled: int, life_cycle: LifeCycle, tokens_per_block: int, capacity: int, history: int
) -> GroupPlan:
    """The plan taking `row` (settled below ordinal `settled`) to `capacity` tokens with `history`
    of them history, walking only the ordinals that can change: O(blocks that change), not O(row).

    Every ordinal in `[settled, len)` outside the stale range is backed (each resize
    leaves it so) and stale ranges only grow, so only three spans can change: the
    newly stale ordinals `[start, hi)`, the growth `[len, num_blocks)` and the shrink
    `[num_blocks, len)`.
    """
    P = tokens_per_block
    num_blocks = -(-capacity // P)
    # `life_cycle.stale_range(history, P)`, inlined: this runs for every step that crosses a
    # page, and history is a valid (>= 0) history here. lo = min(ceil(history / P), sinks),
    # hi = max(lo, (history + 1 - W) // P); empty (hi = lo) for full attention.
    window = life_cycle.window
    lo = -(-history // P)
    if life_cycle.sink_blocks < lo:
        lo = life_cycle.sink_blocks
    hi = lo if window is None else (history + 1 - window) // P
    if hi < lo:
        hi = lo
    old_len = len(row)
    kept = old_len if old_len < num_blocks else num_blocks
    # Stale ranges only grow with history and capacity never drops below history,
    # so everything below the previous settled mark is final.
    start = settled if settled < kept else kept
    release: list[int] = []
    clear: list[int] = []
    allocate: list[int] = []
    # Ordinals in both rows from the settled mark up to hi: each is stale from lo on, else kept.
    # (Plain loops and comparisons, no generator chains or min/max: every page crossing runs this.)
    for ordinal in range(start, hi if hi < kept else kept):
        page = row[ordinal]
        if ordinal >= lo:
            if page != BAD_PAGE_INDEX:
                release.append(page)
                clear.append(ordinal)
        elif page == BAD_PAGE_INDEX:
            allocate.append(ordinal)
    if num_blocks < old_len:  # the shrink: every backed ordinal past the new end goes
        tail = row[num_blocks:]
        release += tail if BAD_PAGE_INDEX not in tail else [page for page in tail if page != BAD_PAGE_INDEX]
    elif hi <= old_len:  # the growth above the stale range (every generation step): all get a page
        allocate += range(old_len, num_blocks)
    else:  # the growth: every new ordinal outside the stale range gets a page
        allocate += [o for o in range(old_len, num_blocks) if not lo <= o < hi]
    if window is None:
        # Full attention never releases: every block wholly below history is final.
        new_settled = history // P
        if new_settled > num_blocks:
            new_settled = num_blocks
        if new_settled < start:
            new_settled = start
    else:
        new_settled = (hi if hi > start else start) if hi > lo else start
    # tuple.__new__: a NamedTuple's own constructor costs as much as the plan on a one-page step
    return tuple.__new__(GroupPlan, (release, clear, allocate, num_blocks, new_settled))


def one_page_crossing(
    row_len: int, settled: int, settled_backed: bool, life_cycle: LifeCycle, tokens_per_block: int,
    capacity: int, history: int,
) -> int:
    """Is the resize of a windowed row (`row_len` block ordinals, settled below `settled`, that ordinal
    backed or not) to `capacity` tokens with `history` of them history one of the two page crossings
    of a generation step, and which? 1: `plan_group_resize` would allocate the one new ordinal at the
    row's end and nothing else; -1: it would release the settled ordinal's page and nothing else, the
    settled mark moving past it; 0: anything else (take the plan). Valid sizes (history within
    capacity, not decreasing) are the caller's to check."""
    if life_cycle.window is None:
        return 0
    lo, hi = life_cycle.stale_range(history, tokens_per_block)
    blocks = -(-capacity // tokens_per_block)
    if blocks == row_len + 1:  # one ordinal more, and no ordinal newly stale
        return 1 if hi <= min(settled, row_len) else 0
    if blocks == row_len and lo <= settled < row_len and hi == settled + 1 and settled_backed:
        return -1  # exactly the settled ordinal goes stale, and it holds a page
    return 0


def cursor_range(
    row_lengths: Sequence[int], settled: Sequence[int], life_cycles: Sequence[LifeCycle], tokens_per_block: int
) -> tuple[int, int, int]:
    """`(capacity_above, capacity_max, history_max)`: the valid sizes in tokens that change no row of
    these rows (lengths in blocks, settled marks), only the cursors.

    Every row spans `n` blocks, so capacity lies in `((n - 1) * P, n * P]`. A window W with settled
    mark s and k sink blocks stales a new block once `(history + 1 - W) // P > max(s, k)` (its stale
    range never reaches past `ceil(history / P)`), so history stays at most `(max(s, k) + 1) * P + W - 2`.
    Rows of different lengths admit no size: `(0, -1, -1)`.
    """
    P = tokens_per_block
    if len(row_lengths) == 1:  # one layer group, a draft pool's usual shape: no set, no loop
        n, life_cycle = row_lengths[0], life_cycles[0]
        window = life_cycle.window
        mark = settled[0] if settled[0] > life_cycle.sink_blocks else life_cycle.sink_blocks
        return (n - 1) * P, n * P, (1 << 62) if window is None else (mark + 1) * P + window - 2
    lengths = set(row_lengths)
    if len(lengths) != 1:
        return 0, -1, -1
    n = lengths.pop()
    history_max = 1 << 62
    for mark, life_cycle in zip(settled, life_cycles):
        if life_cycle.window is not None:
            history_max = min(history_max, (max(mark, life_cycle.sink_blocks) + 1) * P + life_cycle.window - 2)
    return (n - 1) * P, n * P, history_max


__all__ = ["CursorRange", "GroupPlan", "ResizePlan", "ceil_div", "cursor_range", "one_page_crossing", "plan_group_resize"]
