"""One cache's page keys per layer group, and the check a cached prefix must pass to be adopted.

Coordinates: block ordinal `i` covers absolute token positions `[i*P, (i+1)*P)`;
pages are page indices of each group's pool, `BAD_PAGE_INDEX` where nothing
backs an ordinal. `KVCache` owns one `PrefixKeys` (public as `cache.keys`) and
calls `adoption_settled` before it takes over a published prefix.
"""
from __future__ import annotations

from collections.abc import Sequence

from .layer_group import LayerGroup
from .page_pool import BAD_PAGE_INDEX
from .prefix_cache import PageKey, chain_root, page_keys


class PrefixKeys:
    """The key chain of each layer group of one cache: its root, and the keys of ordinals
    `[0, len)` computed so far (computed once, extended as more is committed)."""

    def __init__(self, groups: Sequence[LayerGroup], tokens_per_block: int) -> None:
        self._groups = groups
        self._tokens_per_block = tokens_per_block
        self._known: list[list[PageKey]] = [[] for _ in groups]

    def root(self, group: int) -> int:
        """The chain root of one group: its pool's geometry salt, its index, window and sinks."""
        lc = self._groups[group].life_cycle
        return chain_root(self._groups[group].pool.prefix.salt, group, lc.window, lc.sink_blocks)

    def num_known(self, group: int) -> int:
        """How many ordinals of `group` (from 0) have their key computed and stored."""
        return len(self._known[group])

    def chain(self, group: int, token_ids: Sequence[int], num_pages: int) -> list[PageKey]:
        """Keys of full pages (block ordinals) `[0, num_pages)` of `token_ids` in one group's chain
        (computed afresh; nothing is stored)."""
        return page_keys(token_ids, self._tokens_per_block, self.root(group), end=num_pages)

    def extend(self, group: int, token_ids: Sequence[int], end: int) -> Sequence[PageKey]:
        """The stored keys of ordinals `[0, end)` at least, computing only the ones not yet known.
        The result is the stored list: read it, do not change it."""
        known = self._known[group]
        if len(known) < end:
            parent = known[-1][0] if known else None  # the link of the last keyed page
            known.extend(
                page_keys(token_ids, self._tokens_per_block, self.root(group), first=len(known), end=end, parent=parent)
            )
        return known

    def adopt(self, group: int, keys: Sequence[PageKey]) -> None:
        """Take these keys (ordinals `[0, len(keys))`) as the group's known chain."""
        self._known[group] = list(keys)

    def forget_from(self, ordinal: int) -> None:
        """Drop the keys of ordinals `>= ordinal` in every group (recomputed when needed)."""
        for known in self._known:
            del known[ordinal:]


def adoption_settled(
    name: str,
    groups: Sequence[LayerGroup],
    tokens_per_block: int,
    tokens: int,
    rows: Sequence[Sequence[int]],
    keys: Sequence[Sequence[PageKey]],
    stale_at: int,
) -> list[int]:
    """Check that `rows` may start a fresh cache at `tokens` of history; return each group's settled mark.

    `tokens` must be a whole number of pages `n * P` and `stale_at >= tokens`. `rows[g]`
    has `n` entries by block ordinal: the page published under `keys[g][ordinal]` for
    every ordinal group g still reads at history `stale_at`, `BAD_PAGE_INDEX` for the
    stale ones. ValueError naming cache `name` and the numbers on anything else.
    """
    P = tokens_per_block
    if stale_at < tokens:
        raise ValueError(f"cache {name!r}: stale_at ({stale_at}) must be >= the adopted tokens ({tokens})")
    if tokens < 0 or tokens % P or len(rows) != len(groups) or len(keys) != len(groups):
        raise ValueError(
            f"cache {name!r}: adopting {tokens} tokens needs a multiple of P={P} and one row and key "
            f"list per group ({len(groups)}), got {len(rows)} rows and {len(keys)} key lists"
        )
    n = tokens // P
    settled: list[int] = []
    for g, group in enumerate(groups):
        lo, hi = group.life_cycle.stale_range(stale_at, P)
        row = rows[g]
        if len(row) != n or len(keys[g]) < n:
            raise ValueError(f"cache {name!r}: group {g} row of {len(row)} pages and {len(keys[g])} keys for {n} pages")
        for ordinal, page in enumerate(row):
            stale = lo <= ordinal < hi
            if stale != (page == BAD_PAGE_INDEX) or (not stale and group.pool.lookup(keys[g][ordinal]) != page):
                raise ValueError(
                    f"cache {name!r}: group {g} ordinal {ordinal} holds page {page}, but it must be "
                    + ("unbacked (stale at this history)" if stale else "the page published under its key")
                )
        if group.life_cycle.window is None:
            settled.append(n)
        else:
            settled.append(min(hi, n) if hi > lo else 0)
    return settled


__all__ = ["PrefixKeys", "adoption_settled"]
