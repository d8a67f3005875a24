"""Tests of ``BoundPreparation``: a one-pass step relaunched over fixed tensors.

The executor's contract is static buffers written in place between steps; each
call must then give what a fresh checked call gives on the new values. On CPU
every call is a checked call (interpreter); on CUDA the calls after the first
relaunch the resolved kernel, which must still see new values, new output
poison, a launch hook and graph capture correctly.
"""
from __future__ import annotations

import pytest
import torch

import tensorrt_llm_draftkv.kernels as K
from tensorrt_llm_draftkv.kernels import _launch as fast_launch
from test_one_pass import ONE_PASS, _big_step, make_step, poisoned_one_pass_out
from test_spec_tail_kernels import KV, POISON32, POISON64, assert_prep_equal

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _refill(dst_off, dst_vec, src_off, src_vec, out) -> None:
    """New step values written in place, outputs poisoned: what an executor does between steps."""
    dst_off.copy_(src_off)
    for d, s in zip(dst_vec, src_vec):
        d.copy_(s)
    for t in out.tensors().values():
        t.fill_(POISON32 if t.dtype == torch.int32 else POISON64)


def _bound(off, vectors, kw, out, backend, **extra) -> K.BoundPreparation:
    return K.BoundPreparation(off, *vectors, out=out, **kw, pool_idx=1, divisor=KV, backend=backend, **extra)


@pytest.mark.parametrize("backend", ["python", "cpp"])
def test_bound_cpu_is_a_checked_call_each_time(backend):
    gen = torch.Generator().manual_seed(7100)
    off, _, vectors, kw = make_step(gen, 2, 6, 5, 23, backend=backend, P=4)
    vectors = tuple(v.clone() for v in vectors)
    out = poisoned_one_pass_out(5, 23, kw)
    step = _bound(off, vectors, kw, out, backend, impl="triton")
    for _ in range(3):
        before = K.LAUNCH_COUNTS[ONE_PASS]
        assert step() is out
        assert K.LAUNCH_COUNTS[ONE_PASS] == before + 1
        assert not step.is_bound  # nothing is resolved off CUDA
        assert_prep_equal(out, K.prepare_paged_latent_one_pass_reference(off, 1, KV, backend, *vectors, **kw))
        new_off, _, new_vec, _ = make_step(gen, 2, 6, 5, 23, backend=backend, P=4)
        _refill(off, vectors, new_off, new_vec, out)


def test_bound_needs_outputs_and_checks_on_first_call():
    gen = torch.Generator().manual_seed(7101)
    off, _, vectors, kw = make_step(gen, 2, 4, 4, 10, backend="python")
    with pytest.raises(ValueError, match="preallocated outputs"):
        K.BoundPreparation(off, *vectors, out=None, **kw, pool_idx=1, divisor=KV, backend="python")
    out = K.PagedLatentPrep.empty(4, 10, kw["block_size"], kw["max_new"])  # no extents
    step = K.BoundPreparation(off, *vectors, out=out, **kw, pool_idx=1, divisor=KV, backend="python")
    with pytest.raises(ValueError, match="with_extents=True"):
        step()
    step = K.BoundPreparation(off, *vectors, out=poisoned_one_pass_out(4, 10, kw), **kw, pool_idx=5, divisor=KV,
                              backend="python")
    with pytest.raises(IndexError, match="pool_idx 5"):
        step()


# --------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["python", "cpp"])
def test_bound_cuda_relaunch_sees_new_values(backend):
    gen = torch.Generator().manual_seed(7200)
    for B, M, extra in [(4, 128, {}), (256, 2048, {}), (2, 16384, {}), (64, 700, {"source_tiles": False}),
                        (64, 700, {"source_tiles": True, "split": 2, "block": 256})]:
        off, vectors, kw = _big_step(gen, 2, B, M, backend=backend)
        out = poisoned_one_pass_out(B, M, kw, "cuda")
        step = _bound(off, vectors, kw, out, backend, **extra)
        for i in range(4):
            before = K.LAUNCH_COUNTS[ONE_PASS]
            assert step() is out
            assert K.LAUNCH_COUNTS[ONE_PASS] == before + 1
            assert step.is_bound  # resolved by the first (checked) call
            torch.cuda.synchronize()
            assert_prep_equal(out, K.prepare_paged_latent_one_pass_reference(off, 1, KV, backend, *vectors, **kw))
            new_off, new_vec, _ = _big_step(gen, 2, B, M, backend=backend, device="cpu")
            _refill(off, vectors, new_off, new_vec, out)


@pytest.mark.cuda
def test_bound_cuda_rebind_after_new_storage_and_hook_fallback():
    gen = torch.Generator().manual_seed(7300)
    off, vectors, kw = _big_step(gen, 2, 32, 512, backend="python")
    out = poisoned_one_pass_out(32, 512, kw, "cuda")
    step = _bound(off, vectors, kw, out, "python")
    step()
    # a new output storage: after rebind the relaunch writes the new tensor, not the old one
    new_rows = torch.full_like(out.read_rows, POISON32)
    old_rows = out.read_rows
    out.read_rows = new_rows
    step.rebind()
    assert not step.is_bound
    old_rows.fill_(POISON32)
    step()
    step()
    torch.cuda.synchronize()
    assert bool((old_rows == POISON32).all())
    want = K.prepare_paged_latent_one_pass_reference(off, 1, KV, "python", *vectors, **kw)
    assert_prep_equal(out, want)
    # a launch hook installed: the call takes Triton's path (the hook sees it), same result
    from triton import knobs

    seen = []

    def hook(meta) -> None:
        seen.append(1)

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        out.read_rows.fill_(POISON32)
        step()
        torch.cuda.synchronize()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen, "the launch hook did not see the launch"
    assert_prep_equal(out, want)


@pytest.mark.cuda
def test_bound_cuda_graph_capture():
    gen = torch.Generator().manual_seed(7400)
    B, M = 64, 2048
    off, vectors, kw = _big_step(gen, 2, B, M, backend="python")
    out = poisoned_one_pass_out(B, M, kw, "cuda")
    step = _bound(off, vectors, kw, out, "python")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        new_off, new_vec, _ = _big_step(gen, 2, B, M, backend="python", device="cpu")
        _refill(off, vectors, new_off, new_vec, out)
        graph.replay()
        torch.cuda.synchronize()
        assert_prep_equal(out, K.prepare_paged_latent_one_pass_reference(off, 1, KV, "python", *vectors, **kw))
    fast_launch.clear()  # forgetting every plan leaves a bound step valid (it holds its own)
    step()
    torch.cuda.synchronize()
