"""The Triton body of ``decode_draft_block_table``: exported block offsets to page tables and extents
(layout conventions in ``_triton_kernels.py``).
"""
from __future__ import annotations

import triton.language as tl

from ._combine import max_combine


def decode_kernel(
    off_ptr,  # [num_seqs, M] strided view of block_offsets[pool_idx, :num_seqs, 0]
    tab_ptr,  # out: int32 [num_seqs, M]
    ext_ptr,  # out: int64 [num_seqs]
    M,
    divisor,
    s_ob,
    s_om,
    s_tb,
    s_tm,
    FULL_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    COMPILED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    live = cols < M
    raw = tl.load(off_ptr + row * s_ob + cols * s_om, mask=live, other=-1)
    page = tl.where(raw >= 0, raw // divisor, -1)
    tl.store(tab_ptr + row * s_tb + cols * s_tm, page.to(tl.int32), mask=live)
    if chunk == 0:
        if FULL_ROWS:
            # cpp backend: unbacked entries were exported as a real page, so the
            # row cannot tell them apart; every row counts full.
            ext = row * 0 + M
        else:
            # extent = 1 + last backed ordinal. Scan the row backwards one chunk
            # at a time and stop at the first chunk holding a backed entry, so a
            # row backed up to its end costs one extra chunk read.
            ext = row * 0
            start = chunk * 0 + ((M - 1) // BLOCK) * BLOCK
            while (start >= 0) & (ext == 0):
                c = start + tl.arange(0, BLOCK)
                v = tl.load(off_ptr + row * s_ob + c * s_om, mask=c < M, other=-1)
                one_past = tl.where(v >= 0, c + 1, 0)
                if COMPILED:
                    ext = tl.reduce(one_past, 0, max_combine).to(tl.int64)
                else:
                    ext = tl.max(one_past, axis=0).to(tl.int64)
                start -= BLOCK
        tl.store(ext_ptr + row, ext)


__all__ = ["decode_kernel"]
