"""The planner's text: byte sizes, a pool's table, and the block-reuse savings line.

`planner` (`plan_pool`) and `reuse_savings` (`prefix_reuse_savings`) compute the
numbers; this module only turns their reports into the lines
`python -m tensorrt_llm_draftkv plan` prints, so the arithmetic and its
presentation stay apart. It holds no state.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .planner import PoolReport
    from .reuse_savings import ReuseSavings


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


def format_savings(savings: ReuseSavings) -> str:
    """One line: the prefill tokens skipped and the pages and bytes shared instead of held alone."""
    return (
        f"  shared prefix of {savings.shared_prefix} tokens ({savings.reused_tokens} reused, whole pages): "
        f"{_per_group(list(savings.pages_per_group))} pages, {format_bytes(savings.bytes)} "
        f"({format_bytes(savings.bytes_per_rank)} per rank) saved per request sharing it in the {savings.name} pool"
    )
