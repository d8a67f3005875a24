"""`python -m tensorrt_llm_draftkv`: the simulator's command line, imported only when run."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """The command. Started as a program (`argv` None), it names itself as the user typed it: `draftkv` for
    the console script, `python -m tensorrt_llm_draftkv` for the module."""
    from .sim.cli import PROG, program_name
    from .sim.cli import main as cli_main

    return cli_main(argv, prog=program_name(sys.argv[0]) if argv is None else PROG)


if __name__ == "__main__":
    sys.exit(main())
