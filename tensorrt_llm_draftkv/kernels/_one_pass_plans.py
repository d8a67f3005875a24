"""Remembered launches of the one-pass preparation: a call whose signature was checked once
launches its compiled kernel again without the checks or Triton's argument binding.

A *plan* is keyed by everything the checks and the launch sizing depend on
(`plan_key`); `_dispatch.launch` records one after a checked fast launch
(`remember_plan`) and `_one_pass_call` tries it first on the next call (`launch_planned`).
"""
from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import torch

from . import _launch as _fl
from .reference import PagedLatentPrep

#: call signature of a checked one-pass call -> (kernel, stream device, grid, int args, constexprs)
_PLANS: dict[tuple, tuple] = {}
_PLAN_LIMIT = 4096  # a bound on distinct signatures kept (plans are tiny)
_fl.ON_CLEAR.append(_PLANS.clear)


def plan_key(
    block_offsets: Optional[torch.Tensor],
    vectors: tuple[torch.Tensor, ...],
    out: PagedLatentPrep,
    tables: Optional[torch.Tensor],
    extents: Optional[torch.Tensor],
    pool_idx: Any,
    divisor: Any,
    backend: Any,
    block_size: Any,
    tokens_per_block: Any,
    max_new: Any,
    block: Any,
    num_warps: Any,
    split: Any,
    source_tiles: Any,
    read_window: Any = None,
) -> Optional[tuple]:
    """Everything the checks and the launch sizing of a one-pass call depend on, except ``max_ctx``.

    Two calls with equal keys pass the same checks and launch the same compiled
    kernel on the same grid; only data pointers and ``max_ctx`` differ. Inputs
    enter by dtype, shape, strides and device; the preallocated outputs by
    identity (the plan holds weak references to them, so an id is never
    mistaken for a dead tensor's; an output whose shape is changed in place with
    ``resize_``/``set_`` after it was checked is not checked again). ``None``
    when the call is not eligible (then the checked path runs and raises the
    documented errors).
    """
    if block_offsets is None or tables is not None or extents is not None or out.extents is None:
        return None
    if not (type(block_offsets) is torch.Tensor and block_offsets.is_cuda):
        return None
    sid, ctx, base, n = vectors
    o = out
    try:
        return (
            block_offsets.dtype, block_offsets.shape, block_offsets.stride(), block_offsets.get_device(),
            sid.dtype, sid.shape, sid.stride(), sid.get_device(),
            ctx.dtype, ctx.shape, ctx.stride(), ctx.get_device(),
            base.dtype, base.shape, base.stride(), base.get_device(),
            n.dtype, n.shape, n.stride(), n.get_device(),
            # outputs by identity: the plan keeps weak references and re-checks them
            id(o.read_rows), id(o.read_lens), id(o.query_pos), id(o.store_pages),
            id(o.store_offsets), id(o.new_ctx_len), id(o.shift), id(o.extents),
            type(pool_idx), pool_idx, type(divisor), divisor, backend,
            type(block_size), block_size, type(tokens_per_block), tokens_per_block, type(max_new), max_new,
            block, num_warps, split, source_tiles, type(read_window), read_window,
        )
    except (AttributeError, TypeError):  # not tensors: the checked path says what is wrong
        return None


def remember_plan(key: tuple, ck: Any, index: int, grid: tuple, args: Sequence, meta: dict, kern: Any) -> None:
    ints = tuple(a for a in args if not isinstance(a, torch.Tensor))
    outs = tuple(weakref.ref(t) for t in args[5:13])
    order = tuple(kern.arg_names[len(args):])
    consts = tuple(meta[name] for name in order)
    rows_aligned = (args[5].data_ptr() & 15) == 0
    if len(_PLANS) >= _PLAN_LIMIT:
        _PLANS.clear()
    _PLANS[key + (rows_aligned, -(2**31) <= int(args[19]) < 2**31)] = (ck, index, grid, ints, consts, outs)


def _launch_args(plan: tuple, block_offsets: torch.Tensor, vectors: tuple[torch.Tensor, ...],
                 out: PagedLatentPrep, max_ctx: int) -> tuple:
    """The compiled launcher's arguments after the stream, in the kernel's signature order."""
    ck, _, _, ints, consts, _ = plan
    sid, ctx, base, n = vectors
    o = out
    # ints: M, rows_q, pool_off, s_ob, s_om, divisor, max_ctx (replaced), block_size, max_new, window, out_w
    return (
        ck.function, ck.packed_metadata, None, None, None,
        block_offsets.data_ptr(), sid.data_ptr(), ctx.data_ptr(), base.data_ptr(), n.data_ptr(),
        o.read_rows.data_ptr(), o.read_lens.data_ptr(), o.query_pos.data_ptr(), o.store_pages.data_ptr(),
        o.store_offsets.data_ptr(), o.new_ctx_len.data_ptr(), o.shift.data_ptr(), o.extents.data_ptr(),
        ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], max_ctx, ints[7], ints[8], ints[9], ints[10], *consts,
    )


def _plan_for(key: tuple, out: PagedLatentPrep, max_ctx: int) -> Optional[tuple]:
    return _PLANS.get(key + ((out.read_rows.data_ptr() & 15) == 0, max_ctx < 2**31))


def launch_planned(
    key: tuple, block_offsets: torch.Tensor, vectors: tuple[torch.Tensor, ...], out: PagedLatentPrep, max_ctx: Any
) -> bool:
    """Launch a one-pass call whose signature was checked before; ``False`` if it was not (then nothing ran)."""
    if type(max_ctx) is not int or max_ctx < 0 or _fl.hooked():
        return False
    plan = _plan_for(key, out, max_ctx)
    if plan is None:
        return False
    ck, index, grid, _, _, outs = plan
    o = out
    if (
        outs[0]() is not o.read_rows or outs[1]() is not o.read_lens or outs[2]() is not o.query_pos
        or outs[3]() is not o.store_pages or outs[4]() is not o.store_offsets or outs[5]() is not o.new_ctx_len
        or outs[6]() is not o.shift or outs[7]() is not o.extents or torch.cuda.current_device() != index
    ):
        return False
    ck.run(grid[0], grid[1], 1, _fl.raw_stream(index), *_launch_args(plan, block_offsets, vectors, out, max_ctx))
    return True


def bound_launch(
    key: tuple, block_offsets: torch.Tensor, vectors: tuple[torch.Tensor, ...], out: PagedLatentPrep, max_ctx: int
) -> Optional[tuple[Any, tuple[int, int], int, tuple]]:
    """``(run, grid, device index, args after the stream)`` of a checked plan, every pointer resolved now.

    For a caller that launches the very same tensors again and again (static
    buffers): ``run(grid[0], grid[1], 1, stream, *args)`` is then the whole
    launch. ``None`` when no plan matches (nothing was launched through one yet).
    """
    plan = _plan_for(key, out, max_ctx)
    if plan is None:
        return None
    ck, index, grid = plan[:3]
    return ck.run, grid, index, _launch_args(plan, block_offsets, vectors, out, max_ctx)
