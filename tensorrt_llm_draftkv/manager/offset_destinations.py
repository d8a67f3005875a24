"""`copy_batch_block_offsets` into a tensor it wrote before: only the entries that changed since.

An executor hands the same attention-metadata tensor to `copy_batch_block_offsets`
step after step, with mostly the same requests in the same rows. Upstream's layout
is absolute (`[num_pools, rows, 2, width]`, entry `[p, b, k, o]` = `page * kv_factor
+ k` of ordinal `o`), so a fresh write costs `rows x width` entries, `width` growing
with the prompt. `OffsetDestinations` remembers, per destination tensor, which
request each row holds and the device block table's epoch it was written at; the
next call writes whole only the rows whose request changed (or that were never
written), and for the others only the ordinals the table's syncs logged since.

The memory of a destination assumes nobody else writes its rows `[0, num_seqs)`
and columns `[0, width)` between calls; `forget(dst)` (or `forget_all()`) makes the
next call write every row again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

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


def _key(dst: torch.Tensor) -> tuple:
    return (dst.data_ptr(), tuple(dst.shape), tuple(dst.stride()), str(dst.device))


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
        self._written[key] = _Written(table.epoch, width, list(ids))
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
