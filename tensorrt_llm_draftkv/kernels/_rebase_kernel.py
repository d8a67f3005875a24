"""The Triton body of ``rebase_block_table``: each row shifted past its base pages
(layout conventions in ``_triton_kernels.py``).
"""
from __future__ import annotations

import triton.language as tl


def rebase_kernel(
    tab_ptr,  # [B, M] int32 (strided)
    ext_ptr,  # [B] extents (int32/int64)
    base_ptr,  # [B] base pages (int32/int64)
    rows_ptr,  # out: int32 [B, M] contiguous
    next_ptr,  # out: int64 [B] new extents
    shift_ptr,  # out: int64 [B]
    M,
    s_tb,
    s_tm,
    s_rb,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    ext = tl.load(ext_ptr + row).to(tl.int64)
    ext = tl.minimum(tl.maximum(ext, 0), row * 0 + M)
    base = tl.load(base_ptr + row).to(tl.int64)
    shift = tl.maximum(tl.minimum(base, ext), 0)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    src = shift + cols
    v = tl.load(tab_ptr + row * s_tb + src * s_tm, mask=src < ext, other=-1)
    tl.store(rows_ptr + row * s_rb + cols, v.to(tl.int32), mask=cols < M)
    if chunk == 0:
        tl.store(next_ptr + row, ext - shift)
        tl.store(shift_ptr + row, shift)


__all__ = ["rebase_kernel"]
