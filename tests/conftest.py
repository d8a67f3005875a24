"""Test configuration shared by every test module.

TRITON_INTERPRET must be set before anything imports triton, so it is the very
first thing this file does: on a CPU machine the Triton kernels then run in
Triton's interpreter instead of falling back to the torch reference.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

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
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
