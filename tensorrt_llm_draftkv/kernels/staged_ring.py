"""The ring-form step with its per-row scalars staged by the host: two rounds of device reads, not three.

The ring form of ``prepare_paged_latent`` reads, per batch row, the table row and the
slot, then their live span, base and length, then the ring's pages: three dependent
rounds of reads in a launch that is latency-bound. The host already knows every one of
those scalars (the table's host mirror, the slot table's host mirror, the accepted
counts) and copies one buffer to the device each step anyway (the counts). Here it
stages them all, one int64 row of ``ROW_SCALARS`` per batch row:

====  ==============  ===================================================
col   name            coordinates
====  ==============  ===================================================
0     ``table_row``   row ``r`` of the ring ``[R, C]``
1     ``first``       first live block ordinal of table row ``r`` (absolute)
2     ``extent``      one past its last backed ordinal (absolute)
3     ``base_pages``  the slot's base, in pages
4     ``ctx_len``     the slot's length ``L`` before the step (absolute tokens)
5     ``num_new``     tokens the row stores this step
6     ``slot``        the row's slot (written back when ``slot_ctx_len`` is given)
====  ==============  ===================================================

Results equal the ring form's on the same values (`prepare_paged_latent_ring_reference`
on table rows with those spans and slots with those lengths). With ``slot_ctx_len``, chunk
0 of each row also stores its ``new_ctx_len`` at ``slot_ctx_len[slot]``; the rows' slots
must then be distinct (one row per slot, as a generation step has).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import _dispatch
from . import _launch as _fl
from ._checks import check_step_out, check_step_sizes, check_int, read_width, same_device
from .bound_preparation import BoundLaunch
from .reference import PagedLatentPrep, prepare_paged_latent_ring_reference

ROW_SCALARS = ("table_row", "first", "extent", "base_pages", "ctx_len", "num_new", "slot")
#: int64 columns a staged row takes (the scalars and a pad: 64 bytes a row)
ROW_WIDTH = 8
_STAGED = "prepare_ring_staged"


def stage_row_scalars(
    out: np.ndarray, table_rows, first, extent, base_pages, ctx_len, num_new, slots
) -> np.ndarray:
    """Fill ``out`` (int64 ``[B, ROW_WIDTH]``, e.g. a pinned staging view) with the rows' scalars, each
    argument a length-``B`` sequence in batch-row order; returns ``out``."""
    for col, values in enumerate((table_rows, first, extent, base_pages, ctx_len, num_new, slots)):
        out[:, col] = values
    out[:, ROW_WIDTH - 1] = 0
    return out


def _check(pages: torch.Tensor, row_scalars: torch.Tensor, slot_ctx_len: Optional[torch.Tensor],
           out: Optional[PagedLatentPrep], **sizes) -> tuple[torch.device, dict]:
    check_int("pages", pages, 2)
    if pages.shape[1] < 1:
        raise ValueError("the ring form needs a table at least one column wide (ordinal o lives at column o % C)")
    if not (isinstance(row_scalars, torch.Tensor) and row_scalars.dtype is torch.int64 and row_scalars.dim() == 2
            and row_scalars.shape[1] == ROW_WIDTH and row_scalars.is_contiguous()):
        got = (f"{row_scalars.dtype} {tuple(row_scalars.shape)}" if isinstance(row_scalars, torch.Tensor)
               else type(row_scalars).__name__)
        raise ValueError(f"row_scalars must be a contiguous int64 [B, {ROW_WIDTH}] tensor, got {got}")
    kw = check_step_sizes(**sizes)
    tensors = (pages, row_scalars)
    if slot_ctx_len is not None:
        if not (isinstance(slot_ctx_len, torch.Tensor) and slot_ctx_len.dtype is torch.int64
                and slot_ctx_len.dim() == 1):
            raise ValueError("slot_ctx_len (written by the step) must be a 1-D int64 tensor")
        tensors = (*tensors, slot_ctx_len)
    dev = same_device(*tensors)
    if out is not None:
        check_step_out(out, row_scalars.shape[0], pages.shape[1], kw, dev)
    return dev, kw


def prepare_ring_staged_reference(
    pages: torch.Tensor,
    row_scalars: torch.Tensor,
    slot_ctx_len: Optional[torch.Tensor] = None,
    *,
    block_size: int,
    tokens_per_block: int,
    max_ctx: int,
    max_new: int,
    read_window: Optional[int] = None,
    out: Optional[PagedLatentPrep] = None,
) -> PagedLatentPrep:
    """Torch reference of :func:`prepare_ring_staged`: the ring form's reference with each batch row
    given its own table row (its ring row, span and slot taken from its staged scalars)."""
    s = row_scalars.to(torch.int64)
    B = s.shape[0]
    own = torch.arange(B, dtype=torch.int64, device=pages.device)
    width = out.read_rows.shape[1] if out is not None else None
    res = prepare_paged_latent_ring_reference(
        pages[s[:, 0]], s[:, 2], own, s[:, 1], own, s[:, 4], s[:, 3], s[:, 5], block_size=block_size,
        tokens_per_block=tokens_per_block, max_ctx=max_ctx, max_new=max_new, read_window=read_window,
        read_width=width,
    )
    if slot_ctx_len is not None and B:
        slot_ctx_len.index_copy_(0, s[:, 6], res.new_ctx_len)
    return out.copy_(res) if out is not None else res


def staged_launch(
    pages: torch.Tensor, row_scalars: torch.Tensor, slot_ctx_len: Optional[torch.Tensor], out: PagedLatentPrep,
    kw: dict, block: Optional[int], num_warps: Optional[int],
) -> tuple[tuple[int, int], tuple, dict]:
    """``(grid, args, constexprs)`` of a staged launch over checked arguments (``B > 0``): the ring form's
    launch, the staged scalars in every per-row and per-slot place, ``slot_ctx_len`` written if given."""
    from .spec_tail_kernels import ring_launch

    s = row_scalars
    ctx = slot_ctx_len if slot_ctx_len is not None else s
    return ring_launch((pages, s, s, s, s, ctx, s, s), out, kw, block, num_warps, staged=True,
                       write_ctx=slot_ctx_len is not None)


def prepare_ring_staged(
    pages: torch.Tensor,
    row_scalars: torch.Tensor,
    slot_ctx_len: Optional[torch.Tensor] = None,
    *,
    block_size: int,
    tokens_per_block: int,
    max_ctx: int,
    max_new: int,
    read_window: Optional[int] = None,
    out: Optional[PagedLatentPrep] = None,
    impl: Optional[str] = None,
    block: Optional[int] = None,
    num_warps: Optional[int] = None,
    fast_launch: bool = True,
) -> PagedLatentPrep:
    """One generation step's preparation from a manager's ring ``pages`` (int32 ``[R, C]``, ordinal ``o``
    of table row ``r`` at column ``o % C``) and the rows' staged scalars (int64 ``[B, ROW_WIDTH]``, see
    the module docstring), in one launch; outputs and sizes as ``prepare_paged_latent``'s ring form.
    ``slot_ctx_len`` (int64, optional): each row's ``new_ctx_len`` is also stored at its slot there."""
    dev, kw = _check(pages, row_scalars, slot_ctx_len, out, block_size=block_size,
                     tokens_per_block=tokens_per_block, max_ctx=max_ctx, max_new=max_new, read_window=read_window)
    if not _dispatch.triton_runs(impl, dev):
        return prepare_ring_staged_reference(pages, row_scalars, slot_ctx_len, out=out, **kw)
    B = row_scalars.shape[0]
    if out is None:
        out = PagedLatentPrep.empty(B, read_width(kw, pages.shape[1]), kw["block_size"], kw["max_new"], device=dev)
    if B == 0:
        return out
    grid, args, meta = staged_launch(pages, row_scalars, slot_ctx_len, out, kw, block, num_warps)
    _dispatch.launch(_STAGED, dev, grid, args, fast_launch, **meta)
    return out


