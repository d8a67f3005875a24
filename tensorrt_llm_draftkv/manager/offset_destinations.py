"""`copy_batch_block_offsets` into a tensor it wrote before: only the entries that changed since.

An executor hands the same attention-metadata tensor to `copy_batch_block_offsets`
step after step, with mostly the same requests in the same rows. Upstream's layout
is absolute (`[num_pools, rows, 2, width]`, entry `[p, b, k, o]` = `page * kv_factor
+ k` of ordinal `o`), so a fresh write costs `rows x width` entries, `width` growing
with the prompt. `OffsetDestinations` remembers, per destination tensor, which
request each row holds and the device block table's epoch it was written at; the
next call writes whole only the rows whose request changed (or that were never
written), and for the others only the ordinals the table's syncs logged since.

A destination is recognised by object identity (the same tensor object, as an
executor's attention metadata keeps it) and by torch's version counter of its
storage: any in-place write by someone else in between (through the tensor or any
view of it) makes the next call write every row again, and so does a new tensor
that happens to reuse the old one's memory. `forget(dst)` (or `forget_all()`) does
the same by hand.
"""
from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..runtime import KVCache
from ..staging import PinnedStager
from . import block_table, export
from .block_table import DeviceBlockTable, TableDelta, last_of_each


@dataclass
class _Written:
    epoch: int
    width: int
    ids: list[int]
    tensor: "weakref.ref[torch.Tensor]"
    version: int  # the storage's version counter right after our write
    #: table row -> batch row (-1: none) of the rows the next call may update entry by entry; None when
    #: the next call must work it out again
    batch_row: np.ndarray | None
    #: the last few writes into this tensor that changed something, oldest first, and the numbers
    #: they are complete between: every changing write numbered in (floor, serial] is in `log`
    log: deque["Write"]
    floor: int
    serial: int


@dataclass(frozen=True)
class Write:
    """What one `copy_batch_block_offsets` call changed in a destination: batch rows written whole,
    and single entries `(rows[i], pools[i], ordinals[i])` given K offset `k_values[i]` (V the next
    slot; int64 arrays)."""

    serial: int
    full: tuple[int, ...]
    rows: np.ndarray
    pools: np.ndarray
    ordinals: np.ndarray
    k_values: np.ndarray


_EMPTY = np.empty(0, dtype=np.int64)
_NO_ENTRIES = (_EMPTY, _EMPTY, _EMPTY, _EMPTY)


def _key(dst: torch.Tensor) -> int:
    return id(dst)


