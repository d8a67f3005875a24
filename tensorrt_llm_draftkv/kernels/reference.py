"""Plain-torch references of the draft-KV block-table kernels, and their result types.

Every function here is the specification its Triton counterpart in
``spec_tail_kernels.py`` is tested against. They take and return the same
tensors (see ``spec_tail_kernels.py`` for the full shape/dtype contract and the
coordinates: block ordinals, pages, extents, slot positions) and work on any
device.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple, Optional

import torch

BAD_PAGE = -1  # value of an unbacked entry in every table this module returns


class BlockTables(NamedTuple):
    """Result of ``decode_draft_block_table``: ``(tables, extents)``."""

    tables: torch.Tensor  # int32 [num_seqs, M]
    extents: torch.Tensor  # int64 [num_seqs]


class RebasedTables(NamedTuple):
    """Result of ``rebase_block_table``: ``(rows, extents, shift)``."""

    rows: torch.Tensor  # int32 [B, M]
    extents: torch.Tensor  # int64 [B]
    shift: torch.Tensor  # int64 [B]


@dataclass
class PagedLatentPrep:
    """Outputs of one DFlash generation-step preparation (``B`` rows).

    ====================  =====  ================  =========================================
    field                 dtype  shape             meaning
    ====================  =====  ================  =========================================
    ``read_rows``         int32  [B, M]            rebased read table, -1 past the extent
    ``read_lens``         int64  [B]               tokens the block decode reads (rebased)
    ``query_pos``         int64  [B, block_size]   absolute positions of the block queries
    ``store_pages``       int32  [B, max_new]      page of each accepted token, -1 = no store
    ``store_offsets``     int32  [B, max_new]      slot inside that page, -1 = no store
    ``new_ctx_len``       int64  [B]               slot context length after the step
    ``shift``             int64  [B]               ordinals the read row was shifted by
    ``extents``           int64  [B]               extent of each unrebased row (one-pass
                                                   form only; ``None`` from the two-step form)
    ====================  =====  ================  =========================================
    """

    read_rows: torch.Tensor
    read_lens: torch.Tensor
    query_pos: torch.Tensor
    store_pages: torch.Tensor
    store_offsets: torch.Tensor
    new_ctx_len: torch.Tensor
    shift: torch.Tensor
    extents: Optional[torch.Tensor] = None

    @classmethod
    def empty(
        cls,
        num_rows: int,
        max_blocks: int,
        block_size: int,
        max_new: int,
        device: str | torch.device = "cpu",
        with_extents: bool = False,
    ) -> "PagedLatentPrep":
        """Allocate (uninitialised) outputs, e.g. once before a CUDA-graph capture.

        ``with_extents``: also allocate ``extents`` (needed by the one-pass form).
        """
        i32, i64 = torch.int32, torch.int64
        B = num_rows
        return cls(
            read_rows=torch.empty((B, max_blocks), dtype=i32, device=device),
            read_lens=torch.empty((B,), dtype=i64, device=device),
            query_pos=torch.empty((B, block_size), dtype=i64, device=device),
            store_pages=torch.empty((B, max_new), dtype=i32, device=device),
            store_offsets=torch.empty((B, max_new), dtype=i32, device=device),
            new_ctx_len=torch.empty((B,), dtype=i64, device=device),
            shift=torch.empty((B,), dtype=i64, device=device),
            extents=torch.empty((B,), dtype=i64, device=device) if with_extents else None,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Field name -> tensor, in declaration order; a field that is ``None`` is left out."""
        return {f.name: t for f in fields(self) if (t := getattr(self, f.name)) is not None}

    def copy_(self, other: "PagedLatentPrep") -> "PagedLatentPrep":
        """Copy ``other`` into this one's tensors (a field ``other`` lacks is left as it is)."""
        for name, t in self.tensors().items():
            src = getattr(other, name)
            if src is not None:
                t.copy_(src)
        return self


# --------------------------------------------------------------------------- references


