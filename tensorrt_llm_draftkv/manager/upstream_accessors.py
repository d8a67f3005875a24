"""Upstream's accessors as calls on a manager: buffers, free blocks, stats, cache indices, available tokens.

`UpstreamAccessors` is a mixin of `KVCacheManagerV2`; the pure parts are in
`accessors.py`. Coordinates: pages by block ordinal (`get_batch_cache_indices`,
`get_block_ids_per_seq`), a pool's pages (`get_buffers`, free blocks) and tokens
(`get_num_available_tokens`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

import torch

from . import accessors
from .buffers import check_layer, layer_buffer

if TYPE_CHECKING:
    from ..config import KVPoolConfig
    from ..runtime import LayerGroup, PagePool
    from .buffers import LayerSlot
    from .request_caches import RequestCaches
    from .upstream_init import UpstreamArgs


class UpstreamAccessors:
    """Upstream's read-only calls on a manager's pools and caches (mixed into `KVCacheManagerV2`)."""

    # What these calls read of the manager (`KVCacheManagerV2` provides each).
    error_label: str
    config: KVPoolConfig
    tokens_per_block: int
    num_extra_kv_tokens: int
    layer_slots: tuple[LayerSlot, ...]
    layer_groups: list[LayerGroup]
    caches: RequestCaches
    windows: tuple[int | None, ...]
    _upstream_args: UpstreamArgs | None
    pools: Callable[[], list[PagePool]]
    distinct_pools: Callable[[], list[PagePool]]
    free_pages: Callable[[], tuple[int, ...]]

    def get_buffers(self, layer_idx: int, kv_layout: str = "NHD") -> Optional[torch.Tensor]:
        """Layer `layer_idx`'s pool storage, zero-copy: `[pages, kv_factor, P, heads, head_dim]` (NHD) or
        `[pages, kv_factor, heads, P, head_dim]` (HND). Page indices are the block table's; writes
        through the view are what every reader of the pool sees."""
        slot = check_layer(layer_idx, self.layer_slots, self.error_label)
        return layer_buffer(self.layer_groups[slot.group].pool.layers[slot.index], kv_layout)

    @property
    def num_local_layers(self) -> int:
        return len(self.layer_slots)

    def get_num_free_blocks(self) -> int:
        """Free pages of the tightest pool (upstream returns one number for one pool). Unlike
        upstream's, callable at any time, not only while the manager is empty."""
        return min(self.free_pages())

    def get_kv_cache_stats(self) -> accessors.KvCacheStats:
        """Pages in use and free (per window too), hand-outs and reuse hits so far (see `KvCacheStats`)."""
        pools = self.pools()
        # every page's storage over all its layers (K and V): what the pools allocated
        allocated = sum(p.total * sum(layer[0].numel() * layer.element_size() for layer in p.layers)
                        for p in self.distinct_pools())
        return accessors.kv_cache_stats(
            pools, self.windows, tokens_per_block=self.tokens_per_block, max_seq_len=self.config.max_seq_len,
            allocated_bytes=allocated,
        )

    def get_batch_cache_indices(
        self,
        request_ids: List[int],
        layer_idx: Optional[int] = None,
        num_blocks_per_seq: Optional[Sequence[int]] = None,
        *,
        raw_indices: bool = False,
    ) -> List[List[int]]:
        """Per request, the pages of the pool holding `layer_idx` (pool 0 by default) by block ordinal,
        -1 where a window released the entry; `raw_indices=True` gives the block offsets of K instead
        (page * kv_factor, as `get_block_offsets`). KeyError-like `MissingKVCacheError` for an unknown id."""
        group = 0 if layer_idx is None else check_layer(layer_idx, self.layer_slots, self.error_label).group
        ids = list(request_ids)
        self.caches.require(ids, "get_batch_cache_indices")
        rows = [self.caches[rid].block_row(group) for rid in ids]
        return accessors.cache_indices(rows, num_blocks_per_seq, scale=self.config.kv_factor if raw_indices else 1)

    def get_block_ids_per_seq(self, request_ids: List[int]) -> torch.Tensor:
        """int32 `[B, widest row]` pages of pool 0, 0 for released entries and padding (upstream's layout)."""
        ids = list(request_ids)
        self.caches.require(ids, "get_block_ids_per_seq")
        return accessors.block_ids_per_seq([self.caches[rid].block_row(0) for rid in ids])

    def get_num_available_tokens(
        self, *, token_num_upper_bound: int, batch_size: int = 1, max_num_draft_tokens: int = 0
    ) -> int:
        """Tokens each of `batch_size` new requests could hold now, at most `token_num_upper_bound`,
        leaving room for the extra tokens and `max_num_draft_tokens` drafts."""
        args = self._upstream_args
        return accessors.available_tokens(
            self.free_pages(), self.windows, tokens_per_block=self.tokens_per_block,
            token_num_upper_bound=token_num_upper_bound, batch_size=batch_size,
            extra_tokens=self.num_extra_kv_tokens + max_num_draft_tokens,
            max_tokens=None if args is None else args.kv_cache_config.max_tokens,
        )
