"""Command line: `simulate` (the default), `plan`, `bench`.

`python -m tensorrt_llm_draftkv` runs the embedded scenario: long prompts,
aggregated and disaggregated, under the legacy and the history mirror sizing.
"""
from __future__ import annotations

import argparse
import sys

from ..config import LayerGroupConfig, SpeculativeDecodingMode, parse_dtype
from ..manager.planner import PoolGeometry, format_report, plan_pool, trail_tokens_for


def _mode(text: str) -> SpeculativeDecodingMode:
    try:
        return SpeculativeDecodingMode.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drafter", default="dspark", type=_mode, help="speculative mode (dflash, dspark, pard, mtp, ...)"
    )
    p.add_argument("--num-layers", type=int, default=5, help="windowed draft layers")
    p.add_argument("--num-full-layers", type=int, default=0, help="full-attention draft layers")
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--window", type=int, default=4096, help="attention window in tokens (0 = full attention)")
    p.add_argument("--max-seq-len", type=int, default=524288)
    p.add_argument("--chunk", type=int, default=8192, help="context chunk size")
    p.add_argument("--max-draft-len", type=int, default=7)
    p.add_argument("--pool-gib", type=float, default=1.0, help="byte budget of the draft pool")
    t = p.add_argument_group("target pool (0 target layers skips it)")
    t.add_argument("--target-num-layers", type=int, default=48, help="windowed target layers")
    t.add_argument("--target-num-full-layers", type=int, default=16, help="full-attention target layers")
    t.add_argument("--target-num-kv-heads", type=int, default=8)
    t.add_argument("--target-head-dim", type=int, default=128)
    t.add_argument("--target-window", type=int, default=4096, help="target attention window (0 = full)")
    t.add_argument("--target-pool-gib", type=float, default=64.0, help="byte budget of the target pool")


def run_plan(args: argparse.Namespace) -> int:
    mode = args.drafter
    groups = []
    if args.num_layers:
        groups.append(LayerGroupConfig(args.num_layers, window=args.window or None))
    if args.num_full_layers:
        groups.append(LayerGroupConfig(args.num_full_layers, window=None))
    geometry = PoolGeometry(tuple(groups), args.num_kv_heads, args.head_dim, parse_dtype(args.dtype), args.tokens_per_block)
    trail = trail_tokens_for(mode, geometry, is_draft_pool=True)
    report = plan_pool(
        f"draft ({mode.value})",
        geometry,
        budget_bytes=int(args.pool_gib * (1 << 30)),
        max_seq_len=args.max_seq_len,
        chunk=args.chunk,
        max_draft_len=args.max_draft_len,
        trail_tokens=trail,
    )
    print(format_report(report, args.tokens_per_block))
    target_groups = []
    if args.target_num_layers:
        target_groups.append(LayerGroupConfig(args.target_num_layers, window=args.target_window or None))
    if args.target_num_full_layers:
        target_groups.append(LayerGroupConfig(args.target_num_full_layers, window=None))
    if target_groups:
        target = PoolGeometry(
            tuple(target_groups),
            args.target_num_kv_heads,
            args.target_head_dim,
            parse_dtype(args.dtype),
            args.tokens_per_block,
        )
        target_report = plan_pool(
            "target",
            target,
            budget_bytes=int(args.target_pool_gib * (1 << 30)),
            max_seq_len=args.max_seq_len,
            chunk=args.chunk,
            max_draft_len=args.max_draft_len,
        )
        print()
        print(format_report(target_report, args.tokens_per_block))
        both = min(report.max_concurrency, target_report.max_concurrency)
        print(f"\nconcurrent requests both pools hold: {both}")
    return 0


def _add_simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizing",
        choices=("history", "legacy", "both"),
        default="both",
        help="mirror sizing and slot seeding to run: the fix (history), the pre-fix behaviour (legacy), or both "
        "side by side (default)",
    )
    p.add_argument("--runs", nargs="*", help="names of the embedded runs to execute (default: all)")
    p.add_argument("--json", metavar="FILE", help="write one record per run")
    p.add_argument("--plot", metavar="FILE.png", help="draw draft-pool occupancy over steps (needs matplotlib)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--drafter", default="dflash", type=_mode, help="dflash or dspark")
    p.add_argument(
        "--no-trail-page",
        action="store_true",
        help="turn the trail page off but keep the page-aligned seed (the ablation: shows what the page prevents)",
    )
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument(
        "--full-attention-target",
        action="store_true",
        help="give the target full-attention layers (large target pool: meant for a GPU)",
    )
    p.add_argument("--progress", action="store_true", help="show a progress bar on long runs (default: on a terminal)")


def run_simulate(args: argparse.Namespace) -> int:
    import os

    import torch

    # One intra-op thread per process (spawned ranks inherit the variable): on a
    # small host, two ranks with several threads each make timings swing 5-10x.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off in NCCL ranks (set here, not by the library)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from dataclasses import replace

    from ..manager.rules import MirrorSizing
    from .scenario import DEFAULT_SCENARIO
    from .simulate import format_table, simulate, write_json, write_plot

    scenario = DEFAULT_SCENARIO.with_setup(
        device=args.device,
        drafter=args.drafter,
        trail_page=not args.no_trail_page,
        **({"max_new_tokens": args.max_new_tokens} if args.max_new_tokens else {}),
        **({"target_window": None} if args.full_attention_target else {}),
    )
    if args.runs:
        known = {r.name: r for r in scenario.runs}
        missing = [n for n in args.runs if n not in known]
        if missing:
            raise SystemExit(f"unknown run(s) {missing}; embedded runs: {sorted(known)}")
        scenario = replace(scenario, runs=tuple(known[n] for n in args.runs))
    if args.max_new_tokens:  # the flag wins over runs that set their own length
        scenario = replace(scenario, runs=tuple(replace(r, max_new_tokens=None) for r in scenario.runs))
    if args.plot:
        try:  # an optional extra: say so before a minute of simulation, not after
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--plot needs matplotlib (pip install -e '.[plot]')") from None
    sizings = [MirrorSizing.HISTORY, MirrorSizing.LEGACY] if args.sizing == "both" else [MirrorSizing(args.sizing)]
    results = simulate(scenario, sizings, progress=args.progress or sys.stderr.isatty())
    print(format_table(results))
    if args.json:
        write_json(results, args.json)
    if args.plot:
        write_plot(results, args.plot)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    import runpy

    sys.argv = ["benchmarks/kernels.py", *args.rest]
    runpy.run_module("benchmarks.kernels", run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorrt_llm_draftkv")
    sub = parser.add_subparsers(dest="command")
    simulate = sub.add_parser("simulate", help="the embedded long-prompt scenario, legacy vs history (default)")
    _add_simulate_args(simulate)
    plan = sub.add_parser("plan", help="pages, bytes and concurrency for a pool geometry and budget")
    _add_plan_args(plan)
    bench = sub.add_parser("bench", help="run the kernel benchmarks (arguments go to benchmarks/kernels.py)")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return run_bench(argparse.Namespace(rest=argv[1:]))
    if not argv or argv[0] not in ("simulate", "plan", "bench", "-h", "--help"):
        argv.insert(0, "simulate")  # simulate is the default command, options included
    args = parser.parse_args(argv)
    return {"simulate": run_simulate, "plan": run_plan, "bench": run_bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
