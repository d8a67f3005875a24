"""Two agent processes on this host: rank 0 writes pages into rank 1's pool, rank 1 returns its pool.

`run_pair(transport, plan)` spawns both ranks; they exchange agent descriptors
and region tables through the parent's queues, then run `plan` (a list of
steps). Faults are steps too: rank 0 skips the sync message, posts a
descriptor outside the peer's memory, or exits; rank 1 reports what its wait
raised. Loopback only (`use_loopback`).
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tensorrt_llm_draftkv.transfer import (MemoryDescs, NixlTransferAgent, PoolRegion, Rendezvous, TorchWireAgent,
                                           TransferError, TransferRequest, page_write_descs, use_loopback)

PAGES, LAYERS, PAGE_SHAPE = 64, 2, (2, 1, 4, 16)  # [pages, K/V, heads, tokens per block, head dim] float32


@dataclass(frozen=True)
class Step:
    """One request: rank 0 writes `src_pages` onto rank 1's `dst_pages` with sync message `name`.

    `fault`: "" (none), "no_sync" (rank 0 never sends it), "bad_desc" (a page past the peer's pool),
    "exit" (rank 0's process ends before sending).
    """

    name: str
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    fault: str = ""


@dataclass
class PairResult:
    pools: list[np.ndarray] = field(default_factory=list)  # rank 1's layers after the plan, as bytes
    sender_pools: list[np.ndarray] = field(default_factory=list)
    outcomes: dict[str, str] = field(default_factory=dict)  # rank 1: step name -> "ok" or the error's class
    sender_outcomes: dict[str, str] = field(default_factory=dict)


def _layers(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand((PAGES, *PAGE_SHAPE), generator=gen) + 1.0 for _ in range(LAYERS)]  # never zeros


def _agent(transport: str, rank: int):
    if transport == "nixl":
        return NixlTransferAgent(f"rank{rank}")
    return TorchWireAgent(f"rank{rank}", 1 - rank)


def _rank(rank: int, transport: str, init_method: str, plan: list[Step], inbox, outbox, result_q, timeout_s: float):
    try:
        use_loopback()
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
        layers = _layers(100 + rank)
        regions = [PoolRegion(t.data_ptr(), PAGES, t[0].numel() * 4, t.stride(0) * 4, 4) for t in layers]
        agent = _agent(transport, rank)
        reg = MemoryDescs("DRAM", np.array([(r.base, r.nbytes, 0) for r in regions], dtype=np.int64))
        agent.register_memory(reg)
        outbox.put((agent.get_local_agent_desc(), [r.to_wire() for r in regions]))
        desc, peer_regions = inbox.get()
        peer = f"rank{1 - rank}"
        agent.load_remote_agent(peer, desc)
        peer_regions = [PoolRegion.from_wire(w) for w in peer_regions]
        outcomes = {}
        for step in plan:
            msg = step.name.encode()
            try:
                if rank == 0:
                    if step.fault == "exit":
                        os._exit(0)
                    dst_pages = list(step.dst_pages)
                    targets = peer_regions
                    if step.fault == "bad_desc":  # a page past the peer's pool, as if its table said more
                        dst_pages[-1] = PAGES + 5
                        targets = [replace(r, num_pages=PAGES + 10) for r in peer_regions]
                    src, dst = page_write_descs(regions, step.src_pages, targets, dst_pages)
                    request = TransferRequest("WRITE", MemoryDescs("DRAM", src), MemoryDescs("DRAM", dst), peer,
                                              b"" if step.fault == "no_sync" else msg)
                    if step.fault == "no_sync" and transport == "torch":
                        raise TransferError("skipped: the torch wire carries the message with the data")
                    agent.submit_transfer_requests(request).wait(timeout_s)
                else:
                    agent.wait_sync_message(msg, timeout_s)
                outcomes[step.name] = "ok"
            except TransferError as err:
                outcomes[step.name] = type(err).__name__
        result_q.put((rank, [t.numpy().tobytes() for t in layers], outcomes))
        dist.barrier() if all(s.fault != "exit" for s in plan) else None
        agent.close()
    except BaseException:  # report, never hang the parent
        result_q.put((rank, None, traceback.format_exc()))


def run_pair(transport: str, plan: list[Step], timeout_s: float = 20.0) -> PairResult:
    """Run `plan` on two fresh rank processes; rank 1's pools and both ranks' outcomes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q01, q10, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    meet = Rendezvous.create()  # a file, not a port another test's process could take first
    procs = [ctx.Process(target=_rank, args=(0, transport, meet.init_method, plan, q10, q01, results, timeout_s)),
             ctx.Process(target=_rank, args=(1, transport, meet.init_method, plan, q01, q10, results, timeout_s))]
    try:
        for p in procs:
            p.start()
        out = PairResult()
        expected = 1 if any(s.fault == "exit" for s in plan) else 2
        for _ in range(expected):
            rank, pools, outcomes = results.get(timeout=600)
            if pools is None:
                raise RuntimeError(f"rank {rank} crashed:\n{outcomes}")
            arrays = [np.frombuffer(p, dtype=np.uint8) for p in pools]
            if rank == 1:
                out.pools, out.outcomes = arrays, outcomes
            else:
                out.sender_pools, out.sender_outcomes = arrays, outcomes
        for p in procs:
            p.join()
        return out
    finally:
        meet.remove()  # a crashed pair leaves no directory behind either
