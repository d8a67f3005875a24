"""The Triton body of ``prepare_paged_latent`` (two-step form, from decoded tables): read rows, lengths,
query positions and store targets of one DFlash generation step (layout conventions in ``_triton_kernels.py``).
"""
from __future__ import annotations

import triton.language as tl


def prepare_kernel(
    tab_ptr,  # [B, M] int32 (strided), unrebased
    ext_ptr,  # [B] extents
    slot_ptr,  # [B] slot id per row
    ctx_ptr,  # [num_slots] slot context length L (absolute positions)
    basep_ptr,  # [num_slots] slot base pages
    new_ptr,  # [B] accepted tokens stored this step
    rows_ptr,  # out: int32 [B, M]
    lens_ptr,  # out: int64 [B]
    qpos_ptr,  # out: int64 [B, block_size]
    spage_ptr,  # out: int32 [B, max_new]
    soff_ptr,  # out: int32 [B, max_new]
    nctx_ptr,  # out: int64 [B]
    shift_ptr,  # out: int64 [B]
    M,
    max_ctx,
    block_size,
    max_new,
    s_tb,
    s_tm,
    s_rb,
    window,  # tokens the row may read below the block's end (WINDOWED only)
    out_w,  # columns of read_rows (M unless WINDOWED)
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    QBLOCK: tl.constexpr,
    NBLOCK: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    base = tl.load(basep_ptr + slot).to(tl.int64)
    ext = tl.load(ext_ptr + row).to(tl.int64)
    ext = tl.minimum(tl.maximum(ext, 0), row * 0 + M)
    mc = max_ctx.to(tl.int64)
    if WINDOWED:
        # every program needs the new length: the row starts at the window's first page when that is
        # above the base (upstream's layout loads L and n in the scalar program only)
        L = tl.load(ctx_ptr + slot).to(tl.int64)
        n = tl.load(new_ptr + row).to(tl.int64)
        new_ctx = tl.minimum(L + n, mc)
        base = tl.maximum(base, tl.maximum(new_ctx + block_size - window, 0) // P)
    shift = tl.maximum(tl.minimum(base, ext), 0)
    tab_row = tab_ptr + row * s_tb

    # Rebased read table: read_rows[b, j] = tables[b, shift + j] inside the extent.
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    src = shift + cols
    inside = src < ext
    if WINDOWED:
        inside = inside & (src * P < new_ctx + block_size)  # nothing past the block's last page
    v = tl.load(tab_row + src * s_tm, mask=inside, other=-1)
    tl.store(rows_ptr + row * s_rb + cols, v.to(tl.int32), mask=cols < out_w)

    if chunk == 0:
        if not WINDOWED:
            L = tl.load(ctx_ptr + slot).to(tl.int64)
            n = tl.load(new_ptr + row).to(tl.int64)
            new_ctx = tl.minimum(L + n, mc)
        lens = new_ctx - base * P
        lens = tl.minimum(tl.maximum(lens, 0), (ext - shift) * P)
        tl.store(nctx_ptr + row, new_ctx)
        tl.store(lens_ptr + row, lens)
        tl.store(shift_ptr + row, shift)

        q = tl.arange(0, QBLOCK)
        tl.store(qpos_ptr + row * block_size + q, new_ctx + q, mask=q < block_size)

        # Store targets in UNREBASED coordinates: slot position pos -> ordinal pos // P.
        i = tl.arange(0, NBLOCK)
        in_out = i < max_new
        pos = L + i
        valid = in_out & (i < n) & (pos < mc) & (pos >= 0)
        ordinal = pos // P
        in_table = valid & (ordinal < M)
        pg = tl.load(tab_row + ordinal * s_tm, mask=in_table, other=-1)
        pg = tl.where(in_table, pg, -1)
        off = tl.where(valid, pos % P, -1)
        tl.store(spage_ptr + row * max_new + i, pg.to(tl.int32), mask=in_out)
        tl.store(soff_ptr + row * max_new + i, off.to(tl.int32), mask=in_out)


__all__ = ["prepare_kernel"]
