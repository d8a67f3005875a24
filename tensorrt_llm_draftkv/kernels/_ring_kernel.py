"""The Triton body of ``prepare_paged_latent``'s ring form: the whole generation step read straight from
a manager's device block table (``manager/block_table.py``), no export and no decode before it.

Batch row ``b`` reads table row ``r = table_rows[b]`` of the ring ``[R, C]``, which holds
block ordinal ``o`` at column ``o % C`` inside its live span ``[first[r], extent[r])``;
everything else is as the two-step body (``_prepare_kernel.py``, layout conventions in
``_triton_kernels.py``): grid ``(B, chunks of the read row)``, chunk 0 writes the
row's scalars and store targets.

``STAGED``: the host already knows every per-row scalar the step needs (the table row, its
live span, the slot's base and length, the accepted count) and stages them as one int64
``[B, ROW_SCALARS]`` buffer, passed as ``trow_ptr``. The program then reads them in one round
instead of two dependent ones (batch row -> table row and slot -> their values), so the
ring's pages are the second and last round of reads. ``ctx_ptr`` is then written, not read:
chunk 0 stores the row's new length at its slot (``WRITE_CTX``), which saves the host a
scatter launch; nothing in the launch reads it, so no program races with that store.
"""
from __future__ import annotations

import triton.language as tl


def ring_kernel(
    tab_ptr,  # [R, C] int32 ring (strided)
    ext_ptr,  # [R] extents, absolute ordinals
    first_ptr,  # [R] first live ordinal of each table row
    trow_ptr,  # [B] table row of each batch row (STAGED: int64 [B, 8], the rows' staged scalars)
    slot_ptr,  # [B] slot id per row
    ctx_ptr,  # [num_slots] slot context length L (absolute positions; WRITE_CTX: int64, written)
    basep_ptr,  # [num_slots] slot base pages
    new_ptr,  # [B] accepted tokens stored this step
    rows_ptr,  # out: int32 [B, out_w]
    lens_ptr,  # out: int64 [B]
    qpos_ptr,  # out: int64 [B, block_size]
    spage_ptr,  # out: int32 [B, max_new]
    soff_ptr,  # out: int32 [B, max_new]
    nctx_ptr,  # out: int64 [B]
    shift_ptr,  # out: int64 [B]
    C,
    max_ctx,
    block_size,
    max_new,
    s_tb,
    s_tm,
    s_rb,
    window,  # tokens the row may read below the block's end (WINDOWED only)
    out_w,  # columns of read_rows
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    QBLOCK: tl.constexpr,
    NBLOCK: tl.constexpr,
    WINDOWED: tl.constexpr,
    STAGED: tl.constexpr = False,
    WRITE_CTX: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if STAGED:
        # columns of a row's staged scalars: see `kernels.staged_ring.ROW_SCALARS`
        sc = trow_ptr + row * 8
        r = tl.load(sc)
        first = tl.load(sc + 1)
        ext = tl.load(sc + 2)
        base = tl.load(sc + 3)
        L = tl.load(sc + 4)
        n = tl.load(sc + 5)
        slot = tl.load(sc + 6)
    else:
        r = tl.load(trow_ptr + row).to(tl.int64)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        first = tl.load(first_ptr + r).to(tl.int64)
        ext = tl.load(ext_ptr + r).to(tl.int64)
        base = tl.load(basep_ptr + slot).to(tl.int64)
        L = tl.load(ctx_ptr + slot).to(tl.int64)
        n = tl.load(new_ptr + row).to(tl.int64)
    ext = tl.minimum(tl.maximum(ext, 0), first + C)
    new_ctx = tl.minimum(L + n, max_ctx.to(tl.int64))
    if WINDOWED:
        base = tl.maximum(base, tl.maximum(new_ctx + block_size - window, 0) // P)
    shift = tl.maximum(tl.minimum(base, ext), 0)
    tab_row = tab_ptr + r * s_tb

    # read_rows[b, j] = page of ordinal shift + j, inside the row's live span
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    src = shift + cols
    inside = (src >= first) & (src < ext)
    if WINDOWED:
        inside = inside & (src * P < new_ctx + block_size)  # nothing past the block's last page
    v = tl.load(tab_row + (tl.where(inside, src, 0) % C) * s_tm, mask=inside, other=-1)
    tl.store(rows_ptr + row * s_rb + cols, v.to(tl.int32), mask=cols < out_w)

    if chunk == 0:
        lens = tl.minimum(tl.maximum(new_ctx - base * P, 0), (ext - shift) * P)
        tl.store(nctx_ptr + row, new_ctx)
        if WRITE_CTX:
            tl.store(ctx_ptr + slot, new_ctx)  # int64 (checked by the host)
        tl.store(lens_ptr + row, lens)
        tl.store(shift_ptr + row, shift)

        q = tl.arange(0, QBLOCK)
        tl.store(qpos_ptr + row * block_size + q, new_ctx + q, mask=q < block_size)

        # store targets: slot position pos -> absolute ordinal pos // P, looked up in the ring
        i = tl.arange(0, NBLOCK)
        in_out = i < max_new
        pos = L + i
        valid = in_out & (i < n) & (pos < max_ctx) & (pos >= 0)
        ordinal = tl.where(valid, pos, 0) // P
        in_table = valid & (ordinal >= first) & (ordinal < ext)
        pg = tl.load(tab_row + (ordinal % C) * s_tm, mask=in_table, other=-1)
        pg = tl.where(in_table, pg, -1)
        off = tl.where(valid, pos % P, -1)
        tl.store(spage_ptr + row * max_new + i, pg.to(tl.int32), mask=in_out)
        tl.store(soff_ptr + row * max_new + i, off.to(tl.int32), mask=in_out)


__all__ = ["ring_kernel"]
