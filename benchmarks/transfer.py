"""KV transfer between two processes: NIXL (UCX on loopback) against the torch.distributed wire.

Both ranks hold pools of the default scenario's geometry: a target group of one
layer with 16 KB pages (32 tokens x 32 dims x K/V, float64) and a draft group
of seven layers with 4 KB pages. Per request the context rank writes `n` target
pages and `n` draft pages of every layer onto the generation rank's pages
(`random`: both sides' page ids drawn at random, so runs rarely merge: the descriptor-heavy
case; `runs`: one run of consecutive pages on each side, one descriptor per
layer, as fresh pools mostly hand out) plus a 96-byte auxiliary slot, in one transfer with a notification, and
waits for it as the simulator's context worker does; the generation rank waits
for each notification. `post us` is the context rank's Python-side time per
request, split into `build` (descriptors built with numpy) and `post` (the agent's
submit call: for NIXL the engine's request creation and, with UCX's cma transport
and no progress thread, the copy itself; for the torch wire the gather and the
sends' start); `GB/s` counts page
bytes moved per wall-clock second over the requests (median of repeats). A last table
times the descriptor building alone, warm and in one process: inside the transfer loop
each build follows a copy of up to 92 MB, whose cache misses it pays too.
The default disaggregated runs move 129 pages per group per request.

Run: `python -m benchmarks.transfer` (about two minutes on two CPU cores).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from tensorrt_llm_draftkv.transfer import (MemoryDescs, NixlTransferAgent, PoolRegion, Rendezvous, TorchWireAgent,
                                           TransferRequest, nixl_unavailable, page_write_descs, pool_regions,
                                           slot_descs, use_loopback)

PAGES = 4096
TARGET = (1, (2, 1, 32, 32), torch.float64)  # layers, page shape, dtype
DRAFT = (7, (2, 1, 32, 16), torch.float32)
AUX_BYTES = 96
TIMEOUT_S = 60.0


def _pools() -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    def group(spec):
        layers, shape, dtype = spec
        return [torch.rand((PAGES, *shape), dtype=torch.float64).to(dtype) + 1.0 for _ in range(layers)]

    return group(TARGET), group(DRAFT), torch.ones(1, 4096, dtype=torch.uint8)


def _regions(target, draft, aux) -> list:
    aux_region = PoolRegion(aux.data_ptr(), 1, aux.shape[1], aux.shape[1], 1)
    return [pool_regions(target, 32), pool_regions(draft, 32), aux_region]


def _pages(rng: np.random.Generator, n: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination pages of one request: at random (`random`) or one run each (`runs`)."""
    if layout == "runs":
        return (np.arange(n) + int(rng.integers(0, PAGES - n + 1)), np.arange(n) + int(rng.integers(0, PAGES - n + 1)))
    return rng.permutation(PAGES)[:n], rng.permutation(PAGES)[:n]


def _rank(rank: int, transport: str, layout: str, meet: Rendezvous, sizes: list[int], requests: int, repeats: int,
          out) -> None:
    import torch.distributed as dist

    use_loopback()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=meet.init_method, rank=rank, world_size=2)
    target, draft, aux = _pools()
    mine = _regions(target, draft, aux)
    agent = NixlTransferAgent(f"bench{rank}") if transport == "nixl" else TorchWireAgent(f"bench{rank}", 1 - rank)
    flat = [*mine[0], *mine[1], mine[2]]
    agent.register_memory(MemoryDescs("DRAM", np.array([(r.base, r.nbytes, 0) for r in flat], dtype=np.int64)))
    objs = [None, None]
    dist.all_gather_object(objs, (agent.get_local_agent_desc(), [[r.to_wire() for r in g] for g in mine[:2]],
                                  mine[2].to_wire()))
    desc, groups, aux_wire = objs[1 - rank]
    peer = f"bench{1 - rank}"
    agent.load_remote_agent(peer, desc)
    theirs = [[PoolRegion.from_wire(w) for w in g] for g in groups] + [PoolRegion.from_wire(aux_wire)]
    rng = np.random.default_rng(7)
    rows = []
    for n in sizes:
        gbps, build, post = [], [], []
        for _ in range(repeats):
            plans = [_pages(rng, n, layout) for _ in range(requests + 2)]
            dist.barrier()
            start = time.perf_counter()
            for i, (src_pages, dst_pages) in enumerate(plans):
                if i == 2:  # two warm-up requests, then the clock starts
                    dist.barrier()
                    start = time.perf_counter()
                msg = f"request {i}".encode()
                if rank == 1:
                    agent.wait_sync_message(msg, TIMEOUT_S)
                    continue
                t0 = time.perf_counter()
                built = build_request(mine, theirs, src_pages, dst_pages)
                request = TransferRequest("WRITE", built.src_descs, built.dst_descs, peer, msg)
                t1 = time.perf_counter()
                status = agent.submit_transfer_requests(request)
                if i >= 2:
                    build.append(t1 - t0)
                    post.append(time.perf_counter() - t1)
                status.wait(TIMEOUT_S)
            done = torch.zeros(1)
            if rank == 1:
                dist.send(done, 0)  # the last notification arrived
            else:
                dist.recv(done, 1)
                elapsed = time.perf_counter() - start
                page_bytes = n * (TARGET[0] * 2 * 32 * 32 * 8 + DRAFT[0] * 2 * 32 * 16 * 4)
                gbps.append(requests * page_bytes / elapsed / 1e9)
        if rank == 0:
            rows.append((n, statistics.median(gbps), statistics.median(build) * 1e6, statistics.median(post) * 1e6))
    if rank == 0:
        out.put(rows)
    dist.barrier()
    agent.close()
    dist.destroy_process_group()


