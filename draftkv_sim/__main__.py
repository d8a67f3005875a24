"""`python -m draftkv_sim` and the `draftkv` console script: the simulator's command line."""
from __future__ import annotations

import sys

from .cli import MODULE_PROG, run_program


def main(argv: list[str] | None = None) -> int:
    """The command. Started as a program (`argv` None), it names itself as the user typed it: `draftkv` for
    the console script, `python -m draftkv_sim` for the module."""
    return run_program(argv, module_prog=MODULE_PROG)


if __name__ == "__main__":
    sys.exit(main())
