"""Tests of the window-bounded form of ``prepare_paged_latent`` (``read_window=W``).

With a read window the step's read rows start at the window's first page (or
the slot base, whichever is higher), hold only the ordinals up to the block's
last page (-1 past them) and are ``ceil(W / P) + 1`` columns wide whatever the
prompt length. Checked against a pure-Python oracle written from that
contract, then the torch reference, the two-step kernel and the one-pass
kernel against each other, on fresh random rows with poisoned outputs and rows
whose low entries were released.
"""
from __future__ import annotations

import pytest
import torch

import tensorrt_llm_draftkv.kernels as K
from tensorrt_llm_draftkv.kernels.reference import window_read_width
from test_one_pass import make_step, poisoned_one_pass_out
from test_spec_tail_kernels import KV, POISON32, POISON64, assert_prep_equal, assert_same, oracle_decode, oracle_prepare

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def oracle_window(tables, extents, slot_ids, ctx, base_pages, num_new, *, block_size, P, max_ctx, max_new, window,
                  width):
    """The windowed contract, row by row in plain Python."""
    res = oracle_prepare(tables, extents, slot_ids, ctx, base_pages, num_new, block_size, P, max_ctx, max_new)
    res["read_rows"], res["read_lens"], res["shift"] = [], [], []
    for b, row in enumerate(tables):
        M = len(row)
        s = slot_ids[b]
        new_ctx = min(ctx[s] + num_new[b], max_ctx)
        start = max(base_pages[s], max(new_ctx + block_size - window, 0) // P)
        e = min(max(extents[b], 0), M)
        sh = max(min(start, e), 0)
        end = new_ctx + block_size  # one past the block (slot positions)
        res["read_rows"].append(
            [row[sh + j] if sh + j < e and (sh + j) * P < end else -1 for j in range(width)]
        )
        res["read_lens"].append(min(max(new_ctx - start * P, 0), (e - sh) * P))
        res["shift"].append(sh)
    return res


def windowed_step(gen, B, M, *, backend, P, window, dtype=torch.int32, block_size=3):
    off, _, vectors, kw = make_step(gen, 2, B + 1, B, M, backend=backend, dtype=dtype, P=P, block_size=block_size)
    return off, vectors, dict(kw, read_window=window)


def poisoned(B, width, kw, device="cpu"):
    out = poisoned_one_pass_out(B, width, kw, device)
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("backend", ["python", "cpp"])
def test_reference_matches_oracle(seed, backend):
    gen = torch.Generator().manual_seed(700 + seed)
    B, M, P, W = [(4, 9, 4, 8), (6, 17, 2, 5), (1, 1, 3, 3), (5, 33, 8, 20), (7, 40, 4, 64), (3, 12, 4, 3)][seed]
    off, vectors, kw = windowed_step(gen, B, M, backend=backend, P=P, window=W)
    got = K.prepare_paged_latent_one_pass_reference(off, 1, KV, backend, *vectors, **kw)
    tables, ext = oracle_decode(off[1, :B, 0].tolist(), KV, backend)
    sid, ctx, base, n = (v.tolist() for v in vectors)
    width = window_read_width(W, P)
    want = oracle_window(tables, ext, sid, ctx, base, n, block_size=kw["block_size"], P=P, max_ctx=kw["max_ctx"],
                         max_new=kw["max_new"], window=W, width=width)
    assert got.read_rows.shape == (B, width)
    for name, t in got.tensors().items():
        assert t.tolist() == (ext if name == "extents" else want[name]), name


@pytest.mark.parametrize("backend", ["python", "cpp"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("window,P", [(8, 4), (5, 2), (64, 4), (3, 3)])
def test_kernels_match_reference(backend, dtype, window, P):
    """Two-step and one-pass kernels (interpreted on CPU), poisoned outputs, tiled and split rows."""
    gen = torch.Generator().manual_seed(hash((backend, str(dtype), window, P)) % 2**31)
    off, vectors, kw = windowed_step(gen, 6, 29, backend=backend, P=P, window=window, dtype=dtype)
    B = 6
    want = K.prepare_paged_latent_one_pass_reference(off, 1, KV, backend, *vectors, **kw)
    width = window_read_width(window, P)
    for extra in ({}, {"block": 4}, {"block": 4, "split": 3}):
        out = poisoned(B, width, kw)
        got = K.prepare_paged_latent(None, None, *vectors, **kw, block_offsets=off, pool_idx=1, divisor=KV,
                                     backend=backend, out=out, impl="triton", **extra)
        assert got is out
        assert_prep_equal(got, want)
    bt = K.decode_draft_block_table(off, 1, B, KV, backend, impl="triton")
    two = K.prepare_paged_latent(bt.tables, bt.extents, *vectors, **kw, impl="triton")
    assert two.read_rows.shape == (B, width)
    for name, t in two.tensors().items():
        assert_same(t, getattr(want, name), f"{name} (two-step)")


def test_a_wider_buffer_gets_minus_one_past_the_bound():
    """A static buffer wider than the bound (sized once for the biggest window) holds -1 past it."""
    gen = torch.Generator().manual_seed(5)
    off, vectors, kw = windowed_step(gen, 4, 21, backend="python", P=4, window=8)
    width = window_read_width(8, 4) + 5
    out = poisoned(4, width, kw)
    got = K.prepare_paged_latent(None, None, *vectors, **kw, block_offsets=off, pool_idx=0, divisor=KV,
                                 backend="python", out=out, impl="triton")
    want = K.prepare_paged_latent_one_pass_reference(off, 0, KV, "python", *vectors, **kw, out=poisoned(4, width, kw))
    assert_prep_equal(got, want)
    assert (got.read_rows[:, window_read_width(8, 4):] == -1).all()


@pytest.mark.parametrize("backend", ["python", "cpp"])
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_released_low_entries_never_reach_the_rows(backend, impl):
    """A long row whose low pages were released (-1, or page 0 under ``cpp``): the windowed rows hold only
    the pages of the window, where the unbounded rows start at the base and carry the released entries."""
    P, W, bs, M = 4, 12, 3, 40
    live_pages = list(range(100, 100 + M))
    first_live = 30  # ordinals [0, 30) released
    fill = -1 if backend == "python" else 0
    k_row = [(p * KV if j >= first_live else fill) for j, p in enumerate(live_pages)]
    k_row[38:] = [fill, fill]  # capacity ends at ordinal 38
    k = torch.tensor([k_row], dtype=torch.int32)
    off = torch.stack([k, k + 1], dim=1)[None]
    L = 37 * P + 1  # the block [149, 152) ends on ordinal 37
    vectors = (torch.tensor([0]), torch.tensor([L]), torch.tensor([2]), torch.tensor([0]))
    kw = dict(block_size=bs, tokens_per_block=P, max_ctx=1 << 20, max_new=2)
    got = K.prepare_paged_latent(None, None, *vectors, **kw, block_offsets=off, pool_idx=0, divisor=KV,
                                 backend=backend, impl=impl, read_window=W)
    start = (L + bs - W) // P  # 35
    assert got.shift.tolist() == [start]
    assert got.read_rows[0].tolist() == [135, 136, 137, -1]
    assert got.read_lens.tolist() == [L - start * P]
    held = set(live_pages[first_live:38])
    assert set(got.read_rows[0].tolist()) - {-1} <= held
    full = K.prepare_paged_latent(None, None, *vectors, **kw, block_offsets=off, pool_idx=0, divisor=KV,
                                  backend=backend, impl=impl)
    assert full.shift.tolist() == [2] and full.read_lens.tolist() == [L - 2 * P]
    if backend == "cpp":  # upstream's layout reads page 0 where the window released pages
        assert 0 in full.read_rows[0].tolist()[:28]


def test_bad_window_arguments_raise_and_touch_nothing():
    gen = torch.Generator().manual_seed(9)
    off, vectors, kw = windowed_step(gen, 3, 10, backend="python", P=4, window=8)
    call = dict(block_offsets=off, pool_idx=0, divisor=KV, backend="python", impl="triton")
    narrow = poisoned(3, window_read_width(8, 4) - 1, kw)
    with pytest.raises(ValueError, match="read_rows"):
        K.prepare_paged_latent(None, None, *vectors, **kw, out=narrow, **call)
    assert (narrow.read_rows == POISON32).all() and (narrow.read_lens == POISON64).all()
    with pytest.raises(ValueError, match="must hold the block"):
        K.prepare_paged_latent(None, None, *vectors, **dict(kw, read_window=2), **call)
    with pytest.raises(ValueError, match="source_tiles"):
        K.prepare_paged_latent(None, None, *vectors, **kw, source_tiles=True, **call)
    with pytest.raises(ValueError):
        window_read_width(0, 4)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["python", "cpp"])
@pytest.mark.parametrize("B,M", [(3, 70), (200, 2100), (8, 70_000)])
def test_compiled_windowed_matches_reference(backend, B, M):
    """The compiled one-pass and two-step kernels, the fast launch, a bound call and a graph replay."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(B * 7 + M)
    off, vectors, kw = windowed_step(gen, B, M, backend=backend, P=32, window=1024, block_size=16)
    kw["max_new"] = 16
    vectors = tuple(t.clone() for t in vectors)
    vectors[3].clamp_(max=16)
    off, vectors = off.to(dev), tuple(v.to(dev) for v in vectors)
    want = K.prepare_paged_latent_one_pass_reference(off, 1, KV, backend, *vectors, **kw)
    width = window_read_width(1024, 32)
    for _ in range(2):  # the second call relaunches the remembered plan
        out = poisoned(B, width, kw, dev)
        got = K.prepare_paged_latent(None, None, *vectors, **kw, block_offsets=off, pool_idx=1, divisor=KV,
                                     backend=backend, out=out)
        assert_prep_equal(got, want)
    bt = K.decode_draft_block_table(off, 1, B, KV, backend)
    two = K.prepare_paged_latent(bt.tables, bt.extents, *vectors, **kw)
    for name, t in two.tensors().items():
        assert_same(t, getattr(want, name), f"{name} (two-step)")
    out = poisoned(B, width, kw, dev)
    bound = K.BoundPreparation(off, *vectors, out=out, pool_idx=1, divisor=KV, backend=backend, **kw)
    bound()
    assert bound.is_bound
    for t in out.tensors().values():
        t.fill_(-5)
    bound()
    torch.cuda.synchronize()
    assert_prep_equal(out, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bound()
    for t in out.tensors().values():
        t.fill_(-9)
    graph.replay()
    torch.cuda.synchronize()
    assert_prep_equal(out, want)
