"""The torch.distributed wire behind the transfer-agent interface: the reference and the fallback.

A WRITE travels as point-to-point messages to the peer rank: a header, the
destination descriptors, the source bytes gathered into one buffer, the sync
message. The receiving rank scatters them into its registered memory when it
waits for that message. Host memory only (it reaches registered memory by
address). Bytes move in granules: the largest size dividing every
descriptor's length and offset, so gathering and scattering index whole
granules (pages, typically) with one `index_select` / `index_copy_` per
registered region, never a loop over pages. Coordinates: byte addresses.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from .agent import (BaseTransferAgent, MemoryDescs, MemoryType, PeerGone, TransferError, TransferRequest,
                    TransferStatus, TransferTimeout)

_HEADER = 4  # [descriptors, total bytes, granule bytes, sync message bytes]


@dataclass
class _Registered:
    """Registered host regions, sorted by base address, each viewed as bytes."""

    bases: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    views: list[torch.Tensor] = field(default_factory=list)

    def add(self, base: int, size: int) -> None:
        view = torch.frombuffer((ctypes.c_uint8 * size).from_address(base), dtype=torch.uint8)
        i = int(np.searchsorted(self.bases, base))
        self.bases = np.insert(self.bases, i, base)
        self.sizes = np.insert(self.sizes, i, size)
        self.views.insert(i, view)

    def remove(self, base: int) -> None:
        i = int(np.searchsorted(self.bases, base))
        if i < len(self.bases) and self.bases[i] == base:
            self.bases = np.delete(self.bases, i)
            self.sizes = np.delete(self.sizes, i)
            del self.views[i]

    def granules(self, descs: np.ndarray, granule: int, what: str) -> tuple[np.ndarray, np.ndarray]:
        """Per granule of `descs`, in order: its region index and its granule row in that region."""
        addr, length = descs[:, 0], descs[:, 1]
        reg = np.searchsorted(self.bases, addr, side="right") - 1
        inside = (reg >= 0) & (addr + length <= self.bases[reg.clip(0)] + self.sizes[reg.clip(0)])
        if not inside.all():
            i = int(np.flatnonzero(~inside)[0])
            raise TransferError(f"{what}: descriptor {i} ({int(addr[i]):#x}, {int(length[i])} bytes) is not "
                                f"inside registered memory")
        counts = length // granule
        first = (addr - self.bases[reg]) // granule
        total = int(counts.sum())
        run_start = np.repeat(np.cumsum(counts) - counts, counts)
        rows = np.repeat(first, counts) + (np.arange(total, dtype=np.int64) - run_start)
        return np.repeat(reg, counts), rows

    def rows(self, region: int, granule: int) -> torch.Tensor:
        view = self.views[region]
        return view[: view.numel() // granule * granule].view(-1, granule)


def _granule(*descs: np.ndarray, bases: np.ndarray) -> int:
    """The largest byte count dividing every length and every offset from its region's base."""
    parts = []
    for d in descs:
        reg = (np.searchsorted(bases, d[:, 0], side="right") - 1).clip(0) if len(bases) else None
        parts.append(d[:, 1])
        if reg is not None:
            parts.append(d[:, 0] - bases[reg])
    g = int(np.gcd.reduce(np.concatenate(parts))) if parts else 1
    return g or 1


class _SendStatus(TransferStatus):
    def __init__(self, works: list, what: str) -> None:
        self._works, self._what = works, what

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self, timeout_s: float | None = None) -> None:
        try:
            for w in self._works:
                if timeout_s is None:
                    w.wait()
                elif not w.wait(timeout=timedelta(seconds=timeout_s)):
                    raise TransferTimeout(f"{self._what}: not sent after {timeout_s:g} s")
        except TransferError:
            raise
        except RuntimeError as err:  # gloo: the peer closed the connection
            raise PeerGone(f"{self._what}: {err}") from err


