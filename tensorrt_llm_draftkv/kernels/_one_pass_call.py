"""The one-pass form of ``prepare_paged_latent``: its checks, its dispatch and its launch.

Called by ``spec_tail_kernels.prepare_paged_latent`` (which documents the
coordinates and the contract) when it is given ``block_offsets``; a call whose
signature was checked before is relaunched from its remembered plan
(``_one_pass_plans.py``) without the checks.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _dispatch
from . import _launch as _fl
from . import _one_pass_plans as _plans
from . import reference
from ._checks import check_one_pass, next_pow2, one_pass_config, read_width, vec
from .reference import PagedLatentPrep


def prepare_one_pass(
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
    impl: Optional[str],
    block: Optional[int],
    num_warps: Optional[int],
    split: Optional[int],
    fast_launch: bool,
    source_tiles: Optional[bool] = None,
    read_window: Optional[int] = None,
) -> PagedLatentPrep:
    """The one-pass form of :func:`prepare_paged_latent` (checks, dispatch, the launch)."""
    if fast_launch and out is not None and impl != "reference" and _fl.ENABLED:
        plan_key = _plans.plan_key(block_offsets, vectors, out, tables, extents, pool_idx, divisor, backend,
                                   block_size, tokens_per_block, max_new, block, num_warps, split, source_tiles,
                                   read_window)
        if plan_key is not None and _plans.launch_planned(plan_key, block_offsets, vectors, out, max_ctx):
            _dispatch.LAUNCH_COUNTS["prepare_paged_latent_one_pass"] += 1
            return out
    else:
        plan_key = None
    dev, kw, pool_idx, divisor, backend = check_one_pass(
        block_offsets, pool_idx, divisor, backend, tables, extents, vectors,
        block_size=block_size, tokens_per_block=tokens_per_block, max_ctx=max_ctx, max_new=max_new, out=out,
        read_window=read_window,
    )
    assert block_offsets is not None
    if not _dispatch.triton_runs(impl, dev):
        return reference.prepare_paged_latent_one_pass_reference(
            block_offsets, pool_idx, divisor, backend, *vectors, out=out, **kw
        )
    B = vectors[0].shape[0]
    M = block_offsets.shape[3]
    if out is None:
        out = PagedLatentPrep.empty(B, read_width(kw, M), kw["block_size"], kw["max_new"], device=dev,
                                    with_extents=True)
    if B == 0:
        return out
    windowed = kw["read_window"] is not None
    if windowed and source_tiles:
        raise ValueError("source_tiles reads every ordinal of a row; a window-bounded call reads only its window")
    # a window-bounded launch is sized by the columns it writes, not by the export's width
    config = one_pass_config(B, out.read_rows.shape[1] if windowed else M, dev, block, num_warps, split,
                             False if windowed else source_tiles)
    _launch(dev, block_offsets, vectors, out, kw, config, pool_idx, divisor, backend, fast_launch, plan_key)
    return out


def _launch(
    dev: torch.device,
    block_offsets: torch.Tensor,
    vectors: tuple[torch.Tensor, ...],
    out: PagedLatentPrep,
    kw: dict,
    config: tuple,
    pool_idx: int,
    divisor: int,
    backend: str,
    fast_launch: bool,
    plan_key: Optional[tuple],
) -> None:
    """One checked launch of the one-pass kernel over `B` rows of `M` block ordinals (sizes in `config`)."""
    blk, nsplit, warps, scan, src_tiles = config
    B, M = vectors[0].shape[0], block_offsets.shape[3]
    width = out.read_rows.shape[1]  # M, or the window's bound
    s_pool, s_ob, _, s_om = block_offsets.stride()
    # output rows start 16-byte aligned when the width is a multiple of 4 (int32 entries)
    row_align = 4 if width % 4 == 0 else (2 if width % 2 == 0 else 1)
    slot_ids, slot_ctx_len, slot_base_pages, num_new = vectors
    _dispatch.launch(
        "prepare_paged_latent_one_pass",
        dev,
        (B, nsplit),
        (
            block_offsets,
            vec(slot_ids),
            vec(slot_ctx_len),
            vec(slot_base_pages),
            vec(num_new),
            out.read_rows,
            out.read_lens,
            out.query_pos,
            out.store_pages,
            out.store_offsets,
            out.new_ctx_len,
            out.shift,
            out.extents,
            M,
            width // row_align,
            pool_idx * s_pool,
            s_ob,
            s_om,
            divisor,
            kw["max_ctx"],
            kw["block_size"],
            kw["max_new"],
            kw["read_window"] or 0,
            width,
        ),
        fast_launch,
        plan_key,
        P=kw["tokens_per_block"],
        BLOCK=blk,
        SCAN=scan,
        QBLOCK=next_pow2(max(kw["block_size"], 1)),
        NBLOCK=next_pow2(max(kw["max_new"], 1)),
        SPLIT=nsplit,
        ROW_ALIGN=row_align,
        DIV_SHIFT=divisor.bit_length() - 1 if divisor & (divisor - 1) == 0 else -1,
        UNIT_COL=s_om == 1,
        WIDE_COL=max(M - 1, 0) * s_om >= 2**31,
        FULL_ROWS=backend == "cpp",
        SRC_TILES=src_tiles,
        COMPILED=dev.type == "cuda",
        WINDOWED=kw["read_window"] is not None,
        # host-side, so the kernel branches on one constexpr (no boolean operators on constexprs)
        SCAN_TAIL=nsplit > 1 or kw["read_window"] is not None,
        num_warps=warps,
    )


def bound_launch(
    block_offsets: torch.Tensor,
    vectors: tuple[torch.Tensor, ...],
    out: PagedLatentPrep,
    *,
    pool_idx: int,
    divisor: Optional[int],
    backend: Optional[str],
    block_size: int,
    tokens_per_block: int,
    max_ctx: int,
    max_new: int,
    block: Optional[int] = None,
    num_warps: Optional[int] = None,
    split: Optional[int] = None,
    source_tiles: Optional[bool] = None,
    read_window: Optional[int] = None,
) -> Optional[tuple]:
    """The resolved launch (``_one_pass_plans.bound_launch``) of a call :func:`prepare_one_pass` already made
    with these arguments on CUDA; ``None`` where that call kept no plan (CPU, reference, no fast launch)."""
    if not (_fl.ENABLED and type(max_ctx) is int):
        return None
    key = _plans.plan_key(block_offsets, vectors, out, None, None, pool_idx, divisor, backend, block_size,
                          tokens_per_block, max_new, block, num_warps, split, source_tiles, read_window)
    return None if key is None else _plans.bound_launch(key, block_offsets, vectors, out, max_ctx)
