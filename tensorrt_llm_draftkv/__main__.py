"""`python -m tensorrt_llm_draftkv`: the simulator's command line (the `draftkv_sim` package), imported only when run.

The library itself never imports the simulator; this shim is the one place that names it.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """The command, named `python -m tensorrt_llm_draftkv` in its errors and --help."""
    from draftkv_sim.cli import PROG, run_program

    return run_program(argv, module_prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
