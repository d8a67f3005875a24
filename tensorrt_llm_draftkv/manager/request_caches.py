"""Every live request's `KVCache` in one manager, and the batch transaction over them.

A manager owns one `RequestCaches` (public as `manager.caches`): request id ->
cache over the manager's layer groups. It knows nothing of sizing rules or
drafters; the manager and its collaborators (prefix reuse, dummies, export)
create, find and drop caches through it. Coordinates are the caches' own:
absolute token counts, block ordinals, pages of each group's pool.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

from ..runtime import KVCache, LayerGroup, PagePool
from .diagnostics import MissingKVCacheError, pool_diagnostic


class RequestCaches:
    """Request id -> `KVCache`, a dict in behaviour, plus what every caller needs around it."""

    def __init__(self, layer_groups: Sequence[LayerGroup], tokens_per_block: int, label: str) -> None:
        self._groups = layer_groups  # the manager's own list: one truth for both
        self._tokens_per_block = tokens_per_block
        self._label = label
        self._by_id: dict[int, KVCache] = {}
        self._version = 0  # bumped by every registration or removal
        self._last_required: tuple[list[int], int, list[KVCache]] = ([], -1, [])

    # -- a mapping --------------------------------------------------------------------
    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def __getitem__(self, request_id: int) -> KVCache:
        return self._by_id[request_id]

    def __setitem__(self, request_id: int, cache: KVCache) -> None:
        self._by_id[request_id] = cache
        self._version += 1

    def __delitem__(self, request_id: int) -> None:
        del self._by_id[request_id]
        self._version += 1

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, request_id: int) -> KVCache | None:
        return self._by_id.get(request_id)

    def pop(self, request_id: int) -> KVCache:
        cache = self._by_id.pop(request_id)
        self._version += 1
        return cache

    def items(self):
        return self._by_id.items()

    def ids(self) -> list[int]:
        """Live request ids, ascending."""
        return sorted(self._by_id)

    # -- creating and naming -----------------------------------------------------------
    def new(self, request_id: int) -> KVCache:
        """A fresh, empty cache for `request_id` over the layer groups (not yet registered)."""
        return KVCache(self._groups, self._tokens_per_block, name=f"{self._label} request {request_id}", owner=request_id)

    def missing(self, request_ids: Iterable[int]) -> list[int]:
        return [rid for rid in request_ids if rid not in self._by_id]

    def lookup(self, request_ids: Sequence[int]) -> list[KVCache] | None:
        """The caches of `request_ids`, in order, or None when any has none (the caller names it).

        Shares `require`'s memo: the same ids as the last call, with no cache registered or dropped
        since, get the last answer back. Read it, do not change it."""
        last_ids, version, caches = self._last_required
        if version == self._version and request_ids == last_ids:
            return caches
        by_id = self._by_id
        if any(rid not in by_id for rid in request_ids):
            return None
        caches = [by_id[rid] for rid in request_ids]
        self._last_required = (list(request_ids), self._version, caches)
        return caches

    def require(self, request_ids: Iterable[int], what: str) -> list[KVCache]:
        """The caches of `request_ids`, in order; `MissingKVCacheError` naming every id without one.

        The same ids as the last call, with no cache registered or dropped since, get the last
        answer back (a step asks several times for its batch): read it, do not change it."""
        ids = list(request_ids)
        last_ids, version, caches = self._last_required
        if version == self._version and ids == last_ids:
            return caches
        missing = self.missing(ids)
        if missing:
            named = f"request {missing[0]}" if len(missing) == 1 else f"requests {missing}"
            raise MissingKVCacheError(
                f"{self._label}: {what} names {named}, that hold(s) no cache here "
                f"(live requests: {self.ids()[:16]}); nothing was changed",
                request_ids=missing,
            )
        caches = [self._by_id[rid] for rid in ids]
        self._last_required = (ids, self._version, caches)
        return caches

    def distinct_pools(self) -> list[PagePool]:
        """Each pool once (layer groups may share one), in group order."""
        return list({id(g.pool): g.pool for g in self._groups}.values())

    def diagnostic(self) -> str:
        """Every live cache's capacity, history and blocks, the windows and the free pages per group."""
        return pool_diagnostic(
            self._by_id,
            tuple(g.life_cycle.window for g in self._groups),
            tuple(g.pool.num_free for g in self._groups),
            tuple(g.pool.total for g in self._groups),
        )

    # -- all or nothing ------------------------------------------------------------------
    @contextlib.contextmanager
    def transaction(self, request_ids: Iterable[int]) -> Iterator[None]:
        """All or nothing over a batch: on any exception every cache named is put back.

        Caches that did not exist when the transaction began and exist at the
        failure are freed and dropped; existing ones roll their rows back, and every
        pool undoes its allocations and releases in reverse (free-list order included).
        """
        existing: list[KVCache] = []
        fresh: list[int] = []
        for rid in dict.fromkeys(request_ids):
            cache = self._by_id.get(rid)
            if cache is None:
                fresh.append(rid)
            else:
                cache.begin_journal()  # O(changes) undo, not a copy of every row
                existing.append(cache)
        pools = self.distinct_pools()
        for pool in pools:
            pool.begin_journal()
        try:
            yield
        except BaseException:
            for rid in reversed(fresh):
                cache = self._by_id.pop(rid, None)
                self._version += 1
                if cache is not None:
                    cache.free()  # logged too: the pools' rollback undoes it with the rest
            for cache in reversed(existing):
                cache.rollback_journal()
            # Every page back where it was, free-list order included: bit-identical state.
            for pool in pools:
                pool.rollback_journal()
            raise
        finally:
            for cache in existing:
                cache.end_journal()
            for pool in pools:
                pool.end_journal()


__all__ = ["RequestCaches"]
