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
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from ..config import LayerGroupConfig, SpeculativeDecodingMode
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
        rules.MirrorPolicy(SpeculativeDecodingMode.parse(mode)),  # a mode or its name
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


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            if n // size >= 10**15:  # beyond what a float shows exactly (and may overflow)
                return f"{n // size} {unit}"
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{n} B"


def _per_group(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else "[" + ", ".join(map(str, values)) + "] (per group)"


def format_report(report: PoolReport, tokens_per_block: int) -> str:
    """The pool as a table (one row per group) with its per-request bytes and both charges explained."""
    header = (
        ("group", 5), ("window", 8), ("layers", 6), ("pages/req", 9), ("aligned", 7), ("bytes/req", 11),
        ("per rank", 11), ("trail/req", 10), ("trail %win", 10), ("pool pages", 10), ("max conc", 8),
    )
    lines = [f"{report.name} pool (trail tokens per window: {report.trail_tokens})"]
    lines.append("  " + "  ".join(f"{name:>{width}}" for name, width in header))
    for i, g in enumerate(report.groups):
        window = "full" if g.window is None else str(g.window)
        pct = f"{100.0 * tokens_per_block / g.window:.2f} %" if (g.trail_bytes_per_request and g.window) else "-"
        cells = (
            i, window, g.num_layers, g.pages_per_request, g.aligned_pages_per_request,
            format_bytes(g.bytes_per_request), format_bytes(g.bytes_per_request_per_rank),
            format_bytes(g.trail_bytes_per_request), pct, g.pool_pages, g.max_concurrency,
        )
        lines.append("  " + "  ".join(f"{cell!s:>{width}}" for cell, (_, width) in zip(cells, header)))
    heads = f"{report.kv_heads_per_rank} of {report.num_kv_heads} KV heads" if report.num_kv_heads else "KV heads"
    lines.append(
        f"  per request: {format_bytes(report.bytes_per_request)} (per rank at tp {report.tp_size}: "
        f"{format_bytes(report.bytes_per_request_per_rank)}, {heads}), of which trail page "
        f"{format_bytes(report.trail_bytes_per_request)}; max concurrency {report.max_concurrency} "
        + (
            f"(aligned charge; {report.max_concurrency_unaligned} with the unaligned)"
            if report.chunk_alignment
            else f"(unaligned charge; {report.max_concurrency_aligned} with the aligned)"
        )
    )
    aligned = [g.aligned_pages_per_request for g in report.groups]
    unaligned = [g.unaligned_pages_per_request for g in report.groups]
    chunk = f"{report.chunk} tokens" if report.chunk else "the chunk"
    used = "aligned" if report.chunk_alignment else "unaligned"
    lines.append(
        f"  aligned charge: {_per_group(aligned)} pages/request: every chunk starts at a multiple of the chunk "
        f"({chunk}) from position 0, what a fixed-chunk prefill gives"
    )
    lines.append(
        f"  unaligned charge: {_per_group(unaligned)} pages/request: a chunk may start anywhere, e.g. after a "
        "prefix computed elsewhere that ends at an odd position (the safe charge, at most one page more)"
    )
    lines.append(f"  concurrency and the pages/req column use the {used} charge")
    return "\n".join(lines)


# -- block reuse: what a shared prefix saves -----------------------------------------------------
@dataclass(frozen=True)
class ReuseSavings:
    """What one more request sharing a prefix does not compute or hold alone, in one pool.

    `reused_tokens` is the prefix rounded down to whole pages (the prefill tokens
    skipped; the request's prompt must be longer, since one token is always
    computed). `pages_per_group[g]` counts the prefix pages group g still holds at
    history = `reused_tokens` (all of them under full attention; the window, trail
    and sinks under a window): the pages the request shares instead of allocating.
    """

    name: str
    shared_prefix: int
    reused_tokens: int
    pages_per_group: tuple[int, ...]
    bytes_per_group: tuple[int, ...]
    bytes_per_group_per_rank: tuple[int, ...]

    @property
    def pages(self) -> int:
        return sum(self.pages_per_group)

    @property
    def bytes(self) -> int:
        return sum(self.bytes_per_group)

    @property
    def bytes_per_rank(self) -> int:
        return sum(self.bytes_per_group_per_rank)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "shared_prefix": self.shared_prefix,
            "reused_tokens": self.reused_tokens,
            "pages_per_group": list(self.pages_per_group),
            "bytes_per_group": list(self.bytes_per_group),
            "bytes": self.bytes,
            "bytes_per_rank": self.bytes_per_rank,
        }


def prefix_reuse_savings(name: str, geometry: PoolGeometry, shared_prefix: int, *, trail_tokens: int = 0) -> ReuseSavings:
    """Pages and bytes per request that sharing a `shared_prefix`-token prefix saves in one pool.

    The prefix covers absolute positions `[0, shared_prefix)`; only its whole
    pages `[0, shared_prefix // P)` are shared. `trail_tokens` widens every window
    as the pool's life cycles do (the trail page of a DFlash/DSpark draft pool).
    """
    from ..runtime.life_cycle import LifeCycle
    from .admission import held_pages

    if shared_prefix < 0:
        raise ValueError(f"a shared prefix must be >= 0 tokens, got {shared_prefix}")
    p = geometry.tokens_per_block
    tokens = shared_prefix // p * p
    pages, full, per_rank = [], [], []
    for g in geometry.layer_groups:
        lc = LifeCycle(g.window, g.sink_blocks).widened(trail_tokens)
        count = held_pages(lc, p, tokens, tokens)
        pages.append(count)
        for heads, out in ((geometry.num_kv_heads, full), (geometry.kv_heads_per_rank, per_rank)):
            out.append(count * bytes_per_page(g, tokens_per_block=p, num_kv_heads=heads, head_dim=geometry.head_dim,
                                              dtype=geometry.dtype, kv_factor=geometry.kv_factor))
    return ReuseSavings(name, shared_prefix, tokens, tuple(pages), tuple(full), tuple(per_rank))


def format_savings(savings: ReuseSavings) -> str:
    """One line: the prefill tokens skipped and the pages and bytes shared instead of held alone."""
    return (
        f"  shared prefix of {savings.shared_prefix} tokens ({savings.reused_tokens} reused, whole pages): "
        f"{_per_group(list(savings.pages_per_group))} pages, {format_bytes(savings.bytes)} "
        f"({format_bytes(savings.bytes_per_rank)} per rank) saved per request sharing it in the {savings.name} pool"
    )
