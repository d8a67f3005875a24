"""Argument checks and launch sizing of the kernels' entry points (host side only, no device sync).

Every check raises the explicit error the entry point documents, before any
output is touched; the fast path of each runs first, since a latency-bound
step calls them every time. Shapes: ``B`` rows, ``M`` ordinals per row.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch

from .reference import BlockTables, PagedLatentPrep, RebasedTables, window_read_width

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
    read_window: Optional[int] = None,
) -> tuple[torch.device, dict]:
    """``prepare_paged_latent``'s arguments (``tensors`` in signature order).

    Returns their device and the four sizes as ints plus ``read_window``
    (keyword arguments of the reference and the launch).
    """
    tables, extents, *vectors = tensors
    check_int("tables", tables, 2)
    B, M = tables.shape
    check_int("extents", extents, 1, (B,))
    kw = _check_step_vectors(
        B, tuple(vectors), block_size=block_size, tokens_per_block=tokens_per_block, max_ctx=max_ctx,
        max_new=max_new, read_window=read_window,
    )
    dev = same_device(*tensors)
    if out is not None:
        check_step_out(out, B, M, kw, dev)
    return dev, kw


def check_ring(
    tensors: tuple[torch.Tensor, ...],
    *,
    block_size: int,
    tokens_per_block: int,
    max_ctx: int,
    max_new: int,
    out: Optional[PagedLatentPrep],
    read_window: Optional[int] = None,
) -> tuple[torch.device, dict]:
    """The ring form's arguments (``tables, extents, table_rows, table_first`` then the step vectors)."""
    tables, extents, table_rows, table_first, *vectors = tensors
    check_int("tables", tables, 2)
    R, C = tables.shape
    if C < 1:
        raise ValueError("the ring form needs a table at least one column wide (ordinal o lives at column o % C)")
    check_int("extents", extents, 1, (R,))
    check_int("table_first", table_first, 1, (R,))
    B = vectors[0].shape[0] if vectors[0].dim() == 1 else -1
    check_int("table_rows", table_rows, 1, (B,))
    kw = _check_step_vectors(
        B, tuple(vectors), block_size=block_size, tokens_per_block=tokens_per_block, max_ctx=max_ctx,
        max_new=max_new, read_window=read_window,
    )
    dev = same_device(*tensors)
    if out is not None:
        check_step_out(out, B, C, kw, dev)
    return dev, kw


def _check_step_vectors(
    B: int,
    vectors: tuple[torch.Tensor, ...],
    *,
    block_size: int,
    tokens_per_block: int,
    max_ctx: int,
    max_new: int,
    read_window: Optional[int] = None,
) -> dict:
    """The per-row/per-slot vectors, the four sizes and ``read_window`` shared by both forms of ``prepare_paged_latent``."""
    slot_ids, slot_ctx_len, slot_base_pages, num_new = vectors
    check_int("slot_ids", slot_ids, 1, (B,))
    check_int("slot_ctx_len", slot_ctx_len, 1)
    check_int("slot_base_pages", slot_base_pages, 1, slot_ctx_len.shape)
    check_int("num_new", num_new, 1, (B,))
    return check_step_sizes(block_size=block_size, tokens_per_block=tokens_per_block, max_ctx=max_ctx,
                            max_new=max_new, read_window=read_window)


def check_step_sizes(
    *, block_size: int, tokens_per_block: int, max_ctx: int, max_new: int, read_window: Optional[int] = None
) -> dict:
    """The four sizes and ``read_window`` of a step preparation (every form), as plain ints."""
    kw = dict(block_size=int(block_size), tokens_per_block=int(tokens_per_block), max_ctx=int(max_ctx),
              max_new=int(max_new))
    if kw["tokens_per_block"] < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {kw['tokens_per_block']}")
    if kw["block_size"] < 0 or kw["max_new"] < 0 or kw["max_ctx"] < 0:
        raise ValueError("block_size, max_new and max_ctx must be >= 0")
    if read_window is not None:
        read_window = operator.index(read_window)
        if read_window < max(kw["block_size"], 1):
            raise ValueError(
                f"read_window ({read_window} tokens) must hold the block of {kw['block_size']} queries"
            )
    kw["read_window"] = read_window
    return kw


