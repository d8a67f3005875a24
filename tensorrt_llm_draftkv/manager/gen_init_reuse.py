"""Block reuse on a disaggregated generation worker: a new request adopts its prompt's cached prefix.

Coordinates: absolute token positions from 0; `m` is the prompt length; a hit
is a whole number of pages `h = n * P` (block ordinals `[0, n)`), always below
the prompt's last page boundary that leaves one position to receive
(`n <= (m - 1) // P`). Pages are indices of one pool.

A generation-init cache sits at history `m` (the whole prompt is history), so
the hit rule is taken at `m`, not at `h` as on a context worker: a
full-attention group needs every ordinal of `[0, n)` published, a windowed
group (window widened by the trail page where the pool keeps one) only the
ordinals its window still reads at `m`, its sinks and `[(m + 1 - W) // P, n)`.
At a fixed history that rule is downward closed, so the hit is the smallest
per-group maximum; a hit that would adopt no page at all (every ordinal below
it stale in every group) is no hit (0).

`PrefixReuse.find_gen_init_hit` and `PrefixReuse.adopt_for_gen_init` apply
these pure rules; docs/block_reuse.md ("The generation worker") tells the
whole story.
"""
from __future__ import annotations

from collections.abc import Sequence


def receive_start(window: int | None, prompt_len: int, reused_tokens: int = 0) -> int:
    """First absolute position of `[lo, m)` a generation worker must receive for one layer group.

    `window`: the group's attention window in tokens (widened by the trail page
    for a draft pool), None for full attention. The first query sits at `m` and
    reads `[m + 1 - W, m]`; positions below `reused_tokens` sit on adopted pages.
    """
    lo = 0 if window is None else max(0, prompt_len + 1 - window)
    return min(max(lo, reused_tokens), prompt_len)


def needed_max(pages: Sequence[int | None], stale: tuple[int, int], cap: int) -> int:
    """Largest `n <= cap` such that every ordinal of `[0, n)` outside `stale` is published."""
    lo, hi = stale
    for ordinal in (*range(0, min(lo, cap)), *range(max(hi, lo), cap)):
        if ordinal >= len(pages) or pages[ordinal] is None:
            return ordinal
    return cap


def adopts_a_page(stale: tuple[int, int], n: int) -> bool:
    """Does a hit of `n` pages keep at least one ordinal outside the stale range `[lo, hi)`?"""
    lo, hi = stale
    return min(n, lo) > 0 or n > max(hi, lo)


def gen_init_hit_pages(
    pages: Sequence[Sequence[int | None]], stales: Sequence[tuple[int, int]], cap: int
) -> int:
    """The hit in pages (at most `cap`) valid in every layer group: `pages[g]` by block ordinal
    (None where unpublished), `stales[g]` the group's stale range at history `m`. 0 when no hit
    would adopt a page at all."""
    n = cap
    for have, stale in zip(pages, stales):
        n = min(n, needed_max(have, stale, cap))
    if n == 0 or not any(adopts_a_page(stale, n) for stale in stales):
        return 0
    return n


__all__ = ["adopts_a_page", "gen_init_hit_pages", "needed_max", "receive_start"]
