"""A one-pass step preparation bound to fixed tensors: the launch an executor repeats every step.

An executor that keeps its step inputs in static buffers (the exported block
offsets, the slot state, the accepted counts, the outputs, as it must anyway to
replay a CUDA graph) launches the same preparation every step with the same
pointers. :class:`BoundPreparation` checks that call once, then relaunches the
compiled kernel with every argument already resolved: no argument checks, no
launch-class key, no Triton binding, only the driver launch on the current
stream. It is the direct-call counterpart of capturing the step in a graph.

Contract (as for CUDA-graph inputs): the bound tensors keep their storage; write
new values into them in place (``copy_``, ``fill_``, indexing), never
``resize_``/``set_`` them or rebind the names. After such a change call
:meth:`BoundPreparation.rebind`. The object holds references to every tensor,
so none of them is freed while it lives.

Off CUDA (interpreter or torch reference), under a launch hook (profilers), or
on another current device, a call simply runs the checked
:func:`prepare_paged_latent` again, with the same results.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from . import _dispatch
from . import _launch as _fl
from . import _one_pass_call
from . import spec_tail_kernels as _api
from .reference import PagedLatentPrep

_ONE_PASS = "prepare_paged_latent_one_pass"


class BoundLaunch:
    """A step preparation over fixed tensors: the first call (or the first after :meth:`rebind`) is the
    subclass's checked call (`_checked`, which resolves `_bound`); the next ones relaunch it."""

    #: the kernel's name in `LAUNCH_COUNTS`
    kernel = ""
    out: PagedLatentPrep
    _bound: Optional[tuple] = None

    def rebind(self) -> None:
        """Forget the resolved launch (after a bound tensor's storage changed); the next call checks again."""
        self._bound = None

    @property
    def is_bound(self) -> bool:
        """Whether the next call relaunches without checks (CUDA, after a first checked call)."""
        return self._bound is not None

    def __call__(self) -> PagedLatentPrep:
        """Launch the step; returns ``out``. No host synchronisation; capturable in a CUDA graph."""
        bound = self._bound
        if bound is not None and not _fl.hooked() and torch.cuda.current_device() == bound[2]:
            run, grid, index, args = bound
            run(grid[0], grid[1], 1, _fl.raw_stream(index), *args)
            _dispatch.LAUNCH_COUNTS[self.kernel] += 1
            return self.out
        return self._checked()

    def _checked(self) -> PagedLatentPrep:
        raise NotImplementedError

    def _resolve_launch(self, device: torch.device, grid: tuple[int, int], args: tuple, meta: dict) -> Optional[tuple]:
        """``(run, grid, device index, launcher args)`` of this kernel's compiled launch over checked
        ``args`` and ``meta`` (None where the fast launcher cannot take it)."""
        from . import _triton_kernels as _tk

        index = device.index if device.index is not None else torch.cuda.current_device()
        resolved = _fl.resolve(_tk.get_kernel(self.kernel, False), index, args, meta)
        if resolved is None:
            return None
        run, launcher_args = resolved
        return run, grid, index, launcher_args


class BoundPreparation(BoundLaunch):
    """``prepare_paged_latent``'s one-pass form over fixed tensors; calling it launches the step.

    Arguments are those of :func:`prepare_paged_latent`'s one-pass form (the
    coordinates are the same: ``block_offsets`` ``[num_pools, B', 2, M]`` as
    exported, slot state in absolute token positions, outputs in block ordinals
    of the rebased table), with ``out`` required so the outputs are fixed too.
    The first call (or the first after :meth:`rebind`) is a checked call; the
    next ones relaunch it.
    """

    kernel = _ONE_PASS

    def __init__(
        self,
        block_offsets: torch.Tensor,
        slot_ids: torch.Tensor,
        slot_ctx_len: torch.Tensor,
        slot_base_pages: torch.Tensor,
        num_new: torch.Tensor,
        *,
        out: PagedLatentPrep,
        block_size: int,
        tokens_per_block: int,
        max_ctx: int,
        max_new: int,
        pool_idx: int = 0,
        divisor: Optional[int] = None,
        backend: Optional[str] = None,
        impl: Optional[str] = None,
        **tune: Any,
    ) -> None:
        if out is None:
            raise ValueError("BoundPreparation needs preallocated outputs: out=PagedLatentPrep.empty(..., "
                             "with_extents=True)")
        self.block_offsets = block_offsets
        self.vectors = (slot_ids, slot_ctx_len, slot_base_pages, num_new)
        self.out = out
        self._kw = dict(block_size=block_size, tokens_per_block=tokens_per_block, max_ctx=max_ctx,
                        max_new=max_new, pool_idx=pool_idx, divisor=divisor, backend=backend, impl=impl, **tune)
        self._bound: Optional[tuple] = None

    def _checked(self) -> PagedLatentPrep:
        kw = self._kw
        got = _api.prepare_paged_latent(None, None, *self.vectors, block_offsets=self.block_offsets, out=self.out,
                                        **kw)
        if kw["impl"] != "reference" and kw.get("fast_launch", True):
            args = {k: v for k, v in kw.items() if k not in ("impl", "fast_launch")}
            self._bound = _one_pass_call.bound_launch(self.block_offsets, self.vectors, self.out, **args)
        return got


__all__ = ["BoundLaunch", "BoundPreparation"]
