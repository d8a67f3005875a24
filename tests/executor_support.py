"""Shared by the executor tests: a small geometry and the fixtures that keep its runs fast."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tensorrt_llm_draftkv.sim import SimSetup

# Chunk 512, windows 256/256, 16-token pages, 64 new tokens: each run takes a fraction of a second.
SMALL = replace(
    SimSetup(),
    chunk=512,
    target_window=256,
    draft_window=256,
    tokens_per_block=16,
    max_new_tokens=64,
    pool_requests=4,
    max_seq_len=8192,
)


@pytest.fixture(autouse=True)
def one_thread_per_process(monkeypatch):
    """One intra-op thread here and in spawned ranks: under `pytest -n 2` on two cores, more threads
    per process oversubscribe the machine and slow these runs several-fold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    """The kernels' torch reference (fast on CPU), inherited by spawned ranks; a test may switch back."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
