"""Benchmark of the fused DFlash generation-step preparation (and the block-table decode).

Run as ``python -m benchmarks.kernels`` or ``python benchmarks/kernels.py``.

On CUDA, per (B, M):
  * ``fused``: ``prepare_paged_latent`` (one Triton launch, preallocated ``out``),
    median of ``triton.testing.do_bench`` (L2 flushed before every call);
  * ``graph``: the same call captured in a CUDA graph, replayed;
  * ``eager``: ``eager_prepare_paged_latent`` (``benchmarks/eager_baseline.py``, the
    upstream-style multi-op path with its host round trip), same timer;
  * bytes the step must move (rows' in-extent entries read, full read table
    written, per-row scalars, query positions and store targets), achieved
    GB/s, and a device-to-device copy moving the same number of bytes (half read,
    half written) timed in the same run, GB/s and the fused kernel's % of it;
  * kernel launches per call, counted with torch.profiler (CUDA activity).
A second table times ``decode_draft_block_table`` (Triton) against its torch
reference.

On CPU (no CUDA, or ``--device cpu``) there is no Triton kernel to time (the
interpreter is a test tool, not a fast path): the ``fused`` column is then the
plain-torch reference ``prepare_paged_latent_reference`` against the eager
baseline, both timed with ``time.perf_counter`` (median); the table says so.
``--quick`` shrinks the grid and the repetitions for a CPU smoke run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # `python benchmarks/kernels.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.eager_baseline import eager_prepare_paged_latent  # noqa: E402
from tensorrt_llm_draftkv import kernels as K  # noqa: E402

BATCHES = (1, 8, 64, 256, 1024)
MAX_BLOCKS = (128, 2048, 16384)
P = 32  # tokens per block
BLOCK_SIZE = 8  # bonus token + 7 mask tokens
MAX_NEW = 8


def make_inputs(B: int, M: int, device, seed: int = 0):
    """Rows backed over [lo, extent) with extent in [M/2, M]; slot bases below the extent."""
    gen = torch.Generator().manual_seed(seed * 7919 + B * 31 + M)
    tables = torch.randint(0, 2**30, (B, M), generator=gen, dtype=torch.int32)
    extents = torch.randint(max(1, M // 2), M + 1, (B,), generator=gen)
    S = max(1, B)
    slot_ids = torch.randperm(B, generator=gen) % S
    base_row = (torch.rand(B, generator=gen) * extents.float() / 4).long()  # pages below the window
    base = torch.zeros(S, dtype=torch.int64)
    base[slot_ids] = base_row
    cols = torch.arange(M)
    tables[(cols[None] >= extents[:, None]) | (cols[None] < base_row[:, None])] = -1
    ctx = torch.zeros(S, dtype=torch.int64)
    ctx[slot_ids] = extents * P - torch.randint(P, 2 * P, (B,), generator=gen)
    ctx = torch.maximum(ctx, base * P)
    num_new = torch.randint(0, MAX_NEW + 1, (B,), generator=gen)
    kw = dict(block_size=BLOCK_SIZE, tokens_per_block=P, max_ctx=M * P, max_new=MAX_NEW)
    inputs = tuple(t.to(device) for t in (tables, extents, slot_ids, ctx, base, num_new))
    return inputs, kw


def step_bytes(inputs, kw) -> int:
    """Bytes the preparation must move at least (global memory, read + written)."""
    tables, extents, slot_ids, ctx, base, num_new = inputs
    B, M = tables.shape
    ext = extents.clamp(0, M)
    shift = torch.minimum(base[slot_ids], ext)
    read_entries = int((ext - shift).sum()) * tables.element_size()
    stored = int(num_new.clamp(max=kw["max_new"]).sum()) * tables.element_size()  # store-target gathers
    scalars_in = B * (extents.element_size() + slot_ids.element_size() + num_new.element_size())
    scalars_in += B * (ctx.element_size() + base.element_size())
    writes = B * M * 4 + B * 3 * 8 + B * kw["block_size"] * 8 + 2 * B * kw["max_new"] * 4
    return read_entries + stored + scalars_in + writes


def _median_wall(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3  # ms


def _count_cuda_kernels(fn) -> tuple:
    try:
        return _count_cuda_kernels_unchecked(fn)
    except Exception as exc:  # profiler/CUPTI unavailable: report, don't fail the run
        return -1, -1, [f"profiler failed: {exc!r}"]


def _count_cuda_kernels_unchecked(fn) -> tuple:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [n for n in names if not n.lower().startswith(("memcpy", "memset"))]
    return len(kernels), len(names) - len(kernels), names


def bench_cuda(batches, max_blocks, with_decode=True, sweep=True):
    import triton.testing as tt

    dev = torch.device("cuda")
    bench = lambda fn: tt.do_bench(fn, return_mode="median")  # noqa: E731
    rows, decode_rows, sweep_rows = [], [], []
    launches = host = None
    for M in max_blocks:
        for B in batches:
            inputs, kw = make_inputs(B, M, dev)
            out = K.PagedLatentPrep.empty(B, M, kw["block_size"], kw["max_new"], device=dev)
            fused = lambda: K.prepare_paged_latent(*inputs, **kw, out=out)  # noqa: E731
            eager = lambda: eager_prepare_paged_latent(*inputs, **kw)  # noqa: E731
            fused()
            torch.cuda.synchronize()
            ref = K.prepare_paged_latent_reference(*inputs, **kw)
            for name, t in ref.tensors().items():  # sanity: the timed kernel is right
                assert torch.equal(getattr(out, name), t), (B, M, name)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fused()
            t_fused = bench(fused)
            t_graph = bench(g.replay)
            t_eager = bench(eager)
            nbytes = step_bytes(inputs, kw)
            half = max(1, nbytes // 2)
            src = torch.empty(half, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            t_copy = bench(lambda: dst.copy_(src))
            if launches is None or (B, M) == (256, 2048):
                n_f, n_f_copies, _ = _count_cuda_kernels(fused)
                n_e, n_e_copies, _ = _count_cuda_kernels(eager)
                launches = dict(B=B, M=M, fused=n_f, fused_copies=n_f_copies, eager=n_e, eager_copies=n_e_copies)
            if (B, M) == (1, 128):
                host = dict(
                    B=B, M=M, fused_us=host_overhead_us(fused), graph_replay_us=host_overhead_us(g.replay),
                    eager_us=host_overhead_us(eager, calls=50),
                )
            gbs = nbytes / (t_fused * 1e-3) / 1e9
            copy_gbs = 2 * half / (t_copy * 1e-3) / 1e9
            rows.append(
                dict(
                    B=B, M=M, fused_us=t_fused * 1e3, graph_us=t_graph * 1e3, eager_us=t_eager * 1e3,
                    speedup=t_eager / t_fused, bytes=nbytes, gbs=gbs, copy_gbs=copy_gbs, pct_copy=100 * gbs / copy_gbs,
                )
            )
            del g, src, dst
            if with_decode:
                decode_rows.append(bench_decode_cuda(B, M, bench))
            if sweep and (B, M) in ((1024, 16384), (256, 16384), (1024, 2048)):
                for blk in (512, 1024, 2048, 4096):
                    t = bench(lambda: K.prepare_paged_latent(*inputs, **kw, out=out, block=blk))
                    sweep_rows.append(dict(B=B, M=M, block=blk, us=t * 1e3, gbs=nbytes / (t * 1e-3) / 1e9))
            print_row(rows[-1], file=sys.stderr)
    return rows, decode_rows, sweep_rows, launches, host


def bench_decode_cuda(B, M, bench):
    gen = torch.Generator().manual_seed(B * 131 + M)
    offs = torch.full((2, B, 2, M), -1, dtype=torch.int32)
    pages = torch.randint(0, 2**29, (2, B, M), generator=gen, dtype=torch.int32)
    hi = torch.randint(max(1, M // 2), M + 1, (2, B), generator=gen)
    backed = torch.arange(M)[None, None] < hi[..., None]
    offs[:, :, 0] = torch.where(backed, pages * 2, -1)
    offs[:, :, 1] = torch.where(backed, pages * 2 + 1, -1)
    offs = offs.cuda()
    out = K.BlockTables(
        torch.empty((B, M), dtype=torch.int32, device="cuda"), torch.empty((B,), dtype=torch.int64, device="cuda")
    )
    fused = lambda: K.decode_draft_block_table(offs, 1, B, 2, "python", out=out)  # noqa: E731
    ref = lambda: K.decode_draft_block_table_reference(offs, 1, B, 2, "python")  # noqa: E731
    fused()
    want = ref()
    assert torch.equal(out.tables, want.tables) and torch.equal(out.extents, want.extents)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fused()
    t_f, t_g, t_r = bench(fused), bench(g.replay), bench(ref)
    nbytes = B * M * 4 * 2 + B * 8  # K half read + table written (+ extents); the scan re-reads are extra
    return dict(
        B=B, M=M, triton_us=t_f * 1e3, graph_us=t_g * 1e3, torch_us=t_r * 1e3, speedup=t_r / t_f,
        gbs=nbytes / (t_f * 1e-3) / 1e9, graph_gbs=nbytes / (t_g * 1e-3) / 1e9,
    )


def host_overhead_us(fn, calls: int = 300) -> float:
    """Wall-clock µs per call of back-to-back calls (no sync inside): the host-side cost
    when the GPU work per call is shorter than it."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def bench_cpu(batches, max_blocks, reps):
    rows = []
    for M in max_blocks:
        for B in batches:
            inputs, kw = make_inputs(B, M, "cpu")
            ref = lambda: K.prepare_paged_latent_reference(*inputs, **kw)  # noqa: E731
            eager = lambda: eager_prepare_paged_latent(*inputs, **kw)  # noqa: E731
            t_ref = _median_wall(ref, reps)
            t_eager = _median_wall(eager, reps)
            nbytes = step_bytes(inputs, kw)
            half = max(1, nbytes // 2)
            src = torch.empty(half, dtype=torch.uint8)
            dst = torch.empty_like(src)
            t_copy = _median_wall(lambda: dst.copy_(src), reps)
            gbs = nbytes / (t_ref * 1e-3) / 1e9
            copy_gbs = 2 * half / (t_copy * 1e-3) / 1e9
            rows.append(
                dict(
                    B=B, M=M, fused_us=t_ref * 1e3, graph_us=float("nan"), eager_us=t_eager * 1e3,
                    speedup=t_eager / t_ref, bytes=nbytes, gbs=gbs, copy_gbs=copy_gbs, pct_copy=100 * gbs / copy_gbs,
                )
            )
            print_row(rows[-1], file=sys.stderr)
    return rows


HEADER = (
    "|    B |     M | fused µs | graph µs | eager µs | eager/fused |   MiB moved | fused GB/s | copy GB/s | % of copy |\n"
    "|-----:|------:|---------:|---------:|---------:|------------:|------------:|-----------:|----------:|----------:|"
)


def fmt_row(r) -> str:
    g = "n/a" if r["graph_us"] != r["graph_us"] else f"{r['graph_us']:.1f}"
    return (
        f"| {r['B']:4d} | {r['M']:5d} | {r['fused_us']:8.1f} | {g:>8} | {r['eager_us']:8.1f} | "
        f"{r['speedup']:10.1f}x | {r['bytes'] / 2**20:11.3f} | {r['gbs']:10.1f} | {r['copy_gbs']:9.1f} | "
        f"{r['pct_copy']:8.1f}% |"
    )


def print_row(r, file=sys.stdout):
    print(fmt_row(r), file=file, flush=True)


def print_cuda_extras(result: dict) -> None:
    """The CUDA run's extra tables: decode timings, BLOCK sweep, host cost, launch counts."""
    if result.get("decode"):
        print("\ndecode_draft_block_table (python backend, pool 1 of 2): Triton vs torch reference")
        print("|    B |     M | triton µs | graph µs | torch µs | torch/triton | triton GB/s | graph GB/s |")
        print("|-----:|------:|----------:|---------:|---------:|-------------:|------------:|-----------:|")
        for r in result["decode"]:
            print(f"| {r['B']:4d} | {r['M']:5d} | {r['triton_us']:9.1f} | {r['graph_us']:8.1f} | {r['torch_us']:8.1f} | "
                  f"{r['speedup']:11.1f}x | {r['gbs']:11.1f} | {r['graph_gbs']:10.1f} |")
    if result.get("block_sweep"):
        print("\nBLOCK sweep, prepare_paged_latent, direct launches (default BLOCK: kernels._checks.pick_block)")
        for r in result["block_sweep"]:
            print(f"  B={r['B']:4d} M={r['M']:5d} BLOCK={r['block']:5d}: {r['us']:8.1f} µs  {r['gbs']:8.1f} GB/s")
    h = result.get("host")
    if h:
        print(f"\nhost-side cost per call (B={h['B']}, M={h['M']}, back-to-back, no sync): "
              f"fused {h['fused_us']:.1f} µs, graph replay {h['graph_replay_us']:.1f} µs, eager {h['eager_us']:.1f} µs")
    la = result["launches"]
    print(f"\nkernel launches per call (torch.profiler, B={la['B']}, M={la['M']}): "
          f"fused {la['fused']} kernel(s) + {la['fused_copies']} memcpy/memset; "
          f"eager {la['eager']} kernel(s) + {la['eager_copies']} memcpy/memset")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small grid, few repetitions (CPU smoke run)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--reps", type=int, default=None, help="CPU repetitions per timing")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for a CPU run (default 1)")
    args = ap.parse_args(argv)

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    batches = (1, 8, 64) if args.quick else BATCHES
    max_blocks = (128, 2048) if args.quick else MAX_BLOCKS
    result = dict(date=datetime.date.today().isoformat(), torch=torch.__version__)
    if use_cuda:
        import triton

        dev_name = torch.cuda.get_device_name()
        result.update(device=dev_name, triton=triton.__version__, timer="triton.testing.do_bench (median, L2 flushed)")
        rows, decode_rows, sweep_rows, launches, host = bench_cuda(batches, max_blocks)
        result.update(prepare=rows, decode=decode_rows, block_sweep=sweep_rows, launches=launches, host=host)
        print(f"\nprepare_paged_latent on {dev_name} (torch {torch.__version__}, triton {triton.__version__}); "
              "fused = Triton, one launch; timer: do_bench median, L2 flushed")
    else:
        reps = args.reps or (5 if args.quick else 11)
        torch.set_num_threads(args.threads)
        result.update(device="cpu", timer=f"time.perf_counter median of {reps}")
        rows = bench_cpu(batches, max_blocks, reps)
        result.update(prepare=rows)
        print(f"\nCPU run (torch {torch.__version__}, {torch.get_num_threads()} threads): no Triton kernel is timed on CPU; "
              "'fused' = the plain-torch reference prepare_paged_latent_reference, "
              f"timer: time.perf_counter median of {reps}")
    print(HEADER)
    for r in rows:
        print_row(r)
    if use_cuda:
        print_cuda_extras(result)
    if args.json:
        clean = lambda v: None if isinstance(v, float) and v != v else v  # noqa: E731  NaN -> null
        for key in ("prepare", "decode", "block_sweep"):
            result[key] = [{k: clean(v) for k, v in r.items()} for r in result.get(key) or []]
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
