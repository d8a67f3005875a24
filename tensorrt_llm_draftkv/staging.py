"""Host values onto a device without waiting for it.

A copy from ordinary (pageable) host memory into a CUDA tensor waits until the device
has finished the work queued before it; the per-step bookkeeping (changed table
entries, accepted counts, raised bases, store indices) must not. `to_device` goes
through pinned memory and an asynchronous copy on the current stream: torch's caching
host allocator keeps the pinned buffer alive until the copy is done. Off CUDA it is
a plain conversion.

Pinning fresh memory per copy is most of such a copy's host cost (on an H100 host about
30 µs for a few hundred bytes, against 10 through a kept pinned buffer). A hot path
therefore owns a `PinnedStager`: one pinned int64 arena reused in turn, whose parts are
written again only after the copies out of them are done. Every function here takes
one as `stager=`; without it they pin per call.
"""
from __future__ import annotations

import os
from typing import Sequence, Union

import numpy as np
import torch

HostValues = Union[np.ndarray, torch.Tensor, Sequence[int]]


class PinnedStager:
    """Host values for small host-to-device copies, written into one kept pinned arena (int64 slots).

    The arena is used in `SEGMENTS` parts, one after the other. Leaving a part records an
    event on each stream that claimed from it; coming back to it (a full turn later) waits
    on those events first, so no copy still in flight reads a slot that is written again.
    A claim must therefore be copied from on the current stream before the next claim.
    Claims larger than a part, claims while a stream is being captured into a CUDA graph
    and claims for a non-CUDA device get memory of their own (pinned only for CUDA).
    """

    SEGMENTS = 4

    def __init__(self, device: torch.device | str, capacity: int = 1 << 14) -> None:
        if capacity < self.SEGMENTS:
            raise ValueError(f"PinnedStager: capacity {capacity} is below {self.SEGMENTS} int64 slots")
        self.device = torch.device(device)
        self._part = capacity // self.SEGMENTS
        self._arena: torch.Tensor | None = None  # made at the first claim
        self._host: np.ndarray | None = None
        self._pos = 0
        self._segment = 0
        # streams that claimed from the current part, as torch's raw (stream id, device index, device type):
        # `torch.cuda.current_stream` builds a Stream object per call, several µs of a small copy's cost
        self._streams: dict[int, tuple[int, int, int]] = {}
        self._done: list[list["torch.cuda.Event"]] = [[] for _ in range(self.SEGMENTS)]
        #: claims served by the arena, and parts re-entered after waiting (tests read them)
        self.claims = 0
        #: whether the device reads the arena in place (kernels.host_scatter): None to try at the next
        #: staged scatter, True once that worked, False for staged copies (for good once a try failed).
        #: On unless DRAFTKV_HOST_READS=0 (clean under compute-sanitizer's memcheck; on an H100 host it took
        #: the B 256 step's table update from 773 to 649 µs). Triton checks the pointer at the first launch,
        #: so a device that cannot map the arena refuses there, and this stager copies from then on.
        self.reads_in_place: bool | None = False if os.environ.get("DRAFTKV_HOST_READS") == "0" else None
        self.turns = 0

    def claim(self, n: int) -> tuple[np.ndarray, torch.Tensor]:
        """`n` int64 slots: a numpy view to fill and the same memory as a tensor to copy from (with
        `non_blocking=True`, on the current stream, before the next claim)."""
        if self.device.type != "cuda" or n > self._part or torch.cuda.is_current_stream_capturing():
            own = torch.empty(n, dtype=torch.int64, pin_memory=self.device.type == "cuda")
            return own.numpy(), own
        if self._arena is None:
            self._arena = torch.empty(self._part * self.SEGMENTS, dtype=torch.int64, pin_memory=True)
            self._host = self._arena.numpy()
        if self._pos + n > (self._segment + 1) * self._part:
            self._next_part()
        a = self._pos
        self._pos += n
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        stream = torch._C._cuda_getCurrentStream(index)
        self._streams.setdefault(stream[0], stream)
        self.claims += 1
        assert self._host is not None
        return self._host[a : a + n], self._arena[a : a + n]

    def _next_part(self) -> None:
        events = []
        for stream_id, device_index, device_type in self._streams.values():
            event = torch.cuda.Event()
            event.record(torch.cuda.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type))
            events.append(event)
        self._done[self._segment] = events
        self._streams = {}
        self._segment = (self._segment + 1) % self.SEGMENTS
        self._pos = self._segment * self._part
        for event in self._done[self._segment]:
            event.synchronize()  # copies out of this part a turn ago: long finished, as a rule
        self._done[self._segment] = []
        self.turns += 1


