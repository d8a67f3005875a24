"""Upstream's read-only accessors, as pure functions over pools and block rows.

`KVCacheManagerV2.get_kv_cache_stats`, `get_batch_cache_indices`,
`get_block_ids_per_seq` and `get_num_available_tokens` call these with what
they read off the manager. Coordinates: block ordinals (a row's entry i backs
positions `[i*P, (i+1)*P)`), page indices of one pool, `BAD_PAGE_INDEX` (-1)
where a window released the entry.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..runtime import BAD_PAGE_INDEX, PagePool


@dataclass
class KvCacheStats:
    """Upstream's `KvCacheStats` fields, in blocks (pages) of this manager's pools.

    Pools of several windows: `max_num_blocks` / `free_num_blocks` / `used_num_blocks` are sums
    over the pools, `num_free_blocks_per_window_size` splits the free pages by window (the
    max_seq_len for full attention, as upstream keys it). The counters cover the manager's life.
    """

    max_num_blocks: int
    free_num_blocks: int
    used_num_blocks: int
    tokens_per_block: int
    alloc_total_blocks: int
    alloc_new_blocks: int
    reused_blocks: int
    missed_blocks: int
    cache_hit_rate: float
    num_free_blocks_per_window_size: dict[int, int] = field(default_factory=dict)
    allocated_bytes: int = 0


def kv_cache_stats(
    pools: Sequence[PagePool], windows: Sequence[int | None], *, tokens_per_block: int, max_seq_len: int,
    allocated_bytes: int,
) -> KvCacheStats:
    """The stats of these pools, one per layer group (see `KvCacheStats`)."""
    total = sum(p.total for p in pools)
    free = sum(p.num_free for p in pools)
    per_window: dict[int, int] = {}
    for pool, window in zip(pools, windows):
        key = max_seq_len if window is None else window
        per_window[key] = per_window.get(key, 0) + pool.num_free
    new = sum(p.pages_handed_out for p in pools)
    reused = sum(p.pages_reused for p in pools)
    handed = new + reused
    return KvCacheStats(
        max_num_blocks=total,
        free_num_blocks=free,
        used_num_blocks=total - free,
        tokens_per_block=tokens_per_block,
        alloc_total_blocks=handed,
        alloc_new_blocks=new,
        reused_blocks=reused,
        missed_blocks=new,
        cache_hit_rate=reused / handed if handed else 0.0,
        num_free_blocks_per_window_size=per_window,
        allocated_bytes=allocated_bytes,
    )


def cache_indices(
    rows: Sequence[Sequence[int]], num_blocks_per_seq: Sequence[int] | None, *, scale: int
) -> list[list[int]]:
    """Each row's page indices (times `scale`; -1 kept), cut to `num_blocks_per_seq[i]` entries when given."""
    if num_blocks_per_seq is not None and len(num_blocks_per_seq) != len(rows):
        raise ValueError(f"num_blocks_per_seq has {len(num_blocks_per_seq)} entries for {len(rows)} requests")
    out = []
    for i, row in enumerate(rows):
        n = len(row) if num_blocks_per_seq is None else num_blocks_per_seq[i]
        if n < 0 or n > len(row):
            raise ValueError(f"request #{i}: asks for {n} blocks, its row has {len(row)}")
        out.append([p if p == BAD_PAGE_INDEX else p * scale for p in row[:n]])
    return out


def block_ids_per_seq(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """int32 `[B, widest row]` page ids, 0 for a released entry and for padding (upstream's convention)."""
    width = max((len(r) for r in rows), default=0)
    out = torch.zeros((len(rows), width), dtype=torch.int32)
    for i, row in enumerate(rows):
        if row:
            ids = torch.tensor(row, dtype=torch.int32)
            out[i, : len(row)] = ids.clamp_(min=0)
    return out


def available_tokens(
    free_pages: Sequence[int],
    windows: Sequence[int | None],
    *,
    tokens_per_block: int,
    token_num_upper_bound: int,
    batch_size: int,
    extra_tokens: int,
    max_tokens: int | None,
) -> int:
    """Tokens each of `batch_size` new requests could hold now, past `extra_tokens`, capped by the bound.

    A full-attention pool splits its free pages evenly; a windowed pool only needs its window, so
    it bounds nothing once it can give every request one window (and bounds like a full pool
    otherwise).
    """
    if batch_size < 1 or token_num_upper_bound < 0 or extra_tokens < 0:
        raise ValueError(
            f"batch_size ({batch_size}) must be >= 1, token_num_upper_bound ({token_num_upper_bound}) and "
            f"the extra tokens ({extra_tokens}) >= 0"
        )
    tokens = token_num_upper_bound + extra_tokens
    for free, window in zip(free_pages, windows):
        share = free // batch_size * tokens_per_block
        if window is None or share < window + tokens_per_block:
            tokens = min(tokens, share)
    if max_tokens is not None:
        tokens = min(tokens, max_tokens)
    return max(0, tokens - extra_tokens)
