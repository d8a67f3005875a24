"""`python -m tensorrt_llm_draftkv`: the simulator's command line, imported only when run."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from .sim.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
