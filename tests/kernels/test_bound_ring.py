"""`BoundRingPreparation`: the ring-form step relaunched over fixed tensors.

An executor keeps its step inputs in static buffers and writes new values into them
in place between steps; each call must then give what a fresh checked call gives on
the new values (the two-step reference on the decoded rows is the oracle, outputs
poisoned before every call). On CPU every call is a checked call; on CUDA the calls
after the first relaunch the resolved kernel, and must see new values, a launch hook
and a CUDA-graph capture correctly.
"""
from __future__ import annotations

import pytest
import torch

import tensorrt_llm_draftkv.kernels as K
from tensorrt_llm_draftkv.kernels import _launch as fast_launch
from test_ring import BS, MAX_NEW, P, check_equal, poisoned, random_step

RING = "prepare_paged_latent_ring"


def _step_kw(window):
    return dict(block_size=BS, tokens_per_block=P, max_ctx=10_000, max_new=MAX_NEW, read_window=window)


def _width(window, C: int) -> int:
    return (-(-window // P) + 1) if window is not None else C


def _refill(fixed: list[torch.Tensor], fresh: list[torch.Tensor], out: K.PagedLatentPrep) -> None:
    """New step values in place, outputs poisoned: what an executor does between steps."""
    for d, s in zip(fixed, fresh):
        d.copy_(s)
    for t in out.tensors().values():
        t.copy_(torch.randint(-7, 9999, t.shape, dtype=t.dtype))


def _run(device: str, window, steps: int = 4, seed: int = 0) -> K.BoundRingPreparation:
    ring_args, oracle_args, _ = random_step(seed, device=device)
    fixed = [t.clone() for t in ring_args]
    C = fixed[0].shape[1]
    out = poisoned(fixed[2].shape[0], _width(window, C), device)
    step = K.BoundRingPreparation(*fixed, out=out, **_step_kw(window))
    for i in range(steps):
        before = K.LAUNCH_COUNTS[RING]
        assert step() is out
        assert K.LAUNCH_COUNTS[RING] == before + 1
        want = K.prepare_paged_latent_reference(*oracle_args, **_step_kw(window))
        check_equal(out, want, _width(window, C))
        ring_args, oracle_args, _ = random_step(seed * 100 + i + 1, device=device)  # same shapes, new values
        _refill(fixed, ring_args, out)
    return step


@pytest.mark.parametrize("window", [None, 16])
def test_bound_ring_off_cuda_is_a_checked_call_each_time(window):
    step = _run("cpu", window)
    assert not step.is_bound


def test_bound_ring_needs_outputs_and_checks_its_first_call():
    ring_args, _, _ = random_step(3)
    with pytest.raises(ValueError, match="preallocated outputs"):
        K.BoundRingPreparation(*ring_args, out=None, **_step_kw(None))
    ring, ext, rows, first, *vectors = ring_args
    out = poisoned(rows.shape[0], ring.shape[1], "cpu")
    before = {k: v.clone() for k, v in out.tensors().items()}
    step = K.BoundRingPreparation(ring, ext, rows[:-1], first, *vectors, out=out, **_step_kw(None))
    with pytest.raises(ValueError, match="table_rows"):
        step()
    assert not step.is_bound and all(torch.equal(before[k], v) for k, v in out.tensors().items())


@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("seed", range(3))
def test_bound_ring_cuda_relaunch_sees_new_values(seed, window):
    step = _run("cuda", window, steps=5, seed=seed)
    assert step.is_bound


@pytest.mark.cuda
def test_bound_ring_cuda_graph_capture_and_hooks():
    ring_args, _, _ = random_step(11, device="cuda")
    fixed = [t.clone() for t in ring_args]
    window = 16
    C = fixed[0].shape[1]
    out = poisoned(fixed[2].shape[0], _width(window, C), "cuda")
    step = K.BoundRingPreparation(*fixed, out=out, **_step_kw(window))
    step()
    assert step.is_bound
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(3):
        ring_args, oracle_args, _ = random_step(200 + i, device="cuda")
        _refill(fixed, ring_args, out)
        graph.replay()
        torch.cuda.synchronize()
        check_equal(out, K.prepare_paged_latent_reference(*oracle_args, **_step_kw(window)), _width(window, C))
    # under a launch hook the call takes the checked path, with the same result
    hooked = fast_launch.hooked
    fast_launch.hooked = lambda: True
    try:
        ring_args, oracle_args, _ = random_step(300, device="cuda")
        _refill(fixed, ring_args, out)
        step()
        check_equal(out, K.prepare_paged_latent_reference(*oracle_args, **_step_kw(window)), _width(window, C))
    finally:
        fast_launch.hooked = hooked