def staged(values: HostValues, device: torch.device | str, stager: PinnedStager | None = None) -> torch.Tensor:
    """`values` (a numpy array, a CPU tensor or a list of ints, which becomes int64) as a host tensor
    ready for a copy to `device` with `non_blocking=True`: pinned when `device` is CUDA. With a
    `stager`, int64 values go into its arena (other dtypes as without)."""
    if stager is not None and torch.device(device).type == "cuda":
        arr = values.numpy() if isinstance(values, torch.Tensor) else values
        if not isinstance(arr, np.ndarray) or arr.dtype == np.int64:
            n = arr.size if isinstance(arr, np.ndarray) else len(arr)
            host, tensor = stager.claim(n)
            host[:] = np.ravel(arr) if isinstance(arr, np.ndarray) else arr
            return tensor.view(arr.shape) if isinstance(arr, np.ndarray) else tensor
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values)
    elif isinstance(values, torch.Tensor):
        host = values
    else:
        host = torch.tensor(values, dtype=torch.int64)
    return host.pin_memory() if torch.device(device).type == "cuda" else host


def to_device(values: HostValues, device: torch.device | str, stager: PinnedStager | None = None) -> torch.Tensor:
    """`values` as a tensor on `device` (see `staged`), without waiting for the device."""
    return staged(values, device, stager).to(device, non_blocking=True)


def scatter_int32(memory: torch.Tensor, flat: np.ndarray, values: np.ndarray, stager: PinnedStager | None = None) -> None:
    """`memory[flat[i]] = values[i]` for a 1-D int32 tensor (distinct int64 `flat` offsets): on the CPU
    straight into its storage, on a device as one staged buffer (`scatter_int32_staged`)."""
    if memory.device.type == "cpu":
        memory.numpy()[flat] = values
        return
    scatter_int32_staged(memory, flat, values, stager)


def scatter_int32_staged(memory: torch.Tensor, flat: np.ndarray, values: np.ndarray,
                         stager: PinnedStager | None = None,
                         dense: tuple[torch.Tensor, np.ndarray] | None = None) -> None:
    """`scatter_int32`'s device form, on any device (on the CPU a test runs the GPU's packing with it):
    `[flat offsets | dense values | values, two int32 per int64 slot]` staged as one buffer.

    `dense`: optionally `(target, values)`, int64 values copied whole into the 1-D `target` by the
    same staged buffer. On a GPU whose stager reads its arena in place (`PinnedStager.reads_in_place`,
    on unless `DRAFTKV_HOST_READS=0`), one launch reads the buffer where it is (`kernels.host_scatter`);
    otherwise one asynchronous copy, one scatter and a copy for `dense`."""
    n = flat.size
    m = dense[1].size if dense is not None else 0
    if not n and not m:  # nothing to write (and an empty int64 buffer has no int32 view)
        return
    size = n + m + (n + 1) // 2
    in_place = stager is not None and memory.device.type == "cuda" and stager.reads_in_place is not False
    if in_place:
        before = stager.claims
        host, tensor = stager.claim(size)
        in_place = stager.claims != before  # memory of its own is freed before a kernel would read it
    else:
        host, tensor = np.empty(size, dtype=np.int64), None
    host[:n] = flat
    if m:
        host[n : n + m] = dense[1]
    host[n + m :].view(np.int32)[:n] = values
    if in_place and _scatter_in_place(memory, tensor, n, m, dense, stager):
        return
    # a claim already made (pinned) goes as it is; otherwise the usual staging
    on_device = (tensor.to(memory.device, non_blocking=True) if tensor is not None
                 else to_device(host, memory.device, stager))
    if n:
        memory.index_copy_(0, on_device[:n], on_device[n + m :].view(torch.int32)[:n])
    if m:
        dense[0].copy_(on_device[n : n + m])


def _scatter_in_place(memory: torch.Tensor, tensor: torch.Tensor, n: int, m: int,
                      dense: tuple[torch.Tensor, np.ndarray] | None, stager: PinnedStager) -> bool:
    """The host-read launch; False (and the stager told so for good) when this device cannot read its
    arena, which only the first launch can find out."""
    from .kernels.host_scatter import host_scatter

    try:
        host_scatter(memory, tensor, n, 2 * (n + m), dense[0] if dense is not None else None, m, n)
    except (ValueError, RuntimeError):
        if stager.reads_in_place:
            raise
        stager.reads_in_place = False
        return False
    stager.reads_in_place = True
    return True


__all__ = ["PinnedStager", "scatter_int32", "scatter_int32_staged", "staged", "to_device"]