class OffsetDestinations:
    """What each destination tensor holds (see the module docstring)."""

    def __init__(self) -> None:
        self._written: dict[tuple, _Written] = {}
        self._serial = 0  # numbers every write, across destinations
        #: entries written by the last call (K and V each counted): what the call cost
        self.last_entries = 0
        #: rows the last call wrote whole
        self.last_full_rows = 0
        self._stagers: dict[torch.device, PinnedStager] = {}  # the single entries' copies, per device

    def forget(self, dst: torch.Tensor) -> None:
        self._written.pop(_key(dst), None)

    def forget_all(self) -> None:
        self._written.clear()

    def write(
        self, layout: export.OffsetLayout, table: DeviceBlockTable, dst: torch.Tensor, ids: list[int],
        caches: Sequence[KVCache], num_seqs: int, width: int, width_label: str,
    ) -> None:
        """Rows `[0, num_seqs)`, columns `[0, width)` of `dst` as `export.write_block_offsets` writes them
        ("cpp" offsets), after `table.sync(ids, caches)`; arguments checked by `export.check_copy_args`."""
        key = _key(dst)
        before = self._trusted(dst)  # None: another tensor at the same address, or someone else wrote since
        delta = None if before is None or before.width != width else table.changes_since(before.epoch)
        if delta is None:
            full, batch_row = list(range(len(ids))), None
        elif ids == before.ids and before.batch_row is not None and delta.whole.isdisjoint(ids):
            full, batch_row = [], before.batch_row  # the same rows as last time: only the logged entries
        else:
            # a row keeps its entries only where the same request sat last time, alone, not rewritten whole
            seen: dict[int, int] = {}
            for rid in ids:
                seen[rid] = seen.get(rid, 0) + 1
            old = before.ids
            full = [b for b, rid in enumerate(ids)
                    if b >= len(old) or old[b] != rid or seen[rid] > 1 or rid in delta.whole]
            batch_row = np.full(table.num_rows, -1, dtype=np.int64)
            kept = np.setdiff1d(np.arange(len(ids)), full)
            if kept.size:
                batch_row[[table.row_of(ids[b]) for b in kept.tolist()]] = kept
        entries = self._write_full(layout, dst, ids, caches, full, width, width_label)
        single = _NO_ENTRIES
        if delta is not None and delta.entries:
            stager = self._stagers.get(dst.device)
            if stager is None:
                stager = self._stagers[dst.device] = PinnedStager(dst.device)
            single = self._write_logged(layout, dst, delta, batch_row, width, stager)
            entries += 2 * single[0].size
        self._written = {k: w for k, w in self._written.items() if w.tensor() is not None}
        unchanged = before is not None and ids == before.ids
        self._serial += 1
        # a tensor trusted anew is known only from this write on (someone else may have written anywhere)
        log, floor = (before.log, before.floor) if before is not None else (deque(maxlen=8), self._serial)
        if full or single[0].size:
            if len(log) == log.maxlen:
                floor = log[0].serial  # forgotten: a reader from before it must decode everything
            log.append(Write(self._serial, tuple(full), *single))
        self._written[key] = _Written(
            table.epoch, width, before.ids if unchanged else list(ids), weakref.ref(dst), dst._version,
            None if full else batch_row,  # a row written whole may sit in another table row now
            log, floor, self._serial,
        )
        self.last_entries, self.last_full_rows = entries, len(full)

    def serial(self, dst: torch.Tensor) -> int | None:
        """The number of the last write into `dst`, if this manager wrote it last and nobody since."""
        w = self._trusted(dst)
        return None if w is None else w.serial

    def written_since(
        self, dst: torch.Tensor, serial: int
    ) -> tuple[set[int], np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """What the writes into `dst` after write `serial` changed: `(rows written whole, rows, pools,
        ordinals, k_values)` of the single entries (batch rows, absolute block ordinals, the K offset
        written; in write order, repeats possible: the last one holds); None when that is not known
        (never written by this manager, written by someone else since, or those writes no longer
        remembered). Lets a reader of `dst` (the DFlash worker's decoded tables) follow it at the cost
        of what changed, without reading `dst` back."""
        w = self._trusted(dst)
        if w is None or not w.floor <= serial <= w.serial:
            return None
        later = [e for e in w.log if e.serial > serial]
        if not later:
            return set(), _EMPTY, _EMPTY, _EMPTY, _EMPTY
        full = set().union(*(e.full for e in later))
        if len(later) == 1:
            return full, later[0].rows, later[0].pools, later[0].ordinals, later[0].k_values
        fields = ("rows", "pools", "ordinals", "k_values")
        return (full, *(np.concatenate([getattr(e, a) for e in later]) for a in fields))

    def _trusted(self, dst: torch.Tensor) -> "_Written | None":
        w = self._written.get(_key(dst))
        if w is None or w.tensor() is not dst or w.version != dst._version:
            return None
        return w

    @staticmethod
    def _write_logged(layout: export.OffsetLayout, dst: torch.Tensor, delta: TableDelta, batch_row: np.ndarray,
                      width: int, stager: PinnedStager) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The delta's entries of the rows `batch_row` maps (table row -> batch row, -1: none), below `width`;
        returns the `(rows, pools, ordinals, k_values)` written."""
        if sum(e[1].size for e in delta.entries) <= block_table.SMALL_LOG:
            b, g, o, page = _kept_entries_few(delta, batch_row, width)
        else:
            g = np.concatenate([np.full(r.size, grp, dtype=np.int64) for grp, r, _, _ in delta.entries])
            r, o, page = (np.concatenate([e[i] for e in delta.entries]) for i in (1, 2, 3))
            b = np.where(r < batch_row.size, batch_row[np.minimum(r, batch_row.size - 1)], -1)
            keep = (b >= 0) & (o < width)
            g, b, o, page = g[keep], b[keep], o[keep], page[keep]
            if delta.syncs > 1:  # several syncs may log one entry: the last one holds its page now
                pick = last_of_each((g << 56) | (b << 36) | o)
                b, g, o, page = b[pick], g[pick], o[pick], page[pick]
        if not b.size:
            return _NO_ENTRIES
        k_values = export.k_offset_values(layout, g, page)
        export.write_block_offset_values(layout, dst, b, g, o, k_values, stager)
        return b, g, o, k_values

    @staticmethod
    def _write_full(
        layout: export.OffsetLayout, dst: torch.Tensor, ids: list[int], caches: Sequence[KVCache], rows: list[int],
        width: int, width_label: str,
    ) -> int:
        if not rows:
            return 0
        if rows == list(range(len(ids))):
            export.write_block_offsets(layout, dst, ids, list(caches), len(ids), width, width_label)
        else:
            sub_ids = [ids[b] for b in rows]
            values = export.block_offset_array(layout, sub_ids, [caches[b] for b in rows], "cpp", width, width_label)
            index = torch.tensor(rows, dtype=torch.int64, device=dst.device)
            dst[:, :, :, :width].index_copy_(1, index, torch.from_numpy(values).to(dst.device))
        return len(rows) * width * 2 * layout.num_pools


def _kept_entries_few(delta: TableDelta, batch_row: np.ndarray, width: int) -> tuple[np.ndarray, ...]:
    """`_write_logged`'s selection for a few entries, in Python (as `block_table._last_entries`): the
    `(batch rows, pools, ordinals, pages)` of the delta's entries in mapped rows below `width`, the last
    of each, by ascending (pool, batch row, ordinal)."""
    rows_known = batch_row.size
    last: dict[tuple[int, int, int], int] = {}
    for g, rows, ordinals, pages in delta.entries:
        for r, o, page in zip(rows.tolist(), ordinals.tolist(), pages.tolist()):
            if r < rows_known and o < width:
                b = batch_row.item(r)
                if b >= 0:
                    last[(g, b, o)] = page
    flat = np.array([(b, g, o, page) for (g, b, o), page in sorted(last.items())], dtype=np.int64).reshape(-1, 4)
    return flat[:, 0], flat[:, 1], flat[:, 2], flat[:, 3]


__all__ = ["OffsetDestinations"]