class TorchWireAgent(BaseTransferAgent):
    """Transfers as torch.distributed messages to one peer rank (gloo on CPU); host memory only."""

    def __init__(self, name: str, peer_rank: int) -> None:
        self.name = name
        self.peer = peer_rank
        self._regions = _Registered()
        self._remotes: dict[str, int] = {}

    def register_memory(self, descs: MemoryDescs) -> None:
        if descs.type != MemoryType.DRAM:
            raise TransferError(f"the torch wire reaches host memory only, not {descs.type}")
        for base, size, _ in descs.descs.tolist():
            self._regions.add(base, size)

    def deregister_memory(self, descs: MemoryDescs) -> None:
        for base, _, _ in descs.descs.tolist():
            self._regions.remove(base)

    def get_local_agent_desc(self) -> bytes:
        return str(dist.get_rank()).encode()

    def load_remote_agent(self, name: str, agent_desc: bytes) -> None:
        self._remotes[name] = int(agent_desc.decode())

    def invalidate_remote_agent(self, name: str) -> None:
        self._remotes.pop(name, None)

    def submit_transfer_requests(self, request: TransferRequest) -> TransferStatus:
        what = f"transfer {request.sync_message.decode(errors='replace')} to {request.remote_name}"
        if request.remote_name not in self._remotes:
            raise TransferError(f"{what}: no agent descriptor loaded for {request.remote_name}")
        if request.op != "WRITE":
            raise TransferError(f"{what}: the torch wire writes only")
        src, dst = request.src_descs.descs, request.dst_descs.descs
        granule = _granule(src, dst, bases=self._regions.bases)
        regs, rows = self._regions.granules(src, granule, what)
        data = torch.empty(rows.size, granule, dtype=torch.uint8)
        for r in np.unique(regs).tolist():  # one gather per registered region
            at = np.flatnonzero(regs == r)
            data[torch.from_numpy(at)] = self._regions.rows(r, granule)[torch.from_numpy(rows[at])]
        peer = self._remotes[request.remote_name]
        msg = torch.frombuffer(bytearray(request.sync_message or b"\0"), dtype=torch.uint8)
        header = torch.tensor([len(dst), rows.size * granule, granule, msg.numel()], dtype=torch.long)
        works = [dist.isend(t, peer) for t in (header, torch.from_numpy(dst.copy()), data.view(-1), msg)]
        return _SendStatus(works, what)

    def wait_sync_message(self, message: bytes, timeout_s: float) -> None:
        what = f"sync message {message.decode(errors='replace')}"
        header = self._recv(torch.empty(_HEADER, dtype=torch.long), timeout_s, what)
        n, total, granule, msg_len = (int(x) for x in header.tolist())
        dst = self._recv(torch.empty(n, 3, dtype=torch.long), timeout_s, what).numpy()
        data = self._recv(torch.empty(total, dtype=torch.uint8), timeout_s, what).view(-1, granule)
        got = bytes(self._recv(torch.empty(msg_len, dtype=torch.uint8), timeout_s, what).tolist())
        if got != (message or b"\0"):
            raise TransferError(f"{what}: the peer's next transfer carries {got!r}")
        regs, rows = self._regions.granules(dst, granule, what)
        for r in np.unique(regs).tolist():  # one scatter per registered region
            at = torch.from_numpy(np.flatnonzero(regs == r))
            self._regions.rows(r, granule).index_copy_(0, torch.from_numpy(rows[regs == r]), data[at])

    def _recv(self, t: torch.Tensor, timeout_s: float, what: str) -> torch.Tensor:
        try:
            work = dist.irecv(t, self.peer)
            if not work.wait(timeout=timedelta(seconds=timeout_s)):
                raise TransferTimeout(f"{what}: nothing after {timeout_s:g} s")
        except TransferError:
            raise
        except RuntimeError as err:  # gloo: a timeout or a closed connection
            kind = TransferTimeout if "imeout" in str(err) else PeerGone
            raise kind(f"{what}: {err}") from err
        return t
