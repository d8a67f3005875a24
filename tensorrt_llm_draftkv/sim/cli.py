"""Command line: `simulate` (the default), `plan`, `bench`.

`python -m tensorrt_llm_draftkv` runs the embedded scenario: long prompts,
aggregated and disaggregated, under the legacy and the history mirror sizing.
Each subcommand lives in its own module (cli_simulate, cli_plan); `bench` runs
`benchmarks/kernels.py` of the source checkout the package was installed from.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cli_plan import add_plan_args, run_plan
from .cli_simulate import add_simulate_args, run_simulate

PROG = "python -m tensorrt_llm_draftkv"
BENCH_SCRIPT = Path("benchmarks") / "kernels.py"


def package_version() -> str:
    """The installed distribution's version (the package is meant to be installed, `pip install -e .`)."""
    from importlib import metadata

    try:
        return metadata.version("tensorrt_llm_draftkv")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


# -- bench ----------------------------------------------------------------------------------
def checkout_root() -> Path:
    """The folder holding the `tensorrt_llm_draftkv` package: the repository root of a source checkout."""
    import tensorrt_llm_draftkv

    return Path(tensorrt_llm_draftkv.__file__).resolve().parent.parent


def bench_script() -> Path | None:
    """`benchmarks/kernels.py` next to the package, or None (installed without the source checkout)."""
    path = checkout_root() / BENCH_SCRIPT
    return path if path.is_file() else None


def _bench_device(rest: list[str]) -> str:
    """What the benchmark will time on: its own `--device` rule (auto: CUDA when available)."""
    device = "auto"
    for i, arg in enumerate(rest):
        if arg == "--device" and i + 1 < len(rest):
            device = rest[i + 1]
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device


def bench_header(script: Path, device: str) -> str:
    """One paragraph saying what the numbers below are."""
    where = f"{PROG} bench: {script}"
    if device == "cuda":
        return (
            f"{where}\nGPU run: the fused Triton kernel prepare_paged_latent (direct and CUDA-graph replay) against "
            "the eager baseline (benchmarks/eager_baseline.py), and decode_draft_block_table against its torch "
            "reference; recorded H200 figures: benchmarks/RESULTS.md."
        )
    return (
        f"{where}\nCPU run: times the plain-torch reference prepare_paged_latent_reference (the 'fused' column) "
        "against the eager baseline (benchmarks/eager_baseline.py), both with time.perf_counter. No Triton kernel "
        "is timed: on CPU Triton only runs interpreted, a correctness tool, not a fast path. These are not GPU "
        "figures; the GPU ones are in benchmarks/RESULTS.md."
    )


def run_bench(args: argparse.Namespace) -> int:
    rest = list(args.rest)
    script = bench_script()
    wants_help = any(a in ("-h", "--help") for a in rest)
    if script is None:
        message = (
            f"{PROG} bench: the kernel benchmarks live in the source checkout, not in the installed package "
            f"(no {BENCH_SCRIPT} in {checkout_root()}); run it from a clone installed with pip install -e ."
        )
        if wants_help:
            print(message)
            return 0
        raise SystemExit(message)
    import runpy

    root = str(script.parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)  # `from benchmarks.eager_baseline import ...` from any directory
    if not wants_help:
        print(bench_header(script, _bench_device(rest)), flush=True)
    argv0, sys.argv = sys.argv, [f"{PROG} bench", *rest]
    try:
        module = runpy.run_path(str(script), run_name="benchmarks.kernels")
        return int(module["main"](rest) or 0)
    finally:
        sys.argv = argv0


# -- the parser -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG)
    parser.add_argument("--version", action="version", version=f"tensorrt_llm_draftkv {package_version()}")
    sub = parser.add_subparsers(dest="command")
    simulate = sub.add_parser("simulate", help="the embedded long-prompt scenario, legacy vs history (default)")
    add_simulate_args(simulate)
    plan = sub.add_parser("plan", help="pages, bytes and concurrency for a pool geometry and budget")
    add_plan_args(plan)
    bench = sub.add_parser(
        "bench", help="time the kernels (benchmarks/kernels.py of the source checkout; its options follow)"
    )
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return run_bench(argparse.Namespace(rest=argv[1:]))  # every option, --help included, is the benchmark's
    if not argv or argv[0] not in ("simulate", "plan", "bench", "-h", "--help", "--version"):
        argv.insert(0, "simulate")  # simulate is the default command, options included
    args = parser.parse_args(argv)
    return {"simulate": run_simulate, "plan": run_plan, "bench": run_bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
