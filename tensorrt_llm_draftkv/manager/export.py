"""Block-offset export: a manager's per-request rows as the int32 tables kernels and executors read.

Entry `[pool, row, k, i]` is `page * kv_factor + k` for the page backing block
ordinal i (absolute positions `[i*P, (i+1)*P)`); K at k = 0, V at k = 1.
The manager's `get_block_offsets`, `block_tables` and `copy_batch_block_offsets`
call these functions with its `OffsetLayout` and the caches of the batch; they
read each cache through its public rows (`KVCache.block_row_slice`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import torch

from ..runtime import BAD_PAGE_INDEX, KVCache
from ..staging import PinnedStager, scatter_int32


@dataclass(frozen=True)
class OffsetLayout:
    """What the export needs of a manager: its label for errors, K/V slots per page, the default
    width, the pools' device, and each pool's guard page (None: none)."""

    label: str
    kv_factor: int
    max_blocks_per_seq: int
    device: str
    guard_pages: tuple[int | None, ...]
    torch_device: torch.device = field(init=False, repr=False, compare=False)  # `device`, parsed once
    #: int64 [num_pools]: each pool's "cpp" K offset of an unbacked ordinal (page 0's, or its guard page's)
    cpp_fills: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "torch_device", torch.device(self.device))
        fills = [0 if guard is None else guard * self.kv_factor for guard in self.guard_pages]
        object.__setattr__(self, "cpp_fills", np.array(fills, dtype=np.int64))

    @property
    def num_pools(self) -> int:
        return len(self.guard_pages)


def get_block_offsets(
    layout: OffsetLayout, ids: list[int], caches: list[KVCache], backend: str = "cpp", *, width: int | str | None = None
) -> torch.Tensor:
    """int32 `[num_pools, B, 2, width]` block offsets, by block ordinal.

    Entry `[p, b, k, i]` is `page * kv_factor + k` for the page backing ordinal i
    of request b in pool p (K at k=0, V at k=1, in the pool's storage viewed as
    `[pages * kv_factor, ...]`). Unbacked ordinals: `"python"` keeps -1; `"cpp"`
    writes page 0's offset (a page some other request may own) or, when the
    pool has a guard page, the guard page's.

    `width`: None for `max_blocks_per_seq` columns (upstream's shape); `"live"` for
    the longest row of the batch (every ordinal any of these requests has; the
    columns past a shorter row read as unbacked); or an int >= that.
    """
    _check_backend(backend)
    width, label = _export_width(layout, caches, width)
    return torch.from_numpy(block_offset_array(layout, ids, caches, backend, width, label))


def _check_backend(backend: str) -> None:
    if backend not in ("cpp", "python"):
        raise ValueError(f"unknown block-offset backend {backend!r}; use 'cpp' or 'python'")


def _export_width(layout: OffsetLayout, caches: list[KVCache], width: int | str | None) -> tuple[int, str]:
    if width is None:
        width = layout.max_blocks_per_seq
        return width, f"max_blocks_per_seq={width}"
    if width == "live":
        return live_width(layout, caches), "the live width"
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 0:
        raise ValueError(f"{layout.label}: export width must be None, 'live' or an int >= 0, got {width!r}")
    return int(width), f"width={width}"


def live_width(layout: OffsetLayout, caches: Iterable[KVCache]) -> int:
    """The longest row (block ordinals, backed or not) of these caches over every pool."""
    return max((c.row_length(p) for c in caches for p in range(layout.num_pools)), default=0)


class _RowMemo:
    """One cache's row of one pool as a numpy array for one use (K/V offsets of a backend,
    or pages), updated from the row's settled mark on: ordinals below it never change,
    so a step converts only the live tail."""

    __slots__ = ("version", "settled", "n", "extent", "k", "v")

    def __init__(self, with_v: bool) -> None:
        self.version = -1
        self.settled = 0
        self.n = 0
        self.extent = 0  # 1 + the last backed ordinal
        self.k = np.empty(0, dtype=np.int32)
        self.v = np.empty(0, dtype=np.int32) if with_v else None

    def refresh(self, cache: KVCache, p: int, scale: int, v_slot: int, fill: int | None) -> None:
        """Entries `page * scale` (V: `+ v_slot`); `fill` for an unbacked ordinal (None keeps -1)."""
        n = cache.row_length(p)
        lo = min(self.settled, cache.settled_blocks(p), n, self.n)
        if n > self.k.size:  # geometric growth: a growing row costs O(change) amortised
            size = max(n, 2 * self.k.size, 64)
            self.k = _grown(self.k, size, lo)
            if self.v is not None:
                self.v = _grown(self.v, size, lo)
        if n > lo:
            pages = np.array(cache.block_row_slice(p, lo, n), dtype=np.int64)
            backed = pages >= 0
            k_tail = np.where(backed, pages * scale, BAD_PAGE_INDEX if fill is None else fill)
            self.k[lo:n] = k_tail
            if self.v is not None:
                self.v[lo:n] = np.where(backed | (fill is not None), k_tail + v_slot, BAD_PAGE_INDEX)
        self.extent = cache.backed_extent(p)
        self.n, self.settled, self.version = n, cache.settled_blocks(p), cache.version


def _grown(a: np.ndarray, size: int, keep: int) -> np.ndarray:
    out = np.empty(size, dtype=a.dtype)
    out[:keep] = a[:keep]
    return out


def _memo(cache: KVCache, p: int, use: str, scale: int, v_slot: int, fill: int | None) -> _RowMemo:
    """`use`: "cpp"/"python" (K and V offsets) or "pages-cpp"/"pages-python" (pages only)."""
    memo = cache.export_memo.get((p, use))
    if memo is None:
        memo = cache.export_memo[(p, use)] = _RowMemo(with_v=not use.startswith("pages"))
    if memo.version != cache.version:
        memo.refresh(cache, p, scale, v_slot, fill)
    return memo


def _fill(layout: OffsetLayout, p: int, backend: str) -> int | None:
    """K offset of an unbacked ordinal in pool p (None: -1, the python backend)."""
    return int(layout.cpp_fills[p]) if backend == "cpp" else None


def block_offset_array(
    layout: OffsetLayout,
    ids: list[int],
    caches: list[KVCache],
    backend: str,
    width: int,
    width_label: str,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """int32 `[num_pools, len(ids), 2, width]` offsets (see `get_block_offsets`); changes no row.

    `out`: an int32 array of that shape (a view of the caller's tensor, say) to
    write into instead of a new one. Cost: one copy per row and pool, and each
    row's entries converted only where they changed since the last export of
    that row. Every check runs before the first write.
    """
    kv = layout.kv_factor
    v_slot = 1 if kv > 1 else 0  # a K-only pool (kv_factor 1) has no separate V slot
    _check_width(layout, ids, caches, width, width_label)
    if out is None:
        out = np.empty((layout.num_pools, len(ids), 2, width), dtype=np.int32)  # each entry written once
    for p in range(layout.num_pools):
        fill = _fill(layout, p, backend)
        k_fill = BAD_PAGE_INDEX if fill is None else fill
        v_fill = BAD_PAGE_INDEX if fill is None else fill + v_slot
        for b, cache in enumerate(caches):
            memo = _memo(cache, p, backend, kv, v_slot, fill)
            n = memo.n
            out[p, b, 0, :n], out[p, b, 0, n:] = memo.k[:n], k_fill
            out[p, b, 1, :n], out[p, b, 1, n:] = memo.v[:n], v_fill
    return out


def block_tables(
    layout: OffsetLayout, ids: list[int], caches: list[KVCache], backend: str = "cpp", *,
    width: int | str | None = "live",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per pool, `(tables int32 [B, width], extents int64 [B])`: what decoding
    `get_block_offsets(request_ids, backend, width=width)` yields, without the offsets.

    Tables map block ordinal -> page: -1 where unbacked (`"python"`), page 0 or
    the guard page (`"cpp"`). Extents are `1 + max{i : backed}` (`"python"`) or
    the full width (`"cpp"`: an unbacked entry there looks like a page).
    """
    _check_backend(backend)
    width, label = _export_width(layout, caches, width)
    _check_width(layout, ids, caches, width, label)
    kv = layout.kv_factor
    result = []
    for p in range(layout.num_pools):
        fill = _fill(layout, p, backend)
        fill_page = None if fill is None else fill // kv
        tables = np.empty((len(ids), width), dtype=np.int32)  # every entry is written once below
        extents = np.full(len(ids), width, dtype=np.int64)
        for b, cache in enumerate(caches):
            memo = _memo(cache, p, f"pages-{backend}", 1, 0, fill_page)
            tables[b, : memo.n] = memo.k[: memo.n]
            tables[b, memo.n :] = BAD_PAGE_INDEX if fill_page is None else fill_page
            if fill is None:
                extents[b] = memo.extent
        result.append((torch.from_numpy(tables), torch.from_numpy(extents)))
    return result


def _check_width(layout: OffsetLayout, ids: list[int], caches: list[KVCache], width: int, label: str) -> None:
    for b, cache in enumerate(caches):
        longest = max((cache.row_length(p) for p in range(layout.num_pools)), default=0)
        if longest > width:
            raise ValueError(f"request {ids[b]} spans {longest} blocks, more than {label}")


def write_block_offsets(
    layout: OffsetLayout, dst_tensor: torch.Tensor, ids: list[int], caches: list[KVCache], num_seqs: int,
    width: int, width_label: str,
) -> None:
    """Upstream's `copy_batch_block_offsets` after its checks (`check_copy_args`): rows `[0, num_seqs)`
    and columns `[0, width)` of every pool of `dst_tensor` get the batch's "cpp" offsets."""
    if not num_seqs:
        return
    if dst_tensor.device.type == "cpu":
        # Straight into the caller's tensor: no staging array, and its pages are already faulted in.
        out = dst_tensor[:, :num_seqs, :, :width].numpy()
        block_offset_array(layout, ids, caches, "cpp", width, width_label, out=out)
    else:
        offsets = block_offset_array(layout, ids, caches, "cpp", width, width_label)
        dst_tensor[:, :num_seqs, :, :width].copy_(torch.from_numpy(offsets))


def k_offset_values(layout: OffsetLayout, pools: np.ndarray, pages: np.ndarray) -> np.ndarray:
    """The `"cpp"` K offset of each `(pools[i], pages[i])` entry (int64): `page * kv_factor`, or the pool's
    fill for an unbacked page (BAD_PAGE_INDEX)."""
    return np.where(pages >= 0, pages * layout.kv_factor, layout.cpp_fills[pools])


def write_block_offset_values(
    layout: OffsetLayout, dst_tensor: torch.Tensor, rows: np.ndarray, pools: np.ndarray, ordinals: np.ndarray,
    k_vals: np.ndarray, stager: PinnedStager | None = None,
) -> int:
    """Write single entries of upstream's layout into `dst_tensor` (`"cpp"` offsets, as
    `write_block_offsets`): ordinal `ordinals[i]` of pool `pools[i]` in batch row `rows[i]` gets K
    offset `k_vals[i]` (`k_offset_values`) and V offset `k_vals[i] + 1` (with K and V slots); int64
    arrays, one entry per (row, pool, ordinal), each ordinal below the destination's width.

    K and V go in as one batch: on the CPU straight into the tensor's memory, on a device as
    one staged buffer (flat indices and int32 values; through `stager`'s arena when given), one
    asynchronous copy from pinned memory and one scatter. Returns the entries written (K and V counted)."""
    if not rows.size:
        return 0
    v_slot = 1 if layout.kv_factor > 1 else 0
    s0, s1, s2, s3 = dst_tensor.stride()
    k_at = pools * s0 + rows * s1 + ordinals * s3
    flat = np.concatenate([k_at, k_at + s2])
    values = np.concatenate([k_vals, k_vals + v_slot])
    # the tensor's memory from its first element to its last written one, by flat offset (any strides)
    scatter_int32(torch.as_strided(dst_tensor, (int(flat.max()) + 1,), (1,)), flat, values, stager)
    return flat.size


def check_copy_args(
    layout: OffsetLayout,
    dst_tensor: torch.Tensor,
    ids: list[int],
    beam_width: int,
    num_contexts: int,
    num_seqs: int,
    max_blocks: int | None,
) -> tuple[int, str]:
    """Every argument error of `copy_batch_block_offsets`, before the write; returns the width written."""
    label = f"{layout.label}: copy_batch_block_offsets"
    for name, value in (("beam_width", beam_width), ("num_contexts", num_contexts), ("num_seqs", num_seqs)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{label}: {name} must be an int, got {value!r}")
    if beam_width != 1:
        raise ValueError(f"{label} supports beam_width 1 only (no beam search here), got beam_width={beam_width}")
    if num_seqs != len(ids) * beam_width:
        raise ValueError(
            f"{label}: num_seqs={num_seqs} but {len(ids)} request ids with beam_width={beam_width} "
            f"make {len(ids) * beam_width} rows"
        )
    if not 0 <= num_contexts <= num_seqs:
        raise ValueError(f"{label}: num_contexts={num_contexts} must be between 0 and num_seqs={num_seqs}")
    if max_blocks is None:
        width, width_label = layout.max_blocks_per_seq, f"max_blocks_per_seq={layout.max_blocks_per_seq}"
    elif isinstance(max_blocks, bool) or not isinstance(max_blocks, (int, np.integer)) or max_blocks < 0:
        raise ValueError(f"{label}: max_blocks must be an int >= 0 or None, got {max_blocks!r}")
    else:
        width, width_label = int(max_blocks), f"max_blocks={max_blocks}"
    if not isinstance(dst_tensor, torch.Tensor):
        raise TypeError(f"{label}: dst_tensor must be a torch.Tensor, got {type(dst_tensor).__name__}")
    if dst_tensor.dtype != torch.int32:
        raise ValueError(f"{label}: dst_tensor must be torch.int32, got {dst_tensor.dtype}")
    shape = dst_tensor.shape
    if (
        len(shape) != 4
        or shape[0] != layout.num_pools
        or shape[1] < num_seqs
        or shape[2] != 2
        or shape[3] < width
    ):
        want = f"[num_pools={layout.num_pools}, >= num_seqs={num_seqs}, 2, >= {width}]"
        raise ValueError(f"{label}: dst_tensor has shape {list(shape)}, needs {want} ({width_label})")
    pool_device = layout.torch_device
    if dst_tensor.device.type != pool_device.type or (
        pool_device.index is not None and dst_tensor.device.index != pool_device.index
    ):
        raise ValueError(
            f"{label}: dst_tensor is on {dst_tensor.device}, this manager's pools on {layout.device}"
        )
    return width, width_label


__all__ = [
    "OffsetLayout", "block_offset_array", "block_tables", "check_copy_args", "get_block_offsets", "k_offset_values",
    "live_width", "write_block_offset_values", "write_block_offsets",
]
