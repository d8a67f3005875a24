"""The generation step read straight from a device block table (ring form) against a copy of its bytes.

Run as ``python -m benchmarks.ring_step`` (CUDA; ``--quick`` for fewer sizes, ``--json FILE``).

Per batch B and prompt length: a ring of B table rows (W 4096, P 32: each row's live span
is its window plus a step, ``C = W/P + 8`` columns, whatever the prompt), rows at the
prompt's end, slots based at 0, block 16. Timed, all on the same inputs:

* ``ring``: ``prepare_paged_latent(..., table_rows=, table_first=, read_window=W)``, one launch,
  sized as the ring form is by default (``launch`` ring) and as the other kernels are (``generic``);
  ``staged``: ``prepare_ring_staged`` on the same rows, their scalars staged by the host (two rounds
  of device reads instead of three; it also writes the slots' new lengths);
* ``ring graph``: the same launch captured once and replayed;
* ``step/graph``: the worker's whole device step captured and replayed, against the copy's replay:
  the launch and the scatter of the new lengths to the slots (``index_copy_``) for the ring form,
  the launch alone for the staged form (the host's staging copy happens before a replay in both: the
  accepted counts, or the scalars that include them);
* ``copy``: ``copy_`` of the bytes the window-bounded step must touch (each row's
  ``W/P + 1`` entries read and its read row written), as a same-bytes floor, launched
  directly (``graph/copy``) and captured and replayed as the step is (``graph/graph``:
  both through the same launch mechanism);
* ``host``: wall-clock µs per checked call, back to back (the launch's host cost);
* ``bound``: the same per call of a ``BoundRingPreparation`` over the same tensors
  (checked once, then one driver launch per call), beside ``copy_``'s own host cost.

The prompt length enters only through the ordinals' values, so the figures should be flat.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tensorrt_llm_draftkv import kernels as K  # noqa: E402
from tensorrt_llm_draftkv.kernels.reference import window_read_width  # noqa: E402

P, W, BS, MAX_NEW = 32, 4096, 16, 16
C = W // P + 8


def make(B: int, prompt: int, dev: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = prompt - torch.randint(0, 4 * P, (B,), generator=g)
    extent = (lengths + BS + P - 1) // P
    first = (extent - C + 2).clamp_min(0)
    pages = torch.randperm(B * C, generator=g).reshape(B, C).to(torch.int32)
    rows = torch.randperm(B, generator=g)
    args = [pages, extent, rows, first, torch.arange(B), lengths, torch.zeros(B, dtype=torch.int64),
            torch.randint(0, MAX_NEW + 1, (B,), generator=g)]
    return [a.to(dev) for a in args]


def bench(B: int, prompt: int, dev: torch.device, form: str = "ring") -> dict:
    """One row. `form`: ``ring`` (the ring form as launched by default: `RING_BLOCK`, a column a thread),
    ``generic`` (the same launch sized as the other kernels are: `pick_block`'s block, a warp per 256
    columns, here one warp), ``staged`` (`prepare_ring_staged`: the rows' scalars staged by the host,
    the new lengths written at the slots by the launch itself)."""
    import numpy as np
    import triton.testing as tt
    from tensorrt_llm_draftkv.kernels._checks import num_warps, pick_block

    pages, extent, rows, first, *vectors = make(B, prompt, dev)
    slot_ids, lengths, base, num_new = vectors
    kw = dict(block_size=BS, tokens_per_block=P, max_ctx=prompt + 4096, max_new=MAX_NEW, read_window=W)
    out = K.PagedLatentPrep.empty(B, window_read_width(W, P), BS, MAX_NEW, device=dev)
    want = K.prepare_paged_latent_ring_reference(pages, extent, rows, first, *vectors, **kw)
    tune = {}
    if form == "generic":
        block = pick_block(B, out.read_rows.shape[1], None, False)
        tune = dict(block=block, num_warps=num_warps(block))
    ctx = lengths.clone()  # the slot lengths the step advances

    if form == "staged":
        host = np.empty((B, K.ROW_WIDTH), dtype=np.int64)
        c = lambda t: t.cpu().numpy()  # noqa: E731
        K.stage_row_scalars(host, c(rows), c(first[rows]), c(extent[rows]), c(base[slot_ids]), c(lengths[slot_ids]),
                            c(num_new), c(slot_ids))
        scalars = torch.from_numpy(host).to(dev)

        def call():
            K.prepare_ring_staged(pages, scalars, ctx, out=out, **kw)

        def step():  # the lengths are written by the launch
            call()

        bound = K.BoundStagedRing(pages, scalars, ctx, out=out, **kw)
    else:
        def call():
            K.prepare_paged_latent(pages, extent, *vectors, table_rows=rows, table_first=first, out=out, **kw, **tune)

        def step():  # the worker's step: the launch, then the new lengths scattered to the slots
            call()
            ctx.index_copy_(0, slot_ids, out.new_ctx_len)

        bound = K.BoundRingPreparation(pages, extent, rows, first, *vectors, out=out, **kw, **tune)

    call()
    torch.cuda.synchronize()
    for name, t in want.tensors().items():
        assert torch.equal(getattr(out, name), t), name
    direct = tt.do_bench(call, warmup=25, rep=200, return_mode="median")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    replay = tt.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    step_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(step_graph):
        step()
    step_replay = tt.do_bench(step_graph.replay, warmup=25, rep=200, return_mode="median")
    width = window_read_width(W, P)
    src = torch.randint(0, 1 << 20, (B * (width + 1) * 2,), dtype=torch.int32, device=dev)
    dst = torch.empty_like(src)
    copy = tt.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    copy_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(copy_graph):
        dst.copy_(src)
    copy_replay = tt.do_bench(copy_graph.replay, warmup=25, rep=200, return_mode="median")
    bound()
    assert bound.is_bound
    return {"B": B, "prompt": prompt, "launch": form, "ring_us": direct * 1e3,
            "graph_us": replay * 1e3, "step_graph_us": step_replay * 1e3, "copy_us": copy * 1e3,
            "copy_graph_us": copy_replay * 1e3,
            "host_us": _host_us(call), "bound_us": _host_us(bound), "copy_host_us": _host_us(lambda: dst.copy_(src))}


def _host_us(call) -> float:
    """Median over 5 rounds of the wall-clock µs per call, 200 calls back to back."""
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200):
            call()
        rounds.append((time.perf_counter() - t0) / 200 * 1e6)
        torch.cuda.synchronize()
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("ring_step: needs CUDA (the CPU path is the reference; see tests/kernels/test_ring.py)")
        return
    dev = torch.device("cuda")
    prompts = (32_768, 2_097_152) if args.quick else (32_768, 131_072, 524_288, 2_097_152)
    rows = []
    print(f"{'B':>5} {'prompt':>9} {'launch':>8} {'ring us':>8} {'graph us':>9} {'copy us':>8} {'graph/copy':>10}"
          f" {'copy graph':>10} {'graph/graph':>11} {'step/graph':>10} {'host us':>8} {'bound us':>9}"
          f" {'copy_ host':>10}")
    for B in (8, 64, 256):
        for prompt in prompts:
            for form in ("ring", "generic", "staged"):
                r = bench(B, prompt, dev, form)
                rows.append(r)
                print(f"{B:>5} {prompt:>9} {r['launch']:>8} {r['ring_us']:>8.2f} {r['graph_us']:>9.2f}"
                      f" {r['copy_us']:>8.2f} {r['graph_us'] / r['copy_us']:>10.2f} {r['copy_graph_us']:>10.2f}"
                      f" {r['graph_us'] / r['copy_graph_us']:>11.2f} {r['step_graph_us'] / r['copy_graph_us']:>10.2f}"
                      f" {r['host_us']:>8.1f} {r['bound_us']:>9.1f}"
                      f" {r['copy_host_us']:>10.1f}", flush=True)
    print("targets: graph replay <= 1.2x the same-bytes copy (shown against the copy launched directly and replayed);"
          " bound call <= 12 us of host time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
