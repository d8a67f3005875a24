"""`prepare_ring_staged`: the ring form with each row's scalars staged by the host.

Oracle: the two-step reference on each row's absolute `"python"` table, as for the ring form
(`test_ring.random_step`: garbage outside every live span, released holes inside, batch rows
picking table rows in any order, poisoned outputs). The staged scalars are built from the same
random rows and slots, so the staged launch (interpreted on CPU, compiled on CUDA) and its torch
reference must equal the oracle, and write each row's new length at its slot when asked.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorrt_llm_draftkv.kernels as K
from test_ring import BS, MAX_NEW, P, check_equal, poisoned, random_step


def staged_case(seed: int, device: str = "cpu"):
    """(ring pages, staged scalars, slot lengths, oracle args) of one random step."""
    ring_args, oracle_args, _ = random_step(seed)
    ring, ext, rows, first, slot_ids, L, base, n = ring_args
    buf = np.empty((rows.shape[0], K.ROW_WIDTH), dtype=np.int64)
    buf[:, K.ROW_WIDTH - 1] = 12345  # the pad column must not matter
    K.stage_row_scalars(buf, rows.numpy(), first[rows].numpy(), ext[rows].numpy(), base[slot_ids].numpy(),
                        L[slot_ids].numpy(), n.numpy(), slot_ids.numpy())
    dev = torch.device(device)
    return ring.to(dev), torch.from_numpy(buf).to(dev), L.clone().to(dev), [t.to(dev) for t in oracle_args]


def _kw(window, max_ctx=10_000):
    return dict(block_size=BS, tokens_per_block=P, max_ctx=max_ctx, max_new=MAX_NEW, read_window=window)


def _width(window, C: int) -> int:
    return (-(-window // P) + 1) if window is not None else C


def run_staged(seed: int, window, impl, *, device: str = "cpu", write: bool = True, max_ctx: int = 10_000,
               block=None) -> None:
    pages, scalars, L, oracle = staged_case(seed, device)
    want = K.prepare_paged_latent_reference(*oracle, **_kw(window, max_ctx))
    width = _width(window, pages.shape[1])
    out = poisoned(scalars.shape[0], width, device)
    before = L.clone()
    got = K.prepare_ring_staged(pages, scalars, L if write else None, out=out, impl=impl, block=block,
                                **_kw(window, max_ctx))
    assert got is out
    check_equal(got, want, width)
    expect = before.clone()
    if write:
        expect[scalars[:, 6]] = want.new_ctx_len.to(expect.device)
    assert torch.equal(L.cpu(), expect.cpu())  # written at the rows' slots, nowhere else


@pytest.mark.parametrize("window", [None, 16, 40, 120])
@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("seed", range(6))
def test_staged_form_equals_the_two_step_form(seed, impl, window):
    run_staged(seed, window, impl)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_staged_form_without_a_length_write_leaves_the_slots(impl):
    for seed in range(3):
        run_staged(30 + seed, 40, impl, write=False)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_staged_form_clamps_stores_at_max_ctx(impl):
    for seed in range(4):
        run_staged(100 + seed, 24, impl, max_ctx=60)


@pytest.mark.parametrize("block", [2, 4])
def test_staged_form_split_over_programs(block):
    """Chunk 0 alone writes a row's scalars, store targets and slot length; every chunk its columns."""
    for seed in range(4):
        run_staged(200 + seed, 40, "triton", block=block)


def test_staged_form_refuses_bad_arguments_before_writing():
    pages, scalars, L, _ = staged_case(0)
    out = poisoned(scalars.shape[0], pages.shape[1], "cpu")
    before = {k: v.clone() for k, v in out.tensors().items()}
    L0 = L.clone()
    kw = _kw(None, 100)
    with pytest.raises(ValueError, match="row_scalars"):
        K.prepare_ring_staged(pages, scalars[:, :7].contiguous(), L, out=out, **kw)
    with pytest.raises(ValueError, match="row_scalars"):
        K.prepare_ring_staged(pages, scalars.to(torch.int32), L, out=out, **kw)
    with pytest.raises(ValueError, match="slot_ctx_len"):
        K.prepare_ring_staged(pages, scalars, L.to(torch.int32), out=out, **kw)
    with pytest.raises(ValueError, match="one column"):
        K.prepare_ring_staged(pages[:, :0], scalars, L, out=out, **kw)
    with pytest.raises(ValueError, match="read_rows"):
        K.prepare_ring_staged(pages, scalars, L, out=poisoned(scalars.shape[0], pages.shape[1] - 1, "cpu"), **kw)
    with pytest.raises(ValueError, match="read_window"):
        K.prepare_ring_staged(pages, scalars, L, out=out, **{**kw, "read_window": BS - 1})
    assert all(torch.equal(before[k], v) for k, v in out.tensors().items())
    assert torch.equal(L, L0)


def test_bound_staged_ring_off_cuda_is_a_checked_call_each_time():
    pages, scalars, L, oracle = staged_case(5)
    out = poisoned(scalars.shape[0], _width(16, pages.shape[1]), "cpu")
    step = K.BoundStagedRing(pages, scalars, L, out=out, **_kw(16))
    for seed in (5, 6, 7):
        p2, s2, L2, oracle = staged_case(seed)
        pages.copy_(p2), scalars.copy_(s2), L.copy_(L2)
        assert step() is out
        check_equal(out, K.prepare_paged_latent_reference(*oracle, **_kw(16)), out.read_rows.shape[1])
    assert not step.is_bound


@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 16, 120])
@pytest.mark.parametrize("seed", range(4))
def test_staged_form_on_cuda(seed, window):
    run_staged(seed, window, None, device="cuda")


@pytest.mark.cuda
def test_bound_staged_ring_cuda_relaunch_sees_new_values():
    pages, scalars, L, oracle = staged_case(0, "cuda")
    out = poisoned(scalars.shape[0], _width(16, pages.shape[1]), "cuda")
    step = K.BoundStagedRing(pages, scalars, L, out=out, **_kw(16))
    for seed in range(5):
        p2, s2, L2, oracle = staged_case(seed, "cuda")
        pages.copy_(p2), scalars.copy_(s2), L.copy_(L2)
        before = K.LAUNCH_COUNTS["prepare_ring_staged"]
        assert step() is out
        assert K.LAUNCH_COUNTS["prepare_ring_staged"] == before + 1
        want = K.prepare_paged_latent_reference(*oracle, **_kw(16))
        check_equal(out, want, out.read_rows.shape[1])
        expect = L2.clone()
        expect[s2[:, 6]] = want.new_ctx_len
        assert torch.equal(L, expect)
    assert step.is_bound
