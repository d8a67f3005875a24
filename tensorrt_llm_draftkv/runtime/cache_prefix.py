"""The block-reuse part of `KVCache`: its pages' prefix keys, publishing, and adopting a cached prefix.

A mixin of `KVCache` (`kv_cache.py`), which owns all the state; this part
only reads and writes it. Coordinates as there: token counts from absolute
position 0, block ordinal `i` covering `[i*P, (i+1)*P)`, pages of each group's
pool, `BAD_PAGE_INDEX` where nothing backs an ordinal. `commit` (which calls
`_publish`) stays in `kv_cache.py` because it is journaled with the resizes.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .page_pool import BAD_PAGE_INDEX
from .prefix_cache import PageKey, chain_root, page_keys

if TYPE_CHECKING:
    from .kv_cache import LayerGroup


class CachePrefixReuse:
    """Prefix keys, `_publish` and `adopt_prefix` over a `KVCache`'s rows (no state of its own)."""

    groups: list[LayerGroup]
    tokens_per_block: int
    name: str
    owner: object | None
    capacity: int
    history_length: int
    committed: int
    closed: bool
    _rows: list[list[int]]
    _settled: list[int]
    _held: list[int]
    _keys: list[list[PageKey]]

    def prefix_root(self, group: int) -> int:
        """The chain root of one group: its pool's geometry salt, its index, window and sinks."""
        lc = self.groups[group].life_cycle
        return chain_root(self.groups[group].pool.prefix.salt, group, lc.window, lc.sink_blocks)

    def prefix_keys(self, group: int, token_ids: Sequence[int], num_pages: int) -> list[PageKey]:
        """Keys of full pages (block ordinals) `[0, num_pages)` of `token_ids` in one group's chain."""
        return page_keys(token_ids, self.tokens_per_block, self.prefix_root(group), end=num_pages)

    def _publish(self, tokens: int, token_ids: Sequence[int], first_ordinals: Sequence[int] | None = None) -> None:
        P = self.tokens_per_block
        end = tokens // P
        for g, group in enumerate(self.groups):
            pool = group.pool
            if not pool.block_reuse:
                continue
            keys = self._keys[g]
            if len(keys) < end:
                parent = keys[-1][0] if keys else None  # the link of the last keyed page
                keys.extend(page_keys(token_ids, P, self.prefix_root(g), first=len(keys), end=end, parent=parent))
            row = self._rows[g]
            first = self.committed // P if first_ordinals is None else max(self.committed // P, first_ordinals[g])
            for ordinal in range(first, min(end, len(row))):
                page = row[ordinal]
                if page != BAD_PAGE_INDEX and not pool.is_published(page):
                    pool.publish(page, keys[ordinal], owner=self.owner)

    def adopt_prefix(
        self,
        tokens: int,
        rows: Sequence[Sequence[int]],
        keys: Sequence[Sequence[PageKey]],
        *,
        stale_at: int | None = None,
    ) -> None:
        """Start this fresh cache at `tokens` tokens of history held on published pages.

        `tokens` is a whole number of pages `n * P`. `rows[g]` has `n` entries, by
        block ordinal: the published page for each ordinal group g still reads at
        history `tokens` (every ordinal outside the life cycle's stale range, sinks
        included), `BAD_PAGE_INDEX` for the stale ones. `keys[g]` holds at least the
        `n` keys of the group's chain; each page must be the one published under its
        key. Every page gains this cache's owner as a holder (`PagePool.share`).
        Afterwards capacity = history = committed = `tokens`. ValueError, changing
        nothing, on a cache that is not fresh or rows that break any of this.

        `stale_at` (>= `tokens`; a generation worker's init: the prompt end `m`):
        the stale range is taken at that history instead, so a window's rows need
        only the ordinals it still reads there. The caller's next resize must raise
        history to `stale_at` (ordinals stale there stay unbacked and settled).
        """
        P = self.tokens_per_block
        n = tokens // P if tokens >= 0 else -1
        at = tokens if stale_at is None else stale_at
        if at < tokens:
            raise ValueError(f"cache {self.name!r}: stale_at ({at}) must be >= the adopted tokens ({tokens})")
        if self.closed or self.capacity or self.history_length or any(self._rows):
            raise ValueError(f"cache {self.name!r}: a prefix can only be adopted by a fresh cache")
        if tokens < 0 or tokens % P or len(rows) != len(self.groups) or len(keys) != len(self.groups):
            raise ValueError(
                f"cache {self.name!r}: adopting {tokens} tokens needs a multiple of P={P} and one row and key "
                f"list per group ({len(self.groups)}), got {len(rows)} rows and {len(keys)} key lists"
            )
        settled: list[int] = []
        for g, group in enumerate(self.groups):
            lo, hi = group.life_cycle.stale_range(at, P)
            row = rows[g]
            if len(row) != n or len(keys[g]) < n:
                raise ValueError(
                    f"cache {self.name!r}: group {g} row of {len(row)} pages and {len(keys[g])} keys for {n} pages"
                )
            for ordinal, page in enumerate(row):
                stale = lo <= ordinal < hi
                if stale != (page == BAD_PAGE_INDEX) or (not stale and group.pool.lookup(keys[g][ordinal]) != page):
                    raise ValueError(
                        f"cache {self.name!r}: group {g} ordinal {ordinal} holds page {page}, but it must be "
                        + ("unbacked (stale at this history)" if stale else "the page published under its key")
                    )
            if group.life_cycle.window is None:
                settled.append(n)
            else:
                settled.append(min(hi, n) if hi > lo else 0)
        for g, group in enumerate(self.groups):
            group.pool.share([p for p in rows[g] if p != BAD_PAGE_INDEX], owner=self.owner)
            self._rows[g] = list(rows[g])
            self._held[g] = sum(1 for p in rows[g] if p != BAD_PAGE_INDEX)
            self._keys[g] = list(keys[g][:n])
        self._settled = settled
        self.capacity = self.history_length = self.committed = tokens


__all__ = ["CachePrefixReuse"]
