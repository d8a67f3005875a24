"""Where two rank processes of one host meet to form their torch.distributed group.

For the loopback pairs (tests, benchmarks, the simulator's disaggregated runs):
an executor forms its own process group. A TCP rendezvous needs a port chosen
before the ranks start, and a port found free and then released can be taken by
any other process (a parallel test, a transfer engine) before rank 0 listens on
it. A file in a fresh directory of our own cannot be taken.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Rendezvous:
    """A file store's place in a fresh temporary directory; `tag` names the pair (unique per rendezvous)."""

    directory: str

    @classmethod
    def create(cls) -> "Rendezvous":
        return cls(tempfile.mkdtemp(prefix="draftkv-rdv-"))

    @property
    def init_method(self) -> str:
        """`init_process_group`'s `init_method`: the store file, made by the ranks when they meet."""
        return "file://" + os.path.join(self.directory, "store")

    @property
    def tag(self) -> str:
        return os.path.basename(self.directory)

    def remove(self) -> None:
        """Delete the directory (once the ranks are done with it)."""
        shutil.rmtree(self.directory, ignore_errors=True)


__all__ = ["Rendezvous"]
