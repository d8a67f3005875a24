"""Command line: `simulate` (the default), `plan`, `bench`.

`python -m tensorrt_llm_draftkv` runs the embedded scenario: long prompts,
aggregated and disaggregated, under the legacy and the history mirror sizing.
Each subcommand lives in its own module (cli_simulate, cli_plan); `bench` runs
`benchmarks/kernels.py` of the source checkout the package was installed from.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

PROG = "python -m tensorrt_llm_draftkv"  # the program name unless the caller gives its own (see program_name)
MODULE_PROG = "python -m draftkv_sim"  # the name when started as the simulator's own module
BENCH_SCRIPT = Path("benchmarks") / "kernels.py"


def package_version() -> str:
    """The installed distribution's version (the package is meant to be installed, `pip install -e .`)."""
    from importlib import metadata

    try:
        return metadata.version("tensorrt_llm_draftkv")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def version_line() -> str:
    """What `--version` prints."""
    return f"tensorrt_llm_draftkv {package_version()}"


def program_name(argv0: str, module_prog: str = PROG) -> str:
    """What the user typed to start the command: `module_prog` (`python -m tensorrt_llm_draftkv` or
    `python -m draftkv_sim`, whichever module ran) or the console script's name."""
    name = Path(argv0).name
    return module_prog if not name or name in ("__main__.py", "-m", "-c") else name


def run_program(argv: list[str] | None = None, module_prog: str = PROG) -> int:
    """The command as a program: started with `argv` None it reads sys.argv and names itself as the user
    typed it (see program_name); given `argv` it is named `module_prog`."""
    return main(argv, prog=program_name(sys.argv[0], module_prog) if argv is None else module_prog)


# -- bench ----------------------------------------------------------------------------------
def checkout_root() -> Path:
    """The folder holding the `draftkv_sim` package (beside the library): the repository root of a source checkout."""
    return Path(__file__).resolve().parent.parent


def bench_script() -> Path | None:
    """`benchmarks/kernels.py` next to the package, or None (installed without the source checkout)."""
    path = checkout_root() / BENCH_SCRIPT
    return path if path.is_file() else None


def bench_header(script: Path, device: str, prog: str = PROG) -> str:
    """One paragraph saying what the numbers below are (the columns named are the table's own)."""
    where = f"{prog} bench: {script}"
    if device == "cuda":
        return (
            f"{where}\nGPU run: the fused Triton kernel prepare_paged_latent (the 'one-pass' columns, direct and "
            "CUDA-graph replay) against the eager baseline (benchmarks/eager_baseline.py, the 'eager' column), and "
            "decode_draft_block_table against its torch reference; recorded H200 figures: benchmarks/RESULTS.md."
        )
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    forms = (
        "the Triton interpreter (TRITON_INTERPRET=1)"
        if interpreted
        else "the plain-torch reference prepare_paged_latent_reference"
    )
    note = (
        "The Triton kernels run interpreted here, a correctness tool, not a fast path."
        if interpreted
        else "No Triton kernel is timed: on CPU Triton only runs interpreted, a correctness tool, not a fast path."
    )
    return (
        f"{where}\nCPU run: times the 'one-pass' and 'two-step' columns as {forms} against the eager baseline "
        "(benchmarks/eager_baseline.py, the 'eager' column) and a same-bytes copy (the 'copy' column), all with "
        f"time.perf_counter. {note} These are not GPU figures; the GPU ones are in benchmarks/RESULTS.md."
    )


def run_bench(args: argparse.Namespace) -> int:
    rest = list(args.rest)
    prog = getattr(args, "prog", PROG)
    script = bench_script()
    wants_help = any(a in ("-h", "--help") for a in rest)
    if script is None:
        message = (
            f"{prog} bench: the kernel benchmarks live in the source checkout, not in the installed package "
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
    argv0, sys.argv = sys.argv, [f"{prog} bench", *rest]
    try:
        module = runpy.run_path(str(script), run_name="benchmarks.kernels")
        # The header once the options are checked (a bad one is a one-line error, not a header and a traceback).
        start = lambda device: print(bench_header(script, device, prog), flush=True)  # noqa: E731
        return int(module["main"](rest, prog=f"{prog} bench", on_start=start) or 0)
    finally:
        sys.argv = argv0


# -- the parser -------------------------------------------------------------------------------
def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    # Imported here: the subcommands load the library and torch, which `--version` does not need.
    from .cli_plan import add_plan_args
    from .cli_simulate import add_simulate_args

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--version", action="version", version=version_line())
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


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """`prog`: the program name errors and --help show (the console script gives its own, `draftkv`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--version"]:  # answered before the parsers load the library (and torch): instant
        print(version_line())
        return 0
    if argv[:1] == ["bench"]:
        rest = argv[1:]  # every option, --help included, is the benchmark's
        return _quiet_on_closed_pipe(lambda: run_bench(argparse.Namespace(rest=rest, prog=prog)))
    if not argv or argv[0] not in ("simulate", "plan", "bench", "-h", "--help", "--version"):
        argv.insert(0, "simulate")  # simulate is the default command, options included
    args = build_parser(prog).parse_args(argv)
    from .cli_plan import run_plan
    from .cli_simulate import run_simulate

    return _quiet_on_closed_pipe(lambda: {"simulate": run_simulate, "plan": run_plan}[args.command](args))


def _quiet_on_closed_pipe(command) -> int:
    """Run `command`; if the reader of stdout went away (`... | head`), stop quietly, as `cat` does.

    stdout is pointed at /dev/null so the interpreter's final flush does not raise again.
    """
    try:
        code = command()
        sys.stdout.flush()  # inside the guard: the last buffered lines fail here, not at exit
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1


if __name__ == "__main__":
    sys.exit(main())
