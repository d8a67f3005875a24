"""Command line: `simulate` (the default), `plan`, `bench`.

`python -m tensorrt_llm_draftkv` runs the embedded scenario: long prompts,
aggregated and disaggregated, under the legacy and the history mirror sizing.
Each subcommand lives in its own module (cli_simulate, cli_plan).
"""
from __future__ import annotations

import argparse
import sys

from .cli_plan import add_plan_args, run_plan
from .cli_simulate import add_simulate_args, run_simulate


def run_bench(args: argparse.Namespace) -> int:
    import runpy

    sys.argv = ["benchmarks/kernels.py", *args.rest]
    runpy.run_module("benchmarks.kernels", run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorrt_llm_draftkv")
    sub = parser.add_subparsers(dest="command")
    simulate = sub.add_parser("simulate", help="the embedded long-prompt scenario, legacy vs history (default)")
    add_simulate_args(simulate)
    plan = sub.add_parser("plan", help="pages, bytes and concurrency for a pool geometry and budget")
    add_plan_args(plan)
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
