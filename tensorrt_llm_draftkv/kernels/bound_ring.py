"""The ring-form step preparation bound to fixed tensors: checked once, then one driver launch per call.

The generation step of a drafter that reads the draft manager's device block table
(``prepare_paged_latent``'s ring form) launches the same kernel every step over
tensors an executor keeps anyway: the table's ring (``pages``, ``extent``,
``first``, and the batch rows' ``rows``), the slot state, the accepted counts and
the outputs. :class:`BoundRingPreparation` checks such a call once, resolves every
argument (pointers, sizes, the compiled kernel) and from then on only launches: a
call costs the driver launch and a few attribute reads. The launch goes on the
current stream, never synchronises, and is recorded by a CUDA-graph capture like
any other.

Contract (as for CUDA-graph inputs): the bound tensors keep their storage; write
new values in place. A tensor replaced by another (the manager's table re-laid out
or grown, a larger batch) needs :meth:`BoundRingPreparation.rebind`; the object
holds a reference to every tensor, so none is freed while it lives. Off CUDA, under
a launch hook (profilers) or on another current device, a call runs the checked
``prepare_paged_latent`` again, with the same results.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _launch as _fl
from . import spec_tail_kernels as _api
from ._checks import check_ring
from .bound_preparation import BoundLaunch
from .reference import PagedLatentPrep

_RING = "prepare_paged_latent_ring"


class BoundRingPreparation(BoundLaunch):
    """``prepare_paged_latent``'s ring form over fixed tensors; calling it launches the step.

    Arguments are the ring form's (table rows and block ordinals of the manager's
    ring, slot state in absolute token positions, outputs in block ordinals of the
    unrebased rows), with ``out`` required so the outputs are fixed too.
    """

    kernel = _RING

    def __init__(
        self,
        pages: torch.Tensor,
        extent: torch.Tensor,
        table_rows: torch.Tensor,
        table_first: torch.Tensor,
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
        read_window: Optional[int] = None,
        impl: Optional[str] = None,
        block: Optional[int] = None,
        num_warps: Optional[int] = None,
    ) -> None:
        if out is None:
            raise ValueError("BoundRingPreparation needs preallocated outputs: out=PagedLatentPrep.empty(...)")
        self.tensors = (pages, extent, table_rows, table_first, slot_ids, slot_ctx_len, slot_base_pages, num_new)
        self.out = out
        self._step = dict(block_size=block_size, tokens_per_block=tokens_per_block, max_ctx=max_ctx,
                          max_new=max_new, read_window=read_window)
        self._tune = dict(impl=impl, block=block, num_warps=num_warps)
        self._bound: Optional[tuple] = None

    def _checked(self) -> PagedLatentPrep:
        t = self.tensors
        got = _api.prepare_paged_latent(
            t[0], t[1], *t[4:], table_rows=t[2], table_first=t[3], out=self.out, **self._step, **self._tune
        )
        self._bound = self._resolve()
        return got

    def _resolve(self) -> Optional[tuple]:
        """The launch the checked call just made, every argument resolved (None off the fast CUDA path)."""
        dev = self.tensors[0].device
        if dev.type != "cuda" or not _fl.ENABLED or self._tune["impl"] == "reference" or self.tensors[2].numel() == 0:
            return None
        _, kw = check_ring(self.tensors, out=self.out, **self._step)
        grid, args, meta = _api.ring_launch(self.tensors, self.out, kw, self._tune["block"], self._tune["num_warps"])
        return self._resolve_launch(dev, grid, args, meta)


__all__ = ["BoundRingPreparation"]
