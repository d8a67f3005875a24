"""`python -m tensorrt_llm_draftkv plan`: pages, bytes and concurrency for a pool geometry and budget."""
from __future__ import annotations

import argparse

from ..config import LayerGroupConfig, SpeculativeDecodingMode, parse_dtype
from ..manager.planner import PoolGeometry, format_report, plan_pool, trail_tokens_for


def _mode(text: str) -> SpeculativeDecodingMode:
    try:
        return SpeculativeDecodingMode.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_plan_args(p: argparse.ArgumentParser) -> None:
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
