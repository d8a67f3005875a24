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
rollbacks and adoptions touched (`KVCache.track_changes`), and `sync` rewrites only
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


@dataclass
class _Pool:
    """Host mirror (numpy) and device tensors of one pool's ring."""

    host: np.ndarray  # int32 [rows, C]
    first: np.ndarray  # int64 [rows]
    extent: np.ndarray  # int64 [rows]
    device: torch.Tensor | None = None  # int32 [rows, C], None while the device is the CPU
    first_dev: torch.Tensor | None = None
    extent_dev: torch.Tensor | None = None
    pending: list[np.ndarray] = field(default_factory=list)  # flat indices r * C + c changed since the last push
    scalars_dirty: bool = True


class DeviceBlockTable:
    """Every live request's rows of one manager, one ring per pool (see the module docstring)."""

    def __init__(self, num_pools: int, device: torch.device | str, *, rows: int = 8, width: int = 8) -> None:
        if num_pools < 1 or rows < 1 or width < 1:
            raise ValueError(f"DeviceBlockTable: num_pools ({num_pools}), rows ({rows}) and width ({width}) must be >= 1")
        self.device = torch.device(device)
        self._pools = [self._new_pool(rows, width) for _ in range(num_pools)]
        self._row_of: dict[int, int] = {}
        self._cache_of: dict[int, KVCache] = {}
        self._free_rows = list(range(rows - 1, -1, -1))
        self._rows_cache: tuple[tuple[int, ...], torch.Tensor] | None = None
        #: times a ring was re-laid out (grown): each rewrote every row
        self.relayouts = 0
        #: bumped by every sync that changed an entry; `changes_since` answers for the last few
        self.epoch = 0
        self._deltas: deque[tuple[int, dict[int, Optional[list[tuple[int, np.ndarray]]]]]] = deque(maxlen=8)

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
        self._cache_of.pop(request_id, None)
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
        self._cache_of[request_id] = cache
        cache.track_changes()
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
        and its whole live span; any other writes only the ring columns of the ordinals
        its cache logged since the last sync. Then each pool's changes go to the device
        in one copy and one scatter.
        """
        written = 0
        delta: dict[int, Optional[list[tuple[int, np.ndarray]]]] = {}
        for rid, cache in zip(request_ids, caches):
            if self._cache_of.get(rid) is not cache:
                r = self._attach(rid, cache)
                written += sum(max(0, int(p.extent[r] - p.first[r])) for p in self._pools)
                delta[rid] = None  # the whole row is new
                continue
            changes = cache.drain_changes()
            if changes:
                written += self._apply_changes(self._row_of[rid], cache, changes)
                delta[rid] = _by_group(changes)
        self._push()
        if delta:
            self.epoch += 1
            self._deltas.append((self.epoch, delta))
        return written

    def changes_since(self, epoch: int) -> Optional[dict[int, Optional[list[tuple[int, np.ndarray]]]]]:
        """Request id -> `[(group, ordinals)]` changed by the syncs after `epoch` (None for a request whose
        whole row is new); None when those syncs are no longer remembered. Ordinals are absolute."""
        if epoch == self.epoch:
            return {}
        kept = [d for e, d in self._deltas if e > epoch]
        if not self._deltas or self._deltas[0][0] > epoch + 1 or len(kept) != self.epoch - epoch:
            return None
        merged: dict[int, Optional[list[tuple[int, np.ndarray]]]] = {}
        for d in kept:
            for rid, changes in d.items():
                if changes is None or merged.get(rid, []) is None:
                    merged[rid] = None
                else:
                    merged.setdefault(rid, []).extend(changes)
        return merged

    def _apply_changes(self, r: int, cache: KVCache, changes: list[tuple[int, int]]) -> int:
        by_group: dict[int, set[int]] = {}
        for g, o in changes:
            by_group.setdefault(g, set()).add(o)
        written = 0
        for g, ordinals in by_group.items():
            pool = self._pools[g]
            # The lowest backed ordinal is the old one's next backed ordinal (only logged ordinals
            # were released) or a logged ordinal that is backed now, whichever is lower.
            logged = sorted(ordinals)
            first = cache.first_backed(g, int(pool.first[r]))
            for o, page in zip(logged, cache.block_entries(g, logged)):
                if page != BAD_PAGE_INDEX:
                    first = min(first, o)
                    break
            extent = cache.backed_extent(g)
            C = pool.host.shape[1]
            if extent - first > C:
                pool.first[r] = first  # the re-layout starts this row from here
                self._relayout(g, extent - first)  # rewrites this row too
                written += extent - first
                continue
            if first != pool.first[r] or extent != pool.extent[r]:
                pool.first[r], pool.extent[r] = first, extent
                pool.scalars_dirty = True
            cols = np.array(sorted({o % C for o in logged}), dtype=np.int64)
            owners = first + (cols - first) % C  # the ordinal each touched column holds now
            values = np.asarray(cache.block_entries(g, owners.tolist()), dtype=np.int32)
            values[owners >= extent] = BAD_PAGE_INDEX
            pool.host[r, cols] = values
            pool.pending.append(r * C + cols)
            written += int(cols.size)
        return written

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
            first = cache.first_backed(g, 0 if cache.has_pending_changes else int(old.first[r]))
            self._write_row(self._pools[g], g, r, cache, first)

    def _push(self) -> None:
        """Each pool's pending entries to the device: one copy of the changed values, one scatter."""
        if self.device.type == "cpu":
            for pool in self._pools:
                pool.pending.clear()
                pool.scalars_dirty = False
            return
        for pool in self._pools:
            if pool.device is None or pool.device.shape != pool.host.shape:
                pool.device = torch.from_numpy(pool.host).to(self.device)
                pool.first_dev = torch.from_numpy(pool.first).to(self.device)
                pool.extent_dev = torch.from_numpy(pool.extent).to(self.device)
                pool.pending.clear()
                pool.scalars_dirty = False
                continue
            if pool.pending:
                flat = np.unique(np.concatenate(pool.pending))
                pool.pending.clear()
                staged = torch.from_numpy(np.stack([flat, pool.host.reshape(-1)[flat].astype(np.int64)]))
                staged = staged.to(self.device, non_blocking=False)
                pool.device.view(-1).index_copy_(0, staged[0], staged[1].to(torch.int32))
            if pool.scalars_dirty:
                pool.first_dev.copy_(torch.from_numpy(pool.first))
                pool.extent_dev.copy_(torch.from_numpy(pool.extent))
                pool.scalars_dirty = False

    # -- reads --------------------------------------------------------------------------------
    def rows_tensor(self, request_ids: Sequence[int]) -> torch.Tensor:
        """int64 ``[B]`` on the device: the table row of each id (synced ids only); cached per batch."""
        key = tuple(request_ids)
        if self._rows_cache is not None and self._rows_cache[0] == key:
            return self._rows_cache[1]
        rows = torch.tensor([self._row_of[rid] for rid in key], dtype=torch.int64).to(self.device)
        self._rows_cache = (key, rows)
        return rows

    def ring(self, pool: int, request_ids: Sequence[int]) -> RingTables:
        """Pool ``pool``'s ring and these requests' table rows (call `sync` for them first)."""
        p = self._pools[pool]
        rows = self.rows_tensor(request_ids)
        if self.device.type == "cpu":
            return RingTables(torch.from_numpy(p.host), torch.from_numpy(p.first), torch.from_numpy(p.extent), rows)
        return RingTables(p.device, p.first_dev, p.extent_dev, rows)

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
        if self.device.type == "cpu":
            return self.host_row(pool, request_id)[2]
        first, extent = int(p.first_dev[r]), int(p.extent_dev[r])
        cols = torch.arange(first, max(first, extent), device=self.device) % p.device.shape[1]
        return p.device[r, cols].cpu().numpy()


def _by_group(changes: list[tuple[int, int]]) -> list[tuple[int, np.ndarray]]:
    """`(group, ordinal)` pairs as one ordinal array per group (plain Python: the lists are short)."""
    groups: dict[int, list[int]] = {}
    for g, o in changes:
        groups.setdefault(g, []).append(o)
    return [(g, np.array(ords, dtype=np.int64)) for g, ords in groups.items()]


__all__ = ["DeviceBlockTable", "RingTables"]
