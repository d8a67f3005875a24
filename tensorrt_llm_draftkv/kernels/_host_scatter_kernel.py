"""The Triton body of ``host_scatter``: a staged scatter whose source the kernel reads in place.

The source is one int64 buffer in page-locked host memory, which a GPU under unified
addressing reads directly: ``n`` flat int64 offsets, then (from int32 element
``val_at``) ``n`` int32 values, then (from int64 element ``copy_at``) ``m`` int64
values copied densely to a second destination. Grid: ``cdiv(max(n, m), BLOCK)``.
"""
from __future__ import annotations

import triton.language as tl


def host_scatter_kernel(
    src64_ptr,  # int64 view of the staged buffer
    src32_ptr,  # int32 view of the same buffer
    dst_ptr,  # int32 [*]: dst[offsets[i]] = values[i]
    copy_ptr,  # int64 [m]: copy_ptr[j] = src64[copy_at + j]
    n,
    val_at,  # int32 elements
    m,
    copy_at,  # int64 elements
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    entry = i < n
    offset = tl.load(src64_ptr + i, mask=entry, other=0)
    value = tl.load(src32_ptr + val_at + i, mask=entry, other=0)
    tl.store(dst_ptr + offset, value, mask=entry)
    dense = i < m
    word = tl.load(src64_ptr + copy_at + i, mask=dense, other=0)
    tl.store(copy_ptr + i, word, mask=dense)


__all__ = ["host_scatter_kernel"]
