"""Triton kernel bodies for the draft-KV block-table kernels.

The bodies are plain Python functions written in ``triton.language``. They are
wrapped twice, lazily, by :func:`get_kernel`:

* a compiled ``JITFunction`` for CUDA tensors, and
* an ``InterpretedFunction`` for CPU tensors (Triton's interpreter),

independently of whether ``TRITON_INTERPRET`` was set when this module was
imported. The dispatch policy (which one runs when) lives in ``_dispatch.py``.

Layout conventions shared by the three two-step kernels (the one-pass kernel
lives in ``_one_pass_kernel.py`` and documents its own: a program per row, or a
few per long row, looping over tiles):

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


_BODIES = {
    "decode_draft_block_table": _decode_kernel,
    "rebase_block_table": _rebase_kernel,
    "prepare_paged_latent": _prepare_kernel,
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

def _bodies() -> dict:
    from ._one_pass_kernel import _one_pass_kernel  # its own module; it imports this one

    return {**_BODIES, "prepare_paged_latent_one_pass": _one_pass_kernel}


_compiled: dict = {}
_interpreted: dict = {}


def get_kernel(name: str, interpreted: bool):
    """Return the compiled (CUDA) or interpreted (CPU) wrapper of kernel ``name``."""
    cache = _interpreted if interpreted else _compiled
    kern = cache.get(name)
    if kern is None:
        body = _bodies()[name]
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
