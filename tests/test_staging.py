"""`staging`: host values onto a device without waiting, and the one-copy int32 scatter built on it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorrt_llm_draftkv.staging import scatter_int32, staged, to_device


def _check_scatter(device: str, size: int, picks: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    memory = torch.full((size,), -77, dtype=torch.int32, device=device)  # poisoned: only the picks may change
    flat = np.array(sorted(set(picks)), dtype=np.int64)
    values = rng.integers(-(2**31), 2**31 - 1, flat.size, dtype=np.int64).astype(np.int32)
    scatter_int32(memory, flat, values)
    want = np.full(size, -77, dtype=np.int32)
    want[flat] = values
    assert np.array_equal(memory.cpu().numpy(), want)


@settings(deadline=None, max_examples=40)
@given(size=st.integers(1, 300), data=st.data())
def test_scatter_writes_exactly_the_offsets_given(size, data):
    picks = data.draw(st.lists(st.integers(0, size - 1), max_size=size))
    _check_scatter("cpu", size, picks, data.draw(st.integers(0, 99)))


def test_staged_values_keep_their_dtype_and_land_on_the_device():
    assert staged([1, 2, 3], "cpu").dtype == torch.int64
    arr = np.arange(5, dtype=np.int32)
    assert torch.equal(to_device(arr, "cpu"), torch.arange(5, dtype=torch.int32))


@pytest.mark.cuda
@pytest.mark.parametrize("count", [1, 2, 7, 64])  # odd counts: the last int64 slot holds one int32
def test_scatter_on_the_device_matches_the_host_cuda(count):
    _check_scatter("cuda", 4096, list(range(3, 4096, 4096 // count))[:count], count)
