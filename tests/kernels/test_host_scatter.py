"""`host_scatter`: a staged scatter whose source the kernel reads where the host wrote it.

On the CPU the Triton interpreter runs the body over host memory; on a GPU the source is
a claim from a `PinnedStager` arena (page-locked, read by the device in place). Targets
are poisoned, offsets are random and distinct, counts odd and even, the int32 values start
at any slot, and a dense int64 part rides along; only the named entries may change.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorrt_llm_draftkv.kernels import LAUNCH_COUNTS
from tensorrt_llm_draftkv.kernels.host_scatter import host_scatter
from tensorrt_llm_draftkv.staging import PinnedStager, scatter_int32_staged


def _case(rng: np.random.Generator, size: int, n: int, m: int):
    flat = rng.choice(size, n, replace=False).astype(np.int64)
    values = rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int64).astype(np.int32)
    words = rng.integers(-(2**62), 2**62, m, dtype=np.int64)
    return flat, values, words


def _staged(flat, values, words, lead: int) -> tuple[torch.Tensor, int, int]:
    """`[lead junk | offsets | dense words | values two per slot]` and where the values and words start."""
    n, m = flat.size, words.size
    buf = np.full(lead + n + m + (n + 1) // 2 + 1, 999, dtype=np.int64)
    buf[lead : lead + n] = flat
    buf[lead + n : lead + n + m] = words
    buf[lead + n + m :].view(np.int32)[:n] = values
    return torch.from_numpy(buf), lead + n + m, lead + n


@settings(deadline=None, max_examples=30)
@given(size=st.integers(1, 400), data=st.data())
def test_host_scatter_writes_exactly_the_named_entries(size, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 10**6)))
    n = data.draw(st.integers(0, size))
    m = data.draw(st.integers(0, 40))
    lead = data.draw(st.integers(0, 5))
    flat, values, words = _case(rng, size, n, m)
    staged, val_slot, copy_at = _staged(flat, values, words, lead)
    # offsets start at `lead`: the kernel reads them from slot 0, so shift the view instead
    src = staged[lead:]
    dst = torch.full((size,), -77, dtype=torch.int32)
    dense = torch.full((m + 3,), -5, dtype=torch.int64)
    host_scatter(dst, src, n, 2 * (val_slot - lead), dense, m, copy_at - lead)
    want = np.full(size, -77, dtype=np.int32)
    want[flat] = values
    assert np.array_equal(dst.numpy(), want)
    want_dense = np.full(m + 3, -5, dtype=np.int64)
    want_dense[:m] = words
    assert np.array_equal(dense.numpy(), want_dense)


def test_host_scatter_refuses_bad_arguments_before_writing():
    dst = torch.full((8,), -1, dtype=torch.int32)
    staged = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="int32"):
        host_scatter(dst.to(torch.int64), staged, 1, 2)
    with pytest.raises(ValueError, match="int64"):
        host_scatter(dst, staged.to(torch.int32), 1, 2)
    with pytest.raises(ValueError, match="3 entries"):
        host_scatter(dst, staged, 3, 6)  # values would end at int32 9: past 4 slots
    with pytest.raises(ValueError, match="copy_dst"):
        host_scatter(dst, staged, 0, 0, torch.zeros(1, dtype=torch.int64), 2, 0)
    assert torch.equal(dst, torch.full((8,), -1, dtype=torch.int32))


@pytest.mark.parametrize("n, m", [(0, 3), (5, 0), (7, 4), (64, 9)])
def test_the_staged_scatter_with_a_dense_part_packs_exactly_on_the_cpu(n, m):
    """`scatter_int32_staged`'s copy path (the one a GPU falls back to), dense part included."""
    rng = np.random.default_rng(n * 31 + m)
    flat, values, words = _case(rng, 300, n, m)
    memory = torch.full((300,), -77, dtype=torch.int32)
    dense = torch.full((m + 2,), -5, dtype=torch.int64)
    scatter_int32_staged(memory, flat, values, None, (dense[:m], words))
    want = np.full(300, -77, dtype=np.int32)
    want[flat] = values
    assert np.array_equal(memory.numpy(), want)
    assert np.array_equal(dense.numpy()[:m], words) and (dense.numpy()[m:] == -5).all()


@pytest.mark.cuda
@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("n, m", [(1, 0), (7, 4), (300, 64), (0, 5)])
def test_a_staged_scatter_from_a_pinned_claim_cuda(n, m, in_place):
    """Read in place (one `host_scatter` launch) or, with the reads turned off, copied and scattered:
    the same entries either way."""
    rng = np.random.default_rng(n + m)
    flat, values, words = _case(rng, 4096, n, m)
    stager = PinnedStager("cuda", capacity=4096)
    stager.reads_in_place = None if in_place else False  # whatever DRAFTKV_HOST_READS says
    memory = torch.full((4096,), -77, dtype=torch.int32, device="cuda")
    dense = torch.full((m + 2,), -5, dtype=torch.int64, device="cuda")
    before = LAUNCH_COUNTS["host_scatter"]
    scatter_int32_staged(memory, flat, values, stager, (dense[:m], words))
    torch.cuda.synchronize()
    assert stager.reads_in_place is in_place and LAUNCH_COUNTS["host_scatter"] == before + in_place
    want = np.full(4096, -77, dtype=np.int32)
    want[flat] = values
    assert np.array_equal(memory.cpu().numpy(), want)
    assert np.array_equal(dense.cpu().numpy()[:m], words) and (dense.cpu().numpy()[m:] == -5).all()


@pytest.mark.cuda
def test_in_place_reads_never_see_a_claim_written_again_cuda():
    """The device is held busy while ten turns of the arena are claimed and scattered from: every launch
    still reads its own values (a part is written again only after the work queued on it ran)."""
    stager = PinnedStager("cuda", capacity=128)  # parts of 32 slots: each claim below (18 slots) takes one
    stager.reads_in_place = None
    memory = torch.full((40 * 12,), -1, dtype=torch.int32, device="cuda")
    torch.cuda._sleep(200_000_000)
    for i in range(40):
        flat = np.arange(i * 12, i * 12 + 12, dtype=np.int64)
        scatter_int32_staged(memory, flat, (flat * 7 + 1).astype(np.int32), stager)
    torch.cuda.synchronize()
    assert stager.reads_in_place is True and stager.claims == 40 and stager.turns == 39
    assert torch.equal(memory.cpu(), (torch.arange(40 * 12) * 7 + 1).to(torch.int32))


def test_in_place_reads_are_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("DRAFTKV_HOST_READS", raising=False)
    assert PinnedStager("cpu").reads_in_place is None  # tried at the first staged scatter
    monkeypatch.setenv("DRAFTKV_HOST_READS", "0")
    assert PinnedStager("cpu").reads_in_place is False
    monkeypatch.setenv("DRAFTKV_HOST_READS", "1")
    assert PinnedStager("cpu").reads_in_place is None
