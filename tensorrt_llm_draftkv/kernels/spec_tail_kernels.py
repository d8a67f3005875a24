"""Public entry points of the draft-KV block-table kernels, with dispatch.

Coordinates used throughout
---------------------------
* **block ordinal** ``i``: logical block index of a request's sequence, tokens
  ``[i*P, (i+1)*P)`` with ``P = tokens_per_block``.
* **page**: physical page index in a pool; ``-1`` marks an unbacked ordinal in
  every table this module returns.
* **block offsets** (input of :func:`decode_draft_block_table`): int32 or int64
  ``[num_pools, B, 2, M]`` as exported by the KV cache manager. For pool ``p``,
  row ``b``, ordinal ``i`` backed by page ``pg``: ``[p, b, 0, i] = pg*kv_factor``
  (K) and ``[p, b, 1, i] = pg*kv_factor + 1`` (V). Unbacked ordinals hold ``-1``
  (backend ``"python"``) or a real offset, usually page 0 (backend ``"cpp"``).
* **extent** of a row: ``1 + max{i : row[i] >= 0}``, 0 for an empty row — not
  the number of backed entries (low entries released by a window stay inside).
* **slot positions** (DFlash drafter slots) are absolute token positions; a slot
  ``s`` holds context at ``[base_pages[s]*P, ctx_len[s])``.

Dispatch
--------
``impl=None`` (default): the Triton kernel on CUDA tensors; on CPU tensors the
Triton interpreter when ``os.environ["TRITON_INTERPRET"] == "1"``, else the
torch reference. ``impl="triton"`` forces the kernel (interpreted on CPU),
``impl="reference"`` forces the torch reference. Every Triton launch increments
``LAUNCH_COUNTS[name]`` (a host-side counter keyed by kernel name, the one-pass
form's being ``"prepare_paged_latent_one_pass"``; under CUDA-graph capture it
counts the captured launch once).

On CUDA a launch goes through the fast launcher (``_launch.py``): the compiled
kernel is bound once per launch class and then launched directly on the current
stream, without Triton's per-call binding; ``fast_launch=False`` (or
``DRAFTKV_FAST_LAUNCH=0``) takes Triton's normal path. The one-pass form also
remembers each checked call signature (``_one_pass_plans.plan_key``), so a repeated call with
the same shapes, dtypes, strides and output tensors skips the checks and the
launch sizing as well. An executor whose step tensors are static buffers can go
further with ``bound.BoundPreparation``: the call is checked once and then
relaunched with every argument already resolved.

None of the Triton paths synchronises with the host or creates data-dependent
shapes; all outputs can be preallocated via ``out=`` so a step can be captured
in a CUDA graph. Precondition (not checked, it would need a host sync):
``0 <= slot_ids < len(slot_ctx_len)``. Extents are clamped to ``[0, M]`` and
shifts to ``>= 0`` by kernels and references alike.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from . import _dispatch
from ._checks import (
    read_width,
    check_decode,
    check_prepare,
    check_rebase,
    check_ring,
    next_pow2,
    num_warps as warps_for,
    pick_block,
    vec,
)
from .reference import (
    BlockTables,
    PagedLatentPrep,
    RebasedTables,
    decode_draft_block_table_reference,
    prepare_paged_latent_one_pass_reference,
    prepare_paged_latent_reference,
    prepare_paged_latent_ring_reference,
    rebase_block_table_reference,
)
from ._one_pass_call import prepare_one_pass as _prepare_one_pass


# --------------------------------------------------------------------------- decode


def decode_draft_block_table(
    block_offsets: torch.Tensor,
    pool_idx: int,
    num_seqs: int,
    divisor: int,
    backend: str = "cpp",
    out: Optional[BlockTables] = None,
    *,
    impl: Optional[str] = None,
    block: Optional[int] = None,
) -> BlockTables:
    """Decode one pool's exported block offsets into page tables and extents.

    Args:
        block_offsets: int32 or int64 ``[num_pools, B, 2, M]`` (any strides);
            only the K half (``[:, :, 0]``) is read.
        pool_idx: pool (layer group) to decode, ``0 <= pool_idx < num_pools``.
        num_seqs: rows ``0 .. num_seqs-1`` are decoded, ``num_seqs <= B``.
        divisor: offsets per page (``kv_factor``, 2 for K+V pools), ``>= 1``.
        backend: ``"python"`` (unbacked = -1) or ``"cpp"`` (unbacked entries
            look like real pages, so every row counts full).
        out: optional preallocated ``(tables, extents)`` (contiguous).
        impl: ``None`` / ``"triton"`` / ``"reference"`` (see module docstring).
        block: ordinals per Triton program (power of two), tuning only.

    Returns:
        ``BlockTables(tables, extents)``: ``tables`` int32 ``[num_seqs, M]``,
        ``tables[b, i] = offsets[pool_idx, b, 0, i] // divisor`` where that
        offset is ``>= 0``, else -1; ``extents`` int64 ``[num_seqs]``,
        ``1 + max{i : offsets[pool_idx, b, 0, i] >= 0}`` (0 for an empty row),
        or ``M`` for every row with backend ``"cpp"``.
    """
    M, divisor = check_decode(block_offsets, pool_idx, num_seqs, divisor, backend, out)
    dev = block_offsets.device
    if not _dispatch.triton_runs(impl, dev):
        return decode_draft_block_table_reference(block_offsets, pool_idx, num_seqs, divisor, backend, out)

    if out is None:
        out = BlockTables(
            torch.empty((num_seqs, M), dtype=torch.int32, device=dev),
            torch.empty((num_seqs,), dtype=torch.int64, device=dev),
        )
    if num_seqs == 0:
        return BlockTables(out.tables, out.extents)
    interpreted = dev.type != "cuda"
    blk = pick_block(num_seqs, M, block, interpreted)
    k = block_offsets[pool_idx, :num_seqs, 0]  # strided view, no copy
    grid = (num_seqs, max(1, -(-M // blk)))
    _dispatch.launch(
        "decode_draft_block_table",
        dev,
        grid,
        (k, out.tables, out.extents, M, divisor, k.stride(0), k.stride(1), out.tables.stride(0), 1),
        FULL_ROWS=backend == "cpp",
        BLOCK=blk,
        num_warps=warps_for(blk),
    )
    return BlockTables(out.tables, out.extents)


# --------------------------------------------------------------------------- rebase


def rebase_block_table(
    tables: torch.Tensor,
    extents: torch.Tensor,
    base_pages: torch.Tensor,
    out: Optional[RebasedTables] = None,
    *,
    impl: Optional[str] = None,
    block: Optional[int] = None,
) -> RebasedTables:
    """Shift every row past its base pages.

    Args:
        tables: int32 or int64 ``[B, M]`` page tables (any strides).
        extents: int32/int64 ``[B]`` row extents (clamped to ``[0, M]``).
        base_pages: int32/int64 ``[B]`` base of each row, in pages (may exceed
            the extent).
        out: optional preallocated ``(rows, extents, shift)`` (contiguous).

    Returns:
        ``RebasedTables(rows, extents, shift)`` with ``shift[b] =
        min(base_pages[b], extents[b])`` (int64 ``[B]``), ``rows[b, j] =
        tables[b, shift[b] + j]`` where ``shift[b] + j < extents[b]`` (entries
        inside keep their value, -1 included), else -1 (int32 ``[B, M]``), and
        new ``extents[b] - shift[b]`` (int64 ``[B]``).
    """
    dev = check_rebase(tables, extents, base_pages, out)
    B, M = tables.shape
    if not _dispatch.triton_runs(impl, dev):
        return rebase_block_table_reference(tables, extents, base_pages, out)
    if out is None:
        out = RebasedTables(
            torch.empty((B, M), dtype=torch.int32, device=dev),
            torch.empty((B,), dtype=torch.int64, device=dev),
            torch.empty((B,), dtype=torch.int64, device=dev),
        )
    if B == 0:
        return RebasedTables(out.rows, out.extents, out.shift)
    interpreted = dev.type != "cuda"
    blk = pick_block(B, M, block, interpreted)
    grid = (B, max(1, -(-M // blk)))
    _dispatch.launch(
        "rebase_block_table",
        dev,
        grid,
        (
            tables,
            vec(extents),
            vec(base_pages),
            out.rows,
            out.extents,
            out.shift,
            M,
            tables.stride(0),
            tables.stride(1),
            out.rows.stride(0),
        ),
        BLOCK=blk,
        num_warps=warps_for(blk),
    )
    return RebasedTables(out.rows, out.extents, out.shift)


# --------------------------------------------------------------------------- prepare


def prepare_paged_latent(
    tables: Optional[torch.Tensor],
    extents: Optional[torch.Tensor],
    slot_ids: torch.Tensor,
    slot_ctx_len: torch.Tensor,
    slot_base_pages: torch.Tensor,
    num_new: torch.Tensor,
    *,
    block_size: int,
    tokens_per_block: int,
    max_ctx: int,
    max_new: int,
    out: Optional[PagedLatentPrep] = None,
    impl: Optional[str] = None,
    block: Optional[int] = None,
    block_offsets: Optional[torch.Tensor] = None,
    pool_idx: int = 0,
    divisor: Optional[int] = None,
    backend: Optional[str] = None,
    num_warps: Optional[int] = None,
    split: Optional[int] = None,
    fast_launch: bool = True,
    source_tiles: Optional[bool] = None,
    read_window: Optional[int] = None,
    table_rows: Optional[torch.Tensor] = None,
    table_first: Optional[torch.Tensor] = None,
) -> PagedLatentPrep:
    """One DFlash generation step's preparation, in ONE kernel launch.

    Three forms, identical results:

    * **two-step**: ``tables`` and ``extents`` come from
      :func:`decode_draft_block_table` (a launch of its own);
    * **one-pass**: ``tables=None, extents=None`` and the exported
      ``block_offsets`` with ``pool_idx``, ``divisor`` and ``backend``; the
      decode, the extents, the rebase and the preparation then happen in one
      launch that reads each offset of the rows once. The result's
      ``extents`` field holds the decoded extents (``None`` in the two-step form).
    * **ring**: ``tables`` is a manager's device block table of one pool
      (``manager.device_block_table.ring(pool, ids)``: int32 ``[R, C]``, table row
      ``r`` holding block ordinal ``o`` at column ``o % C``), ``extents`` its
      ``[R]`` extents, ``table_first`` its ``[R]`` first live ordinals and
      ``table_rows`` ``[B]`` the table row of each batch row. Every ordinal outside
      a row's live span ``[first, extent)`` reads as -1 (the ``"python"``
      decode of the row), so the launch reads ``O(window)`` entries per row, never
      an export as wide as the prompt. Without ``read_window`` the read rows are
      ``C`` columns wide (a row's live span, from its shift).

    Args (``B`` rows, ``M`` ordinals per row, ``S`` slots, ``P = tokens_per_block``):
        tables: int32/int64 ``[B, M]`` UNREBASED page tables of the rows (any strides).
        extents: int32/int64 ``[B]`` extents of those rows.
        slot_ids: int32/int64 ``[B]`` drafter slot of each row (rows may share one).
        slot_ctx_len: int32/int64 ``[S]`` slot context length ``L`` (absolute positions).
        slot_base_pages: int32/int64 ``[S]`` slot base ``b`` in pages (``L >= b*P``).
        num_new: int32/int64 ``[B]`` accepted tokens ``n`` (``0 <= n <= max_new``)
            stored this step at slot positions ``[L, L+n)``.
        block_size: queries of the block decode (bonus token + mask tokens).
        max_ctx: maximum context length (positions ``>= max_ctx`` are not stored).
        max_new: width of the store-target outputs.
        out: optional preallocated :class:`PagedLatentPrep` (contiguous tensors;
            the one-pass form also needs ``out.extents``:
            ``PagedLatentPrep.empty(..., with_extents=True)``).
        block_offsets: one-pass form: int32/int64 ``[num_pools, B', 2, M]`` as
            exported (any strides, ``B' >= B``); rows ``0 .. B-1`` of pool
            ``pool_idx`` are read, K half only. ``"cpp"`` exports hold page 0
            (or a guard page) at unbacked ordinals, ``"python"`` exports -1.
        pool_idx, divisor, backend: as in :func:`decode_draft_block_table`
            (``backend`` defaults to ``"cpp"``); one-pass form only.
        impl: ``None`` / ``"triton"`` / ``"reference"`` (see module docstring).
        block, num_warps, split: tuning only (ordinals per tile, warps per
            program, programs per row; ``split`` applies to the one-pass form).
        source_tiles: tuning only, one-pass form: tile the source ordinals
            (the first load issued before the slot state is read) rather than
            the read table; default by launch size (``_checks.one_pass_config``).
        fast_launch: on CUDA, launch through the bound compiled kernel (see
            ``_launch.py``) rather than Triton's per-call binding; same kernel,
            same results.
        read_window: ``None`` (upstream's layout, below) or the drafter's
            window ``W`` in tokens (``>= block_size``): the window-bounded form,
            both forms alike. Each row then starts at ``base' = max(base,
            (new_ctx_len + block_size - W) // P)`` in place of ``base`` in every
            formula below, its entries past the block's last page are -1
            (``read_rows[b, j] = -1`` where ``(shift + j) * P >= new_ctx_len +
            block_size``), and the rows are ``ceil(W / P) + 1`` columns wide
            (``reference.window_read_width``; a wider ``out.read_rows`` gets -1
            past that). Reading ``[0, read_lens + block_size)`` tokens of a row
            then touches only the pages of the drafter's window and block,
            whatever the prompt length, and the launch writes ``B x (W/P + 1)``
            entries, not ``B x M``. Not with ``source_tiles=True``.

    Per row ``b`` with ``s = slot_ids[b]``, ``L = slot_ctx_len[s]``,
    ``base = slot_base_pages[s]``, ``n = num_new[b]``:

    * ``new_ctx_len = min(L + n, max_ctx)``
    * ``shift = min(base, extent)``; ``read_rows[b, j] = tables[b, shift + j]``
      if ``shift + j < extent`` else -1
    * ``read_lens = clamp(new_ctx_len - base*P, 0, (extent - shift)*P)``
    * ``query_pos[b, j] = new_ctx_len + j`` for ``j < block_size``
    * for ``i < max_new``: ``pos = L + i``, valid iff ``i < n`` and
      ``0 <= pos < max_ctx``; ``store_pages[b, i] = tables[b, pos // P]`` if
      valid and ``pos // P < M`` else -1; ``store_offsets[b, i] = pos % P`` if
      valid else -1 (ordinals of the unrebased table).

    No host synchronisation, no data-dependent shape: capturable in a CUDA graph
    when ``out`` is preallocated.
    """
    vectors = (slot_ids, slot_ctx_len, slot_base_pages, num_new)
    if table_rows is not None or table_first is not None:
        if table_rows is None or table_first is None or block_offsets is not None:
            raise ValueError("the ring form takes tables, extents, table_rows and table_first, and no block_offsets")
        return _prepare_ring(
            (tables, extents, table_rows, table_first, *vectors), block_size=block_size,
            tokens_per_block=tokens_per_block, max_ctx=max_ctx, max_new=max_new, out=out, impl=impl, block=block,
            num_warps=num_warps, fast_launch=fast_launch, read_window=read_window,
        )
    if block_offsets is not None or tables is None:
        return _prepare_one_pass(
            block_offsets, pool_idx, divisor, backend, tables, extents, vectors,
            block_size=block_size, tokens_per_block=tokens_per_block, max_ctx=max_ctx, max_new=max_new,
            out=out, impl=impl, block=block, num_warps=num_warps, split=split, fast_launch=fast_launch,
            source_tiles=source_tiles, read_window=read_window,
        )
    if pool_idx != 0 or divisor is not None or backend is not None or split is not None or source_tiles is not None:
        raise ValueError(
            "pool_idx, divisor, backend, split and source_tiles belong to the one-pass form (with block_offsets)"
        )
    tensors = (tables, extents, *vectors)
    dev, kw = check_prepare(
        tensors, block_size=block_size, tokens_per_block=tokens_per_block, max_ctx=max_ctx, max_new=max_new, out=out,
        read_window=read_window,
    )
    if not _dispatch.triton_runs(impl, dev):
        return prepare_paged_latent_reference(*tensors, out=out, **kw)
    B, M = tables.shape
    if out is None:
        out = PagedLatentPrep.empty(B, read_width(kw, M), kw["block_size"], kw["max_new"], device=dev)
    if B == 0:
        return out
    _launch_prepare(tensors, out, block, num_warps, fast_launch, **kw)
    return out


def _prepare_ring(
    tensors: tuple[torch.Tensor, ...],
    *,
    out: Optional[PagedLatentPrep],
    impl: Optional[str],
    block: Optional[int],
    num_warps: Optional[int],
    fast_launch: bool,
    **step: Any,
) -> PagedLatentPrep:
    """The ring form (checked), one launch."""
    dev, kw = check_ring(tensors, out=out, **step)
    tables = tensors[0]
    C = tables.shape[1]
    width = read_width(kw, C)
    if not _dispatch.triton_runs(impl, dev):
        return prepare_paged_latent_ring_reference(*tensors, out=out, read_width=None if out else width, **kw)
    B = tensors[2].shape[0]
    if out is None:
        out = PagedLatentPrep.empty(B, width, kw["block_size"], kw["max_new"], device=dev)
    if B == 0:
        return out
    grid, args, meta = ring_launch(tensors, out, kw, block, num_warps)
    _dispatch.launch("prepare_paged_latent_ring", dev, grid, args, fast_launch, **meta)
    return out


#: The ring form's largest block on a GPU, one entry per thread (``num_warps = block / 32``). Its
#: gathers from the ring wait on two rounds of scalar reads, so the replay is latency-bound: spread
#: over 128-thread programs, one entry a thread, it replays 8-12 % faster than in the one-warp,
#: 256-entry programs the generic sizing gives (H100 sweep of blocks and warps, ``benchmarks.ring_step``).
RING_BLOCK = 128


def ring_launch_size(B: int, out_w: int, block: Optional[int], num_warps: Optional[int], compiled: bool) -> tuple[int, int]:
    """``(block, num_warps)`` of the ring form's launch: read-row columns per program and its warps.
    Compiled, by default at most ``RING_BLOCK`` columns and one column per thread; interpreted, the
    generic big blocks. A caller's ``block`` or ``num_warps`` is kept."""
    blk = pick_block(B, out_w, block, not compiled)
    if compiled and block is None:
        blk = min(blk, RING_BLOCK)
    return blk, num_warps or (max(1, min(8, blk // 32)) if compiled else warps_for(blk))


def ring_launch(
    tensors: tuple[torch.Tensor, ...], out: PagedLatentPrep, kw: dict, block: Optional[int], num_warps: Optional[int],
    *, staged: bool = False, write_ctx: bool = False,
) -> tuple[tuple[int, int], tuple, dict]:
    """``(grid, args, constexprs)`` of the ring form's launch over checked arguments (``B > 0``). ``staged``,
    ``write_ctx``: its host-staged form (``staged_ring.py``), whose tensors name the staged scalars in
    every per-row and per-slot place (``slot_ctx_len`` in the length's place when it is written)."""
    tables = tensors[0]
    C = tables.shape[1]
    B = tensors[2].shape[0]
    out_w = out.read_rows.shape[1]
    blk, warps = ring_launch_size(B, out_w, block, num_warps, tables.device.type == "cuda")
    args = (
        tables, vec(tensors[1]), vec(tensors[3]), vec(tensors[2]), *(vec(t) for t in tensors[4:]),
        out.read_rows, out.read_lens, out.query_pos, out.store_pages, out.store_offsets, out.new_ctx_len,
        out.shift, C, kw["max_ctx"], kw["block_size"], kw["max_new"], tables.stride(0), tables.stride(1),
        out.read_rows.stride(0), kw["read_window"] or 0, out_w,
    )
    meta = dict(
        P=kw["tokens_per_block"],
        BLOCK=blk,
        QBLOCK=next_pow2(max(kw["block_size"], 1)),
        NBLOCK=next_pow2(max(kw["max_new"], 1)),
        WINDOWED=kw["read_window"] is not None,
        STAGED=staged,
        WRITE_CTX=write_ctx,
        num_warps=warps,
    )
    return (B, max(1, -(-out_w // blk))), args, meta


def _launch_prepare(
    tensors: tuple[torch.Tensor, ...],
    out: PagedLatentPrep,
    block: Optional[int],
    warps: Optional[int],
    fast: bool,
    *,
    block_size: int,
    tokens_per_block: int,
    max_ctx: int,
    max_new: int,
    read_window: Optional[int],
) -> None:
    """The one ``prepare_paged_latent`` launch (checked arguments, ``B > 0``)."""
    tables, *vectors = tensors
    B, M = tables.shape
    dev = tables.device
    out_w = out.read_rows.shape[1]
    blk = pick_block(B, out_w, block, dev.type != "cuda")
    grid = (B, max(1, -(-out_w // blk)))
    _dispatch.launch(
        "prepare_paged_latent",
        dev,
        grid,
        (
            tables,
            *(vec(t) for t in vectors),
            out.read_rows,
            out.read_lens,
            out.query_pos,
            out.store_pages,
            out.store_offsets,
            out.new_ctx_len,
            out.shift,
            M,
            max_ctx,
            block_size,
            max_new,
            tables.stride(0),
            tables.stride(1),
            out.read_rows.stride(0),
            read_window or 0,
            out_w,
        ),
        fast,
        P=tokens_per_block,
        BLOCK=blk,
        QBLOCK=next_pow2(max(block_size, 1)),
        NBLOCK=next_pow2(max(max_new, 1)),
        WINDOWED=read_window is not None,
        num_warps=warps or warps_for(blk),
    )


__all__ = [
    "BlockTables",
    "PagedLatentPrep",
    "RebasedTables",
    "decode_draft_block_table",
    "decode_draft_block_table_reference",
    "prepare_paged_latent",
    "prepare_paged_latent_one_pass_reference",
    "prepare_paged_latent_reference",
    "prepare_paged_latent_ring_reference",
    "rebase_block_table",
    "rebase_block_table_reference",
]
