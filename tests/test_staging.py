"""`staging`: host values onto a device without waiting, and the one-copy int32 scatter built on it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorrt_llm_draftkv.staging import PinnedStager, scatter_int32, scatter_int32_staged, staged, to_device


def _check_scatter(device: str, size: int, picks: list[int], seed: int, scatter=scatter_int32) -> None:
    rng = np.random.default_rng(seed)
    memory = torch.full((size,), -77, dtype=torch.int32, device=device)  # poisoned: only the picks may change
    flat = np.array(sorted(set(picks)), dtype=np.int64)
    values = rng.integers(-(2**31), 2**31 - 1, flat.size, dtype=np.int64).astype(np.int32)
    scatter(memory, flat, values)
    want = np.full(size, -77, dtype=np.int32)
    want[flat] = values
    assert np.array_equal(memory.cpu().numpy(), want)


@settings(deadline=None, max_examples=40)
@given(size=st.integers(1, 300), data=st.data())
def test_scatter_writes_exactly_the_offsets_given(size, data):
    picks = data.draw(st.lists(st.integers(0, size - 1), max_size=size))
    _check_scatter("cpu", size, picks, data.draw(st.integers(0, 99)))


@settings(deadline=None, max_examples=40)
@given(size=st.integers(1, 300), data=st.data())
def test_the_device_form_of_the_scatter_packs_and_unpacks_exactly_on_the_cpu(size, data):
    """The GPU's path (offsets and int32 values packed into one int64 buffer, odd counts included), run on
    the CPU so every CI run checks the packing."""
    picks = data.draw(st.lists(st.integers(0, size - 1), max_size=size))
    _check_scatter("cpu", size, picks, data.draw(st.integers(0, 99)), scatter=scatter_int32_staged)


def test_staged_values_keep_their_dtype_and_land_on_the_device():
    assert staged([1, 2, 3], "cpu").dtype == torch.int64
    arr = np.arange(5, dtype=np.int32)
    assert torch.equal(to_device(arr, "cpu"), torch.arange(5, dtype=torch.int32))


@pytest.mark.cuda
@pytest.mark.parametrize("count", [1, 2, 7, 64])  # odd counts: the last int64 slot holds one int32
def test_scatter_on_the_device_matches_the_host_cuda(count):
    _check_scatter("cuda", 4096, list(range(3, 4096, 4096 // count))[:count], count)


def test_a_stager_off_cuda_hands_out_plain_memory_and_refuses_a_tiny_arena():
    stager = PinnedStager("cpu", capacity=16)
    host, tensor = stager.claim(5)
    host[:] = np.arange(5)
    assert torch.equal(tensor, torch.arange(5)) and stager.claims == 0  # memory of its own, not the arena
    assert torch.equal(to_device([4, 5], "cpu", stager), torch.tensor([4, 5]))
    with pytest.raises(ValueError, match="capacity 3"):
        PinnedStager("cpu", capacity=3)


@pytest.mark.cuda
def test_a_stager_never_rewrites_a_slot_a_queued_copy_has_yet_to_read_cuda():
    """The device is held busy while three whole turns of the arena are claimed and copied: every copy
    still lands its own values (a part is written again only after the copies out of it ran)."""
    stager = PinnedStager("cuda", capacity=64)  # parts of 16 slots
    out = torch.full((40, 12), -1, dtype=torch.int64, device="cuda")
    torch.cuda._sleep(200_000_000)  # about 0.1 s of device time queued before every copy
    for i in range(40):  # 40 claims of 12 slots: one per part, ten turns
        out[i].copy_(staged(list(range(i * 100, i * 100 + 12)), "cuda", stager), non_blocking=True)
    torch.cuda.synchronize()
    want = torch.arange(12, device="cuda") + 100 * torch.arange(40, device="cuda")[:, None]
    assert torch.equal(out, want)
    assert stager.claims == 40 and stager.turns == 39


@pytest.mark.cuda
def test_a_stager_waits_for_the_side_stream_its_copies_ran_on_cuda():
    """The first claim's copy is queued on a busy side stream; every later claim is made on an idle
    stream. Leaving the first part must record its event on the busy stream (the one that claimed
    from it), so the fifth claim, which comes back to that part, waits for that copy before it
    writes the part again."""
    stager = PinnedStager("cuda:0", capacity=64)  # parts of 16 slots: each claim of 12 starts a part
    out = torch.full((8, 12), -1, dtype=torch.int64, device="cuda")
    busy, idle = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(200_000_000)  # about 0.1 s queued before the busy stream's copy
    for i in range(8):
        with torch.cuda.stream(busy if i == 0 else idle):
            out[i].copy_(staged(list(range(i * 100, i * 100 + 12)), "cuda", stager), non_blocking=True)
    torch.cuda.synchronize()
    want = torch.arange(12, device="cuda") + 100 * torch.arange(8, device="cuda")[:, None]
    assert torch.equal(out, want)
    assert stager.turns == 7


@pytest.mark.cuda
def test_a_stager_stays_out_of_a_captured_graph_and_of_large_claims_cuda():
    stager = PinnedStager("cuda", capacity=64)
    host, _ = stager.claim(17)  # over one part: memory of its own
    assert stager.claims == 0 and host.size == 17
    dst = torch.zeros(4, dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stager.claim(4)
        dst.add_(1)
    assert stager.claims == 0
    graph.replay()
    assert torch.equal(dst.cpu(), torch.ones(4, dtype=torch.int64))
    dst.copy_(to_device(np.arange(4, dtype=np.int64), "cuda", stager))
    assert stager.claims == 1 and torch.equal(dst.cpu(), torch.arange(4))