def read_width(kw: dict, M: int) -> int:
    """Columns of the read rows: ``M`` (upstream's layout) or, with a read window, its bound."""
    w = kw["read_window"]
    return M if w is None else window_read_width(w, kw["tokens_per_block"])


def check_step_out(out: PagedLatentPrep, B: int, M: int, kw: dict, dev: torch.device) -> None:
    """A step preparation's `out`: each tensor's shape, dtype, device and contiguity (`M`: the table width)."""
    i32, i64, bs, n = torch.int32, torch.int64, kw["block_size"], kw["max_new"]
    if kw["read_window"] is None:
        check_out("read_rows", out.read_rows, (B, M), i32, dev)
    else:
        # a window-bounded row may be wider than its bound (a static buffer), never narrower
        rows = out.read_rows
        need = read_width(kw, M)
        width = rows.shape[1] if isinstance(rows, torch.Tensor) and rows.dim() == 2 else need
        check_out("read_rows", rows, (B, max(width, need)), i32, dev)
    check_out("read_lens", out.read_lens, (B,), i64, dev)
    check_out("query_pos", out.query_pos, (B, bs), i64, dev)
    check_out("store_pages", out.store_pages, (B, n), i32, dev)
    check_out("store_offsets", out.store_offsets, (B, n), i32, dev)
    check_out("new_ctx_len", out.new_ctx_len, (B,), i64, dev)
    check_out("shift", out.shift, (B,), i64, dev)


def check_one_pass(
    block_offsets: Optional[torch.Tensor],
    pool_idx: int,
    divisor: Optional[int],
    backend: Optional[str],
    tables: Optional[torch.Tensor],
    extents: Optional[torch.Tensor],
    vectors: tuple[torch.Tensor, ...],
    *,
    block_size: int,
    tokens_per_block: int,
    max_ctx: int,
    max_new: int,
    out: Optional[PagedLatentPrep],
    read_window: Optional[int] = None,
) -> tuple[torch.device, dict, int, int, str]:
    """The one-pass form of ``prepare_paged_latent`` (exported offsets instead of tables).

    ``B = len(slot_ids)`` rows are prepared from rows ``0 .. B-1`` of pool
    ``pool_idx``. Returns the device, the four sizes as ints, the pool index,
    the divisor and the backend.
    """
    if block_offsets is None:
        raise ValueError("prepare_paged_latent needs either tables and extents, or block_offsets (one-pass form)")
    if tables is not None or extents is not None:
        raise ValueError(
            "prepare_paged_latent: pass tables and extents (two-step form) or block_offsets (one-pass form), "
            "not both; give tables=None and extents=None with block_offsets"
        )
    check_int("block_offsets", block_offsets, 4)
    num_pools, B_exp, two, M = block_offsets.shape
    if two != 2:
        raise ValueError(f"block_offsets must be [num_pools, B, 2, M], got {tuple(block_offsets.shape)}")
    try:
        pool_idx = operator.index(pool_idx)
    except TypeError:
        raise TypeError(f"pool_idx must be an int, got {type(pool_idx).__name__}") from None
    if not 0 <= pool_idx < num_pools:
        raise IndexError(f"pool_idx {pool_idx} out of range for {num_pools} pools")
    if divisor is None:
        raise ValueError("divisor (offsets per page, the pool's kv_factor) is required with block_offsets")
    divisor = int(divisor)
    if divisor < 1:
        raise ValueError(f"divisor must be >= 1, got {divisor}")
    if backend is None:
        backend = "cpp"
    elif backend not in ("cpp", "python"):
        raise ValueError(f"backend must be 'cpp' or 'python', got {backend!r}")
    check_int("slot_ids", vectors[0], 1)
    B = vectors[0].shape[0]
    if B > B_exp:
        raise ValueError(f"slot_ids asks for {B} rows but block_offsets holds {B_exp} rows per pool")
    kw = _check_step_vectors(
        B, vectors, block_size=block_size, tokens_per_block=tokens_per_block, max_ctx=max_ctx, max_new=max_new,
        read_window=read_window,
    )
    dev = same_device(block_offsets, *vectors)
    if out is not None:
        check_step_out(out, B, M, kw, dev)
        if out.extents is None:
            raise ValueError(
                "out.extents is None: the one-pass form also writes the extents; allocate out with "
                "PagedLatentPrep.empty(..., with_extents=True)"
            )
        check_out("extents", out.extents, (B,), torch.int64, dev)
    return dev, kw, pool_idx, divisor, backend


