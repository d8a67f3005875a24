"""The upstream-style eager generation-step preparation: the benchmark's baseline, not a library path.

``eager_prepare_paged_latent`` is what an eager drafter step would write: a
chain of many small torch ops with one host round trip (``.item()``) to size
the read gather. It takes the inputs of
:func:`tensorrt_llm_draftkv.kernels.prepare_paged_latent` (unrebased tables,
per-slot ``L`` in tokens and base in pages, accepted counts per row) and gives
results identical to ``prepare_paged_latent_reference``; ``benchmarks/kernels.py``
times the fused kernel against it. ``eager_step_from_offsets`` adds the eager
decode of the exported block offsets in front: the whole eager step the
one-pass form replaces.
"""
from __future__ import annotations

from typing import Optional

import torch

from tensorrt_llm_draftkv.kernels import PagedLatentPrep
from tensorrt_llm_draftkv.kernels.reference import BAD_PAGE


def eager_prepare_paged_latent(
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
    out: Optional[PagedLatentPrep] = None,
) -> PagedLatentPrep:
    """Upstream-style eager preparation: many small ops and a host round trip.

    Same inputs, outputs and results as :func:`prepare_paged_latent_reference`;
    written the way an eager drafter step is (per-slot gathers, separate
    clamps, an ``.item()`` to size the read gather to the widest rebased row,
    then a padded copy into the full-width table). Benchmark baseline only.
    """
    B, M = tables.shape
    P = tokens_per_block

    # per-row slot state (gathers)
    slot_ids_l = slot_ids.long()
    ctx_len = torch.index_select(slot_ctx_len.long(), 0, slot_ids_l)
    base_pages = torch.index_select(slot_base_pages.long(), 0, slot_ids_l)
    n_new = num_new.long()

    # context length after storing the accepted tokens, clamped at the maximum
    new_ctx_len = ctx_len + n_new
    new_ctx_len = torch.clamp(new_ctx_len, max=max_ctx)

    read_rows, read_lens, shift = _eager_reads(tables, extents, base_pages, new_ctx_len, P)

    # block decode query positions: bonus token + mask tokens
    query_pos = new_ctx_len.unsqueeze(1) + torch.arange(block_size, device=tables.device).unsqueeze(0)

    store_pages, store_offsets = _eager_stores(tables, ctx_len, n_new, P, max_ctx, max_new)

    res = PagedLatentPrep(
        read_rows=read_rows,
        read_lens=read_lens,
        query_pos=query_pos,
        store_pages=store_pages,
        store_offsets=store_offsets,
        new_ctx_len=new_ctx_len,
        shift=shift,
    )
    if out is not None:
        return out.copy_(res)
    return res


def _eager_reads(
    tables: torch.Tensor, extents: torch.Tensor, base_pages: torch.Tensor, new_ctx_len: torch.Tensor, P: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(read_rows, read_lens, shift)``: rebased rows (pages) and read lengths (tokens), one host sync."""
    B, M = tables.shape
    dev = tables.device
    # extent of each row and how far the base shifts it
    extent = extents.long()
    extent = torch.clamp(extent, min=0)
    extent = torch.clamp(extent, max=M)
    shift = torch.minimum(base_pages, extent)
    shift = torch.clamp(shift, min=0)
    rebased_extent = extent - shift

    # host round trip: size the gather to the widest rebased row
    widest = int(rebased_extent.max().item()) if B > 0 else 0
    read_rows = torch.full((B, M), BAD_PAGE, dtype=torch.int32, device=dev)
    if widest > 0:
        cols = torch.arange(widest, device=dev)
        src = cols.unsqueeze(0) + shift.unsqueeze(1)
        inside = cols.unsqueeze(0) < rebased_extent.unsqueeze(1)
        src = torch.where(inside, src, torch.zeros_like(src))
        gathered = torch.gather(tables, 1, src)
        gathered = gathered.masked_fill(~inside, BAD_PAGE)
        read_rows[:, :widest] = gathered

    # read length in rebased coordinates
    read_lens = new_ctx_len - base_pages * P
    read_lens = torch.clamp(read_lens, min=0)
    read_lens = torch.minimum(read_lens, rebased_extent * P)
    return read_rows, read_lens, shift


def _eager_stores(
    tables: torch.Tensor, ctx_len: torch.Tensor, n_new: torch.Tensor, P: int, max_ctx: int, max_new: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(store_pages, store_offsets)`` of the accepted tokens (unrebased ordinals)."""
    M = tables.shape[1]
    dev = tables.device
    steps = torch.arange(max_new, device=dev).unsqueeze(0)
    positions = ctx_len.unsqueeze(1) + steps
    valid = steps < n_new.unsqueeze(1)
    valid = valid & (positions < max_ctx)
    valid = valid & (positions >= 0)
    ordinals = torch.div(positions, P, rounding_mode="floor")
    in_table = valid & (ordinals < M)
    safe = torch.where(in_table, ordinals, torch.zeros_like(ordinals))
    if M > 0:
        pages = torch.gather(tables, 1, safe)
    else:
        pages = torch.zeros_like(safe, dtype=torch.int32)
    store_pages = pages.masked_fill(~in_table, BAD_PAGE).to(torch.int32)
    offsets = torch.remainder(positions, P)
    store_offsets = offsets.masked_fill(~valid, BAD_PAGE).to(torch.int32)
    return store_pages, store_offsets


def eager_decode_block_offsets(
    block_offsets: torch.Tensor, pool_idx: int, num_seqs: int, divisor: int, backend: str = "cpp"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream-style eager decode of one pool's exported offsets: ``(tables, extents)``.

    Tables are int32 ``[num_seqs, M]`` pages (-1 unbacked); extents int64
    ``[num_seqs]`` (``M`` for every row with the ``"cpp"`` export, else
    ``1 + last backed ordinal``). Same results as
    ``decode_draft_block_table_reference``; written as separate small ops.
    """
    k = block_offsets[pool_idx, :num_seqs, 0]
    k = k.long()
    M = k.shape[1]
    backed = k >= 0
    pages = torch.div(k, divisor, rounding_mode="floor")
    tables = torch.where(backed, pages, torch.full_like(pages, BAD_PAGE)).to(torch.int32)
    if backend == "cpp":
        extents = torch.full((num_seqs,), M, dtype=torch.int64, device=k.device)
    elif M == 0:
        extents = torch.zeros((num_seqs,), dtype=torch.int64, device=k.device)
    else:
        ordinals = torch.arange(1, M + 1, device=k.device).unsqueeze(0).expand(num_seqs, M)
        extents = torch.where(backed, ordinals, torch.zeros_like(ordinals)).max(dim=1).values
    return tables, extents


def eager_step_from_offsets(
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
) -> PagedLatentPrep:
    """The whole upstream-style eager step from exported offsets: eager decode, then eager preparation.

    Same results as ``prepare_paged_latent_one_pass_reference`` (extents included).
    """
    tables, extents = eager_decode_block_offsets(block_offsets, pool_idx, slot_ids.shape[0], divisor, backend)
    res = eager_prepare_paged_latent(
        tables, extents, slot_ids, slot_ctx_len, slot_base_pages, num_new,
        block_size=block_size, tokens_per_block=tokens_per_block, max_ctx=max_ctx, max_new=max_new,
    )
    res.extents = extents
    return res


__all__ = ["eager_decode_block_offsets", "eager_prepare_paged_latent", "eager_step_from_offsets"]
