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
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..runtime import KVCache
from . import export
from .block_table import DeviceBlockTable


@dataclass
class _Written:
    epoch: int
    width: int
    ids: list[int]
    tensor: "weakref.ref[torch.Tensor]"
    version: int  # the storage's version counter right after our write


def _key(dst: torch.Tensor) -> int:
    return id(dst)


class OffsetDestinations:
    """What each destination tensor holds (see the module docstring)."""

    def __init__(self) -> None:
        self._written: dict[tuple, _Written] = {}
        #: entries written by the last call (K and V each counted): what the call cost
        self.last_entries = 0
        #: rows the last call wrote whole
        self.last_full_rows = 0

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
        before = self._written.get(key)
        if before is not None and (before.tensor() is not dst or before.version != dst._version):
            before = None  # another tensor at the same address, or written by someone else since
        changes = None if before is None or before.width != width else table.changes_since(before.epoch)
        full: list[int] = []
        delta: list[tuple[int, int, np.ndarray]] = []  # (row, group, ordinals)
        for b, rid in enumerate(ids):
            same = changes is not None and b < len(before.ids) and before.ids[b] == rid
            logged = changes.get(rid, []) if same else None
            if logged is None:
                full.append(b)
            else:
                delta.extend((b, g, ords[ords < width]) for g, ords in logged)
        entries = self._write_full(layout, dst, ids, caches, full, width, width_label)
        entries += export.write_block_offset_entries(layout, dst, caches, delta)
        self._written = {k: w for k, w in self._written.items() if w.tensor() is not None}
        self._written[key] = _Written(table.epoch, width, list(ids), weakref.ref(dst), dst._version)
        self.last_entries, self.last_full_rows = entries, len(full)

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


__all__ = ["OffsetDestinations"]
