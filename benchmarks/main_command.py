"""The main command's wall time and peak memory, beside the bare start-up in the same run.

`python -m tensorrt_llm_draftkv` (the embedded default scenario) is what a
newcomer runs first, so how long it takes is a figure we keep, not a unit test:
a wall-clock limit in a test fails whenever the machine is busy. Each
measurement runs the command in a fresh wrapper process, so the peak RSS is the
largest process of that command alone (the command's own ranks included).

The baseline is `python -m tensorrt_llm_draftkv --version`: importing the
package and starting the interpreter, which every command pays. The ratio says
how much of the wall time is the scenario itself.

Run: `python -m benchmarks.main_command` (about half a minute per repetition on
two CPU cores; `--reps N` for more, `--json FILE` to keep the figures).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Runs one command and prints its wall time and the peak RSS of its largest process (ru_maxrss, KiB).
_MEASURE = """
import resource, subprocess, sys, time
started = time.perf_counter()
proc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
wall = time.perf_counter() - started
if proc.returncode != 0:
    sys.stderr.write(proc.stderr)
    sys.exit(proc.returncode)
print(wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def measure(args: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MB) of `python -m tensorrt_llm_draftkv *args`, run from the checkout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # as a user runs it
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, sys.executable, "-m", "tensorrt_llm_draftkv", *args],
        cwd=REPO, env=env, capture_output=True, text=True, check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"`python -m tensorrt_llm_draftkv {' '.join(args)}` failed ({out.returncode}):\n{out.stderr}")
    wall, rss_kib = out.stdout.split()
    return float(wall), int(rss_kib) / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.main_command", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1, help="repetitions of each command (default 1)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    rows = {"start-up (--version)": ["--version"], "main command (default scenario)": []}
    figures = {}
    for name, cmd in rows.items():
        runs = [measure(cmd) for _ in range(args.reps)]
        walls = [w for w, _ in runs]
        figures[name] = {
            "wall_s_median": statistics.median(walls),
            "wall_s_min": min(walls),
            "wall_s_max": max(walls),
            "peak_rss_mb": max(r for _, r in runs),
            "reps": args.reps,
        }
    base = figures["start-up (--version)"]["wall_s_median"]
    print(f"{'command':<34} {'wall s (median)':>15} {'min':>7} {'max':>7} {'peak RSS MB':>12} {'x start-up':>11}")
    for name, f in figures.items():
        print(
            f"{name:<34} {f['wall_s_median']:>15.1f} {f['wall_s_min']:>7.1f} {f['wall_s_max']:>7.1f} "
            f"{f['peak_rss_mb']:>12.0f} {f['wall_s_median'] / base:>10.1f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"cpus": os.cpu_count(), **figures}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
