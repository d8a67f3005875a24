"""The transfer-agent interface, in the shape of TensorRT-LLM's `BaseTransferAgent`.

A rank registers its memory once (`register_memory`), hands its peer an agent
descriptor (`get_local_agent_desc` -> `load_remote_agent`), and then moves
bytes with one-sided WRITEs: `submit_transfer_requests` posts a list of
(address, length, device) source descriptors onto as many destination
descriptors of the peer, with a sync message the peer reads once every byte
has landed (`wait_sync_message`). Coordinates: byte addresses and lengths.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


class TransferOp:
    """Upstream's operations, plain strings on purpose (NIXL takes the same strings)."""

    READ = "READ"
    WRITE = "WRITE"


class MemoryType:
    """Upstream's memory kinds this package registers: host memory and device memory."""

    DRAM = "DRAM"
    VRAM = "VRAM"


class TransferError(RuntimeError):
    """A transfer could not be posted or failed on the way (the engine's status names why)."""


class TransferTimeout(TransferError):
    """A transfer or a sync message did not complete within the wait's timeout."""


class PeerGone(TransferError):
    """The peer's process or connection is gone."""


@dataclass(frozen=True)
class MemoryDescs:
    """Descriptors of one memory kind: an `[N, 3]` int64 array of (address, length in bytes, device id)."""

    type: str
    descs: np.ndarray

    def __post_init__(self) -> None:
        arr = np.ascontiguousarray(np.asarray(self.descs, dtype=np.int64).reshape(-1, 3))
        if arr.size and (arr[:, 1] <= 0).any():
            i = int(np.flatnonzero(arr[:, 1] <= 0)[0])
            raise ValueError(f"descriptor {i} has length {int(arr[i, 1])} bytes; lengths must be > 0")
        object.__setattr__(self, "descs", arr)

    @property
    def total_bytes(self) -> int:
        return int(self.descs[:, 1].sum())

    def __len__(self) -> int:
        return int(self.descs.shape[0])


@dataclass(frozen=True)
class TransferRequest:
    """One WRITE (or READ) of `src_descs` (this rank) onto `dst_descs` (the peer `remote_name`), pairwise.

    `sync_message`: what the peer's `wait_sync_message` returns once all of it has landed.
    """

    op: str
    src_descs: MemoryDescs
    dst_descs: MemoryDescs
    remote_name: str
    sync_message: bytes

    def __post_init__(self) -> None:
        if self.op not in (TransferOp.READ, TransferOp.WRITE):
            raise ValueError(f"transfer op {self.op!r}; expected READ or WRITE")
        src, dst = self.src_descs.descs, self.dst_descs.descs
        if src.shape != dst.shape or not np.array_equal(src[:, 1], dst[:, 1]):
            raise ValueError(
                f"transfer {self.sync_message!r}: {len(src)} source and {len(dst)} destination descriptors "
                f"({int(src[:, 1].sum())} vs {int(dst[:, 1].sum())} bytes) do not pair up"
            )


class TransferStatus(ABC):
    """A posted transfer: poll it or wait for it."""

    @abstractmethod
    def is_completed(self) -> bool:
        """True once every byte has left this rank's buffers (they may be reused)."""

    @abstractmethod
    def wait(self, timeout_s: float | None = None) -> None:
        """Block until completed; `TransferError` (or `TransferTimeout`) otherwise. Releases the handle."""


class BaseTransferAgent(ABC):
    """One rank's transfer agent (upstream's `BaseTransferAgent` with a timeout on every wait)."""

    name: str

    @abstractmethod
    def register_memory(self, descs: MemoryDescs) -> None:
        """Register regions (one descriptor each) that transfers may read or write."""

    @abstractmethod
    def deregister_memory(self, descs: MemoryDescs) -> None:
        """Undo `register_memory` of the same regions."""

    @abstractmethod
    def get_local_agent_desc(self) -> bytes:
        """What a peer needs to reach this agent (`load_remote_agent`)."""

    @abstractmethod
    def load_remote_agent(self, name: str, agent_desc: bytes) -> None:
        """Make the peer `name` reachable from its descriptor."""

    @abstractmethod
    def invalidate_remote_agent(self, name: str) -> None:
        """Forget the peer `name`."""

    @abstractmethod
    def submit_transfer_requests(self, request: TransferRequest) -> TransferStatus:
        """Post one transfer; `TransferError` when the engine refuses it (nothing was written)."""

    @abstractmethod
    def wait_sync_message(self, message: bytes, timeout_s: float) -> None:
        """Block until the peer's transfer carrying `message` has landed here.

        `TransferTimeout` after `timeout_s` seconds without it, `PeerGone` when the peer is gone.
        """

    def close(self) -> None:
        """Release the engine's resources (nothing to do by default)."""
