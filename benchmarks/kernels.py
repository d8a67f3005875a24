"""Benchmark of a DFlash generation step's preparation: one-pass, two-step, eager, and a same-bytes copy.

Run as ``python -m benchmarks.kernels`` or ``python benchmarks/kernels.py``
(``--quick`` for a short run, ``--json FILE`` to keep the results).

Step measured, per (B, M), P = 32 tokens per block, block_size 8, max_new 8,
exported offsets of 2 pools (pool 1 read, K/V divisor 2, ``"python"`` export:
-1 at unbacked ordinals), rows backed over ``[lo, extent)`` with the extent in
``[M/2, M]`` and a window released below ``lo``; slot bases in the released part:

* ``one-pass``: ``prepare_paged_latent(None, None, ..., block_offsets=...)``:
  decode, extents, rebase and preparation in ONE launch (fast launch);
* ``two-step``: ``decode_draft_block_table`` then ``prepare_paged_latent`` from
  its tables (two launches);
* ``eager``: ``eager_step_from_offsets`` (``benchmarks/eager_baseline.py``): the
  upstream-style eager decode and preparation, many small ops and one ``.item()``
  host sync. It cannot be captured in a CUDA graph (the sync), so it has no
  graph column; ``eager/one-pass (graph)`` compares it, called directly, with the
  one-pass step replayed;
* ``copy``: a device-to-device ``copy_`` moving the step's bytes (half read, half
  written): the K entries a row needs read (from its shift to the end of the
  row), the whole read table written, plus per-row scalars, query positions and
  store targets.

CUDA timings: ``triton.testing.do_bench`` medians, L2 flushed before each call.
``direct`` is one Python call per measurement (host cost partly hidden behind
the flush); ``graph`` the same call captured once in a CUDA graph (side-stream
warmup first) and replayed. ``host µs``: wall clock per call of back-to-back
calls with no sync (fast and normal launch for the one-pass form, and
``kernels.BoundPreparation``, the call bound once to the step's static buffers).
The graph columns of the one-pass form and the copy are medians of
``GRAPH_ROUNDS`` interleaved rounds, which also time both tilings of the one-pass
kernel (read-table tiles and source-ordinal tiles, ``source_tiles=``) so the
default's threshold can be read off the table. A sweep of BLOCK x num_warps for
the one-pass kernel under graph replay, and the kernel launches per call
(torch.profiler), follow. Every timed path is first checked against the torch
reference.

On CPU (no CUDA, or ``--device cpu``) nothing runs on a GPU: the one-pass and
two-step forms run in Triton's interpreter when ``TRITON_INTERPRET=1`` and as
the torch reference otherwise (the table says which), timed with
``time.perf_counter`` (median); graph columns are n/a. It is a smoke run, not a
measurement.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

if __package__ in (None, ""):  # `python benchmarks/kernels.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.eager_baseline import eager_step_from_offsets  # noqa: E402
from tensorrt_llm_draftkv import kernels as K  # noqa: E402
from tensorrt_llm_draftkv.kernels._checks import one_pass_config  # noqa: E402

BATCHES = (1, 8, 64, 256, 1024)
MAX_BLOCKS = (128, 2048, 16384)
QUICK_BATCHES, QUICK_MAX_BLOCKS = (1, 64, 256), (128, 2048)
CPU_BATCHES, CPU_MAX_BLOCKS = (1, 8), (16, 128)
P = 32  # tokens per block
BLOCK_SIZE = 8  # bonus token + 7 mask tokens
MAX_NEW = 8
NUM_POOLS, POOL, DIVISOR, BACKEND = 2, 1, 2, "python"
SWEEP_SIZES = ((8, 16384), (256, 2048), (1024, 16384))
SWEEP_CONFIGS = ((None, None), (1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16))
SWEEP_CONFIGS_QUICK = ((None, None), (2048, 4), (4096, 8))
GRAPH_ROUNDS = 3

Step = tuple[torch.Tensor, tuple[torch.Tensor, ...], dict[str, int]]


def make_step(B: int, M: int, device: Any, seed: int = 0) -> Step:
    """Exported offsets ``[2, B, 2, M]`` and slot state of one step (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed * 7919 + B * 31 + M)
    pages = torch.randint(0, 2**29, (NUM_POOLS, B, M), generator=gen)
    extent = torch.randint(max(1, M // 2), M + 1, (NUM_POOLS, B), generator=gen)
    lo = (torch.rand(NUM_POOLS, B, generator=gen) * extent.float() / 4).long()  # released below lo
    cols = torch.arange(M)
    backed = (cols >= lo[..., None]) & (cols < extent[..., None])
    off = torch.empty((NUM_POOLS, B, 2, M), dtype=torch.int32)
    off[:, :, 0] = torch.where(backed, pages * DIVISOR, -1).to(torch.int32)
    off[:, :, 1] = torch.where(backed, pages * DIVISOR + 1, -1).to(torch.int32)
    S = max(1, B)
    slot_ids = torch.randperm(B, generator=gen) % S
    base = torch.zeros(S, dtype=torch.int64)
    base[slot_ids] = lo[POOL]  # the slot's base covers the released pages
    ctx = torch.zeros(S, dtype=torch.int64)
    ctx[slot_ids] = extent[POOL] * P - torch.randint(P, 2 * P, (B,), generator=gen)
    ctx = torch.maximum(ctx, base * P)
    num_new = torch.randint(0, MAX_NEW + 1, (B,), generator=gen)
    kw = dict(block_size=BLOCK_SIZE, tokens_per_block=P, max_ctx=M * P, max_new=MAX_NEW)
    vectors = tuple(t.to(device) for t in (slot_ids, ctx, base, num_new))
    return off.to(device), vectors, kw


def step_bytes(step: Step) -> int:
    """Bytes one step has to move at least (global memory, read + written)."""
    off, vectors, kw = step
    slot_ids, ctx, base, num_new = vectors
    B, M = slot_ids.shape[0], off.shape[3]
    shift = base[slot_ids].clamp(0, M)
    reads = int((M - shift).sum()) * off.element_size()  # a row's entries from its shift on
    reads += int(num_new.clamp(max=kw["max_new"]).sum()) * off.element_size()  # store-target gathers
    reads += B * (slot_ids.element_size() + num_new.element_size() + ctx.element_size() + base.element_size())
    writes = B * M * 4 + B * 4 * 8 + B * kw["block_size"] * 8 + 2 * B * kw["max_new"] * 4
    return reads + writes


# --------------------------------------------------------------------------- progress


class RowStream:
    """Each measured row as it comes, on stderr, without repeating the final table on the same terminal.

    With stdout and stderr on one terminal the final table (stdout) would show every row a second
    time, so there a row is a transient status line, rewritten in place and erased at the end;
    anywhere else (stdout redirected, a log) the rows go to stderr as they are, one a line.
    """

    def __init__(self, out=None, err=None) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.transient = _is_terminal(self.out) and _is_terminal(self.err)
        self._shown = False

    def __call__(self, text: str) -> None:
        if not self.transient:
            print(text, file=self.err, flush=True)
            return
        import shutil

        width = max(shutil.get_terminal_size().columns - 1, 20)
        status = " ".join(text.split())  # a table row or a sweep line, squeezed onto one line
        self.err.write("\r\033[K" + "measuring " + status[: width - 10])
        self.err.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            self.err.write("\r\033[K")
            self.err.flush()
            self._shown = False


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# --------------------------------------------------------------------------- the paths timed


class Paths:
    """The timed calls of one (B, M) step, each writing into preallocated outputs."""

    def __init__(self, step: Step, impl: Optional[str] = None):
        self.off, self.vectors, self.kw = step
        B, M = self.vectors[0].shape[0], self.off.shape[3]
        dev = self.off.device
        self.impl = impl
        self.out = K.PagedLatentPrep.empty(B, M, BLOCK_SIZE, MAX_NEW, device=dev, with_extents=True)
        self.two = K.PagedLatentPrep.empty(B, M, BLOCK_SIZE, MAX_NEW, device=dev)
        self.bt = K.BlockTables(
            torch.empty((B, M), dtype=torch.int32, device=dev), torch.empty((B,), dtype=torch.int64, device=dev)
        )
        self.bound = K.BoundPreparation(self.off, *self.vectors, out=self.out, **self.kw, pool_idx=POOL,
                                        divisor=DIVISOR, backend=BACKEND, impl=impl)

    def one_pass(self, fast_launch: bool = True, **tune: Any) -> K.PagedLatentPrep:
        return K.prepare_paged_latent(
            None, None, *self.vectors, **self.kw, block_offsets=self.off, pool_idx=POOL, divisor=DIVISOR,
            backend=BACKEND, out=self.out, impl=self.impl, fast_launch=fast_launch, **tune,
        )

    def one_pass_normal(self) -> K.PagedLatentPrep:
        return self.one_pass(fast_launch=False)

    def two_step(self) -> K.PagedLatentPrep:
        B = self.vectors[0].shape[0]
        K.decode_draft_block_table(self.off, POOL, B, DIVISOR, BACKEND, out=self.bt, impl=self.impl)
        return K.prepare_paged_latent(self.bt.tables, self.bt.extents, *self.vectors, **self.kw, out=self.two,
                                      impl=self.impl)

    def eager(self) -> K.PagedLatentPrep:
        return eager_step_from_offsets(self.off, POOL, DIVISOR, BACKEND, *self.vectors, **self.kw)

    def check(self) -> None:
        """Every timed path gives the reference's results (a wrong kernel is not timed)."""
        want = K.prepare_paged_latent_one_pass_reference(self.off, POOL, DIVISOR, BACKEND, *self.vectors, **self.kw)
        for name, fn in (("one-pass", self.one_pass), ("one-pass normal", self.one_pass_normal),
                         ("two-step", self.two_step), ("eager", self.eager), ("bound", self.bound),
                         ("bound again", self.bound),
                         ("rows tiles", lambda: self.one_pass(source_tiles=False)),
                         ("source tiles", lambda: self.one_pass(source_tiles=True))):
            for t in (*self.out.tensors().values(), *self.two.tensors().values(), *self.bt):
                t.fill_(-7)  # poison: each path must write every element itself
            got = fn()
            for field, t in want.tensors().items():
                g = getattr(got, field)
                if g is None and field == "extents":
                    g = self.bt.extents
                assert torch.equal(g, t), (name, field)


# --------------------------------------------------------------------------- timers


def _median_wall(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    """Median wall-clock milliseconds of ``fn`` (CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def capture(fn: Callable[[], Any]) -> "torch.cuda.CUDAGraph":
    """``fn`` warmed up on a side stream (compiles, binds the fast launch), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def host_us(fn: Callable[[], Any], calls: int = 300) -> float:
    """Wall-clock µs per call of back-to-back calls (no sync inside)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def count_launches(fn: Callable[[], Any]) -> tuple[int, int]:
    """``(kernels, memcpy/memset)`` of one call, from torch.profiler; ``(-1, -1)`` if unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    except Exception:  # profiler/CUPTI unavailable: report, don't fail the run
        return -1, -1
    kernels = [n for n in names if not n.lower().startswith(("memcpy", "memset"))]
    return len(kernels), len(names) - len(kernels)


# --------------------------------------------------------------------------- CUDA run


def bench_cuda(batches, max_blocks, sweep_configs, with_launches: bool = True, show=None) -> dict:
    import triton.testing as tt

    show = show or RowStream()
    dev = torch.device("cuda")
    bench = lambda fn: tt.do_bench(fn, return_mode="median") * 1e3  # noqa: E731  µs
    rows, sweep = [], []
    launches = None
    for M in max_blocks:
        for B in batches:
            step = make_step(B, M, dev)
            paths = Paths(step)
            paths.check()
            nbytes = step_bytes(step)
            half = max(1, nbytes // 2)
            src = torch.empty(half, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            copy = lambda: dst.copy_(src)  # noqa: E731
            g_one, g_two, g_copy = capture(paths.one_pass), capture(paths.two_step), capture(copy)
            g_rows = capture(lambda: paths.one_pass(source_tiles=False))
            g_src = capture(lambda: paths.one_pass(source_tiles=True))
            r = dict(B=B, M=M, bytes=nbytes)
            r["default_source_tiles"] = one_pass_config(B, M, dev, None, None, None)[4]
            # the graph ratios are small differences of a few µs: interleave rounds, keep the median round
            rounds = [[bench(g.replay) for g in (g_one, g_copy, g_rows, g_src)] for _ in range(GRAPH_ROUNDS)]
            one_g, copy_g, rows_g, src_g = (statistics.median(col) for col in zip(*rounds))
            r["one_pass_us"] = bench(paths.one_pass)
            r["bound_us"] = bench(paths.bound)
            r["one_pass_graph_us"] = one_g
            r["rows_tiles_graph_us"], r["source_tiles_graph_us"] = rows_g, src_g
            r["two_step_us"] = bench(paths.two_step)
            r["two_step_graph_us"] = bench(g_two.replay)
            r["eager_us"] = bench(paths.eager)
            r["copy_us"] = bench(copy)
            r["copy_graph_us"] = copy_g
            r["graph_vs_copy"] = r["one_pass_graph_us"] / r["copy_graph_us"]
            r["direct_vs_copy"] = r["one_pass_us"] / r["copy_us"]
            r["two_step_graph_vs_copy"] = r["two_step_graph_us"] / r["copy_graph_us"]
            r["eager_vs_one_pass_graph"] = r["eager_us"] / r["one_pass_graph_us"]
            r["one_pass_graph_gbs"] = nbytes / (r["one_pass_graph_us"] * 1e-6) / 1e9
            r["host_one_pass_fast_us"] = host_us(paths.one_pass)
            r["host_bound_us"] = host_us(paths.bound)
            r["host_one_pass_normal_us"] = host_us(paths.one_pass_normal)
            r["host_two_step_us"] = host_us(paths.two_step)
            r["host_copy_us"] = host_us(copy)
            r["host_graph_replay_us"] = host_us(g_one.replay)
            rows.append(r)
            show(fmt_row(r))
            if with_launches and (launches is None or (B, M) == (256, 2048)):
                launches = dict(B=B, M=M)
                for name, fn in (("one_pass", paths.one_pass), ("two_step", paths.two_step), ("eager", paths.eager)):
                    launches[name], launches[name + "_copies"] = count_launches(fn)
            if (B, M) in SWEEP_SIZES:
                sweep.extend(sweep_cuda(paths, nbytes, r["copy_graph_us"], sweep_configs, bench, show))
            del g_one, g_two, g_copy, g_rows, g_src, src, dst
    return dict(prepare=rows, sweep=sweep, launches=launches)


def sweep_cuda(paths: Paths, nbytes: int, copy_graph_us: float, configs, bench, show=None) -> list[dict]:
    """One-pass kernel under graph replay for each (BLOCK, num_warps) in ``configs`` (None: default)."""
    B, M = paths.vectors[0].shape[0], paths.off.shape[3]
    out = []
    for blk, warps in configs:
        tune = {} if blk is None else dict(block=blk, num_warps=warps)
        fn = lambda: paths.one_pass(**tune)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        want = K.prepare_paged_latent_one_pass_reference(paths.off, POOL, DIVISOR, BACKEND, *paths.vectors, **paths.kw)
        assert all(torch.equal(getattr(paths.out, f), t) for f, t in want.tensors().items()), (B, M, blk, warps)
        us = bench(capture(fn).replay)
        out.append(dict(B=B, M=M, block=blk or "default", num_warps=warps or "default", graph_us=us,
                        vs_copy=us / copy_graph_us, gbs=nbytes / (us * 1e-6) / 1e9))
        (show or RowStream())(f"  sweep B={B} M={M} BLOCK={blk} warps={warps}: {us:.1f} µs")
    return out


# --------------------------------------------------------------------------- CPU run


def cpu_impl() -> str:
    """What a CPU run times as the one-pass and two-step forms: Triton's interpreter or the torch reference."""
    return "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "reference"


def bench_cpu(batches, max_blocks, reps: int, show=None) -> dict:
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    show = show or RowStream()
    impl = cpu_impl()
    rows = []
    for M in max_blocks:
        for B in batches:
            step = make_step(B, M, "cpu")
            paths = Paths(step, impl=impl)
            paths.check()
            nbytes = step_bytes(step)
            half = max(1, nbytes // 2)
            src = torch.empty(half, dtype=torch.uint8)
            dst = torch.empty_like(src)
            nan = float("nan")
            r = dict(B=B, M=M, bytes=nbytes, one_pass_us=_median_wall(paths.one_pass, reps) * 1e3,
                     one_pass_graph_us=nan, two_step_us=_median_wall(paths.two_step, reps) * 1e3,
                     two_step_graph_us=nan, eager_us=_median_wall(paths.eager, reps) * 1e3,
                     copy_us=_median_wall(lambda: dst.copy_(src), reps) * 1e3, copy_graph_us=nan)
            r["direct_vs_copy"] = r["one_pass_us"] / r["copy_us"]
            r["graph_vs_copy"] = r["two_step_graph_vs_copy"] = r["eager_vs_one_pass_graph"] = nan
            rows.append(r)
            show(fmt_row(r))
    return dict(prepare=rows, sweep=[], launches=None, cpu_impl=impl)


# --------------------------------------------------------------------------- report


HEADER = (
    "|    B |     M |  MiB | one-pass µs | graph µs | two-step µs | graph µs | eager µs | copy µs | graph µs |"
    " one-pass/copy (graph) |  (direct) | two-step/copy (graph) | eager/one-pass (graph) |\n"
    "|-----:|------:|-----:|------------:|---------:|------------:|---------:|---------:|--------:|---------:|"
    "----------------------:|----------:|----------------------:|-----------------------:|"
)


def _f(v: float, width: int, digits: int = 1, suffix: str = "") -> str:
    return f"{'n/a':>{width}}" if v != v else f"{v:{width - len(suffix)}.{digits}f}{suffix}"


def fmt_row(r: dict) -> str:
    return (
        f"| {r['B']:4d} | {r['M']:5d} | {r['bytes'] / 2**20:4.2f} | {_f(r['one_pass_us'], 11)} | "
        f"{_f(r['one_pass_graph_us'], 8)} | {_f(r['two_step_us'], 11)} | {_f(r['two_step_graph_us'], 8)} | "
        f"{_f(r['eager_us'], 8)} | {_f(r['copy_us'], 7)} | {_f(r['copy_graph_us'], 8)} | "
        f"{_f(r['graph_vs_copy'], 22, 2, 'x')} | {_f(r['direct_vs_copy'], 9, 1, 'x')} | "
        f"{_f(r['two_step_graph_vs_copy'], 21, 2, 'x')} | {_f(r['eager_vs_one_pass_graph'], 22, 0, 'x')} |"
    )


def print_report(result: dict) -> None:
    print(HEADER)
    for r in result["prepare"]:
        print(fmt_row(r))
    if result["prepare"] and "host_one_pass_fast_us" in result["prepare"][0]:
        print("\nhost µs per call (back-to-back calls, no sync); bound: kernels.BoundPreparation")
        print("|    B |     M | bound | one-pass fast | one-pass normal | two-step | copy_ | graph replay |")
        print("|-----:|------:|------:|--------------:|----------------:|---------:|------:|-------------:|")
        for r in result["prepare"]:
            print(f"| {r['B']:4d} | {r['M']:5d} | {r['host_bound_us']:5.1f} | {r['host_one_pass_fast_us']:13.1f} | "
                  f"{r['host_one_pass_normal_us']:15.1f} | {r['host_two_step_us']:8.1f} | {r['host_copy_us']:5.1f} | "
                  f"{r['host_graph_replay_us']:12.1f} |")
        print(f"\none-pass tilings under graph replay (median of {GRAPH_ROUNDS} interleaved rounds), "
              "and the bound step called directly")
        print("|    B |     M | copy µs | rows tiles µs | / copy | source tiles µs | / copy | default | bound direct µs |")
        print("|-----:|------:|--------:|--------------:|-------:|----------------:|-------:|--------:|----------------:|")
        for r in result["prepare"]:
            c = r["copy_graph_us"]
            d = "source" if r.get("default_source_tiles") else "rows"
            print(f"| {r['B']:4d} | {r['M']:5d} | {c:7.1f} | {r['rows_tiles_graph_us']:13.1f} | "
                  f"{r['rows_tiles_graph_us'] / c:5.2f}x | {r['source_tiles_graph_us']:15.1f} | "
                  f"{r['source_tiles_graph_us'] / c:5.2f}x | {d:>7} | {r['bound_us']:15.1f} |")
    if result.get("sweep"):
        print("\none-pass kernel, BLOCK x num_warps under graph replay (default: kernels._checks.one_pass_config)")
        print("|    B |     M |   BLOCK | warps | graph µs | / copy (graph) |  GB/s |")
        print("|-----:|------:|--------:|------:|---------:|---------------:|------:|")
        for r in result["sweep"]:
            print(f"| {r['B']:4d} | {r['M']:5d} | {str(r['block']):>7} | {str(r['num_warps']):>5} | "
                  f"{r['graph_us']:8.1f} | {r['vs_copy']:13.2f}x | {r['gbs']:5.0f} |")
    la = result.get("launches")
    if la:
        print(f"\nkernel launches per call (torch.profiler, B={la['B']}, M={la['M']}): "
              f"one-pass {la['one_pass']} kernel(s) + {la['one_pass_copies']} memcpy/memset; "
              f"two-step {la['two_step']} + {la['two_step_copies']}; eager {la['eager']} + {la['eager_copies']}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> argparse.Namespace:
    """The options, every one checked before anything is timed: a bad one is one line on stderr, exit 2."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])

    def fail(message: str):
        sys.stderr.write(f"{ap.prog}: error: {message}\n")
        raise SystemExit(2)

    ap.error = fail  # type: ignore[method-assign]
    ap.add_argument("--quick", action="store_true", help="fewer sizes and sweep configs (CPU: tiny sizes)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                    help="what to time on (auto: cuda when available, else cpu)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON (its folder must exist)")
    ap.add_argument("--reps", type=_positive_int, default=None, metavar="N",
                    help="CPU repetitions per timing (default 7, 3 with --quick)")
    ap.add_argument("--threads", type=_positive_int, default=1, metavar="N",
                    help="torch CPU threads for a CPU run (default 1)")
    args = ap.parse_args(argv)
    args.prog = ap.prog
    from draftkv_sim.cli_simulate import UsageError, check_device, check_output_path

    try:
        if args.device == "cuda":
            check_device("cuda", "--device")
        if args.json is not None:
            check_output_path("--json", args.json)  # before the run, not after it
    except UsageError as err:
        fail(str(err))
    args.device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    return args


def main(
    argv: Optional[list[str]] = None,
    *,
    prog: Optional[str] = None,
    on_start: Optional[Callable[[str], None]] = None,
) -> int:
    """Parse and check the options, call ``on_start(device)`` (``cuda`` or ``cpu``), run, print the report."""
    args = parse_args(argv, prog)
    use_cuda = args.device == "cuda"
    if on_start is not None:
        on_start(args.device)
    show = RowStream()
    result: dict[str, Any] = dict(date=datetime.date.today().isoformat(), torch=torch.__version__,
                                  P=P, block_size=BLOCK_SIZE, max_new=MAX_NEW, backend=BACKEND)
    if use_cuda:
        import triton

        batches = QUICK_BATCHES if args.quick else BATCHES
        max_blocks = QUICK_MAX_BLOCKS if args.quick else MAX_BLOCKS
        result.update(device=torch.cuda.get_device_name(), triton=triton.__version__,
                      timer="triton.testing.do_bench (median, L2 flushed), µs")
        try:
            result.update(bench_cuda(batches, max_blocks, SWEEP_CONFIGS_QUICK if args.quick else SWEEP_CONFIGS,
                                     show=show))
        finally:
            show.close()
        print(f"\nDFlash step preparation on {result['device']} (torch {torch.__version__}, triton "
              f"{triton.__version__}); do_bench medians, L2 flushed; eager is not capturable (host sync)")
    else:
        reps = args.reps or (3 if args.quick else 7)
        torch.set_num_threads(args.threads)
        batches = CPU_BATCHES if args.quick else QUICK_BATCHES
        max_blocks = CPU_MAX_BLOCKS if args.quick else QUICK_MAX_BLOCKS
        result.update(device="cpu", timer=f"time.perf_counter median of {reps}, µs")
        try:
            result.update(bench_cpu(batches, max_blocks, reps, show=show))
        finally:
            show.close()
        print(f"\nCPU smoke run (torch {torch.__version__}): one-pass and two-step run as "
              f"{'the Triton interpreter' if result['cpu_impl'] == 'triton' else 'the torch reference'}; "
              "no GPU timing")
    print_report(result)
    if args.json:
        clean = lambda v: None if isinstance(v, float) and v != v else v  # noqa: E731  NaN -> null
        for key in ("prepare", "sweep"):
            result[key] = [{k: clean(v) for k, v in r.items()} for r in result.get(key) or []]
        try:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        except OSError as err:  # checked before the run; the folder went away during it
            print(f"{args.prog}: error: argument --json: cannot write {args.json}: {err.strerror or err}",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
