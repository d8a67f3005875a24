"""The one-pass DFlash step kernel: decode, extent, rebase and preparation in one launch.

Its body is a plain function in ``triton.language``, wrapped lazily by
``_triton_kernels.get_kernel`` (compiled for CUDA, interpreted on CPU) like the
two-step kernels; the launch sizing is ``_checks.one_pass_config`` and the entry
point ``spec_tail_kernels.prepare_paged_latent`` (one-pass form).
"""
from __future__ import annotations

import triton.language as tl

from ._combine import max_combine


def one_pass_kernel(
    off_ptr,  # block_offsets [num_pools, B_exported, 2, M] (int32/int64, any strides); K half read
    slot_ptr,  # [B] slot id per row
    ctx_ptr,  # [num_slots] slot context length L (absolute positions)
    basep_ptr,  # [num_slots] slot base pages
    new_ptr,  # [B] accepted tokens stored this step
    rows_ptr,  # out: int32 [B, M] contiguous, rebased read table ([B, rows_q * ROW_ALIGN] if WINDOWED)
    lens_ptr,  # out: int64 [B]
    qpos_ptr,  # out: int64 [B, block_size]
    spage_ptr,  # out: int32 [B, max_new]
    soff_ptr,  # out: int32 [B, max_new]
    nctx_ptr,  # out: int64 [B]
    shift_ptr,  # out: int64 [B]
    ext_ptr,  # out: int64 [B], extents of the unrebased rows
    M,
    rows_q,  # output row width (M, or the window's bound) // ROW_ALIGN, in units of ROW_ALIGN ordinals
    pool_off,  # element offset of block_offsets[pool_idx, 0, 0, 0]
    s_ob,  # element stride between rows of one pool
    s_om,  # element stride between ordinals
    divisor,
    max_ctx,
    block_size,
    max_new,
    window,  # tokens a row may read below its block's end (WINDOWED only)
    out_w,  # columns of each read row: M, or the window's bound (== rows_q * ROW_ALIGN)
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    SCAN: tl.constexpr,
    QBLOCK: tl.constexpr,
    NBLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    DIV_SHIFT: tl.constexpr,
    UNIT_COL: tl.constexpr,
    WIDE_COL: tl.constexpr,
    FULL_ROWS: tl.constexpr,
    SRC_TILES: tl.constexpr,
    COMPILED: tl.constexpr,
    WINDOWED: tl.constexpr = False,
    SCAN_TAIL: tl.constexpr = False,
):
    """Decode + extent + rebase + step preparation of one pool, one pass over the rows.

    Grid ``(B, SPLIT)``. Program ``(b, part)`` writes read-table ordinals
    ``[t*BLOCK, (t+1)*BLOCK)`` for every tile ``t = part, part + SPLIT, ...``:
    ``read_rows[b, j] = page(offsets[b, base' + j])`` with ``base' =
    clamp(base, 0, M)``. That needs no extent: with the ``"python"`` export
    every ordinal at or past the extent holds -1 anyway, and with ``"cpp"`` the
    extent is ``M``. The extent only enters the per-row scalars, which
    program ``part == 0`` writes:

    * ``SPLIT == 1`` (one program per row): the extent is accumulated while the
      row is copied, so each offset is read once; only a row with no backed
      ordinal at or above its base also scans ``[0, base')`` (backwards, stops at
      the first backed entry).
    * ``SPLIT > 1`` (few rows, long rows): program 0 scans the row backwards from
      its end, ``SCAN`` ordinals at a time (wider than a tile: fewer dependent
      round trips), and stops at the first span holding a backed entry. The
      first span is loaded before anything else, so for most rows the scan
      costs no round trip of its own.

    Every program loads its row's slot state; program 0 also writes the
    scalars that need only ``L`` and ``n`` before it copies its tiles.

    ``SRC_TILES`` (for latency-bound launches: few or short rows) tiles the
    *source* ordinals ``[0, M)`` instead of the read table: a tile's load needs
    no slot state, so the first one is issued before the slot loads and each
    next one before the current one is stored (one dependent round trip fewer);
    entry ``src`` is stored at column ``src - base'`` and the last ``base'``
    columns get -1. It reads ``[0, base')`` as well, and with ``SPLIT == 1``
    that makes the extent exact with no backward scan.

    ``WINDOWED`` (never with ``SRC_TILES``): the row starts at ``max(base,
    (new_ctx + block_size - window) // P)`` instead of the base, holds only the
    ordinals below the block's end (-1 past them) and is ``rows_q * ROW_ALIGN``
    columns wide; the extent is found as with ``SPLIT > 1`` (the copy sees only
    the window's columns). ``SCAN_TAIL`` (host-computed: ``SPLIT > 1 or
    WINDOWED``) selects that backward-scan extent over the one accumulated
    during the copy.
    """
    row = tl.program_id(0)
    part = tl.program_id(1)
    first = part == 0  # the program that writes the row's scalars
    row64 = row.to(tl.int64)
    # row starts in int64 (a strided parent may exceed 2**31 elements); columns stay int32
    k_row = off_ptr + (pool_off + row64 * s_ob)
    if not FULL_ROWS:
        if SCAN_TAIL:
            # program 0's first scan span, the row's last SCAN ordinals: it needs no slot
            # state, so it is issued first and its round trip overlaps the slot loads
            c0 = M - SCAN + tl.arange(0, SCAN)
            if UNIT_COL:
                v0 = tl.load(k_row + c0, mask=(c0 >= 0) & first, other=-1)
            else:
                v0 = tl.load(k_row + c0.to(tl.int64) * s_om, mask=(c0 >= 0) & first, other=-1)
    if SRC_TILES:
        # this program's first source tile needs no slot state: its round trip overlaps theirs
        ahead = part * BLOCK + tl.arange(0, BLOCK)
        if UNIT_COL:
            nxt = tl.load(k_row + ahead, mask=ahead < M, other=-1)
        elif WIDE_COL:
            nxt = tl.load(k_row + ahead.to(tl.int64) * s_om, mask=ahead < M, other=-1)
        else:
            nxt = tl.load(k_row + ahead * s_om, mask=ahead < M, other=-1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    n = tl.load(new_ptr + row).to(tl.int64)
    base = tl.load(basep_ptr + slot).to(tl.int64)
    L = tl.load(ctx_ptr + slot).to(tl.int64)

    # What needs only L and n is written first (program 0): new length, query
    # positions, and the store targets in UNREBASED ordinals (slot position pos
    # -> ordinal pos // P), decoded from the offsets directly (a few entries).
    mc = max_ctx.to(tl.int64)
    new_ctx = tl.minimum(L + n, mc)
    tl.store(nctx_ptr + row, new_ctx, mask=first)
    q = tl.arange(0, QBLOCK)
    tl.store(qpos_ptr + row64 * block_size + q, new_ctx + q, mask=(q < block_size) & first)
    i = tl.arange(0, NBLOCK)
    in_out = (i < max_new) & first
    pos = L + i
    valid = in_out & (i < n) & (pos < mc) & (pos >= 0)
    ordinal = pos // P
    in_table = valid & (ordinal < M)
    raw_s = tl.load(k_row + ordinal * s_om, mask=in_table, other=-1)
    pg = tl.where(in_table & (raw_s >= 0), raw_s // divisor, -1)
    off = tl.where(valid, pos % P, -1)
    tl.store(spage_ptr + row64 * max_new + i, pg.to(tl.int32), mask=in_out)
    tl.store(soff_ptr + row64 * max_new + i, off.to(tl.int32), mask=in_out)

    # The read table: read_rows[b, j] = page(offsets[b, base' + j]), base' = clamp(base, 0, M).
    if WINDOWED:
        # the row starts at the window's first page when that is above the slot base
        base = tl.maximum(base, tl.maximum(new_ctx + block_size - window, 0) // P)
        live_end = (new_ctx + block_size + P - 1) // P  # one past the block's last ordinal
    base_c = tl.minimum(tl.maximum(base, 0), M).to(tl.int32)
    out_row = rows_ptr + (row64 * rows_q) * ROW_ALIGN
    m_out = rows_q * ROW_ALIGN  # the row width; written so the store masks are known ROW_ALIGN-aligned
    acc = tl.zeros([BLOCK], dtype=tl.int32)  # one past each backed source ordinal seen
    if SRC_TILES:
        lim = m_out - base_c  # read-table columns [lim, M) have no source ordinal: -1
        none = tl.full([BLOCK], -1, dtype=tl.int32)
        for start in range(part * BLOCK, M, SPLIT * BLOCK):
            src = start + tl.arange(0, BLOCK)
            raw = nxt
            ahead = src + SPLIT * BLOCK  # the next tile's load, issued before this one is stored
            if UNIT_COL:
                nxt = tl.load(k_row + ahead, mask=ahead < M, other=-1)
            elif WIDE_COL:
                nxt = tl.load(k_row + ahead.to(tl.int64) * s_om, mask=ahead < M, other=-1)
            else:
                nxt = tl.load(k_row + ahead * s_om, mask=ahead < M, other=-1)
            backed = raw >= 0
            if DIV_SHIFT >= 0:
                page = tl.where(backed, raw >> DIV_SHIFT, -1)
            else:
                page = tl.where(backed, raw // divisor, -1)
            tl.store(out_row + (src - base_c), page.to(tl.int32), mask=(src >= base_c) & (src < M))
            tl.store(out_row + src, none, mask=(src >= lim) & (src < m_out))
            if SPLIT == 1:
                if not FULL_ROWS:
                    acc = tl.maximum(acc, tl.where(backed, src + 1, 0))
    else:
        for start in range(part * BLOCK, out_w, SPLIT * BLOCK):
            cols = start + tl.arange(0, BLOCK)
            src = base_c + cols
            inside = src < M
            if WINDOWED:
                inside = inside & (src < live_end)
            if UNIT_COL:
                raw = tl.load(k_row + src, mask=inside, other=-1)
            elif WIDE_COL:  # (M - 1) * s_om does not fit in int32
                raw = tl.load(k_row + src.to(tl.int64) * s_om, mask=inside, other=-1)
            else:
                raw = tl.load(k_row + src * s_om, mask=inside, other=-1)
            backed = raw >= 0
            if DIV_SHIFT >= 0:
                page = tl.where(backed, raw >> DIV_SHIFT, -1)
            else:
                page = tl.where(backed, raw // divisor, -1)
            tl.store(out_row + cols, page.to(tl.int32), mask=cols < m_out)
            if not SCAN_TAIL:
                if not FULL_ROWS:
                    acc = tl.maximum(acc, tl.where(backed, src + 1, 0))

    if part == 0:
        if FULL_ROWS:
            # cpp export: unbacked entries look like real pages, every row counts full
            ext = M + row * 0
        else:
            if not SCAN_TAIL:
                if COMPILED:
                    ext = tl.reduce(acc, 0, max_combine)
                else:
                    ext = tl.max(acc, axis=0)
                if SRC_TILES:
                    top = base_c * 0  # the whole row was read
                else:
                    top = base_c  # only [0, base') is left unread
            else:
                one_past0 = tl.where(v0 >= 0, c0 + 1, 0)
                if COMPILED:
                    ext = tl.reduce(one_past0, 0, max_combine)
                else:
                    ext = tl.max(one_past0, axis=0)
                top = M - SCAN + row * 0  # [0, M - SCAN) is left unread
            # backward scan of [0, top) one SCAN-wide span at a time; skipped when ext is known
            start = top - SCAN
            while (start > -SCAN) & (ext == 0):
                c = start + tl.arange(0, SCAN)
                if UNIT_COL:
                    v = tl.load(k_row + c, mask=(c >= 0) & (c < top), other=-1)
                else:
                    v = tl.load(k_row + c.to(tl.int64) * s_om, mask=(c >= 0) & (c < top), other=-1)
                one_past = tl.where(v >= 0, c + 1, 0)
                if COMPILED:
                    ext = tl.reduce(one_past, 0, max_combine)
                else:
                    ext = tl.max(one_past, axis=0)
                start -= SCAN
        ext = ext.to(tl.int64)
        shift = tl.maximum(tl.minimum(base, ext), 0)
        lens = tl.minimum(tl.maximum(new_ctx - base * P, 0), (ext - shift) * P)
        tl.store(ext_ptr + row, ext)
        tl.store(shift_ptr + row, shift)
        tl.store(lens_ptr + row, lens)
