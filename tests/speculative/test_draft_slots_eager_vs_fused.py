"""The eager path (reference decode/rebase + torch) and the fused path (`prepare_paged_latent`)
of DFlashDraftSlots give identical results, on random tables and end to end (on the test
executor, tests/executor_fixture.py: the same slots, tables, reads and pool contents every step).
"""
from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tensorrt_llm_draftkv.kernels import HAVE_TRITON, LAUNCH_COUNTS, BlockTables, PagedLatentPrep
from tensorrt_llm_draftkv.speculative import DFlashDraftSlots
from executor_fixture import DraftExecutor


def same(a: PagedLatentPrep, b: PagedLatentPrep) -> None:
    for name, t in a.tensors().items():
        u = getattr(b, name)
        assert t.dtype == u.dtype and t.shape == u.shape, name
        assert torch.equal(t, u), f"{name}: eager {t.tolist()} != fused {u.tolist()}"


@st.composite
def workloads(draw):
    P = draw(st.sampled_from([1, 4, 16, 32]))
    B = draw(st.integers(1, 5))
    M = draw(st.integers(1, 24))
    S = draw(st.integers(1, 4)) + 1
    bs = draw(st.integers(2, 5))
    max_new = draw(st.integers(1, 6))
    max_ctx = draw(st.integers(1, M * P + 8))
    backend = draw(st.sampled_from(["python", "cpp"]))
    seed = draw(st.integers(0, 2**16))
    return P, B, M, S, bs, max_new, max_ctx, backend, seed


@settings(max_examples=40, deadline=None)
@given(workloads())
def test_eager_and_fused_preparation_are_identical_on_random_workloads(w):
    P, B, M, S, bs, max_new, max_ctx, backend, seed = w
    g = torch.Generator().manual_seed(seed)
    # tables with released low entries, holes and unbacked tails (python), or all "backed" (cpp)
    tables = torch.randint(0, 50, (B, M), generator=g, dtype=torch.int32)
    holes = torch.rand(B, M, generator=g) < 0.3
    tables = torch.where(holes, -1, tables).to(torch.int32)
    if backend == "python":
        one_past = torch.arange(1, M + 1)
        extents = torch.where(tables >= 0, one_past, 0).amax(dim=1).to(torch.int64)
    else:
        extents = torch.full((B,), M, dtype=torch.int64)
    metas = []
    for fused in (False, True):
        meta = DFlashDraftSlots(S - 1, block_size=bs, tokens_per_block=P, max_ctx_len=max(max_ctx, P), fused=fused,
                                  max_new_tokens=max_new, backend=backend)
        meta.slot_ids = torch.randint(0, S, (B,), generator=torch.Generator().manual_seed(seed + 1))
        meta.slots.ctx_len = torch.randint(0, max_ctx + 1, (S,), generator=torch.Generator().manual_seed(seed + 2))
        meta.slots.base_pages = torch.randint(0, M + 3, (S,), generator=torch.Generator().manual_seed(seed + 3))
        meta.tables = [BlockTables(tables, extents)]
        metas.append(meta)
    n = torch.randint(0, max_new + 1, (B,), generator=torch.Generator().manual_seed(seed + 4))
    from tensorrt_llm_draftkv.kernels import prepare_paged_latent

    kw = dict(block_size=bs, tokens_per_block=P, max_ctx=max_ctx, max_new=max_new)
    eager = prepare_paged_latent(tables, extents, metas[0].slot_ids, metas[0].slots.ctx_len,
                                 metas[0].slots.base_pages, n, impl="reference", **kw)
    fused = prepare_paged_latent(tables, extents, metas[1].slot_ids, metas[1].slots.ctx_len,
                                 metas[1].slots.base_pages, n, **kw)
    same(eager, fused)


def _prepare_launches() -> int:
    """Launches of the step's preparation kernel: the two-step form or the ring form (device block table),
    its scalars read on the device or staged by the host."""
    return (LAUNCH_COUNTS["prepare_paged_latent"] + LAUNCH_COUNTS["prepare_paged_latent_ring"]
            + LAUNCH_COUNTS["prepare_ring_staged"])


def _run(fused: bool, windows, backend: str, seed: int):
    launches = _prepare_launches()
    loop = DraftExecutor.build(windows=windows, tokens_per_block=16, pages=96, fused=fused, backend=backend,
                               max_seq_len=1024)
    rng = random.Random(seed)
    for rid in range(3):
        if rid == 2:
            loop.add_disagg_request(rid, 400 + rng.randrange(16))
        else:
            loop.add_context_request(rid, 120 + rng.randrange(40), chunk=48, start=16 * rid)
    log = []
    for step in range(10):
        reads = len(loop.ledger.read_log)
        accepted = loop.step(
            chunks={r: 48 for r in loop.requests},
            accepted=lambda rid: rng.randrange(4),
            optimistic=[0] if step % 2 else [],
        )
        # what each row read (positions and values) stands for the drafts it would propose
        log.append((accepted, loop.ledger.read_log[reads:], loop.meta.slots.ctx_len_host,
                    loop.meta.slots.base_pages_host))
        log.append([loop.meta.generation_prep()[g].tensors() for g in range(loop.dm.num_pools)])
        if step == 5:
            loop.evict(2)
    pools = [layer.clone() for g in loop.dm.layer_groups for layer in g.pool.layers]
    loop.ledger.assert_clean()
    if fused and HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
        assert _prepare_launches() > launches  # the Triton kernel ran (interpreted)
    if not fused:
        assert _prepare_launches() == launches
    return log, pools


@pytest.mark.parametrize("windows, backend", [((64,), "cpp"), ((None, 48), "python")])
def test_eager_and_fused_drafters_produce_identical_steps(windows, backend):
    eager_log, eager_pools = _run(False, windows, backend, 7)
    fused_log, fused_pools = _run(True, windows, backend, 7)
    assert len(eager_log) == len(fused_log)
    for a, b in zip(eager_log, fused_log):
        if isinstance(a, list):
            for ta, tb in zip(a, b):
                for name in ta:
                    assert torch.equal(ta[name], tb[name]), name
        else:
            assert a == b
    for a, b in zip(eager_pools, fused_pools):
        assert torch.equal(a, b)
