"""A manager's block tables kept on its pools' device, updated by what each resize changed.

Per pool (layer group) one int32 ring ``pages [rows, C]``: the table row ``r`` of a
request holds block ordinal ``o`` (absolute positions ``[o*P, (o+1)*P)``) at column
``o % C``, for every ordinal of its live span ``first[r] <= o < extent[r]``:

* ``first[r]``: the lowest backed ordinal of the request's row (its length if none);
* ``extent[r]``: one past the highest backed ordinal (0 if none), the ``"python"``
  extent of the exported row;
* ``C``: at least the widest live span ``extent - first`` of any row. A windowed
  pool's span is its window plus the step in flight, whatever the prompt length,
  so ``C`` stays near ``ceil(W / P) + chunk / P`` pages; a full-attention pool's (or
  one with sink blocks) is its longest row. A row that outgrows ``C`` doubles it
  (the only step that rewrites every row).

Entries outside a row's live span hold no meaning; within it an unbacked ordinal
holds -1, never page 0. The kernels read the ring directly
(``prepare_paged_latent(..., table_rows=, table_first=)``), so a step moves
``O(window)`` entries per row however long the prompt.

Updates cost what changed: each request's `KVCache` logs the ordinals its resizes,
rollbacks and adoptions touched (`KVCache.changes`, a `ChangeLog`), and `sync` rewrites only
the ring columns those ordinals own, with one host-to-device copy per pool and
one scatter. The table knows nothing of drafters.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from ..runtime import BAD_PAGE_INDEX, KVCache
from ..staging import PinnedStager, scatter_int32_staged


@dataclass
class RingTables:
    """One pool's tables as the kernels read them (all on the pools' device).

    ``pages`` int32 ``[rows, C]``; ``first``, ``extent`` int64 ``[rows]`` (block
    ordinals); ``rows`` int64 ``[B]``: the table row of each batch row.
    """

    pages: torch.Tensor
    first: torch.Tensor
    extent: torch.Tensor
    rows: torch.Tensor
    #: the same ``first``, ``extent`` and ``rows`` as host arrays (the table's mirror, equal to the
    #: device tensors in stream order): what a launch that stages its per-row scalars reads
    host_first: np.ndarray | None = None
    host_extent: np.ndarray | None = None
    host_rows: np.ndarray | None = None


@dataclass
class TableDelta:
    """What one or more syncs changed: the requests whose rows were written whole, and per pool
    `(group, table rows, ordinals, pages)` int64 arrays of the logged entries, each ordinal's
    page as it is now (BAD_PAGE_INDEX: unbacked), in order (a later entry supersedes an earlier one
    for the same row and ordinal). Ordinals are absolute block ordinals; table rows, not batch rows."""

    whole: set[int]
    entries: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]
    #: syncs merged into this delta; from one sync, no (pool, row, ordinal) appears twice in `entries`
    syncs: int = 1


def last_of_each(key: np.ndarray) -> np.ndarray:
    """Indices of the last occurrence of each distinct value of `key` (int64), in ascending key order:
    where a log says one entry several times, its last word holds."""
    _, last = np.unique(key[::-1], return_index=True)
    return key.size - 1 - last


#: below this many entries a sync keeps the last of each in Python: a handful of numpy calls costs more
#: than the entries, above all inside a step whose other work has evicted numpy from the caches
SMALL_LOG = 32


def _last_entries(rows: list[int], ordinals: list[int], pages: list[int]) -> tuple[np.ndarray, ...]:
    """The entries as int64 arrays, only the last one of each (row, ordinal): in log order when no
    (row, ordinal) repeats (a page crossing's log), else by ascending (row, ordinal)."""
    r, o, page = (np.array(a, dtype=np.int64) for a in (rows, ordinals, pages))
    if len(set(zip(rows, ordinals))) == len(rows):
        # A set of Python pairs costs a few µs; np.unique's sort costs ten times that inside a step,
        # whose other work has pushed numpy's code out of the processor's caches.
        return r, o, page
    keep = last_of_each((r << 40) | o)  # ordinals < 2**40
    return r[keep], o[keep], page[keep]


def _last_entries_few(rows: list[int], ordinals: list[int], pages: list[int]) -> list[tuple[tuple[int, int], int]]:
    """`_last_entries` in Python for a few entries: `((row, ordinal), page)`, by ascending (row, ordinal)."""
    return sorted(dict(zip(zip(rows, ordinals), pages)).items())  # a dict keeps the last value of a key


@dataclass
class _Pool:
    """Host mirror (numpy) and device tensors of one pool's ring."""

    host: np.ndarray  # int32 [rows, C]
    first: np.ndarray  # int64 [rows]
    extent: np.ndarray  # int64 [rows]
    device: torch.Tensor | None = None  # int32 [rows, C]; None where readers read `host` (the CPU)
    scalars_dev: torch.Tensor | None = None  # int64 [2, rows]: first, extent (one copy updates both)
    first_dev: torch.Tensor | None = None  # its rows, as views made once (a bound launch keys on them)
    extent_dev: torch.Tensor | None = None
    pending: list[np.ndarray] = field(default_factory=list)  # flat indices r * C + c changed since the last push
    scalars_dirty: bool = True


class DeviceBlockTable:
    """Every live request's rows of one manager, one ring per pool (see the module docstring)."""

    def __init__(self, num_pools: int, device: torch.device | str, *, rows: int = 8, width: int = 8,
                 cpu_copy: bool = False) -> None:
        """`rows` x `width`: each ring's starting size (both grow as needed). On a GPU the rings live in
        device tensors that each `sync` pushes to; on the CPU the readers read the host mirror itself,
        unless `cpu_copy`: then the CPU keeps its own copy and takes the GPU's pushes (how tests check
        the push path on a machine without a GPU)."""
        if num_pools < 1 or rows < 1 or width < 1:
            raise ValueError(f"DeviceBlockTable: num_pools ({num_pools}), rows ({rows}) and width ({width}) must be >= 1")
        self.device = torch.device(device)
        self._pushed = self.device.type != "cpu" or cpu_copy  # readers read tensors that `_push` updates
        self._stager = PinnedStager(self.device)  # the pushes' copies
        self._pools = [self._new_pool(rows, width) for _ in range(num_pools)]
        self._row_of: dict[int, int] = {}
        self._cache_of: dict[int, KVCache] = {}
        self._rid_of: dict[KVCache, int] = {}  # attached cache -> its request (caches hash by identity)
        #: attached caches with undrained changes: each adds itself when it logs one (`KVCache.changes`, a `ChangeLog`)
        self._dirty: set[KVCache] = set()
        #: the batch of the last full membership check (`sync`): the same lists again need none
        self._checked: tuple[list[int], list[KVCache]] = ([], [])
        self._free_rows = list(range(rows - 1, -1, -1))
        self._rows_cache: tuple[tuple[int, ...], torch.Tensor, np.ndarray] | None = None
        #: times a ring was re-laid out (grown): each rewrote every row
        self.relayouts = 0
        #: bumped by every sync that changed an entry; `changes_since` answers for the last few
        self.epoch = 0
        self._deltas: deque[tuple[int, TableDelta]] = deque(maxlen=8)

    # -- shape -------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return int(self._pools[0].host.shape[0])

    def width(self, pool: int) -> int:
        return int(self._pools[pool].host.shape[1])

    def _new_pool(self, rows: int, width: int) -> _Pool:
        host = np.full((rows, width), BAD_PAGE_INDEX, dtype=np.int32)
        return _Pool(host, np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64))

    # -- membership ----------------------------------------------------------------------
    def row_of(self, request_id: int) -> int:
        return self._row_of[request_id]

    @property
    def num_attached(self) -> int:
        """Requests holding a table row."""
        return len(self._row_of)

    def prune(self, live: Mapping[int, KVCache]) -> None:
        """Forget every request whose cache is no longer the live one (dropped without `forget`)."""
        for rid in [rid for rid, cache in self._cache_of.items() if live.get(rid) is not cache]:
            self.forget(rid)

    def forget(self, request_id: int) -> None:
        """The request left the manager: its table row is free again (nothing to write: a
        row's entries mean something only inside its live span, which the next owner sets)."""
        r = self._row_of.pop(request_id, None)
        cache = self._cache_of.pop(request_id, None)
        if cache is not None:
            self._rid_of.pop(cache, None)
            cache.changes.stop()
        self._checked = ([], [])
        if r is not None:
            self._free_rows.append(r)
            for pool in self._pools:
                pool.first[r] = pool.extent[r] = 0
                pool.scalars_dirty = True
            self._rows_cache = None

    def _attach(self, request_id: int, cache: KVCache) -> int:
        r = self._row_of.get(request_id)
        if r is None:
            if not self._free_rows:
                self._grow_rows(2 * self.num_rows)
            r = self._free_rows.pop()
            self._row_of[request_id] = r
            self._rows_cache = None
        replaced = self._cache_of.get(request_id)
        if replaced is not None:
            self._rid_of.pop(replaced, None)
            replaced.changes.stop()
        self._cache_of[request_id] = cache
        self._rid_of[cache] = request_id
        cache.changes.start(self._dirty)  # a fresh log: the whole row is written below
        for g, pool in enumerate(self._pools):
            first = cache.first_backed(g)
            self._write_row(pool, g, r, cache, first)
        return r

    def _grow_rows(self, rows: int) -> None:
        old = self.num_rows
        for p, pool in enumerate(self._pools):
            grown = self._new_pool(rows, pool.host.shape[1])
            grown.host[:old], grown.first[:old], grown.extent[:old] = pool.host, pool.first, pool.extent
            self._pools[p] = grown
        self._free_rows.extend(range(rows - 1, old - 1, -1))

    # -- updates ---------------------------------------------------------------------------
    def sync(self, request_ids: Sequence[int], caches: Sequence[KVCache]) -> int:
        """Bring these requests' rows up to date with their caches; returns entries written.

        A request seen for the first time (or whose cache was replaced) gets a table row
        and its whole live span. Then every attached cache that logged a change since the
        last sync (these requests' or any other's: each adds itself to the table's dirty
        set) has the ring columns of its logged ordinals rewritten from its log, in one
        numpy pass over all of them (a Python pass when they are few, `SMALL_LOG`). Python
        per changed row: draining its log and finding its new first/extent; per request of
        the batch: one C-level comparison with the last batch checked (a loop only when the
        batch's membership changed). Each pool's changes then go to the device in one copy
        and one scatter.
        """
        ids, batch = list(request_ids), list(caches)
        written = 0
        whole: set[int] = set()
        if ids != self._checked[0] or batch != self._checked[1]:  # identity per element, in C
            for rid, cache in zip(ids, batch):
                if self._cache_of.get(rid) is not cache:
                    r = self._attach(rid, cache)
                    written += sum(max(0, int(p.extent[r] - p.first[r])) for p in self._pools)
                    whole.add(rid)  # the whole row is new
            self._checked = (ids, batch)
        entries = []
        if self._dirty:
            logged = self._take_logs()
            for g, (rows, ordinals, pages) in enumerate(logged):
                if not rows:
                    continue
                if len(rows) <= SMALL_LOG:
                    kept = _last_entries_few(rows, ordinals, pages)
                    written += self._write_entries_few(g, kept)
                    flat = np.array([(r, o, page) for (r, o), page in kept], dtype=np.int64).reshape(-1, 3)
                    r, o, page = flat[:, 0], flat[:, 1], flat[:, 2]
                else:
                    r, o, page = _last_entries(rows, ordinals, pages)
                    written += self._write_entries(g, r, o, page)
                entries.append((g, r, o, page))
        self._push()
        if whole or entries:
            self.epoch += 1
            self._deltas.append((self.epoch, TableDelta(whole, entries)))
        return written

    def changes_since(self, epoch: int) -> Optional["TableDelta"]:
        """What the syncs after `epoch` changed, merged in order (see `TableDelta`); None when those
        syncs are no longer remembered."""
        if epoch == self.epoch:
            return TableDelta(set(), [], 0)
        kept = [d for e, d in self._deltas if e > epoch]
        if not self._deltas or self._deltas[0][0] > epoch + 1 or len(kept) != self.epoch - epoch:
            return None
        return TableDelta(set().union(*(d.whole for d in kept)), [e for d in kept for e in d.entries], len(kept))

    def _take_logs(self) -> list[tuple[list[int], list[int], list[int]]]:
        """Every dirty cache's log, drained, its row's first/extent settled: per pool the (table row,
        ordinal, page) entries in log order (page BAD_PAGE_INDEX: unbacked).

        A log of one entry (a generation step's page crossing) is settled with the other such logs of
        its pool in one short loop (`_settle_crossings`); any other log, or a crossing that loop cannot
        place, settles its row alone (`_take_log`)."""
        logged: list[tuple[list[int], list[int], list[int]]] = [([], [], []) for _ in self._pools]
        # per pool, the one-entry logs: (table rows, ordinals, backed now?, caches)
        crossings: list[tuple[list[int], list[int], list[bool], list[KVCache]]] = [([], [], [], []) for _ in self._pools]
        others: list[tuple[int, KVCache, list]] = []
        row_of, rid_of = self._row_of, self._rid_of
        for cache in self._dirty:
            changes = cache.changes.drain()
            if not changes:
                continue
            r = row_of[rid_of[cache]]
            for g, ordinals, pages in changes:
                k = len(ordinals)
                rows, ords, values = logged[g]
                rows += [r] * k
                ords += ordinals
                values += [BAD_PAGE_INDEX] * k if pages is None else pages
            if len(changes) == 1 and len(changes[0][1]) == 1:
                g, ordinals, pages = changes[0]
                rows, ords, backed, owners = crossings[g]
                rows.append(r)
                ords.append(ordinals[0])
                backed.append(pages is not None and pages[0] != BAD_PAGE_INDEX)
                owners.append(cache)
            else:
                others.append((r, cache, changes))
        self._dirty.clear()
        for g, (rows, ords, backed, owners) in enumerate(crossings):
            if rows:
                for i in self._settle_crossings(g, rows, ords, backed):
                    self._settle_span(rows[i], owners[i], g, (ords[i],) if backed[i] else ())
        for r, cache, changes in others:
            self._take_log(r, cache, changes)
        return logged

    def _settle_crossings(self, g: int, rows: list[int], ordinals: list[int], backed: list[bool]) -> list[int]:
        """First/extent in pool g of rows whose log holds one entry each (distinct table rows; block
        ordinals), from the ring alone: a page taken at the row's end moves its extent up by one, a page
        given back at its start moves its first to the next ordinal when the ring holds that one backed.
        Returns the indices of the entries this cannot place (the caller settles those rows from their
        caches); their first/extent are left as they were.

        One short loop over plain ints: a few dozen numpy calls for the same work cost more inside a
        step, whose other work has pushed numpy's code out of the processor's caches."""
        pool = self._pools[g]
        first_of, extent_of, host = pool.first, pool.extent, pool.host
        C = host.shape[1]
        left: list[int] = []
        moved = False
        for i, (r, o, b) in enumerate(zip(rows, ordinals, backed)):
            first, extent = first_of.item(r), extent_of.item(r)
            if extent > first:  # an empty row's first is its length: the cache knows it, not the ring
                if b:
                    if o == extent and o + 1 - first <= C:  # a span past the ring's width: the caller re-lays out
                        extent_of[r] = o + 1
                        moved = True
                        continue
                # Inside the old span the ring is the row as it was, and only `o` changed: the next
                # ordinal's column says whether it is still backed.
                elif o == first and o + 1 < extent and host.item(r, (o + 1) % C) != BAD_PAGE_INDEX:
                    first_of[r] = o + 1
                    moved = True
                    continue
            left.append(i)
        if moved:
            pool.scalars_dirty = True
        return left

    def _take_log(self, r: int, cache: KVCache, changes: list) -> None:
        """Row r's first/extent brought up to date from its drained log and its cache (a row outgrowing
        its ring re-lays the ring out). (A page crossing's one-entry log is settled by `_settle_crossings`.)"""
        groups: dict[int, list[int]] = {}  # group -> the ordinals logged with a page (candidates for first)
        for g, ordinals, pages in changes:
            backed = groups.setdefault(g, [])
            if pages is not None:
                backed += ordinals
        for g, backed in groups.items():
            self._settle_span(r, cache, g, backed)

    def _settle_span(self, r: int, cache: KVCache, g: int, backed: Sequence[int]) -> None:
        """Row r's first/extent in pool g, its log holding `backed` (ordinals logged with a page)."""
        pool = self._pools[g]
        old_first, old_extent = pool.first.item(r), pool.extent.item(r)
        # The lowest backed ordinal is the old one's next backed ordinal (only logged ordinals
        # were released) or a logged ordinal that is backed now, whichever is lower.
        first, extent = cache.backed_span(g, old_first)
        for o in backed:
            if o < first and cache.block_entry(g, o) != BAD_PAGE_INDEX:
                first = o
        if extent - first > pool.host.shape[1]:
            pool.first[r] = first  # the re-layout starts this row from here
            self._relayout(g, extent - first)  # rewrites every row (what is logged stays valid)
        elif first != old_first or extent != old_extent:
            pool.first[r], pool.extent[r] = first, extent
            pool.scalars_dirty = True

    def _write_entries(self, g: int, r: np.ndarray, o: np.ndarray, page: np.ndarray) -> int:
        """Pool g's ring columns of these (table row, ordinal, page now) entries, first/extent already
        current: a column is written with its logged ordinal's page when that ordinal owns it (is the
        one ordinal of the live span at that column), unbacked when no live ordinal owns it, and left
        alone when another, unlogged, live ordinal does."""
        pool = self._pools[g]
        C = pool.host.shape[1]
        first, extent = pool.first[r], pool.extent[r]
        cols = o % C
        owner = first + (cols - first) % C
        mine = o == owner
        write = mine | (owner >= extent)
        flat = (r * C + cols)[write]
        pool.host.reshape(-1)[flat] = np.where(mine & (o < extent), page, BAD_PAGE_INDEX)[write]
        pool.pending.append(flat)
        return int(flat.size)

    def _write_entries_few(self, g: int, kept: list[tuple[tuple[int, int], int]]) -> int:
        """`_write_entries` in Python for a few `((table row, ordinal), page)` entries."""
        pool = self._pools[g]
        host, first_of, extent_of = pool.host, pool.first, pool.extent
        C = host.shape[1]
        flat = []
        for (r, o), page in kept:
            first, extent = first_of.item(r), extent_of.item(r)
            col = o % C
            owner = first + (col - first) % C
            if o == owner:
                host[r, col] = page if o < extent else BAD_PAGE_INDEX
            elif owner >= extent:
                host[r, col] = BAD_PAGE_INDEX
            else:
                continue  # another, live, ordinal owns the column
            flat.append(r * C + col)
        pool.pending.append(np.array(flat, dtype=np.int64))
        return len(flat)

    def _write_row(self, pool: _Pool, g: int, r: int, cache: KVCache, first: int) -> int:
        """The row's whole live span (a new row, or after a re-layout)."""
        extent = cache.backed_extent(g)
        C = pool.host.shape[1]
        if extent - first > C:
            self._relayout(g, extent - first)
            pool = self._pools[g]
            C = pool.host.shape[1]
        pool.first[r], pool.extent[r] = first, extent
        pool.scalars_dirty = True
        ordinals = np.arange(first, max(first, extent), dtype=np.int64)
        cols = ordinals % C
        pool.host[r, cols] = np.asarray(cache.block_row_slice(g, first, max(first, extent)), dtype=np.int32)
        pool.pending.append(r * C + cols)
        return int(cols.size)

    def _relayout(self, g: int, span: int) -> None:
        """Widen pool g's ring to hold twice `span` ordinals (at least doubling, so a span that
        fluctuates by a few pages does not re-lay out again): every row is rewritten."""
        old = self._pools[g]
        width = max(2 * span, 2 * old.host.shape[1])
        self._pools[g] = self._new_pool(old.host.shape[0], width)
        self.relayouts += 1
        for rid, r in self._row_of.items():
            cache = self._cache_of[rid]
            if cache.closed:
                continue
            # a row with nothing pending still starts where the table last saw it; one with pending
            # changes (synced later this round, or next) is found from its start
            first = cache.first_backed(g, 0 if cache.changes.pending else int(old.first[r]))
            self._write_row(self._pools[g], g, r, cache, first)

    def _push(self) -> None:
        """Each pool's pending entries (and first/extent, when they moved) to the device: one staged
        host buffer (`staging.scatter_int32_staged`: one launch that reads it in place, or one
        asynchronous copy from pinned memory, one scatter and one copy)."""
        if not self._pushed:
            for pool in self._pools:
                pool.pending.clear()
                pool.scalars_dirty = False
            return
        for pool in self._pools:
            if pool.device is None or pool.device.shape != pool.host.shape:
                pool.device = torch.from_numpy(pool.host).to(self.device, copy=True)  # a copy on the CPU too
                pool.scalars_dev = torch.from_numpy(np.stack([pool.first, pool.extent])).to(self.device)
                pool.first_dev, pool.extent_dev = pool.scalars_dev[0], pool.scalars_dev[1]
                pool.pending.clear()
                pool.scalars_dirty = False
                continue
            if not pool.pending and not pool.scalars_dirty:
                continue
            flat = np.unique(np.concatenate(pool.pending)) if pool.pending else np.empty(0, dtype=np.int64)
            pool.pending.clear()
            dense = None
            if pool.scalars_dirty:  # first and extent of every row, whole
                dense = (pool.scalars_dev.view(-1), np.concatenate([pool.first, pool.extent]))
                pool.scalars_dirty = False
            scatter_int32_staged(pool.device.view(-1), flat, pool.host.reshape(-1)[flat], self._stager, dense)

    # -- reads --------------------------------------------------------------------------------
    def rows_tensor(self, request_ids: Sequence[int]) -> torch.Tensor:
        """int64 ``[B]`` on the device: the table row of each id (synced ids only); cached per batch."""
        return self._rows(request_ids)[0]

    def _rows(self, request_ids: Sequence[int]) -> tuple[torch.Tensor, np.ndarray]:
        """The table row of each id, on the device and on the host; cached per batch."""
        key = tuple(request_ids)
        if self._rows_cache is not None and self._rows_cache[0] == key:
            return self._rows_cache[1], self._rows_cache[2]
        host = np.array([self._row_of[rid] for rid in key], dtype=np.int64)
        rows = torch.from_numpy(host.copy()).to(self.device)
        self._rows_cache = (key, rows, host)
        return rows, host

    def ring(self, pool: int, request_ids: Sequence[int]) -> RingTables:
        """Pool ``pool``'s ring and these requests' table rows (call `sync` for them first)."""
        p = self._pools[pool]
        rows, host_rows = self._rows(request_ids)
        mirror = dict(host_first=p.first, host_extent=p.extent, host_rows=host_rows)
        if not self._pushed:
            return RingTables(torch.from_numpy(p.host), torch.from_numpy(p.first), torch.from_numpy(p.extent), rows,
                              **mirror)
        return RingTables(p.device, p.first_dev, p.extent_dev, rows, **mirror)

    def host_row(self, pool: int, request_id: int) -> tuple[int, int, np.ndarray]:
        """``(first, extent, pages)`` of one request's live span in pool ``pool``, from the host mirror
        (``pages[i]`` is ordinal ``first + i``): what a test compares with the cache's row."""
        p = self._pools[pool]
        r = self._row_of[request_id]
        first, extent = int(p.first[r]), int(p.extent[r])
        cols = np.arange(first, max(first, extent)) % p.host.shape[1]
        return first, extent, p.host[r, cols].copy()

    def device_row(self, pool: int, request_id: int) -> np.ndarray:
        """The same live span read back from the device tensors (a test's check of the pushes)."""
        p = self._pools[pool]
        r = self._row_of[request_id]
        if not self._pushed:
            return self.host_row(pool, request_id)[2]
        first, extent = int(p.first_dev[r]), int(p.extent_dev[r])
        cols = torch.arange(first, max(first, extent), device=self.device) % p.device.shape[1]
        return p.device[r, cols].cpu().numpy()


__all__ = ["DeviceBlockTable", "RingTables", "TableDelta", "last_of_each"]
