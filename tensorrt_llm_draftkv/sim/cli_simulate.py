"""`python -m tensorrt_llm_draftkv [simulate]`: the embedded scenario, legacy vs history, as a table."""
from __future__ import annotations

import argparse
import sys

from .cli_plan import _mode


def add_simulate_args(p: argparse.ArgumentParser) -> None:
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
