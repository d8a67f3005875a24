"""The torch.distributed wire behind the transfer-agent interface: the reference and the fallback.

A WRITE travels as point-to-point messages to the peer rank: a header, the
destination descriptors, the source bytes gathered into one buffer, the sync
message. The receiving rank scatters them into its registered memory when it
waits for that message. Host memory only (it reaches registered memory by
address). Bytes move in granules, per registered region the largest size
dividing its descriptors' lengths and offsets (a page, typically), so
gathering and scattering index whole granules with one indexing call per
region, never a loop over pages. Coordinates: byte addresses.
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

_HEADER = 3  # [descriptors, total bytes, sync message bytes]


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

    def plan(self, descs: np.ndarray, what: str) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """How `descs` map onto one flat buffer (descriptor i at its running byte offset): per registered
        region it touches, `(region, granule, rows in the region, rows in the flat buffer)`, the granule the
        largest size dividing those descriptors' lengths, region offsets and flat offsets."""
        addr, length = descs[:, 0], descs[:, 1]
        reg = np.searchsorted(self.bases, addr, side="right") - 1
        inside = (reg >= 0) & (addr + length <= self.bases[reg.clip(0)] + self.sizes[reg.clip(0)])
        if not inside.all():
            i = int(np.flatnonzero(~inside)[0])
            raise TransferError(f"{what}: descriptor {i} ({int(addr[i]):#x}, {int(length[i])} bytes) is not "
                                f"inside registered memory")
        flat = np.cumsum(length) - length
        offset = addr - self.bases[reg]
        out = []
        for r in np.unique(reg).tolist():  # one entry per registered region (pool layer), never per page
            m = reg == r
            granule = int(np.gcd.reduce(np.concatenate([length[m], offset[m], flat[m]])))
            counts = length[m] // granule
            out.append((r, granule, _expand(offset[m] // granule, counts), _expand(flat[m] // granule, counts)))
        return out

    def rows(self, region: int, granule: int) -> torch.Tensor:
        view = self.views[region]
        return view[: view.numel() // granule * granule].view(-1, granule)


def _expand(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`[s0, s0 + 1, .., s0 + c0 - 1, s1, ..]`: every row of every run, vectorised."""
    total = int(counts.sum())
    run_start = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + (np.arange(total, dtype=np.int64) - run_start)


def _flat_rows(data: torch.Tensor, granule: int) -> torch.Tensor:
    return data[: data.numel() // granule * granule].view(-1, granule)


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
        data = torch.empty(int(src[:, 1].sum()), dtype=torch.uint8)
        for region, granule, rows, flat in self._regions.plan(src, what):  # one gather per registered region
            _flat_rows(data, granule)[torch.from_numpy(flat)] = self._regions.rows(region, granule)[
                torch.from_numpy(rows)]
        peer = self._remotes[request.remote_name]
        msg = torch.frombuffer(bytearray(request.sync_message or b"\0"), dtype=torch.uint8)
        header = torch.tensor([len(dst), data.numel(), msg.numel()], dtype=torch.long)
        works = [dist.isend(t, peer) for t in (header, torch.from_numpy(dst.copy()), data.view(-1), msg)]
        return _SendStatus(works, what)

    def wait_sync_message(self, message: bytes, timeout_s: float) -> None:
        what = f"sync message {message.decode(errors='replace')}"
        header = self._recv(torch.empty(_HEADER, dtype=torch.long), timeout_s, what)
        n, total, msg_len = (int(x) for x in header.tolist())
        dst = self._recv(torch.empty(n, 3, dtype=torch.long), timeout_s, what).numpy()
        data = self._recv(torch.empty(total, dtype=torch.uint8), timeout_s, what)
        got = bytes(self._recv(torch.empty(msg_len, dtype=torch.uint8), timeout_s, what).tolist())
        if got != (message or b"\0"):
            raise TransferError(f"{what}: the peer's next transfer carries {got!r}")
        for region, granule, rows, flat in self._regions.plan(dst, what):  # one scatter per registered region
            self._regions.rows(region, granule).index_copy_(
                0, torch.from_numpy(rows), _flat_rows(data, granule)[torch.from_numpy(flat)])

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
