"""The page pool's journal: what a batch transaction rolls back, and how.

`PagePool` logs every change it makes while a journal is open (`begin_journal`)
and either keeps them (`end_journal`) or undoes them, latest first
(`rollback_journal`). The undo logic lives here, apart from the pool's
allocate/share/publish/release paths, because it is the one part that must know
every kind of change and its exact inverse; `PagePool` inherits it as a mixin and
holds all the state itself (this module keeps none).

A journal entry is `(kind, page, owner, data)`. Kinds and their `data`:

- "pop": a free page handed out (allocate); "push": a page back on the free list;
- "evict": a cached-free page dropped from the prefix table, data `(key, stamp)`;
- "park": a published page whose last holder left became cached-free;
- "revive": a cached-free page held again by a hit, data its LRU stamp;
- "share" / "unshare": an owner joined / left a page others hold;
- "publish": a held page entered the prefix table.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .prefix_cache import PrefixCache

JournalEntry = tuple[str, int, object, object]
"""`(kind, page, owner, data)`: one change the pool made while its journal was open."""


class PoolJournal:
    """Journal and rollback for `PagePool` (a mixin: the pool owns every attribute used here)."""

    _free: list[int]
    _held: set[int]
    _extra: dict[int, int]
    prefix: PrefixCache | None
    # While a journal is open: (kind, page, owner, data) for every change, in order.
    _log: list[JournalEntry] | None

    if TYPE_CHECKING:  # provided by PagePool

        def _emit(self, event: str, pages: list[int], owner: object | None) -> None: ...

        def _drop_extra(self, page: int) -> None: ...

        def take(self, pages: list[int], *, owner: object | None = None) -> None: ...

        def release(self, pages: list[int], *, owner: object | None = None) -> None: ...

    def _record(self, kind: str, page: int, owner: object, data: object = None) -> None:
        if self._log is not None:
            self._log.append((kind, page, owner, data))

    # -- the journal (what a batch transaction rolls back) ----------------------------------
    def begin_journal(self) -> None:
        """Log every allocate and release from now on, so `rollback_journal` can undo them."""
        if self._log is not None:
            raise ValueError("this pool's journal is already open")
        self._log = []

    def end_journal(self) -> None:
        """Keep the changes; stop logging."""
        self._log = None

    def rollback_journal(self) -> None:
        """Undo every change since `begin_journal`, latest first.

        The free list only ever pops and pushes at its end, so undoing in reverse
        puts every page back in the very position it had: the pool, its free-list
        order, holders, prefix table and LRU order included, is as it was.
        Listeners hear the undo as the inverse events (an allocation undone is a
        "release", a share an "unshare", an eviction a "publish", ...), with the
        owners that were named.
        """
        log, self._log = self._log or [], None
        if self.prefix is None:
            self._rollback_plain(log)
            return
        runs: list[tuple[str, object, list[int]]] = []  # consecutive events of one kind and owner
        for kind, page, owner, data in reversed(log):
            event, who = self._undo(kind, page, owner, data)
            if runs and runs[-1][:2] == (event, who):
                runs[-1][2].append(page)
            else:
                runs.append((event, who, [page]))
        for event, who, pages in runs:
            self._emit(event, pages, who)

    def _rollback_plain(self, log: list[JournalEntry]) -> None:
        """Without block reuse only pops and pushes exist: undo them as runs of `release` and `take`."""
        runs: list[tuple[str, object, list[int]]] = []  # consecutive undo steps of one kind and owner
        for kind, page, owner, _ in reversed(log):
            if runs and runs[-1][:2] == (kind, owner):
                runs[-1][2].append(page)
            else:
                runs.append((kind, owner, [page]))
        for kind, owner, pages in runs:
            if kind == "pop":  # handed out: back onto the end, latest first
                self.release(pages, owner=owner)
            else:  # returned: it sits at the end again, claim it back
                self.take(pages, owner=owner)

    def _undo(self, kind: str, page: int, owner: object, data: object) -> tuple[str, object]:
        """Undo one journal entry in place; return the event listeners hear and its owner."""
        if kind == "pop":  # handed out: back onto the end of the free list
            self._held.discard(page)
            self._free.append(page)
            return "release", owner
        if kind == "push":  # returned: it sits at the end again
            self._pop_free(page)
            self._held.add(page)
            return "allocate", owner
        assert self.prefix is not None  # every other kind needs the prefix table
        if kind == "evict":
            key, stamp = data
            self._pop_free(page)
            self.prefix.publish(page, key)
            self.prefix.park(page, stamp)
            return "publish", None
        if kind == "park":
            self.prefix.unpark(page)
            self._held.add(page)
            return "allocate", owner
        if kind == "revive":
            self._held.discard(page)
            self.prefix.park(page, data)
            return "release", owner
        if kind == "share":
            self._drop_extra(page)
            return "unshare", owner
        if kind == "unshare":
            self._extra[page] = self._extra.get(page, 0) + 1
            return "share", owner
        if kind == "publish":
            self.prefix.unpublish(page)
            return "evict", owner
        raise AssertionError(f"unknown journal entry {kind!r}")

    def _pop_free(self, page: int) -> None:
        if self._free and self._free[-1] == page:
            self._free.pop()
        else:  # not reached by a reverse-order undo; kept correct anyway
            self._free.remove(page)
