"""Command line: `plan` (pool capacity planner); `simulate` and `bench` come with the executor."""
from __future__ import annotations

import argparse
import sys

from .config import LayerGroupConfig, SpeculativeDecodingMode, parse_dtype
from .planner import PoolGeometry, format_report, plan_pool, trail_tokens_for


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", default="dspark", help="speculative mode (dflash, dspark, pard, mtp, ...)")
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


def run_plan(args: argparse.Namespace) -> int:
    mode = SpeculativeDecodingMode.parse(args.drafter)
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
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorrt_llm_draftkv")
    sub = parser.add_subparsers(dest="command")
    plan = sub.add_parser("plan", help="pages, bytes and concurrency for a pool geometry and budget")
    _add_plan_args(plan)
    args = parser.parse_args(argv)
    if args.command in (None, "plan"):
        if args.command is None:
            args = plan.parse_args([])
        return run_plan(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
