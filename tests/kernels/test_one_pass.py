"""Tests of the one-pass form of ``prepare_paged_latent`` (exported block offsets in, one launch).

The one-pass form decodes one pool's exported offsets, finds each row's extent,
rebases it past its slot's base and prepares the generation step in a single
launch. It is checked against

* a pure-Python oracle (decode, then prepare, written from the contract),
* its torch reference (``prepare_paged_latent_one_pass_reference``), and
* the two-step form (``decode_draft_block_table`` then ``prepare_paged_latent``),

on fresh random rows, with every output element poisoned before the call. On
CPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1);
the ``cuda`` tests run the compiled kernel, its fast launch and a CUDA graph.
"""
from __future__ import annotations

import os

import pytest
import torch

import tensorrt_llm_draftkv.kernels as K
from tensorrt_llm_draftkv.kernels import _launch as fast_launch
from tensorrt_llm_draftkv.kernels import _one_pass_call as one_pass_call
from test_spec_tail_kernels import (
    KV,
    POISON32,
    POISON64,
    assert_prep_equal,
    assert_same,
    make_offsets,
    oracle_decode,
    oracle_prepare,
)

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    HAVE_HYPOTHESIS = True
except ImportError:  # hypothesis is a test extra
    HAVE_HYPOTHESIS = False

ONE_PASS = "prepare_paged_latent_one_pass"

# Triton's interpreter converts the row loop's bounds with a NumPy call it deprecated itself
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


# --------------------------------------------------------------------------- builders


