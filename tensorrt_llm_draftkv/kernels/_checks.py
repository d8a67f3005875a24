"""Argument checks and launch sizing of the kernels' entry points (host side only, no device sync).

Every check raises the explicit error the entry point documents, before any
output is touched; the fast path of each runs first, since a latency-bound
step calls them every time. Shapes: ``B`` rows, ``M`` ordinals per row.
"""
from __future__ import annotations

from typing import Optional

import torch

from .reference import BlockTables, PagedLatentPrep, RebasedTables

_MAX_BLOCK = 4096
_MIN_SPLIT_BLOCK = 512
_TARGET_PROGRAMS = 512
_INT_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------- launch sizing
def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def pick_block(rows: int, M: int, block: Optional[int], interpreted: bool) -> int:
    """Ordinals per program. Big blocks; split long rows when the grid is small."""
    if block is not None:
        if block < 1 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 1, got {block}")
        return block
    b = min(max(next_pow2(M), 16), _MAX_BLOCK)
    if not interpreted:
        # keep enough programs in flight for small batches of long rows
        while b > _MIN_SPLIT_BLOCK and rows * -(-M // b) < _TARGET_PROGRAMS:
            b //= 2
    return b


def num_warps(block: int) -> int:
    return max(1, min(8, block // 256))


# --------------------------------------------------------------------------- single arguments
def check_impl(impl: Optional[str]) -> None:
    if impl not in (None, "triton", "reference"):
        raise ValueError(f"impl must be None, 'triton' or 'reference', got {impl!r}")


def same_device(*tensors: torch.Tensor) -> torch.device:
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise ValueError(f"all tensors must be on one device, got {dev} and {t.device}")
    return dev


def check_int(name: str, t: torch.Tensor, ndim: int, shape: Optional[tuple | torch.Size] = None) -> None:
    # fast path first: this runs on every call of a step that may be latency-bound
    if (
        isinstance(t, torch.Tensor)
        and t.dtype in _INT_DTYPES
        and t.dim() == ndim
        and (shape is None or t.shape == shape)
    ):
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor")
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_out(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if (
        isinstance(t, torch.Tensor)
        and t.dtype is dtype
        and t.shape == shape
        and t.device == device
        and t.is_contiguous()
    ):
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"out.{name} must be a torch.Tensor")
    if not t.is_contiguous():
        raise ValueError(f"out.{name} must be contiguous")
    raise ValueError(
        f"out.{name} must be {dtype} {tuple(shape)} on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
    )


def vec(t: torch.Tensor) -> torch.Tensor:
    # 1-D inputs are read with unit stride; a non-contiguous one is copied.
    return t if t.is_contiguous() else t.contiguous()


# --------------------------------------------------------------------------- per entry point
def check_decode(
    block_offsets: torch.Tensor,
    pool_idx: int,
    num_seqs: int,
    divisor: int,
    backend: str,
    out: Optional[BlockTables],
) -> tuple[int, int]:
    """``decode_draft_block_table``'s arguments; returns ``(M, divisor)``."""
    check_int("block_offsets", block_offsets, 4)
    num_pools, B, two, M = block_offsets.shape
    if two != 2:
        raise ValueError(f"block_offsets must be [num_pools, B, 2, M], got {tuple(block_offsets.shape)}")
    if not 0 <= pool_idx < num_pools:
        raise IndexError(f"pool_idx {pool_idx} out of range for {num_pools} pools")
    if not 0 <= num_seqs <= B:
        raise ValueError(f"num_seqs {num_seqs} out of range for {B} rows")
    divisor = int(divisor)
    if divisor < 1:
        raise ValueError(f"divisor must be >= 1, got {divisor}")
    if backend not in ("cpp", "python"):
        raise ValueError(f"backend must be 'cpp' or 'python', got {backend!r}")
    dev = block_offsets.device
    if out is not None:
        check_out("tables", out.tables, (num_seqs, M), torch.int32, dev)
        check_out("extents", out.extents, (num_seqs,), torch.int64, dev)
    return M, divisor


def check_rebase(
    tables: torch.Tensor, extents: torch.Tensor, base_pages: torch.Tensor, out: Optional[RebasedTables]
) -> torch.device:
    """``rebase_block_table``'s arguments; returns their device."""
    check_int("tables", tables, 2)
    B, M = tables.shape
    check_int("extents", extents, 1, (B,))
    check_int("base_pages", base_pages, 1, (B,))
    dev = same_device(tables, extents, base_pages)
    if out is not None:
        check_out("rows", out.rows, (B, M), torch.int32, dev)
        check_out("extents", out.extents, (B,), torch.int64, dev)
        check_out("shift", out.shift, (B,), torch.int64, dev)
    return dev


def check_prepare(
    tensors: tuple[torch.Tensor, ...],
    *,
    block_size: int,
    tokens_per_block: int,
    max_ctx: int,
    max_new: int,
    out: Optional[PagedLatentPrep],
) -> tuple[torch.device, dict[str, int]]:
    """``prepare_paged_latent``'s arguments (``tensors`` in signature order).

    Returns their device and the four sizes as ints (keyword arguments of the
    reference and the launch).
    """
    tables, extents, slot_ids, slot_ctx_len, slot_base_pages, num_new = tensors
    check_int("tables", tables, 2)
    B, M = tables.shape
    check_int("extents", extents, 1, (B,))
    check_int("slot_ids", slot_ids, 1, (B,))
    check_int("slot_ctx_len", slot_ctx_len, 1)
    check_int("slot_base_pages", slot_base_pages, 1, slot_ctx_len.shape)
    check_int("num_new", num_new, 1, (B,))
    dev = same_device(*tensors)
    kw = dict(block_size=int(block_size), tokens_per_block=int(tokens_per_block), max_ctx=int(max_ctx),
              max_new=int(max_new))
    if kw["tokens_per_block"] < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {kw['tokens_per_block']}")
    if kw["block_size"] < 0 or kw["max_new"] < 0 or kw["max_ctx"] < 0:
        raise ValueError("block_size, max_new and max_ctx must be >= 0")
    if out is not None:
        i32, i64, bs, n = torch.int32, torch.int64, kw["block_size"], kw["max_new"]
        check_out("read_rows", out.read_rows, (B, M), i32, dev)
        check_out("read_lens", out.read_lens, (B,), i64, dev)
        check_out("query_pos", out.query_pos, (B, bs), i64, dev)
        check_out("store_pages", out.store_pages, (B, n), i32, dev)
        check_out("store_offsets", out.store_offsets, (B, n), i32, dev)
        check_out("new_ctx_len", out.new_ctx_len, (B,), i64, dev)
        check_out("shift", out.shift, (B,), i64, dev)
    return dev, kw