def decode_draft_block_table_reference(
    block_offsets: torch.Tensor,
    pool_idx: int,
    num_seqs: int,
    divisor: int,
    backend: str = "cpp",
    out: Optional[BlockTables] = None,
) -> BlockTables:
    """Torch reference of :func:`~tensorrt_llm_draftkv.kernels.decode_draft_block_table`."""
    k = block_offsets[pool_idx, :num_seqs, 0].to(torch.int64)  # [num_seqs, M]
    n, M = k.shape
    backed = k >= 0
    tables = torch.where(backed, torch.div(k, divisor, rounding_mode="floor"), BAD_PAGE)
    tables = tables.to(torch.int32)
    if backend == "cpp":
        extents = torch.full((n,), M, dtype=torch.int64, device=k.device)
    elif M == 0:
        extents = torch.zeros((n,), dtype=torch.int64, device=k.device)
    else:
        one_past = torch.arange(1, M + 1, dtype=torch.int64, device=k.device)
        extents = torch.where(backed, one_past, 0).amax(dim=1)
    if out is not None:
        out.tables.copy_(tables)
        out.extents.copy_(extents)
        return BlockTables(out.tables, out.extents)
    return BlockTables(tables, extents)


def _rebase(
    tables: torch.Tensor, extents: torch.Tensor, base_pages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared by the rebase and prepare references: (rows, new_extents, shift)."""
    B, M = tables.shape
    dev = tables.device
    ext = extents.to(torch.int64).clamp(0, M)
    shift = torch.minimum(base_pages.to(torch.int64), ext).clamp_min(0)
    src = shift[:, None] + torch.arange(M, dtype=torch.int64, device=dev)[None, :]
    inside = src < ext[:, None]
    gathered = tables.to(torch.int64).gather(1, torch.where(inside, src, 0)) if M else src
    rows = torch.where(inside, gathered, BAD_PAGE).to(torch.int32)
    return rows, ext - shift, shift


def rebase_block_table_reference(
    tables: torch.Tensor,
    extents: torch.Tensor,
    base_pages: torch.Tensor,
    out: Optional[RebasedTables] = None,
) -> RebasedTables:
    """Torch reference of :func:`~tensorrt_llm_draftkv.kernels.rebase_block_table`."""
    rows, new_ext, shift = _rebase(tables, extents, base_pages)
    if out is not None:
        out.rows.copy_(rows)
        out.extents.copy_(new_ext)
        out.shift.copy_(shift)
        return RebasedTables(out.rows, out.extents, out.shift)
    return RebasedTables(rows, new_ext, shift)


def window_read_width(read_window: int, tokens_per_block: int) -> int:
    """Columns of a window-bounded read row: ``ceil(W / P) + 1`` ordinals (pages).

    The context a block decode reads plus the block itself span at most the
    last ``W`` slot positions up to the block's end; those touch at most
    ``ceil(W / P) + 1`` pages, whatever the prompt length.
    """
    if read_window < 1 or tokens_per_block < 1:
        raise ValueError(
            f"read_window ({read_window} tokens) and tokens_per_block ({tokens_per_block}) must be >= 1"
        )
    return -(-read_window // tokens_per_block) + 1


def window_read_base(
    base: torch.Tensor, new_ctx: torch.Tensor, *, block_size: int, tokens_per_block: int, read_window: int
) -> torch.Tensor:
    """First ordinal a window-bounded row reads: the slot base or the window's first page, the higher.

    ``base`` (pages) and ``new_ctx`` (slot positions, tokens) per row; the
    window's first slot position is ``new_ctx + block_size - read_window``.
    """
    first = (new_ctx + block_size - read_window).clamp_min(0) // tokens_per_block
    return torch.maximum(base, first)


def prepare_paged_latent_reference(
    tables: torch.Tensor,
    extents: torch.Tensor,
    slot_ids: torch.Tensor,
    slot_ctx_len: torch.Tensor,
    slot_base_pages: torch.Tensor,
    num_new: torch.Tensor,
    *,
    block_size: int,
    tokens_per_block: int,
    max_ctx: int,
    max_new: int,
    read_window: Optional[int] = None,
    read_width: Optional[int] = None,
    out: Optional[PagedLatentPrep] = None,
) -> PagedLatentPrep:
    """Torch reference of :func:`~tensorrt_llm_draftkv.kernels.prepare_paged_latent`.

    ``read_window=None``: upstream's layout, rows ``[B, M]`` from the slot base.
    ``read_window=W``: rows from :func:`window_read_base`, live only over the
    context and block (``(shift + j) * P < new_ctx_len + block_size``), -1
    elsewhere, ``read_width`` columns (default: ``out.read_rows``' width, else
    :func:`window_read_width`).
    """
    B, M = tables.shape
    dev = tables.device
    P = tokens_per_block
    sid = slot_ids.to(torch.int64)
    L = slot_ctx_len.to(torch.int64)[sid]
    base = slot_base_pages.to(torch.int64)[sid]
    n = num_new.to(torch.int64)

    new_ctx = torch.clamp(L + n, max=max_ctx)
    if read_window is not None:
        base = window_read_base(base, new_ctx, block_size=block_size, tokens_per_block=P, read_window=read_window)
    rows, rebased_ext, shift = _rebase(tables, extents, base)
    if read_window is not None:
        if read_width is None:
            read_width = out.read_rows.shape[1] if out is not None else window_read_width(read_window, P)
        rows = _bound_rows(rows, shift, new_ctx + block_size, P, read_width)
    read_lens = torch.minimum((new_ctx - base * P).clamp_min(0), rebased_ext * P)
    query_pos = new_ctx[:, None] + torch.arange(block_size, dtype=torch.int64, device=dev)

    i = torch.arange(max_new, dtype=torch.int64, device=dev)[None, :]
    pos = L[:, None] + i
    valid = (i < n[:, None]) & (pos < max_ctx) & (pos >= 0)
    ordinal = torch.where(valid, pos, 0) // P
    in_table = valid & (ordinal < M)
    if M:
        pages = tables.to(torch.int64).gather(1, torch.where(in_table, ordinal, 0))
    else:
        pages = ordinal
    store_pages = torch.where(in_table, pages, BAD_PAGE).to(torch.int32)
    store_offsets = torch.where(valid, pos % P, BAD_PAGE).to(torch.int32)

    res = PagedLatentPrep(
        read_rows=rows,
        read_lens=read_lens,
        query_pos=query_pos,
        store_pages=store_pages,
        store_offsets=store_offsets,
        new_ctx_len=new_ctx,
        shift=shift,
    )
    if out is not None:
        return out.copy_(res)
    return res


def _bound_rows(rows: torch.Tensor, shift: torch.Tensor, end: torch.Tensor, P: int, width: int) -> torch.Tensor:
    """Rebased rows cut to ``width`` columns, -1 at every column whose page starts at or past ``end`` (tokens)."""
    B, M = rows.shape
    if width > M:
        rows = torch.cat([rows, torch.full((B, width - M), BAD_PAGE, dtype=rows.dtype, device=rows.device)], 1)
    rows = rows[:, :width]
    col = torch.arange(width, dtype=torch.int64, device=rows.device)[None, :]
    live = (shift[:, None] + col) * P < end[:, None]
    return torch.where(live, rows, BAD_PAGE).to(torch.int32)


def ring_entries(
    tables: torch.Tensor, extents: torch.Tensor, table_rows: torch.Tensor, table_first: torch.Tensor,
    ordinals: torch.Tensor,
) -> torch.Tensor:
    """Pages of absolute block ``ordinals`` ``[B, K]`` read from a ring table, -1 outside each live span.

    Batch row ``b`` reads table row ``r = table_rows[b]`` of ``tables`` ``[R, C]``, which
    holds ordinal ``o`` at column ``o % C`` for ``table_first[r] <= o < min(extents[r],
    table_first[r] + C)`` (its live span).
    """
    r = table_rows.to(torch.int64)
    C = tables.shape[1]
    first, ext = ring_span(extents, table_first, r, C)
    inside = (ordinals >= first[:, None]) & (ordinals < ext[:, None])
    if C == 0:
        return torch.full_like(ordinals, BAD_PAGE, dtype=torch.int32)
    cols = torch.where(inside, ordinals, 0) % C
    pages = tables[r].to(torch.int64).gather(1, cols)
    return torch.where(inside, pages, BAD_PAGE).to(torch.int32)


def ring_span(
    extents: torch.Tensor, table_first: torch.Tensor, rows: torch.Tensor, C: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, extent)`` (absolute ordinals) of table rows ``rows``; the extent clamped into ``[0, first + C]``."""
    first = table_first.to(torch.int64)[rows]
    ext = torch.minimum(extents.to(torch.int64)[rows].clamp_min(0), first + C)
    return first, ext


def prepare_paged_latent_ring_reference(
    tables: torch.Tensor,
    extents: torch.Tensor,
    table_rows: torch.Tensor,
    table_first: torch.Tensor,
    slot_ids: torch.Tensor,
    slot_ctx_len: torch.Tensor,
    slot_base_pages: torch.Tensor,
    num_new: torch.Tensor,
    *,
    block_size: int,
    tokens_per_block: int,
    max_ctx: int,
    max_new: int,
    read_window: Optional[int] = None,
    read_width: Optional[int] = None,
    out: Optional[PagedLatentPrep] = None,
) -> PagedLatentPrep:
    """Torch reference of the ring form of :func:`~tensorrt_llm_draftkv.kernels.prepare_paged_latent`.

    Defined as the two-step form on each row's absolute ``"python"`` table (ordinal
    ``o`` -> :func:`ring_entries`, extents as given), without ever building it: every
    ordinal the step reads or stores is looked up in the ring. Rows are ``read_width``
    columns (default: ``out.read_rows``' width, else :func:`window_read_width` with a
    window, else the ring's width ``C``).
    """
    B = slot_ids.shape[0]
    C = tables.shape[1]
    dev = tables.device
    P = tokens_per_block
    r = table_rows.to(torch.int64)
    sid = slot_ids.to(torch.int64)
    L = slot_ctx_len.to(torch.int64)[sid]
    base = slot_base_pages.to(torch.int64)[sid]
    n = num_new.to(torch.int64)
    _, ext = ring_span(extents, table_first, r, C)

    new_ctx = torch.clamp(L + n, max=max_ctx)
    if read_window is not None:
        base = window_read_base(base, new_ctx, block_size=block_size, tokens_per_block=P, read_window=read_window)
    if read_width is None:
        read_width = out.read_rows.shape[1] if out is not None else (
            window_read_width(read_window, P) if read_window is not None else C)
    shift = torch.minimum(base, ext).clamp_min(0)
    src = shift[:, None] + torch.arange(read_width, dtype=torch.int64, device=dev)[None, :]
    rows = ring_entries(tables, extents, r, table_first, src)
    if read_window is not None:
        rows = torch.where(src * P < (new_ctx + block_size)[:, None], rows, BAD_PAGE).to(torch.int32)
    read_lens = torch.minimum((new_ctx - base * P).clamp_min(0), (ext - shift) * P)
    query_pos = new_ctx[:, None] + torch.arange(block_size, dtype=torch.int64, device=dev)

    i = torch.arange(max_new, dtype=torch.int64, device=dev)[None, :]
    pos = L[:, None] + i
    valid = (i < n[:, None]) & (pos < max_ctx) & (pos >= 0)
    ordinal = torch.where(valid, pos, -1) // P
    store_pages = torch.where(valid, ring_entries(tables, extents, r, table_first, ordinal), BAD_PAGE)
    store_offsets = torch.where(valid, pos % P, BAD_PAGE).to(torch.int32)
    res = PagedLatentPrep(
        read_rows=rows.reshape(B, read_width),
        read_lens=read_lens,
        query_pos=query_pos,
        store_pages=store_pages.to(torch.int32),
        store_offsets=store_offsets,
        new_ctx_len=new_ctx,
        shift=shift,
    )
    if out is not None:
        return out.copy_(res)
    return res


def prepare_paged_latent_one_pass_reference(
    block_offsets: torch.Tensor,
    pool_idx: int,
    divisor: int,
    backend: str,
    slot_ids: torch.Tensor,
    slot_ctx_len: torch.Tensor,
    slot_base_pages: torch.Tensor,
    num_new: torch.Tensor,
    *,
    block_size: int,
    tokens_per_block: int,
    max_ctx: int,
    max_new: int,
    read_window: Optional[int] = None,
    out: Optional[PagedLatentPrep] = None,
) -> PagedLatentPrep:
    """Torch reference of the one-pass form of :func:`~tensorrt_llm_draftkv.kernels.prepare_paged_latent`.

    By definition the two-step composition: decode rows ``0 .. B-1`` of pool
    ``pool_idx`` (``B = len(slot_ids)``), then prepare from those tables and
    extents; the result also carries the decoded extents.
    """
    B = slot_ids.shape[0]
    bt = decode_draft_block_table_reference(block_offsets, pool_idx, B, divisor, backend)
    res = prepare_paged_latent_reference(
        bt.tables, bt.extents, slot_ids, slot_ctx_len, slot_base_pages, num_new,
        block_size=block_size, tokens_per_block=tokens_per_block, max_ctx=max_ctx, max_new=max_new,
        read_window=read_window, read_width=None if out is None else out.read_rows.shape[1],
    )
    res = PagedLatentPrep(**{**res.tensors(), "extents": bt.extents})
    if out is not None:
        return out.copy_(res)
    return res
