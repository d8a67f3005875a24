"""Test configuration shared by every test module.

TRITON_INTERPRET must be set before anything imports triton, so it is the very
first thing this file does: on a CPU machine the Triton kernels then run in
Triton's interpreter instead of falling back to the torch reference.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # `from support import ...` from every test folder

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "draftkv",
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.load_profile("draftkv")
except ImportError:  # hypothesis is a test extra; plain tests still run without it
    pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return
    if torch.cuda.is_available():
        # Triton's interpreter mode is process-wide: with it on, kernels cannot compile for the GPU
        reason = "compiled kernels need TRITON_INTERPRET=0: run `TRITON_INTERPRET=0 python -m pytest -m cuda`"
    else:
        reason = "needs a CUDA device"
    skip_cuda = pytest.mark.skip(reason=reason)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def one_thread_per_process(monkeypatch):
    """One intra-op thread here and in spawned ranks: under `pytest -n 2` on two cores more threads
    per process oversubscribe the machine and make runs several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def reference_kernels(monkeypatch):
    """The kernels' torch reference (fast on CPU), inherited by spawned ranks."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