def make_step(gen, num_pools, B_exp, B, M, *, backend, dtype=torch.int32, P=4, S=None, max_new=5, block_size=3,
              vec_dtype=torch.int64, kinds=None):
    """Exported offsets and the slot state of one generation step over rows ``0 .. B-1``.

    Slots are shared by several rows; bases reach past the rows' extents; some
    slots sit far out (stores past the table or past ``max_ctx``).
    """
    extra = {} if kinds is None else {"kinds": kinds}
    off, pages = make_offsets(gen, num_pools, B_exp, M, backend=backend, dtype=dtype, big_pages=False, **extra)
    S = S or max(1, B // 2)

    def ri(lo, hi, n):
        return torch.randint(lo, hi + 1, (n,), generator=gen)

    base = ri(0, M + 2, S)
    base[0] = 0
    ctx = base * P + ri(0, 3 * P, S)
    far = torch.rand(S, generator=gen) < 0.2
    ctx = torch.where(far, ri(0, (M + 3) * P, S), ctx)
    slot_ids = ri(0, S - 1, B)
    if B > 1:
        slot_ids[: max(1, B // 3)] = 0  # one slot shared by several rows
    num_new = ri(0, max_new, B)
    max_ctx = int(ri(1, (M + 3) * P, 1)) if torch.rand(1, generator=gen) < 0.7 else 2**40
    vectors = tuple(t.to(vec_dtype) for t in (slot_ids, ctx, base, num_new))
    kw = dict(block_size=block_size, tokens_per_block=P, max_ctx=max_ctx, max_new=max_new)
    return off, pages, vectors, kw


def poisoned_one_pass_out(B, M, kw, device="cpu"):
    out = K.PagedLatentPrep.empty(B, M, kw["block_size"], kw["max_new"], device=device, with_extents=True)
    for t in out.tensors().values():
        t.fill_(POISON32 if t.dtype == torch.int32 else POISON64)
    return out


def one_pass(off, vectors, kw, *, pool, divisor, backend, out=None, **extra):
    return K.prepare_paged_latent(
        None, None, *vectors, **kw, block_offsets=off, pool_idx=pool, divisor=divisor, backend=backend,
        out=out, **extra,
    )


def two_step(off, vectors, kw, *, pool, divisor, backend, impl="triton"):
    B = vectors[0].shape[0]
    bt = K.decode_draft_block_table(off, pool, B, divisor, backend, impl=impl)
    prep = K.prepare_paged_latent(bt.tables, bt.extents, *vectors, **kw, impl=impl)
    return bt, prep


def check_one_pass(off, vectors, kw, *, pool, divisor, backend, device="cpu", **extra):
    """Poisoned one-pass calls, both tilings unless ``source_tiles`` is given: each one launch,
    equal to the reference and to the two-step form. Returns the last result."""
    if "source_tiles" not in extra:
        for tiles in (False, True):
            got = check_one_pass(off, vectors, kw, pool=pool, divisor=divisor, backend=backend, device=device,
                                 source_tiles=tiles, **extra)
        return got
    B, M = vectors[0].shape[0], off.shape[3]
    out = poisoned_one_pass_out(B, M, kw, device)
    before = dict(K.LAUNCH_COUNTS)
    got = one_pass(off, vectors, kw, pool=pool, divisor=divisor, backend=backend, out=out, impl="triton", **extra)
    assert got is out
    assert K.LAUNCH_COUNTS[ONE_PASS] == before.get(ONE_PASS, 0) + 1
    assert sum(K.LAUNCH_COUNTS.values()) == sum(before.values()) + 1  # nothing else launched
    want = K.prepare_paged_latent_one_pass_reference(off, pool, divisor, backend, *vectors, **kw)
    assert_prep_equal(got, want)
    bt, prep = two_step(off, vectors, kw, pool=pool, divisor=divisor, backend=backend)
    assert prep.extents is None  # the two-step form carries no extents
    assert_same(got.extents, bt.extents, "extents vs decode")
    for name, t in prep.tensors().items():
        assert_same(getattr(got, name), t, f"{name} vs two-step")
    return got


# --------------------------------------------------------------------------- reference vs oracle


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("backend", ["python", "cpp"])
def test_one_pass_reference_matches_oracle(seed, backend):
    gen = torch.Generator().manual_seed(100 + seed)
    B_exp, B, M, P = [(4, 3, 9, 4), (6, 6, 17, 2), (3, 1, 1, 3), (8, 5, 33, 8)][seed]
    off, _, vectors, kw = make_step(gen, 2, B_exp, B, M, backend=backend, P=P)
    pool, divisor = seed % 2, [1, 2, 3, 2][seed]
    got = K.prepare_paged_latent_one_pass_reference(off, pool, divisor, backend, *vectors, **kw)
    tables, ext = oracle_decode(off[pool, :B, 0].tolist(), divisor, backend)
    sid, ctx, base, n = (v.tolist() for v in vectors)
    want = oracle_prepare(tables, ext, sid, ctx, base, n, kw["block_size"], P, kw["max_ctx"], kw["max_new"])
    for name, t in got.tensors().items():
        if name == "extents":
            assert t.tolist() == ext
        else:
            assert t.tolist() == want[name], name


# --------------------------------------------------------------------------- interpreted kernel


@pytest.mark.parametrize("backend", ["python", "cpp"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("pool,divisor", [(0, 2), (1, 1), (2, 2), (1, 3)])
def test_one_pass_matches_reference_and_two_step(backend, dtype, pool, divisor):
    gen = torch.Generator().manual_seed(hash((backend, str(dtype), pool, divisor)) % 2**31)
    off, _, vectors, kw = make_step(gen, 3, 7, 6, 29, backend=backend, dtype=dtype, P=4)
    check_one_pass(off, vectors, kw, pool=pool, divisor=divisor, backend=backend, block=8)  # 4 tiles per row
    check_one_pass(off, vectors, kw, pool=pool, divisor=divisor, backend=backend, block=8, split=3)
    check_one_pass(off, vectors, kw, pool=pool, divisor=divisor, backend=backend)  # default: one tile


@pytest.mark.parametrize("split", [1, 2])
def test_one_pass_released_low_entries_and_bases(split):
    """Hand-made rows: released low entries (-1 / page 0), base past the last backed entry, empty row."""
    P = 4
    rows = [
        [-1, -1, 5, 7, -1, -1],  # released low entries: extent 4
        [3, 4, -1, -1, -1, -1],  # backed only below the base (base 3): extent 2, nothing to read
        [-1, -1, -1, -1, -1, -1],  # empty row
        [9, 8, -1, 6, -1, 2],  # hole inside the extent
    ]
    slot_ids = torch.tensor([0, 1, 2, 0])  # rows 0 and 3 share slot 0
    ctx = torch.tensor([9, 13, 0])
    base = torch.tensor([2, 3, 0])
    num_new = torch.tensor([3, 2, 0, 1])
    kw = dict(block_size=2, tokens_per_block=P, max_ctx=24, max_new=3)
    for backend in ("python", "cpp"):
        fill = -1 if backend == "python" else 0  # cpp: page 0's offset at every unbacked ordinal
        k = torch.tensor([[p * KV if p >= 0 else fill for p in r] for r in rows], dtype=torch.int32)
        off = torch.stack([k, k + 1], dim=1)[None]  # [1, B, 2, M]
        vectors = (slot_ids, ctx, base, num_new)
        got = check_one_pass(off, vectors, kw, pool=0, divisor=KV, backend=backend, block=2, split=split)
        if backend == "python":
            assert got.extents.tolist() == [4, 2, 0, 6]
            assert got.shift.tolist() == [2, 2, 0, 2]
            assert got.read_rows[0].tolist() == [5, 7, -1, -1, -1, -1]
            assert got.read_rows[1].tolist() == [-1] * 6
            assert got.read_lens.tolist() == [4, 0, 0, 2]
        else:  # every row counts full; page 0 stands in for the unbacked entries
            assert got.extents.tolist() == [6] * 4
            assert got.read_rows[0].tolist() == [5, 7, 0, 0, -1, -1]
            assert got.read_rows[1].tolist() == [0, 0, 0, -1, -1, -1]
        assert got.new_ctx_len.tolist() == [12, 15, 0, 10]
        assert got.store_pages[0].tolist() == [5, 5, 5]  # positions 9..11: ordinal 2
        assert got.store_offsets[0].tolist() == [1, 2, 3]
        assert got.store_offsets[2].tolist() == [-1, -1, -1]


def test_one_pass_non_contiguous_offsets():
    gen = torch.Generator().manual_seed(21)
    for backend in ("python", "cpp"):
        off, _, vectors, kw = make_step(gen, 2, 5, 4, 19, backend=backend, dtype=torch.int64)
        # a window of a wider export: row and pool strides differ from a dense [.., 2, M]
        big = torch.full((2, 5, 2, 40), -3, dtype=torch.int64)
        big[..., 7:26] = off
        view = big[..., 7:26]
        assert not view.is_contiguous() and view.stride(3) == 1
        check_one_pass(view, vectors, kw, pool=1, divisor=KV, backend=backend, block=8)
        # ordinals not adjacent in memory (stride 5 along M)
        perm = off.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        assert perm.stride(3) != 1 and torch.equal(perm, off)
        check_one_pass(perm, vectors, kw, pool=1, divisor=KV, backend=backend, block=8)
        check_one_pass(perm, vectors, kw, pool=0, divisor=1, backend=backend, block=4, split=2)


def test_one_pass_int32_vectors_and_fewer_rows_than_exported():
    gen = torch.Generator().manual_seed(22)
    off, _, vectors, kw = make_step(gen, 2, 9, 3, 12, backend="python", vec_dtype=torch.int32, P=3)
    check_one_pass(off, vectors, kw, pool=1, divisor=KV, backend="python", block=4)


def test_one_pass_empty_shapes():
    gen = torch.Generator().manual_seed(23)
    # M = 0: nothing to read, every extent 0, no store lands in the table
    off, _, vectors, kw = make_step(gen, 1, 3, 3, 0, backend="python")
    got = check_one_pass(off, vectors, kw, pool=0, divisor=KV, backend="python")
    assert got.extents.tolist() == [0, 0, 0] and got.read_rows.shape == (3, 0)
    got = check_one_pass(off, vectors, kw, pool=0, divisor=KV, backend="cpp")
    assert got.extents.tolist() == [0, 0, 0]
    # B = 0: no launch, empty outputs
    off, _, _, kw = make_step(gen, 1, 3, 3, 5, backend="python")
    empty = tuple(torch.zeros(n, dtype=torch.int64) for n in (0, 2, 2, 0))
    before = sum(K.LAUNCH_COUNTS.values())
    got = one_pass(off, empty, kw, pool=0, divisor=KV, backend="python", impl="triton")
    assert sum(K.LAUNCH_COUNTS.values()) == before
    assert got.read_rows.shape == (0, 5) and got.extents.shape == (0,)


def test_one_pass_without_out_allocates_extents():
    gen = torch.Generator().manual_seed(24)
    off, _, vectors, kw = make_step(gen, 2, 4, 4, 10, backend="python")
    want = K.prepare_paged_latent_one_pass_reference(off, 1, KV, "python", *vectors, **kw)
    for impl in ("triton", "reference", None):
        got = one_pass(off, vectors, kw, pool=1, divisor=KV, backend="python", impl=impl)
        assert got.extents is not None
        assert_prep_equal(got, want)


def test_one_pass_backend_defaults_to_cpp():
    gen = torch.Generator().manual_seed(25)
    off, _, vectors, kw = make_step(gen, 1, 4, 4, 10, backend="python", kinds=("released_low", "tail"))
    got = K.prepare_paged_latent(None, None, *vectors, **kw, block_offsets=off, divisor=KV, impl="triton")
    assert got.extents.tolist() == [10] * 4  # cpp: full rows
    assert_prep_equal(got, K.prepare_paged_latent_one_pass_reference(off, 0, KV, "cpp", *vectors, **kw))


def test_one_pass_dispatch(monkeypatch):
    gen = torch.Generator().manual_seed(26)
    off, _, vectors, kw = make_step(gen, 2, 4, 4, 10, backend="python")
    want = K.prepare_paged_latent_one_pass_reference(off, 1, KV, "python", *vectors, **kw)
    before = K.LAUNCH_COUNTS[ONE_PASS]
    assert_prep_equal(one_pass(off, vectors, kw, pool=1, divisor=KV, backend="python", impl="reference"), want)
    assert K.LAUNCH_COUNTS[ONE_PASS] == before
    # under the suite the CPU default is the interpreted kernel, not the reference
    assert os.environ.get("TRITON_INTERPRET") == "1"

    def boom(*a, **k):
        raise AssertionError("the torch reference ran instead of the Triton kernel")

    monkeypatch.setattr(one_pass_call.reference, "prepare_paged_latent_one_pass_reference", boom)
    assert_prep_equal(one_pass(off, vectors, kw, pool=1, divisor=KV, backend="python"), want)
    assert K.LAUNCH_COUNTS[ONE_PASS] == before + 1
    monkeypatch.undo()
    # without TRITON_INTERPRET the CPU default is the reference
    monkeypatch.delenv("TRITON_INTERPRET")
    assert_prep_equal(one_pass(off, vectors, kw, pool=1, divisor=KV, backend="python"), want)
    assert K.LAUNCH_COUNTS[ONE_PASS] == before + 1


def test_prep_tensors_and_copy_skip_missing_extents():
    two = K.PagedLatentPrep.empty(2, 3, 1, 1)
    assert "extents" not in two.tensors() and len(two.tensors()) == 7
    full = K.PagedLatentPrep.empty(2, 3, 1, 1, with_extents=True)
    for t in full.tensors().values():
        t.fill_(7)
    full.extents.fill_(5)
    two.copy_(full)  # the extents two lacks are not copied
    assert all(bool((t == 7).all()) for t in two.tensors().values())
    keep = full.extents.clone()
    full.copy_(two)  # extents full holds are left as they were
    assert torch.equal(full.extents, keep)


def test_one_pass_argument_checks():
    gen = torch.Generator().manual_seed(27)
    off, _, vectors, kw = make_step(gen, 2, 4, 4, 10, backend="python")
    tables, extents = K.decode_draft_block_table_reference(off, 0, 4, KV, "python")
    good = dict(block_offsets=off, pool_idx=1, divisor=KV, backend="python")
    with pytest.raises(ValueError, match="not both"):
        K.prepare_paged_latent(tables, extents, *vectors, **kw, **good)
    with pytest.raises(ValueError, match="not both"):
        K.prepare_paged_latent(None, extents, *vectors, **kw, **good)
    with pytest.raises(ValueError, match="block_offsets"):
        K.prepare_paged_latent(None, None, *vectors, **kw)
    with pytest.raises(ValueError, match="divisor"):
        K.prepare_paged_latent(None, None, *vectors, **kw, **{**good, "divisor": None})
    with pytest.raises(ValueError, match="divisor"):
        K.prepare_paged_latent(None, None, *vectors, **kw, **{**good, "divisor": 0})
    with pytest.raises(ValueError, match="backend"):
        K.prepare_paged_latent(None, None, *vectors, **kw, **{**good, "backend": "rust"})
    with pytest.raises(IndexError, match="pool_idx 2"):
        K.prepare_paged_latent(None, None, *vectors, **kw, **{**good, "pool_idx": 2})
    with pytest.raises(TypeError, match="pool_idx"):
        K.prepare_paged_latent(None, None, *vectors, **kw, **{**good, "pool_idx": 1.0})
    with pytest.raises(TypeError, match="block_offsets"):
        K.prepare_paged_latent(None, None, *vectors, **kw, **{**good, "block_offsets": off.float()})
    with pytest.raises(ValueError, match=r"\[num_pools, B, 2, M\]"):
        K.prepare_paged_latent(None, None, *vectors, **kw, **{**good, "block_offsets": off[:, :, :1]})
    with pytest.raises(ValueError, match="block_offsets"):
        K.prepare_paged_latent(None, None, *vectors, **kw, **{**good, "block_offsets": off[0]})
    long = tuple(torch.zeros(5, dtype=torch.int64) for _ in range(4))
    with pytest.raises(ValueError, match="5 rows but block_offsets holds 4"):
        K.prepare_paged_latent(None, None, *long, **kw, **good)
    with pytest.raises(ValueError, match="num_new"):
        K.prepare_paged_latent(None, None, *vectors[:3], vectors[3][:2], **kw, **good)
    # the one-pass keywords do not go with the two-step form
    with pytest.raises(ValueError, match="one-pass"):
        K.prepare_paged_latent(tables, extents, *vectors, **kw, divisor=KV)
    # outputs: extents required, dtype and shape checked, nothing written on error
    out = K.PagedLatentPrep.empty(4, 10, kw["block_size"], kw["max_new"])
    out.read_rows.fill_(POISON32)
    with pytest.raises(ValueError, match="with_extents=True"):
        K.prepare_paged_latent(None, None, *vectors, **kw, **good, out=out)
    out.extents = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="out.extents"):
        K.prepare_paged_latent(None, None, *vectors, **kw, **good, out=out)
    out.extents = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="out.extents"):
        K.prepare_paged_latent(None, None, *vectors, **kw, **good, out=out)
    assert bool((out.read_rows == POISON32).all())
    with pytest.raises(ValueError, match="block"):
        K.prepare_paged_latent(None, None, *vectors, **kw, **good, block=12, impl="triton")
    with pytest.raises(ValueError, match="split"):
        K.prepare_paged_latent(None, None, *vectors, **kw, **good, split=0, impl="triton")


if HAVE_HYPOTHESIS:

    @settings(max_examples=15, deadline=None)
    @given(
        seed=st.integers(0, 2**31 - 1),
        num_pools=st.integers(1, 3),
        B=st.integers(1, 5),
        M=st.integers(0, 24),
        P=st.sampled_from([1, 2, 4, 5]),
        backend=st.sampled_from(["python", "cpp"]),
        int64=st.booleans(),
        divisor=st.sampled_from([1, 2, 3]),
        block=st.sampled_from([4, 8, None]),
        split=st.sampled_from([1, 2, None]),
        max_new=st.integers(0, 6),
        block_size=st.integers(0, 4),
        source_tiles=st.sampled_from([True, False, None]),
    )
    def test_one_pass_hypothesis(seed, num_pools, B, M, P, backend, int64, divisor, block, split, max_new,
                                 block_size, source_tiles):
        gen = torch.Generator().manual_seed(seed)
        dtype = torch.int64 if int64 else torch.int32
        off, _, vectors, kw = make_step(gen, num_pools, B + seed % 2, B, M, backend=backend, dtype=dtype, P=P,
                                        max_new=max_new, block_size=block_size)
        check_one_pass(off, vectors, kw, pool=seed % num_pools, divisor=divisor, backend=backend, block=block,
                       split=split, source_tiles=source_tiles)


# --------------------------------------------------------------------------- CUDA


def _big_step(gen, num_pools, B, M, *, backend, dtype=torch.int32, P=32, device="cuda"):
    """Large exported offsets built with vectorised ops: rows backed on [lo, hi), page 0 / -1 elsewhere."""
    pages = torch.randint(1, 2**29, (num_pools, B, M), generator=gen)
    lo = torch.randint(0, M + 1, (num_pools, B), generator=gen)
    hi = torch.minimum(lo + torch.randint(0, M + 1, (num_pools, B), generator=gen), torch.tensor(M))
    cols = torch.arange(M)
    backed = (cols >= lo[..., None]) & (cols < hi[..., None])
    fill = -1 if backend == "python" else 0
    off = torch.empty((num_pools, B, 2, M), dtype=torch.int64)
    off[:, :, 0] = torch.where(backed, pages * KV, fill)
    off[:, :, 1] = torch.where(backed, pages * KV + 1, fill)
    S = max(1, B // 2)
    base = torch.randint(0, M + 2, (S,), generator=gen)
    ctx = base * P + torch.randint(0, 4 * P, (S,), generator=gen)
    slot_ids = torch.randint(0, S, (B,), generator=gen)
    slot_ids[: B // 4] = 0
    num_new = torch.randint(0, 9, (B,), generator=gen)
    kw = dict(block_size=8, tokens_per_block=P, max_ctx=int(M * P * 0.9) + 1, max_new=8)
    vectors = tuple(t.to(device) for t in (slot_ids, ctx, base, num_new))
    return off.to(dtype).to(device), vectors, kw


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["python", "cpp"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_one_pass_cuda_matches_reference(backend, dtype):
    gen = torch.Generator().manual_seed(6100)
    for num_pools, B, M, pool in [(2, 1, 128, 1), (3, 8, 2048, 2), (1, 64, 16384, 0), (2, 300, 2048, 1),
                                  (2, 1024, 128, 0), (2, 5, 1, 1), (1, 3, 37, 0)]:
        off, vectors, kw = _big_step(gen, num_pools, B, M, backend=backend, dtype=dtype)
        for extra in ({}, {"block": 256, "split": 3}, {"num_warps": 4}, {"block": 128, "split": 2, "num_warps": 2}):
            check_one_pass(off, vectors, kw, pool=pool, divisor=KV, backend=backend, device="cuda", **extra)
        # the small edge generator too, strided view included
        off_s, _, vec_s, kw_s = make_step(gen, 2, 6, 5, 21, backend=backend, dtype=dtype)
        check_one_pass(off_s[..., 2:19].cuda(), tuple(v.cuda() for v in vec_s), kw_s, pool=1, divisor=1,
                       backend=backend, device="cuda")


@pytest.mark.cuda
def test_one_pass_cuda_fast_launch_equals_normal_launch():
    gen = torch.Generator().manual_seed(6200)
    fast_launch.clear()
    for backend in ("python", "cpp"):
        for B, M in [(4, 128), (256, 2048), (2, 16384)]:
            off, vectors, kw = _big_step(gen, 2, B, M, backend=backend)
            want = K.prepare_paged_latent_one_pass_reference(off, 1, KV, backend, *vectors, **kw)
            outs = []
            for fast in (False, True, True, True):  # the second fast call runs the bound plan
                out = poisoned_one_pass_out(B, M, kw, "cuda")
                one_pass(off, vectors, kw, pool=1, divisor=KV, backend=backend, out=out, fast_launch=fast)
                outs.append(out)
            # the same out again, then a new max_ctx (a runtime argument of the plan)
            one_pass(off, vectors, kw, pool=1, divisor=KV, backend=backend, out=outs[-1])
            torch.cuda.synchronize()
            for out in outs:
                assert_prep_equal(out, want)
            kw2 = {**kw, "max_ctx": kw["max_ctx"] // 3}
            out = poisoned_one_pass_out(B, M, kw, "cuda")
            for _ in range(2):
                one_pass(off, vectors, kw2, pool=1, divisor=KV, backend=backend, out=out)
            assert_prep_equal(out, K.prepare_paged_latent_one_pass_reference(off, 1, KV, backend, *vectors, **kw2))
    assert fast_launch.cached_classes() > 0
    # the two-step kernels go through the same fast launcher
    off, vectors, kw = _big_step(gen, 2, 64, 700, backend="python")
    for fast in (False, True, True):
        bt = K.decode_draft_block_table(off, 1, 64, KV, "python")
        prep = K.prepare_paged_latent(bt.tables, bt.extents, *vectors, **kw, fast_launch=fast)
        assert_prep_equal(prep, K.prepare_paged_latent_reference(bt.tables, bt.extents, *vectors, **kw))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["python", "cpp"])
def test_one_pass_cuda_graph_capture_and_replay(backend):
    gen = torch.Generator().manual_seed(6300)
    B, M = 64, 700
    off, vectors, kw = _big_step(gen, 2, B, M, backend=backend)
    out = poisoned_one_pass_out(B, M, kw, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, bind the fast plan and warm up outside the capture
        for _ in range(3):
            one_pass(off, vectors, kw, pool=1, divisor=KV, backend=backend, out=out)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    before = sum(K.LAUNCH_COUNTS.values())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        one_pass(off, vectors, kw, pool=1, divisor=KV, backend=backend, out=out)
    assert sum(K.LAUNCH_COUNTS.values()) == before + 1
    for _ in range(4):
        fresh_off, fresh_vec, _ = _big_step(gen, 2, B, M, backend=backend, device="cpu")
        off.copy_(fresh_off)
        for dst, src in zip(vectors, fresh_vec):
            dst.copy_(src)
        for t in out.tensors().values():
            t.fill_(POISON32 if t.dtype == torch.int32 else POISON64)
        graph.replay()
        torch.cuda.synchronize()
        assert_prep_equal(out, K.prepare_paged_latent_one_pass_reference(off, 1, KV, backend, *vectors, **kw))


@pytest.mark.cuda
def test_one_pass_is_one_kernel_launch_cuda():
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(6400)
    off, vectors, kw = _big_step(gen, 2, 256, 2048, backend="python")
    out = poisoned_one_pass_out(256, 2048, kw, "cuda")
    for _ in range(2):
        one_pass(off, vectors, kw, pool=1, divisor=KV, backend="python", out=out)
    torch.cuda.synchronize()
    before = sum(K.LAUNCH_COUNTS.values())
    for _ in range(5):
        one_pass(off, vectors, kw, pool=1, divisor=KV, backend="python", out=out)
    assert sum(K.LAUNCH_COUNTS.values()) == before + 5
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            one_pass(off, vectors, kw, pool=1, divisor=KV, backend="python", out=out)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    except RuntimeError as exc:  # pragma: no cover - depends on CUPTI
        pytest.skip(f"profiler unavailable: {exc}")
    if not kernels:
        pytest.skip("profiler recorded no CUDA activity (CUPTI unavailable)")
    assert len(kernels) == 1, kernels


def test_one_pass_tiling_default_follows_the_launch_size():
    """Source tiling for launches of at most 2^19 offsets (latency-bound), read-table tiling above;
    an explicit ``source_tiles`` wins. The threshold was read off the H200 tilings table."""
    from tensorrt_llm_draftkv.kernels._checks import _SRC_TILES_MAX_ENTRIES, one_pass_config

    cpu = torch.device("cpu")
    assert _SRC_TILES_MAX_ENTRIES == 256 * 2048
    for B, M, want in [(1, 128, True), (256, 2048, True), (257, 2048, False), (64, 16384, False),
                       (1024, 2048, False), (1, 2**19, True), (1, 2**19 + 1, False)]:
        assert one_pass_config(B, M, cpu, None, None, None)[4] is want, (B, M)
        assert one_pass_config(B, M, cpu, None, None, None, not want)[4] is (not want), (B, M)
