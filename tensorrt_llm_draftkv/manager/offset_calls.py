"""The block-offset calls: a batch's rows exported for kernels, and the device block table kept in sync.

`OffsetCalls` is a mixin of `KVCacheManagerV2`. Coordinates: block ordinals (column
`o` of a row is the block holding tokens `[o * P, (o + 1) * P)`, `P` tokens a block)
mapped to pages, or to block offsets `page * kv_factor + k`. The work is done by
`export.py`, `block_table.py` and `offset_destinations.py`; these calls pick the
caches and hand them over.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

import torch

from . import export
from .block_table import DeviceBlockTable

if TYPE_CHECKING:
    from ..config import KVPoolConfig
    from ..runtime import KVCache
    from .offset_destinations import OffsetDestinations
    from .request_caches import RequestCaches


class OffsetCalls:
    """Export and device-block-table calls over a manager's caches (mixed into `KVCacheManagerV2`)."""

    # What these calls read of the manager (`KVCacheManagerV2` provides each).
    config: KVPoolConfig
    num_pools: int
    caches: RequestCaches
    offset_layout: export.OffsetLayout
    offset_destinations: OffsetDestinations
    _block_table: DeviceBlockTable | None
    get_cache: Callable[[int], KVCache]

    def get_block_offsets(
        self, request_ids: Iterable[int], backend: str = "cpp", *, width: int | str | None = None
    ) -> torch.Tensor:
        """int32 `[num_pools, B, 2, width]` block offsets by block ordinal: `page * kv_factor + k`
        (K at k=0, V at k=1). Unbacked: -1 (`"python"`), page 0's or the guard page's offset
        (`"cpp"`). `width`: None (`max_blocks_per_seq`), `"live"` or an int (`export.get_block_offsets`)."""
        ids = list(request_ids)
        return export.get_block_offsets(self.offset_layout, ids, [self.get_cache(r) for r in ids], backend, width=width)

    def block_tables(
        self, request_ids: Iterable[int], backend: str = "cpp", *, width: int | str | None = "live"
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per pool, `(tables int32 [B, width], extents int64 [B])`: block ordinal -> page, what
        decoding `get_block_offsets` yields without the offsets (`export.block_tables`)."""
        ids = list(request_ids)
        return export.block_tables(self.offset_layout, ids, [self.get_cache(r) for r in ids], backend, width=width)

    def copy_batch_block_offsets(
        self,
        dst_tensor: torch.Tensor,
        request_ids: Iterable[int],
        beam_width: int,
        num_contexts: int,
        num_seqs: int,
        max_blocks: int | None = None,
    ) -> None:
        """Upstream's call: write the batch's block offsets into `dst_tensor`, in place.

        `dst_tensor` is the caller's int32 `[num_pools, >= num_seqs, 2, >= width]`
        tensor on this manager's device, `width` being `max_blocks` or else
        `config.max_blocks_per_seq`. Row i of every pool gets `request_ids[i]`'s
        entries, exactly `get_block_offsets(request_ids, "cpp")[:, i, :, :width]`
        (unbacked blocks as page 0's offset, or the guard page's when the pool has
        one); rows from `num_seqs` on and columns from `width` on are left as they
        are. As upstream, the first `num_contexts` ids are the context requests and
        the rest generation requests, `num_seqs == len(request_ids) * beam_width`,
        and only `beam_width` 1 is supported. Every check runs before the write: on
        any error `dst_tensor` is unchanged.
        """
        ids = list(request_ids)
        width, label = export.check_copy_args(
            self.offset_layout, dst_tensor, ids, beam_width, num_contexts, num_seqs, max_blocks
        )
        caches = self.caches.require(ids, "copy_batch_block_offsets")
        table = self._synced_table(ids, caches)
        self.offset_destinations.write(self.offset_layout, table, dst_tensor, ids, caches, num_seqs, width, label)

    # -- the device block table (manager/block_table.py) -------------------------------------
    @property
    def device_block_table(self) -> DeviceBlockTable:
        """Ours: every live request's rows on the pools' device, one ring per pool, kept up to date by
        `sync_block_table` with only the entries that changed (manager/block_table.py)."""
        if self._block_table is None:
            self._block_table = DeviceBlockTable(self.num_pools, self.config.device)
        return self._block_table

    def sync_block_table(self, request_ids: Iterable[int]) -> DeviceBlockTable:
        """Ours: bring these requests' rows of `device_block_table` up to date; returns the table.
        `MissingKVCacheError` naming every id without a cache (nothing changes then)."""
        ids = list(request_ids)
        return self._synced_table(ids, self.caches.require(ids, "sync_block_table"))

    def _synced_table(self, ids: list[int], caches: list[KVCache]) -> DeviceBlockTable:
        table = self.device_block_table
        if table.num_attached > len(self.caches):  # a cache dropped without free_resources
            table.prune(self.caches)
        table.sync(ids, caches)
        return table
