"""Capacity planning: pages and bytes per request and the concurrency a pool budget allows."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import LayerGroupConfig, SpeculativeDecodingMode
from . import rules
from .budget import (
    bytes_per_page,
    group_pages_per_request,
    max_concurrency,
    pages_for_quota,
)


@dataclass(frozen=True)
class PoolGeometry:
    """One pool's model side: layers per group, heads, head size, dtype, page size."""

    layer_groups: tuple[LayerGroupConfig, ...]
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    tokens_per_block: int
    kv_factor: int = 2


@dataclass(frozen=True)
class GroupReport:
    window: int | None
    num_layers: int
    pages_per_request: int
    bytes_per_request: int
    trail_bytes_per_request: int
    pool_pages: int
    max_concurrency: int


@dataclass(frozen=True)
class PoolReport:
    name: str
    trail_tokens: int
    groups: tuple[GroupReport, ...]

    @property
    def bytes_per_request(self) -> int:
        return sum(g.bytes_per_request for g in self.groups)

    @property
    def trail_bytes_per_request(self) -> int:
        return sum(g.trail_bytes_per_request for g in self.groups)

    @property
    def max_concurrency(self) -> int:
        return min(g.max_concurrency for g in self.groups)


def trail_tokens_for(mode: SpeculativeDecodingMode | str | None, geometry: PoolGeometry, is_draft_pool: bool) -> int:
    """The trail page: P tokens on a DFlash/DSpark draft pool with any windowed group (see `rules`)."""
    if not is_draft_pool or mode is None:
        return 0
    return rules.draft_slot_trail_tokens(
        rules.MirrorPolicy(SpeculativeDecodingMode.parse(mode)),  # a mode or its name
        tokens_per_block=geometry.tokens_per_block,
        any_windowed_group=any(g.window is not None for g in geometry.layer_groups),
    )


def plan_pool(
    name: str,
    geometry: PoolGeometry,
    *,
    budget_bytes: int,
    max_seq_len: int,
    chunk: int,
    max_draft_len: int = 0,
    num_extra_kv_tokens: int = 0,
    trail_tokens: int = 0,
    chunk_alignment: bool = False,
) -> PoolReport:
    """Split `budget_bytes` over the groups in proportion to their per-request bytes."""
    per_group = []
    for g in geometry.layer_groups:
        pages = group_pages_per_request(
            g.window,
            geometry.tokens_per_block,
            max_seq_len=max_seq_len,
            chunk=chunk,
            max_draft_len=max_draft_len,
            num_extra_kv_tokens=num_extra_kv_tokens,
            trail_tokens=trail_tokens,
            sink_blocks=g.sink_blocks,
            chunk_alignment=chunk_alignment,
        )
        page_bytes = bytes_per_page(
            g,
            tokens_per_block=geometry.tokens_per_block,
            num_kv_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim,
            dtype=geometry.dtype,
            kv_factor=geometry.kv_factor,
        )
        per_group.append((g, pages, page_bytes))
    total_per_request = sum(pages * pb for _, pages, pb in per_group)
    groups = []
    for g, pages, page_bytes in per_group:
        share = budget_bytes * (pages * page_bytes) // max(total_per_request, 1)
        pool_pages = pages_for_quota(share, page_bytes)
        trail_pages = 1 if (trail_tokens and g.window is not None) else 0
        groups.append(
            GroupReport(
                window=g.window,
                num_layers=g.num_layers,
                pages_per_request=pages,
                bytes_per_request=pages * page_bytes,
                trail_bytes_per_request=trail_pages * page_bytes,
                pool_pages=pool_pages,
                max_concurrency=max_concurrency(pool_pages, pages),
            )
        )
    return PoolReport(name=name, trail_tokens=trail_tokens, groups=tuple(groups))


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{n} B"


def format_report(report: PoolReport, tokens_per_block: int) -> str:
    lines = [f"{report.name} pool (trail tokens per window: {report.trail_tokens})"]
    lines.append(
        f"  {'group':>5} {'window':>8} {'layers':>6} {'pages/req':>10} {'bytes/req':>12} "
        f"{'trail/req':>10} {'trail %win':>10} {'pool pages':>11} {'max conc':>9}"
    )
    for i, g in enumerate(report.groups):
        window = "full" if g.window is None else str(g.window)
        pct = f"{100.0 * tokens_per_block / g.window:.2f} %" if (g.trail_bytes_per_request and g.window) else "-"
        lines.append(
            f"  {i:>5} {window:>8} {g.num_layers:>6} {g.pages_per_request:>10} "
            f"{format_bytes(g.bytes_per_request):>12} {format_bytes(g.trail_bytes_per_request):>10} {pct:>10} "
            f"{g.pool_pages:>11} {g.max_concurrency:>9}"
        )
    lines.append(
        f"  per request: {format_bytes(report.bytes_per_request)}, of which trail page "
        f"{format_bytes(report.trail_bytes_per_request)}; max concurrency {report.max_concurrency}"
    )
    return "\n".join(lines)
