"""The generation step's device inputs and outputs kept in place, and its launches bound to them.

A DFlash generation step launches the same preparation every step. Fresh tensors per
step (the rows' slots, the accepted counts, the outputs) cost an allocation or a
host-to-device copy each and defeat a bound launch. `StepBuffers` keeps them in
capacity buffers on the slots' device, hands out views that stay the same objects
for the same batch size, writes the slots only when they change and the counts
with one staged copy (or, in the staged form, every row's scalars with one), and
keeps one `BoundRingPreparation` or `BoundStagedRing` per pool and set of tensors:
after the first (checked) step of a shape, a step is one driver launch per pool. The outputs are these buffers: a step's preparation is valid until the next
step's.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

import numpy as np

from ..kernels import ROW_WIDTH, BoundRingPreparation, BoundStagedRing, PagedLatentPrep, prepare_paged_latent
from ..kernels import prepare_ring_staged
from ..staging import PinnedStager, staged

_OUT_FIELDS = ("read_rows", "read_lens", "query_pos", "store_pages", "store_offsets", "new_ctx_len", "shift")


class StepBuffers:
    """Capacity buffers, their views per batch size, and the bound launches (see the module docstring)."""

    #: bound launches kept (each holds its tensors alive; a replaced table ring leaves stale ones)
    MAX_BOUND = 64

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._stager = PinnedStager(self.device)
        self._slot_ids = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._slot_host: list[int] = []
        self._num_new = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._views: dict[tuple[str, int], torch.Tensor] = {}
        self._outs: dict[tuple, tuple[int, PagedLatentPrep]] = {}  # shape class -> (capacity, buffers)
        self._out_views: dict[tuple, PagedLatentPrep] = {}
        self._bound: dict[tuple, BoundRingPreparation | BoundStagedRing] = {}
        self._scalars = torch.zeros((0, 0, ROW_WIDTH), dtype=torch.int64, device=self.device)
        # (pools, B) -> the whole staged block's view, then a view per pool
        self._scalar_views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._staged_rows: Optional[tuple[int, int, torch.Tensor]] = None

    # ------------------------------------------------------------------ inputs
    def slot_ids(self, slots: list[int]) -> torch.Tensor:
        """int64 ``[B]``: the rows' slots, written to the device only when they differ from last time."""
        B = len(slots)
        if B > self._slot_ids.numel():
            self._slot_ids = torch.zeros(max(B, 2 * self._slot_ids.numel(), 8), dtype=torch.int64, device=self.device)
            self._slot_host = []
            self._drop_views("slot_ids")
        if slots != self._slot_host[:B]:
            self._copy_in(self._slot_ids, slots)
            self._slot_host = list(slots)
        return self._view("slot_ids", self._slot_ids, B)

    def num_new(self, counts: list[int]) -> torch.Tensor:
        """int64 ``[B]``: tokens each row commits this step (one staged copy)."""
        B = len(counts)
        if B > self._num_new.numel():
            self._num_new = torch.zeros(max(B, 2 * self._num_new.numel(), 8), dtype=torch.int64, device=self.device)
            self._drop_views("num_new")
        self._copy_in(self._num_new, counts)
        return self._view("num_new", self._num_new, B)

    def stage_rows(self, pools: int, B: int) -> np.ndarray:
        """int64 ``[pools, B, ROW_WIDTH]`` host memory to fill with the rows' staged scalars
        (``kernels.staged_ring``): on CUDA a claim of the kept pinned arena itself, so the copy
        :meth:`push_rows` makes reads it where it was written. No other claim until that push."""
        if pools > self._scalars.shape[0] or B > self._scalars.shape[1]:
            cap = max(B, 2 * self._scalars.shape[1], 8)
            self._scalars = torch.zeros((max(pools, self._scalars.shape[0]), cap, ROW_WIDTH), dtype=torch.int64,
                                        device=self.device)
            self._scalar_views = {}
        host, tensor = self._stager.claim(pools * B * ROW_WIDTH)
        self._staged_rows = (pools, B, tensor)
        return host.reshape(pools, B, ROW_WIDTH)

    def push_rows(self) -> list[torch.Tensor]:
        """The rows staged by the last :meth:`stage_rows` on the device, with one copy: per pool an int64
        ``[B, ROW_WIDTH]`` view, the same object for the same shape."""
        assert self._staged_rows is not None, "push_rows without stage_rows"
        pools, B, tensor = self._staged_rows
        self._staged_rows = None
        views = self._scalar_views.get((pools, B))
        if views is None:
            views = self._scalar_views[(pools, B)] = [self._scalars[:pools, :B], *(self._scalars[g, :B]
                                                                                   for g in range(pools))]
        if B:
            views[0].copy_(tensor.view(pools, B, ROW_WIDTH), non_blocking=True)
        return views[1:]

    def _copy_in(self, buffer: torch.Tensor, values: list[int]) -> None:
        if not values:
            return
        buffer[: len(values)].copy_(staged(values, buffer.device, self._stager), non_blocking=True)

    def _view(self, name: str, buffer: torch.Tensor, B: int) -> torch.Tensor:
        view = self._views.get((name, B))
        if view is None:
            view = self._views[(name, B)] = buffer[:B]
        return view

    def _drop_views(self, name: str) -> None:
        self._views = {k: v for k, v in self._views.items() if k[0] != name}

    # ------------------------------------------------------------------ outputs
    def out(self, pool: int, B: int, width: int, block_size: int, max_new: int) -> PagedLatentPrep:
        """Pool ``pool``'s outputs for ``B`` rows ``width`` ordinals wide (views of one capacity buffer)."""
        shape = (pool, width, block_size, max_new)
        cap, full = self._outs.get(shape, (0, None))
        if B > cap:
            cap = max(B, 2 * cap, 8)
            full = PagedLatentPrep.empty(cap, width, block_size, max_new, device=self.device)
            self._outs[shape] = (cap, full)
            self._out_views = {k: v for k, v in self._out_views.items() if k[0] != shape}
        view = self._out_views.get((shape, B))
        if view is None:
            view = PagedLatentPrep(*(getattr(full, f)[:B] for f in _OUT_FIELDS))
            self._out_views[(shape, B)] = view
        return view

    # ------------------------------------------------------------------ launches
    def ring_step(self, pool: int, ring: Any, slot_ids: torch.Tensor, ctx_len: torch.Tensor,
                  base_pages: torch.Tensor, num_new: torch.Tensor, out: PagedLatentPrep, *,
                  impl: Optional[str], **step: Any) -> PagedLatentPrep:
        """The ring-form preparation of pool ``pool`` into ``out``: on CUDA through the launch bound to these
        very tensors (checked the first time), elsewhere the checked call."""
        tensors = (ring.pages, ring.extent, ring.rows, ring.first, slot_ids, ctx_len, base_pages, num_new)
        if not self.device.type == "cuda" or impl == "reference":
            return prepare_paged_latent(tensors[0], tensors[1], *tensors[4:], table_rows=tensors[2],
                                        table_first=tensors[3], out=out, impl=impl, **step)
        # identities are safe keys: each bound launch holds its tensors, so no id is reused while it lives
        key = (pool, *(id(t) for t in tensors), id(out.read_rows), tuple(sorted(step.items())))
        bound = self._bound.get(key)
        if bound is None:
            if len(self._bound) >= self.MAX_BOUND:
                self._bound.clear()
            bound = self._bound[key] = BoundRingPreparation(*tensors, out=out, impl=impl, **step)
        return bound()

    def staged_step(self, pool: int, pages: torch.Tensor, scalars: torch.Tensor, ctx_len: Optional[torch.Tensor],
                    out: PagedLatentPrep, *, impl: Optional[str], **step: Any) -> PagedLatentPrep:
        """Pool ``pool``'s preparation from its ring ``pages`` and the rows' staged ``scalars`` (a view from
        :meth:`row_scalars`) into ``out``, the new lengths written to ``ctx_len`` when given: on CUDA through
        the launch bound to these tensors, elsewhere the checked call."""
        if not self.device.type == "cuda" or impl == "reference":
            return prepare_ring_staged(pages, scalars, ctx_len, out=out, impl=impl, **step)
        key = ("staged", pool, id(pages), id(scalars), id(ctx_len), id(out.read_rows), tuple(sorted(step.items())))
        bound = self._bound.get(key)
        if bound is None:
            if len(self._bound) >= self.MAX_BOUND:
                self._bound.clear()
            bound = self._bound[key] = BoundStagedRing(pages, scalars, ctx_len, out=out, impl=impl, **step)
        return bound()


__all__ = ["StepBuffers"]