class BoundStagedRing(BoundLaunch):
    """:func:`prepare_ring_staged` over fixed tensors (the ring, the staged scalars' device buffer, the
    slot lengths and ``out``): the first call is checked, the next ones are one driver launch each. The
    caller writes each step's scalars into ``row_scalars`` in place (one staged copy)."""

    kernel = _STAGED

    def __init__(self, pages: torch.Tensor, row_scalars: torch.Tensor, slot_ctx_len: Optional[torch.Tensor] = None,
                 *, out: PagedLatentPrep, block_size: int, tokens_per_block: int, max_ctx: int, max_new: int,
                 read_window: Optional[int] = None, impl: Optional[str] = None, block: Optional[int] = None,
                 num_warps: Optional[int] = None) -> None:
        if out is None:
            raise ValueError("BoundStagedRing needs preallocated outputs: out=PagedLatentPrep.empty(...)")
        self.tensors = (pages, row_scalars, slot_ctx_len)
        self.out = out
        self._step = dict(block_size=block_size, tokens_per_block=tokens_per_block, max_ctx=max_ctx,
                          max_new=max_new, read_window=read_window)
        self._tune = dict(impl=impl, block=block, num_warps=num_warps)
        self._bound: Optional[tuple] = None

    def _checked(self) -> PagedLatentPrep:
        got = prepare_ring_staged(*self.tensors, out=self.out, **self._step, **self._tune)
        self._bound = self._resolve()
        return got

    def _resolve(self) -> Optional[tuple]:
        pages, scalars, ctx = self.tensors
        dev = pages.device
        if dev.type != "cuda" or not _fl.ENABLED or self._tune["impl"] == "reference" or scalars.shape[0] == 0:
            return None
        _, kw = _check(pages, scalars, ctx, self.out, **self._step)
        grid, args, meta = staged_launch(pages, scalars, ctx, self.out, kw, self._tune["block"], self._tune["num_warps"])
        return self._resolve_launch(dev, grid, args, meta)


__all__ = [
    "BoundStagedRing",
    "ROW_SCALARS",
    "ROW_WIDTH",
    "prepare_ring_staged",
    "prepare_ring_staged_reference",
    "stage_row_scalars",
]
