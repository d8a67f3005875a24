"""A staged scatter the device reads straight from page-locked host memory: one launch, no copy.

The per-step table updates (changed ring entries, changed offsets) are a few hundred
int32 entries. Staged the usual way they cost a fresh device tensor, an asynchronous
copy, several views and an ``index_copy_`` launch, each a few µs of host time. Under
unified addressing a GPU reads page-locked host memory directly, so a kernel can
take the staged buffer itself as its source: the host writes it and launches once.

The staged buffer must stay unchanged until the kernel has run: the callers take it
from a ``staging.PinnedStager`` arena, whose parts are rewritten only after the work
queued on them is done.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _dispatch
from ._checks import next_pow2

_NAME = "host_scatter"
#: entries per program on a GPU (one a thread): the launch is latency-bound, so many small programs
_GPU_BLOCK = 256


def host_scatter(
    dst: torch.Tensor,
    staged: torch.Tensor,
    n: int,
    val_at: int,
    copy_dst: Optional[torch.Tensor] = None,
    m: int = 0,
    copy_at: int = 0,
) -> None:
    """``dst[staged[i]] = staged.view(int32)[val_at + i]`` for ``i < n`` and ``copy_dst[j] = staged[copy_at + j]``
    for ``j < m``, in one launch on ``dst``'s device (the interpreter on the CPU).

    ``dst``: int32, 1-D, contiguous; ``staged``: int64, 1-D, on the CPU (page-locked for a GPU: the
    kernel reads it in place); ``copy_dst``: int64, 1-D, contiguous, on ``dst``'s device. Offsets are
    flat element indices into ``dst``, distinct; nothing is checked on the device."""
    if dst.dtype is not torch.int32 or dst.dim() != 1 or not dst.is_contiguous():
        raise ValueError(f"host_scatter: dst must be a contiguous 1-D int32 tensor, got {dst.dtype} {tuple(dst.shape)}")
    if staged.dtype is not torch.int64 or staged.dim() != 1 or staged.device.type != "cpu":
        raise ValueError("host_scatter: staged must be a 1-D int64 tensor in host memory")
    need = max(n, -(-(val_at + n) // 2), copy_at + m)  # int64 slots the offsets, values and dense part reach
    if n < 0 or m < 0 or staged.numel() < need:
        raise ValueError(f"host_scatter: {n} entries and {m} dense values do not fit a staged buffer of "
                         f"{staged.numel()} int64 slots")
    if m and (copy_dst is None or copy_dst.dtype is not torch.int64 or copy_dst.numel() < m
              or not copy_dst.is_contiguous() or copy_dst.device != dst.device):
        raise ValueError(f"host_scatter: copy_dst must be a contiguous int64 tensor of >= {m} values on {dst.device}")
    count = max(n, m)
    if not count:
        return
    compiled = dst.device.type == "cuda"
    block = _GPU_BLOCK if compiled else min(4096, max(16, next_pow2(count)))
    args = (staged, staged.view(torch.int32), dst, copy_dst if m else staged, n, val_at, m, copy_at)
    _dispatch.launch(_NAME, dst.device, (-(-count // block), 1), args, True, BLOCK=block,
                     num_warps=max(1, min(8, block // 32)) if compiled else 1)


__all__ = ["host_scatter"]
