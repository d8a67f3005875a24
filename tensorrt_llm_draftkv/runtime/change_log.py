"""A cache's change log: what a mirror of its rows kept elsewhere needs to follow them.

`ChangeLog` is a component of `KVCache` (`cache.changes`). Until a consumer starts it,
it records nothing. Started, it keeps `(group, ordinals, pages)` chunks in the order the
row entries changed (block ordinals, and the page each was set to; `pages` None: all
unbacked), and adds its cache to the consumer's sink set whenever it records, so a
consumer of many caches (the manager's device block table) visits only the changed ones.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

#: One chunk of the log: `(group, ordinals, pages)`, pages None for all unbacked.
Change = tuple[int, Sequence[int], Optional[Sequence[int]]]


class ChangeLog:
    """The change log of one cache (see the module docstring)."""

    __slots__ = ("_owner", "_chunks", "_sink")

    def __init__(self, owner: Any) -> None:
        self._owner = owner  # what the sink is told about: the cache
        self._chunks: list[Change] | None = None  # None: not started
        self._sink: set | None = None

    @property
    def started(self) -> bool:
        return self._chunks is not None

    @property
    def pending(self) -> bool:
        """Recorded chunks not drained yet."""
        return bool(self._chunks)

    def start(self, sink: set | None = None) -> None:
        """Record every changed row entry from now on (what was recorded before is dropped); `sink`: a set
        the owner is added to whenever something is recorded, until the consumer drains it."""
        self._chunks = []
        self._sink = sink

    def stop(self) -> None:
        """Record nothing more (the consumer let go); what was recorded is dropped."""
        if self._sink is not None:
            self._sink.discard(self._owner)
        self._chunks = None
        self._sink = None

    def record(self, *chunks: Change) -> None:
        """Append these chunks, in order (nothing while not started)."""
        if self._chunks is None:
            return
        self._chunks.extend(chunks)
        if self._sink is not None:
            self._sink.add(self._owner)

    def drain(self) -> list[Change]:
        """The chunks recorded since the last call, in the order the entries changed: ordinal
        `ordinals[i]` was set to `pages[i]` (`pages` None: every one to BAD_PAGE_INDEX; an ordinal cut
        off the row's end counts as BAD_PAGE_INDEX). An ordinal may repeat: its last entry is its page
        now. Empty when nothing changed or nothing is recorded."""
        chunks = self._chunks
        if not chunks:
            return []
        self._chunks = []
        return chunks


__all__ = ["Change", "ChangeLog"]
