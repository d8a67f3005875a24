"""Stale-range boundaries of a life cycle, pinned against a brute-force definition.

Brute force (in positions, not formulas): once `h` tokens are history
the next query sits at position `h` and attends `[h + 1 - W, h]`. Block ordinal
`i` covers positions `[i*P, (i+1)*P)`; it is *stale* iff it is not a sink block
(`i >= sinks`) and none of its positions is attended by this or any later query,
i.e. every position of the block is below `h + 1 - W`. Full attention: nothing
is ever stale.
"""
from __future__ import annotations

import itertools

import pytest

from tensorrt_llm_draftkv.runtime import LifeCycle


def brute_stale(history: int, window: int | None, sinks: int, p: int, upto: int) -> set[int]:
    """Stale ordinals among [0, upto) by looking at every position of every block."""
    if window is None:
        return set()
    first_attended = history + 1 - window
    stale = set()
    for i in range(upto):
        if i < sinks:
            continue
        if all(pos < first_attended for pos in range(i * p, (i + 1) * p)):
            stale.add(i)
    return stale


def as_set(rng: tuple[int, int]) -> set[int]:
    lo, hi = rng
    assert lo <= hi, rng
    return set(range(lo, hi))


# (window, sinks, P, history, expected (lo, hi)) — worked out by hand from the
# The stale-range formula of docs/design.md: [min(ceil(h/P), sinks), max(that, (h + 1 - W) // P)).
TABLE = [
    # history 0: never anything stale
    (1, 0, 4, 0, (0, 0)),
    (8, 0, 4, 0, (0, 0)),
    (None, 0, 4, 0, (0, 0)),
    (8, 2, 4, 0, (0, 0)),
    # W = 1: only the block holding position h is attended
    (1, 0, 4, 3, (0, 0)),  # h=3 in block 0
    (1, 0, 4, 4, (0, 1)),  # h=4 opens block 1: block 0 stale
    (1, 0, 4, 7, (0, 1)),
    (1, 0, 4, 8, (0, 2)),
    (1, 0, 1, 5, (0, 5)),  # P=1: every position below h is stale
    # window smaller than a page (W=3, P=8)
    (3, 0, 8, 9, (0, 0)),  # attends [7, 9]: block 0 still has position 7
    (3, 0, 8, 10, (0, 1)),  # attends [8, 10]: block 0 stale
    (3, 0, 8, 17, (0, 1)),
    (3, 0, 8, 18, (0, 2)),
    # window exactly one page (W=P=4): exact page boundaries
    (4, 0, 4, 6, (0, 0)),  # attends [3, 6]
    (4, 0, 4, 7, (0, 1)),  # attends [4, 7]
    (4, 0, 4, 8, (0, 1)),
    (4, 0, 4, 11, (0, 2)),
    # window larger than a page (W=10, P=4)
    (10, 0, 4, 12, (0, 0)),  # attends [3, 12]
    (10, 0, 4, 13, (0, 1)),  # attends [4, 13]
    (10, 0, 4, 16, (0, 1)),
    (10, 0, 4, 17, (0, 2)),
    (10, 0, 4, 100, (0, 22)),  # (101 - 10) // 4 = 22
    # sinks: the first `sinks` blocks are never stale
    (4, 1, 4, 7, (1, 1)),  # block 0 would be stale but is a sink
    (4, 1, 4, 11, (1, 2)),
    (4, 2, 4, 11, (2, 2)),
    (4, 2, 4, 15, (2, 3)),
    (10, 3, 4, 100, (3, 22)),
    # more sinks than history covers: lo clamps to ceil(h/P)
    (4, 5, 4, 3, (1, 1)),
    (4, 5, 4, 9, (3, 3)),
    (1, 5, 4, 8, (2, 2)),
    # full attention with sinks: empty
    (None, 2, 4, 100, (2, 2)),
    (None, 0, 4, 100, (0, 0)),
]


@pytest.mark.parametrize("window,sinks,p,history,expected", TABLE)
def test_stale_range_table(window, sinks, p, history, expected):
    lc = LifeCycle(window, sinks)
    got = lc.stale_range(history, p)
    assert got == expected
    assert as_set(got) == brute_stale(history, window, sinks, p, upto=history // p + 4)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("sinks", [0, 1, 3])
@pytest.mark.parametrize("window", [None, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17])
def test_stale_range_matches_brute_force_grid(window, sinks, p):
    lc = LifeCycle(window, sinks)
    previous: set[int] = set()
    for history in range(0, 6 * p + (window or 0) + 3):
        got = lc.stale_range(history, p)
        brute = brute_stale(history, window, sinks, p, upto=history // p + 3)
        assert as_set(got) == brute, (window, sinks, p, history, got)
        # nothing at or past the block holding position h is ever stale
        assert all(i * p + p - 1 < history for i in brute)
        # stale sets only grow with history
        assert previous <= brute
        previous = brute


def test_stale_range_lo_formula_with_and_without_sinks():
    """lo is exactly min(ceil(h/P), sinks) — also when the range is empty."""
    for window, sinks, p, h in itertools.product([None, 1, 5, 9], [0, 1, 2, 7], [1, 3, 4], range(0, 40)):
        lo, hi = LifeCycle(window, sinks).stale_range(h, p)
        assert lo == min(-(-h // p), sinks)
        assert hi >= lo


def test_widened_keeps_more_below_the_window():
    lc = LifeCycle(8, 1)
    wide = lc.widened(4)
    assert wide == LifeCycle(12, 1)
    assert lc.widened(0) is lc
    assert LifeCycle(None, 2).widened(32) == LifeCycle(None, 2)
    for h in range(100):
        assert as_set(wide.stale_range(h, 4)) <= as_set(lc.stale_range(h, 4))
        assert as_set(wide.stale_range(h, 4)) == brute_stale(h, 12, 1, 4, h // 4 + 2)


@pytest.mark.parametrize("window", [0, -1, -4096])
def test_window_below_one_rejected(window):
    with pytest.raises(ValueError, match=rf"window={window}\b"):
        LifeCycle(window)


def test_bad_arguments_name_their_numbers():
    with pytest.raises(ValueError, match="-2"):
        LifeCycle(8, -2)
    with pytest.raises(ValueError, match="-1"):
        LifeCycle(8).stale_range(-1, 4)
    with pytest.raises(ValueError, match=r"got 0\b"):
        LifeCycle(8).stale_range(10, 0)
    with pytest.raises(ValueError, match="-3"):
        LifeCycle(8).widened(-3)
