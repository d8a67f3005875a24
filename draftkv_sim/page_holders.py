"""The ownership checker's holders map: which requests hold each page of a draft manager's pools.

``holders_of[(key, page)] -> frozenset of request ids`` (live pages only), fed
by the events of every pool of the draft manager (see ownership.py for the
rules each event is checked against). ``key`` is the layer-group index of the
first group on that pool (groups may share one pool; `key(group)` maps a group
to it); pages are page indices of that pool. ``owned`` indexes the map by
(holder, key); ``published`` is the prefix table as the events built it. Every
mismatch an event shows is passed to `report` (the checker counts it).
"""
from __future__ import annotations

import weakref
from typing import Callable

from tensorrt_llm_draftkv.runtime.page_pool import PagePool

NOBODY: frozenset = frozenset()  # the holders map's answer for a page nobody holds


def holders_text(holders: frozenset) -> str:
    """One holder as its repr (the single-owner wording); several, sorted by repr, joined by ", "."""
    if len(holders) == 1:
        return repr(next(iter(holders)))
    return ", ".join(sorted(repr(h) for h in holders))


class PageHolders:
    """The holders map of one checker, subscribed to every pool of its draft manager (see `subscribe`)."""

    def __init__(self, report: Callable[[str], None]) -> None:
        """`report(text)`: an accounting error an event showed (called inside the pool's event)."""
        self.report = report
        # (key, page) -> its holders, live pages only (>= 1 holder); `owned` indexes it by (holder, key).
        # Frozensets: a snapshot of the map stays as it was.
        self.holders_of: dict[tuple[int, int], frozenset] = {}
        self.owned: dict[tuple[object, int], set[int]] = {}
        # (key, page) of every page in its pool's prefix table (held or cached-free), from the events.
        self.published: set[tuple[int, int]] = set()
        self.version = 0  # bumped by every pool event (keys the checker's row cache)
        self.group_key: list[int] = []  # group -> the key the map uses for that group's pool
        self.listeners: list[tuple[PagePool, PoolListener]] = []

    def subscribe(self, dm) -> None:
        """Listen to every pool of `dm` (once per pool) and learn the pages live caches hold now.

        Rows are the only record of holders before the checker listens; a reuse pool's
        prefix table (which pages are published) is read from the pool itself.
        """
        first: dict[int, int] = {}
        for g, group in enumerate(dm.layer_groups):
            pool = group.pool
            key = first.setdefault(id(pool), g)
            self.group_key.append(key)
            if key == g:
                listener = PoolListener(self, pool, key)
                pool.add_listener(listener)
                self.listeners.append((pool, listener))
                if pool.block_reuse:
                    self.published.update((key, page) for page in range(pool.total) if pool.is_published(page))
        for rid in dm.request_ids():
            cache = dm.get_cache(rid)
            for g in range(len(self.group_key)):
                self.learn(g, dm.layer_groups[g].pool, cache.held_pages(g), rid)

    def learn(self, group: int, pool: PagePool, pages: list[int], owner: object) -> None:
        """A live cache's row holds `pages` of `group`'s pool: add `owner` as a holder of each.

        A page the map already has is joined only where the pool's refcount says
        it has room for one more holder (a shared prefix page); otherwise it is
        the same "held twice" error as an allocation.
        """
        key = self.key(group)
        for page in pages:
            holders = self.holders_of.get((key, page), NOBODY)
            if holders and owner not in holders and pool.refcount(page) > len(holders):
                self._add_holder(key, page, owner, holders)
            else:
                self._claim(group, [page], owner, "held when the checker was built")

    def detach(self) -> None:
        """Stop following the pools and drop the holders map (idempotent).

        A detached checker with a draft manager finds no page owned: use it
        only for reporting afterwards.
        """
        for pool, listener in self.listeners:
            pool.remove_listener(listener)
        self.listeners.clear()
        self.holders_of.clear()
        self.owned.clear()
        self.published.clear()
        self.version += 1

    @property
    def attached(self) -> bool:
        """Whether the checker follows its draft manager's pools."""
        return bool(self.listeners)

    def holders(self, group: int, page: int) -> frozenset:
        """The requests the map has holding `page` of layer group `group`'s pool (empty: nobody)."""
        return self.holders_of.get((self.key(group), page), NOBODY)

    def is_published(self, group: int, page: int) -> bool:
        """Whether the events put `page` of layer group `group`'s pool in its prefix table (and kept it)."""
        return (self.key(group), page) in self.published

    def owned_pages(self, request_id: object, group: int) -> list[int]:
        """Pages of layer group `group`'s pool that `request_id` holds per the map (shared or not), ascending."""
        return sorted(self.owned.get((request_id, self.key(group)), ()))

    def key(self, group: int) -> int:
        return self.group_key[group] if 0 <= group < len(self.group_key) else group

    def describe(self, key: int, page: int) -> str:
        """How the map has a page: "free", or "held by" its holders (", published" when in the table)."""
        holders = self.holders_of.get((key, page), NOBODY)
        text = "free" if not holders else "held by " + holders_text(holders)
        return text + (", published" if (key, page) in self.published else "")

    def on_pool_event(self, key: int, event: str, pages: list[int], owner: object | None) -> None:
        """A pool of group `key` told its listeners `event` for `pages` and `owner` (see `PagePool`)."""
        self.version += 1
        if event == "allocate":
            self._claim(key, pages, owner, "allocated")
        elif event == "release":
            self._drop(key, pages, owner)
        elif event == "share":
            self._join(key, pages, owner)
        elif event == "unshare":
            self._leave(key, pages, owner)
        elif event == "publish":
            self._publish(key, pages, owner)
        elif event == "evict":
            self._evict(key, pages, owner)
        else:
            raise ValueError(f"unknown pool event {event!r}")

    def _add_holder(self, key: int, page: int, owner: object, holders: frozenset) -> None:
        self.holders_of[(key, page)] = holders | {owner}
        self.owned.setdefault((owner, key), set()).add(page)

    def _unindex(self, owner: object, key: int, page: int) -> None:
        """Forget that `owner` holds `page` in the (holder, group) index."""
        mine = self.owned[(owner, key)]
        mine.discard(page)
        if not mine:
            del self.owned[(owner, key)]

    def _claim(self, group: int, pages: list[int], owner: object, how: str) -> None:
        """"allocate": `owner` now holds each page alone; the map must have had it free (or cached-free)."""
        key = self.key(group)
        for page in pages:
            holders = self.holders_of.get((key, page), NOBODY)
            if holders:
                # Keep the holders the map has: the new holder's accesses are then the foreign ones.
                self.report(
                    f"group {key}: page {page} {how} for {owner!r} while the owner map has it held by "
                    f"{holders_text(holders)} (one page held twice)"
                )
                continue
            self._add_holder(key, page, owner, NOBODY)

    def _drop(self, key: int, pages: list[int], owner: object) -> None:
        """"release": `owner` was each page's last holder; the pool has the page free or cached-free now."""
        for page in pages:
            holders = self.holders_of.pop((key, page), NOBODY)
            if not holders:
                self.report(
                    f"group {key}: page {page} released by {owner!r} but the owner map has it free"
                )
                continue
            for holder in holders:  # the pool holds nobody on it now: neither does the map
                self._unindex(holder, key, page)
            if owner not in holders:
                self.report(
                    f"group {key}: page {page} released by {owner!r} but the owner map has it held by "
                    f"{holders_text(holders)}"
                )
            elif len(holders) > 1:
                self.report(
                    f"group {key}: page {page} released by {owner!r} as its last holder, but the owner map "
                    f"also has it held by {holders_text(holders - {owner})}"
                )

    def _join(self, key: int, pages: list[int], owner: object) -> None:
        """"share": `owner` joins published pages others hold (a page nobody holds is revived by "allocate")."""
        for page in pages:
            holders = self.holders_of.get((key, page), NOBODY)
            published = (key, page) in self.published
            if owner in holders:
                self.report(
                    f"group {key}: page {page} shared with {owner!r}, which the owner map already has "
                    f"among its holders ({holders_text(holders)})"
                )
                continue
            if not holders or not published:
                self.report(
                    f"group {key}: page {page} shared with {owner!r} but the owner map has it "
                    + ("held by " + holders_text(holders) if holders else "free")
                    + (", published" if published else ", not published")
                    + " (a share joins published pages others hold)"
                )
            self._add_holder(key, page, owner, holders)  # the pool has `owner` holding it: follow

    def _leave(self, key: int, pages: list[int], owner: object) -> None:
        """"unshare": `owner` leaves pages that other holders keep."""
        for page in pages:
            holders = self.holders_of.get((key, page), NOBODY)
            if owner not in holders:
                self.report(
                    f"group {key}: page {page} unshared by {owner!r} but the owner map has it {self.describe(key, page)}"
                )
                continue
            self._unindex(owner, key, page)
            rest = holders - {owner}
            if rest:
                self.holders_of[(key, page)] = rest
                continue
            del self.holders_of[(key, page)]
            self.report(
                f"group {key}: page {page} unshared by {owner!r}, its last holder in the owner map, but the pool "
                "says others still hold it"
            )

    def _publish(self, key: int, pages: list[int], owner: object | None) -> None:
        """"publish": pages enter the prefix table (by a holder, or put back by a rollback with owner None)."""
        for page in pages:
            if (key, page) in self.published:
                self.report(
                    f"group {key}: page {page} published by {owner!r} but the owner map has it published already"
                )
                continue
            self.published.add((key, page))
            holders = self.holders_of.get((key, page), NOBODY)
            if owner is not None and owner not in holders:
                self.report(
                    f"group {key}: page {page} published by {owner!r}, which the owner map does not have among "
                    f"its holders ({self.describe(key, page)})"
                )

    def _evict(self, key: int, pages: list[int], owner: object | None) -> None:
        """"evict": pages leave the prefix table (a cached-free page reused, or a publish rolled back)."""
        for page in pages:
            if (key, page) not in self.published:
                self.report(
                    f"group {key}: page {page} evicted (owner {owner!r}) but the owner map has it unpublished"
                )
                continue
            self.published.discard((key, page))


class PoolListener:
    """Forwards one pool's events to a holders map, holding it weakly (a dropped checker unsubscribes)."""

    def __init__(self, holders: PageHolders, pool: PagePool, key: int) -> None:
        self._holders = weakref.ref(holders)
        self._pool = weakref.ref(pool)
        self.key = key

    def __call__(self, event: str, pages: list[int], owner: object | None) -> None:
        holders = self._holders()
        if holders is None:
            pool = self._pool()
            if pool is not None:
                pool.remove_listener(self)
            return
        holders.on_pool_event(self.key, event, pages, owner)
