"""Triton kernel bodies for the draft-KV block-table kernels.

The bodies are plain Python functions written in ``triton.language``. They are
wrapped twice, lazily, by :func:`get_kernel`:

* a compiled ``JITFunction`` for CUDA tensors, and
* an ``InterpretedFunction`` for CPU tensors (Triton's interpreter),

independently of whether ``TRITON_INTERPRET`` was set when this module was
imported. The dispatch policy (which one runs when) lives in ``spec_tail_kernels.py``.

Layout conventions shared by the three two-step kernels (the one-pass kernel,
``_one_pass_kernel``, documents its own: a program per row, or a few per long
row, looping over tiles):

* grid axis 0 is the batch row ``b``; grid axis 1 is a chunk of ``BLOCK``
  consecutive block ordinals of that row;
* the program with chunk 0 of a row also writes that row's scalar outputs
  (extent, shift, lengths, query positions, store targets), so each kernel is a
  single launch and every output element is written exactly once;
* row offsets are computed in int64 (``B * M`` may exceed 2**31 elements in a
  strided parent tensor), column offsets in int32 (``M < 2**31``).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


def _max_combine_body(a, b):
    return tl.maximum(a, b)


# Built explicitly as a compiled JITFunction: under TRITON_INTERPRET=1 (set by
# the test suite) ``tl.max`` and the other standard-library reductions are
# interpreter objects, and calling one while *compiling* a CUDA kernel breaks
# the compiler. The compiled bodies therefore reduce with ``tl.reduce`` and
# this combine function; the interpreted bodies use ``tl.max``.
_max_combine = JITFunction(_max_combine_body)


def _decode_kernel(
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
                    ext = tl.reduce(one_past, 0, _max_combine).to(tl.int64)
                else:
                    ext = tl.max(one_past, axis=0).to(tl.int64)
                start -= BLOCK
        tl.store(ext_ptr + row, ext)


def _rebase_kernel(
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


def _prepare_kernel(
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
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    QBLOCK: tl.constexpr,
    NBLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    base = tl.load(basep_ptr + slot).to(tl.int64)
    ext = tl.load(ext_ptr + row).to(tl.int64)
    ext = tl.minimum(tl.maximum(ext, 0), row * 0 + M)
    shift = tl.maximum(tl.minimum(base, ext), 0)
    tab_row = tab_ptr + row * s_tb

    # Rebased read table: read_rows[b, j] = tables[b, shift + j] inside the extent.
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    src = shift + cols
    v = tl.load(tab_row + src * s_tm, mask=src < ext, other=-1)
    tl.store(rows_ptr + row * s_rb + cols, v.to(tl.int32), mask=cols < M)

    if chunk == 0:
        L = tl.load(ctx_ptr + slot).to(tl.int64)
        n = tl.load(new_ptr + row).to(tl.int64)
        mc = max_ctx.to(tl.int64)
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


def _one_pass_kernel(
    off_ptr,  # block_offsets [num_pools, B_exported, 2, M] (int32/int64, any strides); K half read
    slot_ptr,  # [B] slot id per row
    ctx_ptr,  # [num_slots] slot context length L (absolute positions)
    basep_ptr,  # [num_slots] slot base pages
    new_ptr,  # [B] accepted tokens stored this step
    rows_ptr,  # out: int32 [B, M] contiguous, rebased read table
    lens_ptr,  # out: int64 [B]
    qpos_ptr,  # out: int64 [B, block_size]
    spage_ptr,  # out: int32 [B, max_new]
    soff_ptr,  # out: int32 [B, max_new]
    nctx_ptr,  # out: int64 [B]
    shift_ptr,  # out: int64 [B]
    ext_ptr,  # out: int64 [B], extents of the unrebased rows
    M,
    rows_q,  # M // ROW_ALIGN: output row stride in units of ROW_ALIGN ordinals
    pool_off,  # element offset of block_offsets[pool_idx, 0, 0, 0]
    s_ob,  # element stride between rows of one pool
    s_om,  # element stride between ordinals
    divisor,
    max_ctx,
    block_size,
    max_new,
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
    COMPILED: tl.constexpr,
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
    """
    row = tl.program_id(0)
    part = tl.program_id(1)
    first = part == 0  # the program that writes the row's scalars
    row64 = row.to(tl.int64)
    # row starts in int64 (a strided parent may exceed 2**31 elements); columns stay int32
    k_row = off_ptr + (pool_off + row64 * s_ob)
    if not FULL_ROWS:
        if SPLIT > 1:
            # program 0's first scan span, the row's last SCAN ordinals: it needs no slot
            # state, so it is issued first and its round trip overlaps the slot loads
            c0 = M - SCAN + tl.arange(0, SCAN)
            if UNIT_COL:
                v0 = tl.load(k_row + c0, mask=(c0 >= 0) & first, other=-1)
            else:
                v0 = tl.load(k_row + c0.to(tl.int64) * s_om, mask=(c0 >= 0) & first, other=-1)
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
    base_c = tl.minimum(tl.maximum(base, 0), M).to(tl.int32)
    out_row = rows_ptr + (row64 * rows_q) * ROW_ALIGN
    m_out = rows_q * ROW_ALIGN  # == M; written so the store masks are known ROW_ALIGN-aligned (vector stores)
    acc = tl.zeros([BLOCK], dtype=tl.int32)  # one past each backed source ordinal seen
    for start in range(part * BLOCK, M, SPLIT * BLOCK):
        cols = start + tl.arange(0, BLOCK)
        src = base_c + cols
        if UNIT_COL:
            raw = tl.load(k_row + src, mask=src < M, other=-1)
        elif WIDE_COL:  # (M - 1) * s_om does not fit in int32
            raw = tl.load(k_row + src.to(tl.int64) * s_om, mask=src < M, other=-1)
        else:
            raw = tl.load(k_row + src * s_om, mask=src < M, other=-1)
        backed = raw >= 0
        if DIV_SHIFT >= 0:
            page = tl.where(backed, raw >> DIV_SHIFT, -1)
        else:
            page = tl.where(backed, raw // divisor, -1)
        tl.store(out_row + cols, page.to(tl.int32), mask=cols < m_out)
        if SPLIT == 1:
            if not FULL_ROWS:
                acc = tl.maximum(acc, tl.where(backed, src + 1, 0))

    if part == 0:
        if FULL_ROWS:
            # cpp export: unbacked entries look like real pages, every row counts full
            ext = M + row * 0
        else:
            if SPLIT == 1:
                if COMPILED:
                    ext = tl.reduce(acc, 0, _max_combine)
                else:
                    ext = tl.max(acc, axis=0)
                top = base_c  # only [0, base') is left unread
            else:
                one_past0 = tl.where(v0 >= 0, c0 + 1, 0)
                if COMPILED:
                    ext = tl.reduce(one_past0, 0, _max_combine)
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
                    ext = tl.reduce(one_past, 0, _max_combine)
                else:
                    ext = tl.max(one_past, axis=0)
                start -= SCAN
        ext = ext.to(tl.int64)
        shift = tl.maximum(tl.minimum(base, ext), 0)
        lens = tl.minimum(tl.maximum(new_ctx - base * P, 0), (ext - shift) * P)
        tl.store(ext_ptr + row, ext)
        tl.store(shift_ptr + row, shift)
        tl.store(lens_ptr + row, lens)


_BODIES = {
    "decode_draft_block_table": _decode_kernel,
    "rebase_block_table": _rebase_kernel,
    "prepare_paged_latent": _prepare_kernel,
    "prepare_paged_latent_one_pass": _one_pass_kernel,
}

# ``max_ctx`` is converted with ``.to`` inside the body, so it must stay a
# runtime value even when it equals 1. ``M`` stays specialisable: its
# divisibility by 16 lets the ``cols < M`` store masks vectorise.
_NO_SPECIALIZE = {
    "decode_draft_block_table": [],
    "rebase_block_table": [],
    "prepare_paged_latent": ["max_ctx"],
    # every integer stays a runtime value: the fast launcher's cache key then only
    # needs each integer's width (alignment hints are explicit constexprs)
    "prepare_paged_latent_one_pass": [
        "M", "rows_q", "pool_off", "s_ob", "s_om", "divisor", "max_ctx", "block_size", "max_new",
    ],
}

# Pointers whose alignment is not specialised on: their accesses are scalars or
# shifted by a base, so an alignment hint buys nothing, and leaving it out keeps
# the fast launcher's cache key to dtypes (``rows_ptr`` stays specialised: its
# row stores vectorise).
_NO_ALIGN = {
    "prepare_paged_latent_one_pass": [
        "off_ptr", "slot_ptr", "ctx_ptr", "basep_ptr", "new_ptr", "lens_ptr", "qpos_ptr", "spage_ptr",
        "soff_ptr", "nctx_ptr", "shift_ptr", "ext_ptr",
    ],
}

_compiled: dict = {}
_interpreted: dict = {}


def get_kernel(name: str, interpreted: bool):
    """Return the compiled (CUDA) or interpreted (CPU) wrapper of kernel ``name``."""
    cache = _interpreted if interpreted else _compiled
    kern = cache.get(name)
    if kern is None:
        body = _BODIES[name]
        if interpreted:
            from triton.runtime.interpreter import InterpretedFunction

            kern = InterpretedFunction(body)
        else:
            from triton.runtime.jit import JITFunction

            kern = JITFunction(
                body,
                do_not_specialize=_NO_SPECIALIZE[name],
                do_not_specialize_on_alignment=_NO_ALIGN.get(name),
            )
        cache[name] = kern
    return kern


__all__ = ["get_kernel", "triton", "tl"]