# --------------------------------------------------------------------------- one-pass launch sizing
_ONE_PASS_MAX_BLOCK = 4096
_SRC_TILES_MAX_ENTRIES = 1 << 19  # B * M up to 256 x 2048: latency-bound on an H200
_sm_counts: dict[int, int] = {}


def _sm_count(dev: torch.device) -> int:
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    n = _sm_counts.get(index)
    if n is None:
        n = _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


def one_pass_config(
    B: int,
    M: int,
    dev: torch.device,
    block: Optional[int],
    warps: Optional[int],
    split: Optional[int],
    source_tiles: Optional[bool] = None,
) -> tuple[int, int, int, int, bool]:
    """``(BLOCK, SPLIT, num_warps, SCAN, SRC_TILES)`` of the one-pass kernel for ``B`` rows of ``M`` ordinals.

    Default: one program per row looping over the row in tiles of up to 4096
    ordinals (each offset read once). With fewer rows than the GPU has SMs, a
    row is split over ``SPLIT`` programs (tile ``t`` goes to program
    ``t % SPLIT``, about two programs per SM) and tiles shrink to at least 512
    ordinals; program 0 of a row then finds the extent by scanning back from
    the row's end, ``SCAN`` ordinals per step (the tile, widened to up to
    8192 ordinals on CUDA).
    ``SRC_TILES`` (tiles over source ordinals, the first load issued before the
    slot state is known) by default when the whole launch moves at most
    ``_SRC_TILES_MAX_ENTRIES`` offsets: there a dependent round trip costs more
    than the ``[0, base)`` entries it also reads.
    Interpreted (CPU): one tile per row, one program per row.
    """
    if block is not None and (block < 1 or block & (block - 1)):
        raise ValueError(f"block must be a power of two >= 1, got {block}")
    if warps is not None and (warps < 1 or warps & (warps - 1) or warps > 32):
        raise ValueError(f"num_warps must be a power of two in [1, 32], got {warps}")
    if split is not None and split < 1:
        raise ValueError(f"split must be >= 1, got {split}")
    if source_tiles is None:
        source_tiles = B * M <= _SRC_TILES_MAX_ENTRIES
    if dev.type != "cuda":
        blk = block or min(max(next_pow2(M), 16), _ONE_PASS_MAX_BLOCK)
        return blk, split or 1, warps or 1, blk, bool(source_tiles)
    sms = _sm_count(dev)
    want = 2 * sms  # programs that keep every SM busy
    if block is not None:
        blk = block
    elif B >= sms:
        blk = min(max(next_pow2(M), 128), _ONE_PASS_MAX_BLOCK)
    else:
        # enough programs for the SMs, but no tile below 512 ordinals
        per_prog = -(-B * M // want)
        blk = min(max(next_pow2(per_prog), 512), _ONE_PASS_MAX_BLOCK, max(next_pow2(M), 128))
    tiles = max(1, -(-M // blk))
    if split is None:
        # a row per program (each offset read once) as soon as every SM has a row
        split = 1 if B >= sms else min(tiles, -(-want // B))
    split = min(split, tiles)
    # split rows: program 0's first span covers the row's last 8192 ordinals, one round trip
    scan = max(blk, min(2 * _ONE_PASS_MAX_BLOCK if split > 1 else _ONE_PASS_MAX_BLOCK, next_pow2(M)))
    # warps sized for the widest load a program makes (the scan's, when split)
    return blk, split, warps or max(1, min(16, (scan if split > 1 else blk) // 256)), scan, bool(source_tiles)
