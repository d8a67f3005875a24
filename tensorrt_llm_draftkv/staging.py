"""Host values onto a device without waiting for it.

A copy from ordinary (pageable) host memory into a CUDA tensor waits until the device
has finished the work queued before it; the per-step bookkeeping (changed table
entries, accepted counts, raised bases, store indices) must not. `to_device` goes
through pinned memory and an asynchronous copy on the current stream: torch's caching
host allocator keeps the pinned buffer alive until the copy is done. Off CUDA it is
a plain conversion.
"""
from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import torch

HostValues = Union[np.ndarray, torch.Tensor, Sequence[int]]


def staged(values: HostValues, device: torch.device | str) -> torch.Tensor:
    """`values` (a numpy array, a CPU tensor or a list of ints, which becomes int64) as a host tensor
    ready for a copy to `device` with `non_blocking=True`: pinned when `device` is CUDA."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values)
    elif isinstance(values, torch.Tensor):
        host = values
    else:
        host = torch.tensor(values, dtype=torch.int64)
    return host.pin_memory() if torch.device(device).type == "cuda" else host


def to_device(values: HostValues, device: torch.device | str) -> torch.Tensor:
    """`values` as a tensor on `device` (see `staged`), without waiting for the device."""
    return staged(values, device).to(device, non_blocking=True)


def scatter_int32(memory: torch.Tensor, flat: np.ndarray, values: np.ndarray) -> None:
    """`memory[flat[i]] = values[i]` for a 1-D int32 tensor (distinct int64 `flat` offsets): on the CPU
    straight into its storage, on a device as one staged buffer (the offsets, then the values two per
    int64 slot), one asynchronous copy from pinned memory and one scatter."""
    if memory.device.type == "cpu":
        memory.numpy()[flat] = values
        return
    n = flat.size
    buf = np.empty(n + (n + 1) // 2, dtype=np.int64)
    buf[:n] = flat
    buf[n:].view(np.int32)[:n] = values
    on_device = to_device(buf, memory.device)
    memory.index_copy_(0, on_device[:n], on_device[n:].view(torch.int32)[:n])


__all__ = ["scatter_int32", "staged", "to_device"]