def build_request(mine: list, theirs: list, src_pages: np.ndarray, dst_pages: np.ndarray) -> TransferRequest:
    """One request's transfer: both groups' pages and the auxiliary slot, descriptors built with numpy."""
    s_t, d_t = page_write_descs(mine[0], src_pages, theirs[0], dst_pages)
    s_d, d_d = page_write_descs(mine[1], src_pages, theirs[1], dst_pages)
    src = np.concatenate([s_t, s_d, slot_descs(mine[2], 0, AUX_BYTES)])
    dst = np.concatenate([d_t, d_d, slot_descs(theirs[2], 0, AUX_BYTES)])
    return TransferRequest("WRITE", MemoryDescs("DRAM", src), MemoryDescs("DRAM", dst), "peer", b"request")


def warm_build_us(layout: str, sizes: list[int]) -> list[float]:
    """The descriptor building alone, in this process, warm: median µs per request over 5 rounds of 200
    (no transfer runs in between, so no copy has flushed the caches)."""
    ours, theirs = _regions(*_pools()), _regions(*_pools())
    rng = np.random.default_rng(11)
    out = []
    for n in sizes:
        src_pages, dst_pages = _pages(rng, n, layout)
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                build_request(ours, theirs, src_pages, dst_pages)
            rounds.append((time.perf_counter() - t0) / 200 * 1e6)
        out.append(statistics.median(rounds))
    return out


def measure(transport: str, layout: str, sizes: list[int], requests: int, repeats: int) -> list[tuple]:
    """`(pages per group, GB/s, build us, post us per request)` per size, from two fresh rank processes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    meet = Rendezvous.create()
    procs = [ctx.Process(target=_rank, args=(r, transport, layout, meet, sizes, requests, repeats, out)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        rows = out.get()
        for p in procs:
            p.join()
        return rows
    finally:
        meet.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,32,129,512,2048", help="pages per group per request")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    why = nixl_unavailable()
    if why is not None:
        raise SystemExit(f"this benchmark compares NIXL with the torch wire, and NIXL does not import: {why}")
    print("| pages | pages/group | MB/request | NIXL GB/s | torch GB/s | ratio | NIXL build us | NIXL post us "
          "| torch build us | torch post us |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layout in ("runs", "random"):
        nixl = measure("nixl", layout, sizes, args.requests, args.repeats)
        wire = measure("torch", layout, sizes, args.requests, args.repeats)
        for (n, g_n, b_n, p_n), (_, g_t, b_t, p_t) in zip(nixl, wire):
            mb = n * (TARGET[0] * 2 * 32 * 32 * 8 + DRAFT[0] * 2 * 32 * 16 * 4) / 1e6
            print(f"| {layout} | {n} | {mb:.2f} | {g_n:.2f} | {g_t:.2f} | {g_n / g_t:.2f}x | {b_n:.0f} | {p_n:.0f} "
                  f"| {b_t:.0f} | {p_t:.0f} |")
    print()
    print("Descriptor building per request alone, warm, in one process (us; both groups and the auxiliary slot):")
    print("| layout | " + " | ".join(f"{n} pages" for n in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for layout in ("runs", "random"):
        print(f"| {layout} | " + " | ".join(f"{us:.0f}" for us in warm_build_us(layout, sizes)) + " |")

if __name__ == "__main__":
    main()
