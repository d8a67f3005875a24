"""The generation step's preparation bounded by the drafter's window, against upstream's layout and a copy.

Run as ``python -m benchmarks.window_step`` (``--quick`` for a short run, ``--json FILE``).

Per prompt length (32k .. 2M tokens, P = 32, so M = prompt / P + 2 ordinals per
row) and batch (B 8 and 256): exported ``"cpp"`` offsets of 2 pools, each row
backed only over its window (W = 4096 tokens) at its tail and page 0 below, as a
windowed draft mirror looks after a long prefill; slots based at 0, block 16.

* ``base``: the one-pass preparation in upstream's layout (``read_window=None``):
  rows from the slot base, ``B x M`` entries written;
* ``window``: the same launch with ``read_window=W``: ``B x (W/P + 1)`` entries;
* ``bound``: the window-bounded call bound once to its static buffers
  (``kernels.BoundPreparation``), host µs per call;
* ``copy``: ``copy_`` of the window-bounded step's bytes (half read, half written):
  the K entries of each row's window read, its rows and per-row outputs written.

CUDA: medians of ``triton.testing.do_bench`` (direct calls and CUDA-graph
replays, L2 flushed) and host wall clock per call of back-to-back calls. On CPU
it is a smoke run of the reference path only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tensorrt_llm_draftkv import kernels as K  # noqa: E402
from tensorrt_llm_draftkv.kernels.reference import window_read_width  # noqa: E402

P, W, BS, MAX_NEW, KV = 32, 4096, 16, 16, 2
PROMPTS = (32_768, 131_072, 524_288, 2_097_152)
BATCHES = (8, 256)
ROUNDS = 5


def make_step(B: int, prompt: int, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """Offsets ``[2, B, 2, M]`` backed over each row's window only, and slot state at the prompt's end."""
    gen = torch.Generator().manual_seed(seed)
    M = prompt // P + 2
    live = window_read_width(W, P) + 1
    lengths = prompt - torch.randint(0, 4 * P, (B,), generator=gen)
    k = torch.zeros((2, B, M), dtype=torch.int32)  # cpp: page 0 at every released ordinal
    last = (lengths + BS - 1) // P
    pages = torch.randperm(2 * B * live, generator=gen).reshape(2, B, live).to(torch.int32) + 1
    cols = (last[:, None] - live + 1 + torch.arange(live)[None, :]).clamp_min(0)
    for p in range(2):
        k[p].scatter_(1, cols, pages[p] * KV)
    offsets = torch.stack([k, k + 1], dim=2).to(device)
    vectors = (
        torch.arange(B, dtype=torch.int64, device=device),
        lengths.to(device),
        torch.zeros(B, dtype=torch.int64, device=device),
        torch.randint(0, MAX_NEW + 1, (B,), generator=gen).to(device),
    )
    kw = dict(block_size=BS, tokens_per_block=P, max_ctx=1 << 40, max_new=MAX_NEW, pool_idx=1, divisor=KV,
              backend="cpp")
    return dict(B=B, M=M, prompt=prompt, offsets=offsets, vectors=vectors, kw=kw)


def out_for(step: dict, width: int) -> K.PagedLatentPrep:
    return K.PagedLatentPrep.empty(step["B"], width, BS, MAX_NEW, device=step["offsets"].device, with_extents=True)


def call(step: dict, out: K.PagedLatentPrep, window: int | None, **extra: Any) -> K.PagedLatentPrep:
    return K.prepare_paged_latent(None, None, *step["vectors"], block_offsets=step["offsets"], out=out,
                                  read_window=window, **step["kw"], **extra)


def step_bytes(B: int, width: int, offset_bytes: int = 4) -> int:
    """Bytes a step moves: each row's K entries over ``width`` ordinals read, its rows and outputs written,
    its slot state read."""
    rows = B * width * (offset_bytes + 4)
    per_row = B * (8 * 4 + 8 * BS + 8 * MAX_NEW) + B * 8 * 4
    return rows + per_row


def check(step: dict) -> None:
    want = K.prepare_paged_latent_one_pass_reference(step["offsets"], 1, KV, "cpp", *step["vectors"],
                                                     **{k: v for k, v in step["kw"].items()
                                                        if k not in ("pool_idx", "divisor", "backend")},
                                                     read_window=W)
    got = call(step, out_for(step, window_read_width(W, P)), W)
    for name, t in want.tensors().items():
        assert torch.equal(getattr(got, name).cpu(), t.cpu()), name


def bench_cuda(prompts, batches, show) -> list[dict]:
    import triton.testing as tt

    from benchmarks.kernels import capture, host_us

    dev = torch.device("cuda")
    bench = lambda fn: tt.do_bench(fn, return_mode="median") * 1e3  # noqa: E731  µs
    rows = []
    width = window_read_width(W, P)
    for prompt in prompts:
        for B in batches:
            step = make_step(B, prompt, dev)
            check(step)
            out_base, out_win = out_for(step, step["M"]), out_for(step, width)
            base = lambda: call(step, out_base, None)  # noqa: E731
            win = lambda: call(step, out_win, W)  # noqa: E731
            bound = K.BoundPreparation(step["offsets"], *step["vectors"], out=out_win, read_window=W, **step["kw"])
            bound()
            nbytes = step_bytes(B, width)
            half = max(1, nbytes // 2)
            src = torch.empty(half, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            copy = lambda: dst.copy_(src)  # noqa: E731
            g_base, g_win, g_copy = capture(base), capture(win), capture(copy)
            rounds = [[bench(g.replay) for g in (g_win, g_copy, g_base)] for _ in range(ROUNDS)]
            win_g, copy_g, base_g = (statistics.median(c) for c in zip(*rounds))
            r = dict(prompt=prompt, B=B, M=step["M"], width=width, base_bytes=step_bytes(B, step["M"]),
                     window_bytes=nbytes, base_graph_us=base_g, window_graph_us=win_g, copy_graph_us=copy_g,
                     window_vs_copy=win_g / copy_g, base_vs_window=base_g / win_g,
                     window_us=bench(win), bound_us=bench(bound), copy_us=bench(copy),
                     host_window_us=host_us(win), host_bound_us=host_us(bound), host_copy_us=host_us(copy))
            rows.append(r)
            show(fmt(r))
            del g_base, g_win, g_copy, step, out_base, out_win, src, dst
            torch.cuda.empty_cache()
    return rows


HEADER = (f"{'prompt':>9} {'B':>4} {'M':>6} {'base MB':>8} {'win KB':>7} {'base gr':>8} {'win gr':>7} "
          f"{'copy gr':>7} {'win/copy':>8} {'base/win':>8} {'bound':>6} {'host win':>8} {'host bnd':>8} "
          f"{'host cp':>7}")


def fmt(r: dict) -> str:
    return (f"{r['prompt']:>9} {r['B']:>4} {r['M']:>6} {r['base_bytes'] / 1e6:>8.2f} {r['window_bytes'] / 1e3:>7.1f} "
            f"{r['base_graph_us']:>8.1f} {r['window_graph_us']:>7.2f} {r['copy_graph_us']:>7.2f} "
            f"{r['window_vs_copy']:>8.2f} {r['base_vs_window']:>8.1f} {r['bound_us']:>6.2f} "
            f"{r['host_window_us']:>8.1f} {r['host_bound_us']:>8.1f} {r['host_copy_us']:>7.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.window_step", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two prompt lengths")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    prompts = PROMPTS[::3] if args.quick else PROMPTS
    if not torch.cuda.is_available():
        print("no CUDA device: checking the window-bounded reference on CPU only (a smoke run, no timings)")
        for prompt in prompts[:1]:
            check(make_step(8, prompt, torch.device("cpu")))
        print("ok")
        return 0
    print(f"window-bounded generation step, W {W}, P {P}, block {BS}, {torch.cuda.get_device_name()}")
    print("graph/direct columns: device µs (medians); host: µs per call, back-to-back")
    print(HEADER)
    rows = bench_cuda(prompts, BATCHES, print)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
