"""Capacity planning: pages and bytes per request and the concurrency a pool budget allows.

Every group is charged two ways (`admission.request_charge`, the estimator's one wrapper):

- **aligned**: every context chunk starts at a multiple of the chunk from position
  0, which is what a fixed-chunk prefill gives;
- **unaligned**: a chunk may start anywhere (a prefix computed elsewhere can end at
  an odd position); at most one page more, and the charge admission can always
  honour (`admission.request_charge(..., aligned=False)`).

Concurrency is computed from the charge `plan_pool` is asked for (the unaligned one
unless `chunk_alignment=True`), with the other beside it. With tensor parallelism
the KV heads are sharded over the ranks (`ceil(heads / tp)` per rank); a byte budget
is what one rank spends, and page counts are the same on every rank.

The report text lives in `plan_format` and what a shared prefix saves in
`reuse_savings`; both are re-exported here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from ..config import KVPoolConfig, LayerGroupConfig, SpeculativeDecodingMode
from . import rules
from .admission import request_charge
from .budget import (
    bytes_per_page,
    max_concurrency,
    pages_for_quota,
)

GIB = 1 << 30


@dataclass(frozen=True)
class PoolGeometry:
    """One pool's model side: layers per group, heads, head size, dtype, page size, tensor parallelism."""

    layer_groups: tuple[LayerGroupConfig, ...]
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    tokens_per_block: int
    kv_factor: int = 2
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not self.layer_groups:
            raise ValueError("a pool needs at least one layer group")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads one rank holds: the heads sharded over `tp_size` ranks, rounded up (replicated past tp = heads)."""
        return -(-self.num_kv_heads // self.tp_size)


@dataclass(frozen=True)
class GroupReport:
    """One layer group: its charge both ways, its page sizes and what the budget buys it."""

    window: int | None
    num_layers: int
    aligned_pages_per_request: int
    unaligned_pages_per_request: int
    pages_per_request: int  # the charge concurrency is computed from
    page_bytes: int  # one page, all heads (unsharded)
    page_bytes_per_rank: int  # one page on one rank
    trail_pages_per_request: int
    pool_pages: int

    @property
    def bytes_per_request(self) -> int:
        return self.pages_per_request * self.page_bytes

    @property
    def bytes_per_request_per_rank(self) -> int:
        return self.pages_per_request * self.page_bytes_per_rank

    @property
    def trail_bytes_per_request(self) -> int:
        return self.trail_pages_per_request * self.page_bytes

    @property
    def trail_bytes_per_request_per_rank(self) -> int:
        return self.trail_pages_per_request * self.page_bytes_per_rank

    @property
    def pool_bytes_per_rank(self) -> int:
        return self.pool_pages * self.page_bytes_per_rank

    @property
    def max_concurrency(self) -> int:
        return max_concurrency(self.pool_pages, self.pages_per_request)

    @property
    def max_concurrency_aligned(self) -> int:
        return max_concurrency(self.pool_pages, self.aligned_pages_per_request)

    @property
    def max_concurrency_unaligned(self) -> int:
        return max_concurrency(self.pool_pages, self.unaligned_pages_per_request)

    def to_dict(self) -> dict:
        return {
            "window": self.window,
            "num_layers": self.num_layers,
            "pages_per_request": {
                "aligned": self.aligned_pages_per_request,
                "unaligned": self.unaligned_pages_per_request,
                "charged": self.pages_per_request,
            },
            "trail_pages_per_request": self.trail_pages_per_request,
            "page_bytes": self.page_bytes,
            "page_bytes_per_rank": self.page_bytes_per_rank,
            "bytes_per_request": self.bytes_per_request,
            "bytes_per_request_per_rank": self.bytes_per_request_per_rank,
            "bytes_per_request_aligned": self.aligned_pages_per_request * self.page_bytes,
            "bytes_per_request_aligned_per_rank": self.aligned_pages_per_request * self.page_bytes_per_rank,
            "trail_bytes_per_request": self.trail_bytes_per_request,
            "trail_bytes_per_request_per_rank": self.trail_bytes_per_request_per_rank,
            "pool_pages": self.pool_pages,
            "pool_bytes_per_rank": self.pool_bytes_per_rank,
            "max_concurrency": self.max_concurrency,
            "max_concurrency_aligned": self.max_concurrency_aligned,
            "max_concurrency_unaligned": self.max_concurrency_unaligned,
        }


@dataclass(frozen=True)
class PoolReport:
    name: str
    trail_tokens: int
    groups: tuple[GroupReport, ...]
    tp_size: int = 1
    num_kv_heads: int = 0
    kv_heads_per_rank: int = 0
    chunk: int = 0
    chunk_alignment: bool = False

    def to_pool_config(
        self, geometry: PoolGeometry, *, max_seq_len: int, device: str = "cpu", enable_block_reuse: bool = False
    ) -> KVPoolConfig:
        """The pool geometry this plan buys, for `KVCacheManagerV2.from_pool_config` (one rank: the KV
        heads it holds, every group's planned pages). ValueError if the plan gives a group no page, or the
        geometry breaks the page/window rule (`config.check_pool_geometry`)."""
        if len(geometry.layer_groups) != len(self.groups):
            raise ValueError(f"{self.name}: the plan has {len(self.groups)} layer groups, the geometry "
                             f"{len(geometry.layer_groups)}")
        empty = [g for g, report in enumerate(self.groups) if report.pool_pages < 1]
        if empty:
            raise ValueError(f"{self.name}: the plan buys no page for layer groups {empty}; raise the budget")
        config = KVPoolConfig(
            layer_groups=geometry.layer_groups,
            pages_per_group=tuple(report.pool_pages for report in self.groups),
            tokens_per_block=geometry.tokens_per_block,
            num_kv_heads=geometry.kv_heads_per_rank,
            head_dim=geometry.head_dim,
            dtype=geometry.dtype,
            kv_factor=geometry.kv_factor,
            device=device,
            max_seq_len=max_seq_len,
            enable_block_reuse=enable_block_reuse,
        )
        return config.check_geometry()  # the package's one page/window rule

    @property
    def bytes_per_request(self) -> int:
        return sum(g.bytes_per_request for g in self.groups)

    @property
    def bytes_per_request_per_rank(self) -> int:
        return sum(g.bytes_per_request_per_rank for g in self.groups)

    @property
    def trail_bytes_per_request(self) -> int:
        return sum(g.trail_bytes_per_request for g in self.groups)

    @property
    def pool_bytes_per_rank(self) -> int:
        return sum(g.pool_bytes_per_rank for g in self.groups)

    @property
    def max_concurrency(self) -> int:
        return min(g.max_concurrency for g in self.groups)

    @property
    def max_concurrency_aligned(self) -> int:
        return min(g.max_concurrency_aligned for g in self.groups)

    @property
    def max_concurrency_unaligned(self) -> int:
        return min(g.max_concurrency_unaligned for g in self.groups)

    def shortfalls(self) -> list[tuple[int, GroupReport]]:
        """(index, group) of every group whose pool cannot hold one request at the charge."""
        return [(i, g) for i, g in enumerate(self.groups) if g.pool_pages < g.pages_per_request]

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "trail_tokens": self.trail_tokens,
            "tp": self.tp_size,
            "num_kv_heads": self.num_kv_heads,
            "kv_heads_per_rank": self.kv_heads_per_rank,
            "charge": "aligned" if self.chunk_alignment else "unaligned",
            "groups": [g.to_dict() for g in self.groups],
            "bytes_per_request": self.bytes_per_request,
            "bytes_per_request_per_rank": self.bytes_per_request_per_rank,
            "trail_bytes_per_request": self.trail_bytes_per_request,
            "pool_pages": [g.pool_pages for g in self.groups],
            "pool_bytes_per_rank": self.pool_bytes_per_rank,
            "max_concurrency": self.max_concurrency,
            "max_concurrency_aligned": self.max_concurrency_aligned,
            "max_concurrency_unaligned": self.max_concurrency_unaligned,
        }


def trail_tokens_for(mode: SpeculativeDecodingMode | str | None, geometry: PoolGeometry, is_draft_pool: bool) -> int:
    """The trail page: P tokens on a DFlash/DSpark draft pool with any windowed group (see `rules`)."""
    if not is_draft_pool or mode is None:
        return 0
    return rules.draft_slot_trail_tokens(
        rules.DraftPoolTraits(SpeculativeDecodingMode.parse(mode)),  # a mode or its name
        tokens_per_block=geometry.tokens_per_block,
        any_windowed_group=any(g.window is not None for g in geometry.layer_groups),
    )


def gib_to_bytes(gib: float | int | Fraction) -> int:
    """Whole bytes in `gib` GiB, exactly (no float overflow for large finite values)."""
    if isinstance(gib, float) and not math.isfinite(gib):
        raise ValueError(f"a GiB budget must be finite, got {gib}")
    value = Fraction(gib) * GIB
    if value < 0:
        raise ValueError(f"a GiB budget must be >= 0, got {gib}")
    return math.floor(value)


def max_tokens_to_pages(max_tokens: int, tokens_per_block: int) -> int:
    """Pages a pool of `max_tokens` token slots holds (rounded up to whole pages)."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    return -(-max_tokens // tokens_per_block)


def plan_pool(
    name: str,
    geometry: PoolGeometry,
    *,
    budget_bytes: int | None = None,
    max_tokens: int | None = None,
    max_seq_len: int,
    chunk: int,
    max_draft_len: int = 0,
    num_extra_kv_tokens: int = 0,
    trail_tokens: int = 0,
    chunk_alignment: bool = False,
) -> PoolReport:
    """Charge each group both ways and give it pool pages from one budget.

    The budget is either `budget_bytes` (what one rank spends on this pool; split over
    the groups in proportion to their per-rank bytes at the charge) or `max_tokens`
    (every group holds that many token slots, rounded up to pages). Concurrency uses
    the unaligned charge unless `chunk_alignment` (then the aligned one).
    """
    if (budget_bytes is None) == (max_tokens is None):
        raise ValueError("give exactly one of budget_bytes and max_tokens")
    p = geometry.tokens_per_block
    aligned_charge, unaligned_charge = (
        request_charge(
            geometry.layer_groups,
            p,
            chunk=chunk,
            max_seq_len=max_seq_len,
            max_draft_len=max_draft_len,
            num_extra_kv_tokens=num_extra_kv_tokens,
            trail_tokens=trail_tokens,
            aligned=alignment,
        )
        for alignment in (True, False)
    )
    per_group = []
    for g, aligned, unaligned in zip(geometry.layer_groups, aligned_charge, unaligned_charge):
        page_bytes, page_bytes_per_rank = (
            bytes_per_page(g, tokens_per_block=p, num_kv_heads=heads, head_dim=geometry.head_dim,
                           dtype=geometry.dtype, kv_factor=geometry.kv_factor)
            for heads in (geometry.num_kv_heads, geometry.kv_heads_per_rank)
        )
        charged = aligned if chunk_alignment else unaligned
        per_group.append((g, aligned, unaligned, charged, page_bytes, page_bytes_per_rank))
    total_per_request = sum(charged * pbr for _, _, _, charged, _, pbr in per_group)
    groups = []
    for g, aligned, unaligned, charged, page_bytes, page_bytes_per_rank in per_group:
        if max_tokens is not None:
            pool_pages = max_tokens_to_pages(max_tokens, p)
        else:
            share = budget_bytes * (charged * page_bytes_per_rank) // max(total_per_request, 1)
            pool_pages = pages_for_quota(share, page_bytes_per_rank)
        groups.append(
            GroupReport(
                window=g.window,
                num_layers=g.num_layers,
                aligned_pages_per_request=aligned,
                unaligned_pages_per_request=unaligned,
                pages_per_request=charged,
                page_bytes=page_bytes,
                page_bytes_per_rank=page_bytes_per_rank,
                trail_pages_per_request=1 if (trail_tokens and g.window is not None) else 0,
                pool_pages=pool_pages,
            )
        )
    return PoolReport(
        name=name,
        trail_tokens=trail_tokens,
        groups=tuple(groups),
        tp_size=geometry.tp_size,
        num_kv_heads=geometry.num_kv_heads,
        kv_heads_per_rank=geometry.kv_heads_per_rank,
        chunk=chunk,
        chunk_alignment=chunk_alignment,
    )
