"""The page pool's journal: what a batch transaction rolls back, and how.

`PagePool` owns one `PoolJournal`. While it is open (`begin`), the pool records
every change it makes; a rollback (`undo`) reverts them latest first on the
pool's `PageSets` and prefix table and hands back the events listeners must
hear. The undo logic lives here, apart from the pool's allocate/share/publish/
release paths, because it is the one part that must know every kind of change
and its exact inverse.

A journal entry is `(kind, page, owner, data)`. Kinds and their `data`:

- "pop": a free page handed out (allocate); "push": a page back on the free list;
- "evict": a cached-free page dropped from the prefix table, data `(key, stamp)`;
- "park": a published page whose last holder left became cached-free;
- "revive": a cached-free page held again by a hit, data its LRU stamp;
- "share" / "unshare": an owner joined / left a page others hold;
- "publish": a held page entered the prefix table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from .prefix_cache import PrefixCache

JournalEntry = tuple[str, int, object, object]
"""`(kind, page, owner, data)`: one change the pool made while its journal was open."""

EventRun = tuple[str, object, list[int]]
"""`(event, owner, pages)`: consecutive listener events of one kind and owner."""


@dataclass
class PageSets:
    """Where every page of a pool is: the plain free list (popped from the end), the held pages,
    and the holders beyond the first of each shared page (refcount = 1 + `extra[page]`).
    Cached-free pages are in neither set: the prefix table keeps them."""

    free: list[int]
    held: set[int] = field(default_factory=set)
    extra: dict[int, int] = field(default_factory=dict)

    def pop_free(self, page: int) -> None:
        """Take `page` off the free list (the end, on every reverse-order undo)."""
        if self.free and self.free[-1] == page:
            self.free.pop()
        else:  # not reached by a reverse-order undo; kept correct anyway
            self.free.remove(page)

    def drop_extra(self, page: int) -> None:
        """One holder beyond the first leaves `page`."""
        left = self.extra[page] - 1
        if left:
            self.extra[page] = left
        else:
            del self.extra[page]


class PoolJournal:
    """The log of one pool's changes while a batch transaction is open, and their inverses."""

    def __init__(self) -> None:
        self._log: Optional[list[JournalEntry]] = None

    @property
    def is_open(self) -> bool:
        return self._log is not None

    def begin(self) -> None:
        """Log every change from now on."""
        if self._log is not None:
            raise ValueError("this pool's journal is already open")
        self._log = []

    def end(self) -> None:
        """Keep the changes; stop logging."""
        self._log = None

    def record(self, kind: str, page: int, owner: object, data: object = None) -> None:
        if self._log is not None:
            self._log.append((kind, page, owner, data))

    def record_many(self, kind: str, pages: Iterable[int], owner: object) -> None:
        """One data-less entry per page (the allocate and plain release paths)."""
        if self._log is not None:
            self._log.extend((kind, p, owner, None) for p in pages)

    def undo(self, sets: PageSets, prefix: Optional[PrefixCache]) -> list[EventRun]:
        """Revert every logged change on `sets` and `prefix`, latest first, and close the journal.

        The free list only ever pops and pushes at its end, so undoing in reverse
        puts every page back in the very position it had: free-list order,
        holders, prefix table and LRU order are as they were. Returns what
        listeners must hear, as the inverse events (an allocation undone is a
        "release", a share an "unshare", an eviction a "publish", ...) with the
        owners that were named, grouped into runs.
        """
        log, self._log = self._log or [], None
        runs: list[EventRun] = []
        for kind, page, owner, data in reversed(log):
            event, who = _undo_one(sets, prefix, kind, page, owner, data)
            if runs and runs[-1][:2] == (event, who):
                runs[-1][2].append(page)
            else:
                runs.append((event, who, [page]))
        return runs


def _undo_one(sets: PageSets, prefix: Optional[PrefixCache], kind: str, page: int, owner: object,
              data: object) -> tuple[str, object]:
    """Undo one journal entry in place; return the event listeners hear and its owner."""
    if kind == "pop":  # handed out: back onto the end of the free list
        sets.held.discard(page)
        sets.free.append(page)
        return "release", owner
    if kind == "push":  # returned: it sits at the end again
        sets.pop_free(page)
        sets.held.add(page)
        return "allocate", owner
    assert prefix is not None, f"a {kind!r} entry needs the prefix table"
    if kind == "evict":
        key, stamp = data
        sets.pop_free(page)
        prefix.publish(page, key)
        prefix.park(page, stamp)
        return "publish", None
    if kind == "park":
        prefix.unpark(page)
        sets.held.add(page)
        return "allocate", owner
    if kind == "revive":
        sets.held.discard(page)
        prefix.park(page, data)
        return "release", owner
    if kind == "share":
        sets.drop_extra(page)
        return "unshare", owner
    if kind == "unshare":
        sets.extra[page] = sets.extra.get(page, 0) + 1
        return "share", owner
    if kind == "publish":
        prefix.unpublish(page)
        return "evict", owner
    raise AssertionError(f"unknown journal entry {kind!r}")


__all__ = ["EventRun", "JournalEntry", "PageSets", "PoolJournal"]
