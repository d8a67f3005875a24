"""Tests of the draft-KV block-table kernels (tensorrt_llm_draftkv.kernels).

Layers of checking:
* a pure-Python oracle (loops over lists, written from the contract) checks the
  torch references on small random inputs;
* the Triton kernels (the interpreter on CPU, since conftest sets
  TRITON_INTERPRET=1; compiled on CUDA) are checked against the references on
  fresh random inputs, with every output element poisoned before the call;
* the eager baseline (``benchmarks/eager_baseline.py``) is checked against the reference;
* dispatch tests prove the interpreted kernel really ran.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

import tensorrt_llm_draftkv.kernels as K
from tensorrt_llm_draftkv.kernels import spec_tail_kernels as api

try:  # benchmarks/ sits beside the package: on sys.path under `python -m pytest`, not under plain `pytest`
    from benchmarks.eager_baseline import eager_prepare_paged_latent
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.eager_baseline import eager_prepare_paged_latent

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    HAVE_HYPOTHESIS = True
except ImportError:  # hypothesis is a test extra
    HAVE_HYPOTHESIS = False

POISON32 = 12345
POISON64 = -777
KV = 2  # kv_factor
ROW_KINDS = ("full", "empty", "released_low", "tail", "holes", "last_only", "first_only")
PAGE_HI = 2**30 - 1  # pages up to this keep K/V offsets <= 2**31 - 1


# --------------------------------------------------------------------------- input builders


def _row_mask(gen: torch.Generator, kind: str, M: int) -> torch.Tensor:
    """Which ordinals of one row are backed (bool [M])."""
    cols = torch.arange(M)
    if M == 0:
        return cols < 0
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    if kind == "full":
        return cols >= 0
    if kind == "empty":
        return cols < 0
    if kind == "released_low":  # a window released [0, lo); row ends at hi
        lo = r(0, M - 1)
        hi = r(lo + 1, M)
        return (cols >= lo) & (cols < hi)
    if kind == "tail":
        return cols < r(0, M)
    if kind == "holes":
        return torch.rand(M, generator=gen) < 0.5
    if kind == "last_only":
        return cols == M - 1
    if kind == "first_only":
        return cols == 0
    raise ValueError(kind)


def make_offsets(
    gen,
    num_pools,
    B,
    M,
    *,
    backend="python",
    dtype=torch.int32,
    kinds=ROW_KINDS,
    guard_page=0,
    garbage_v=True,
    big_pages=True,
):
    """Random exported block offsets [num_pools, B, 2, M] and their truth.

    Returns (offsets, pages) where pages[p, b] is the int64 row of page indices
    (-1 = unbacked) of row b in pool p. Unbacked entries hold -1 (python
    backend) or the guard page's offset (cpp backend; page 0 by default). With
    garbage_v the V half holds values unrelated to K, so a kernel reading the
    wrong half fails.
    """
    hi = PAGE_HI if big_pages else 1000
    pages = torch.randint(0, hi + 1, (num_pools, B, M), generator=gen)
    if big_pages and M:  # an extreme offset in every row
        pages[:, :, int(torch.randint(M, (1,), generator=gen))] = PAGE_HI
    for p in range(num_pools):
        for b in range(B):
            kind = kinds[int(torch.randint(len(kinds), (1,), generator=gen))]
            pages[p, b][~_row_mask(gen, kind, M)] = -1
    backed = pages >= 0
    fill = -1 if backend == "python" else guard_page * KV
    off = torch.empty((num_pools, B, 2, M), dtype=torch.int64)
    off[:, :, 0] = torch.where(backed, pages * KV, fill)
    off[:, :, 1] = torch.where(backed, pages * KV + 1, fill + (1 if backend == "cpp" else 0))
    if garbage_v:
        off[:, :, 1] = torch.randint(-5, 2**31 - 1, (num_pools, B, M), generator=gen)
    return off.to(dtype), pages


def make_prepare_inputs(
    gen,
    B,
    M,
    *,
    P,
    num_slots,
    max_new,
    block_size,
    table_dtype=torch.int32,
    vec_dtype=torch.int64,
    device="cpu",
    strided=False,
):
    """Random inputs of prepare_paged_latent covering the edge cases."""
    off, _ = make_offsets(gen, 1, B, M, backend="python", big_pages=False)
    tables, extents = K.decode_draft_block_table_reference(off, 0, B, KV, backend="python")
    # some rows as the cpp backend sees them (full extent), some with page-0 holes
    full = torch.rand(B, generator=gen) < 0.25
    extents = torch.where(full, torch.full_like(extents, M), extents)
    if strided:  # a view with row stride > M
        wide = torch.randint(-1, 1000, (B, M + 7), generator=gen, dtype=torch.int32)
        wide[:, 3 : 3 + M] = tables
        tables = wide[:, 3 : 3 + M]
    tables = tables.to(table_dtype)

    def ri(lo, hi, n):
        return torch.randint(lo, hi + 1, (n,), generator=gen)

    base = ri(0, M + 3, num_slots)  # sometimes beyond every extent
    base[ri(0, num_slots - 1, 1)] = 0
    ctx = base * P + ri(0, 3 * P, num_slots)  # L >= base*P
    # some slots far out (positions past the table / past max_ctx)
    far = torch.rand(num_slots, generator=gen) < 0.2
    ctx = torch.where(far, ri(0, (M + 4) * P, num_slots), ctx)
    slot_ids = ri(0, num_slots - 1, B)
    if B > 1:  # a shared dummy slot
        slot_ids[ri(0, B - 1, max(1, B // 3))] = 0
    num_new = ri(0, max_new, B)
    num_new[ri(0, B - 1, 1)] = 0
    max_ctx = int(ri(1, (M + 3) * P, 1))
    if torch.rand(1, generator=gen) < 0.2:
        max_ctx = 2**40  # never clamps
    t = lambda x: x.to(vec_dtype).to(device)  # noqa: E731
    inputs = (
        tables.to(device),
        extents.to(device),
        t(slot_ids),
        t(ctx),
        t(base),
        t(num_new),
    )
    kw = dict(block_size=block_size, tokens_per_block=P, max_ctx=max_ctx, max_new=max_new)
    return inputs, kw


# --------------------------------------------------------------------------- oracles (pure Python)


def oracle_decode(rows_k, divisor, backend):
    M = len(rows_k[0]) if rows_k else 0
    tables = [[v // divisor if v >= 0 else -1 for v in row] for row in rows_k]
    if backend == "cpp":
        ext = [M] * len(rows_k)
    else:
        ext = [max([i + 1 for i, v in enumerate(row) if v >= 0], default=0) for row in rows_k]
    return tables, ext


def oracle_rebase(tables, extents, base):
    rows, new_ext, shifts = [], [], []
    for row, e, bb in zip(tables, extents, base):
        M = len(row)
        e = min(max(e, 0), M)
        s = max(min(bb, e), 0)
        rows.append([row[s + j] if s + j < e else -1 for j in range(M)])
        new_ext.append(e - s)
        shifts.append(s)
    return rows, new_ext, shifts


def oracle_prepare(tables, extents, slot_ids, ctx, base_pages, num_new, block_size, P, max_ctx, max_new):
    res = {k: [] for k in ("read_rows", "read_lens", "query_pos", "store_pages", "store_offsets", "new_ctx_len", "shift")}
    for b, row in enumerate(tables):
        M = len(row)
        s = slot_ids[b]
        L, base, n = ctx[s], base_pages[s], num_new[b]
        e = min(max(extents[b], 0), M)
        sh = max(min(base, e), 0)
        nc = min(L + n, max_ctx)
        res["new_ctx_len"].append(nc)
        res["shift"].append(sh)
        res["read_rows"].append([row[sh + j] if sh + j < e else -1 for j in range(M)])
        res["read_lens"].append(min(max(nc - base * P, 0), (e - sh) * P))
        res["query_pos"].append([nc + j for j in range(block_size)])
        pages, offs = [], []
        for i in range(max_new):
            pos = L + i
            valid = i < n and 0 <= pos < max_ctx
            pages.append(row[pos // P] if valid and pos // P < M else -1)
            offs.append(pos % P if valid else -1)
        res["store_pages"].append(pages)
        res["store_offsets"].append(offs)
    return res


# --------------------------------------------------------------------------- comparison helpers


def poisoned_tables(n, M, device="cpu"):
    return K.BlockTables(
        torch.full((n, M), POISON32, dtype=torch.int32, device=device),
        torch.full((n,), POISON64, dtype=torch.int64, device=device),
    )


def poisoned_rebased(B, M, device="cpu"):
    return K.RebasedTables(
        torch.full((B, M), POISON32, dtype=torch.int32, device=device),
        torch.full((B,), POISON64, dtype=torch.int64, device=device),
        torch.full((B,), POISON64, dtype=torch.int64, device=device),
    )


def poisoned_prep(B, M, block_size, max_new, device="cpu"):
    out = K.PagedLatentPrep.empty(B, M, block_size, max_new, device=device)
    for t in out.tensors().values():
        t.fill_(POISON32 if t.dtype == torch.int32 else POISON64)
    return out


def assert_same(got, want, what=""):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.equal(got.cpu(), want.cpu()):
        bad = (got.cpu() != want.cpu()).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: mismatch at {bad}\n got={got.cpu()}\nwant={want.cpu()}")


def assert_prep_equal(got: K.PagedLatentPrep, want: K.PagedLatentPrep):
    for name, t in want.tensors().items():
        assert_same(getattr(got, name), t, name)


def run_prepare(impl, inputs, kw, *, block=None, poison=True):
    B, M = inputs[0].shape
    out = poisoned_prep(B, M, kw["block_size"], kw["max_new"], inputs[0].device) if poison else None
    extra = {} if block is None else {"block": block}
    res = K.prepare_paged_latent(*inputs, **kw, out=out, impl=impl, **extra)
    if out is not None:
        assert res is out
    return res


# --------------------------------------------------------------------------- references vs oracle


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("backend", ["python", "cpp"])
def test_decode_reference_matches_oracle(seed, backend):
    gen = torch.Generator().manual_seed(1000 + seed)
    M = [1, 5, 17, 33, 2, 9][seed]
    off, pages = make_offsets(gen, 3, 5, M, backend=backend)
    for pool in range(3):
        for divisor in (1, 2, 3):
            n = 4
            rows_k = off[pool, :n, 0].tolist()
            want_t, want_e = oracle_decode(rows_k, divisor, backend)
            got = K.decode_draft_block_table_reference(off, pool, n, divisor, backend)
            assert got.tables.tolist() == want_t
            assert got.extents.tolist() == want_e
            if divisor == KV and backend == "python":
                assert got.tables.tolist() == pages[pool, :n].tolist()


@pytest.mark.parametrize("seed", range(6))
def test_rebase_and_prepare_references_match_oracle(seed):
    gen = torch.Generator().manual_seed(2000 + seed)
    B, M = [(1, 1), (3, 7), (6, 20), (4, 33), (8, 5), (2, 64)][seed]
    P = [1, 4, 8, 2, 16, 3][seed]
    inputs, kw = make_prepare_inputs(gen, B, M, P=P, num_slots=max(1, B // 2), max_new=5, block_size=3)
    tables, extents, slot_ids, ctx, base, num_new = inputs
    # rebase with per-row bases taken through the slots
    rb = base[slot_ids]
    got = K.rebase_block_table_reference(tables, extents, rb)
    want = oracle_rebase(tables.tolist(), extents.tolist(), rb.tolist())
    assert (got.rows.tolist(), got.extents.tolist(), got.shift.tolist()) == want
    # prepare
    got = K.prepare_paged_latent_reference(*inputs, **kw)
    want = oracle_prepare(
        tables.tolist(), extents.tolist(), slot_ids.tolist(), ctx.tolist(), base.tolist(), num_new.tolist(),
        kw["block_size"], P, kw["max_ctx"], kw["max_new"],
    )
    for name, t in got.tensors().items():
        assert t.tolist() == want[name], name


def test_extent_counts_past_released_low_entries():
    """[-1, -1, 5, 7, -1] has extent 4, not 2 (the number of backed entries)."""
    row = [-1, -1, 5, 7, -1]
    off = torch.tensor(
        [[[[p * KV if p >= 0 else -1 for p in row], [p * KV + 1 if p >= 0 else -1 for p in row]]]],
        dtype=torch.int32,
    )
    for impl in ("reference", "triton"):
        got = K.decode_draft_block_table(off, 0, 1, KV, backend="python", impl=impl, block=2)
        assert got.tables.tolist() == [row]
        assert got.extents.tolist() == [4]
        cpp = K.decode_draft_block_table(off, 0, 1, KV, backend="cpp", impl=impl, block=2)
        assert cpp.extents.tolist() == [5]
        # the rebase of that row past 3 pages keeps ordinal 3 (page 7) readable
        rb = K.rebase_block_table(got.tables, got.extents, torch.tensor([3]), impl=impl)
        assert rb.rows.tolist() == [[7, -1, -1, -1, -1]]
        assert rb.extents.tolist() == [1] and rb.shift.tolist() == [3]


# --------------------------------------------------------------------------- Triton (interpreted on CPU) vs reference


def _check_decode(off, pool, n, divisor, backend, block, device="cpu"):
    num_pools, B, _, M = off.shape
    out = poisoned_tables(n, M, device)
    got = K.decode_draft_block_table(off, pool, n, divisor, backend, out=out, impl="triton", block=block)
    assert got.tables is out.tables and got.extents is out.extents
    want = K.decode_draft_block_table_reference(off, pool, n, divisor, backend)
    assert_same(got.tables, want.tables, "tables")
    assert_same(got.extents, want.extents, "extents")


@pytest.mark.parametrize("backend", ["python", "cpp"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("pool", [0, 1, 2])
def test_decode_triton_matches_reference(backend, dtype, pool):
    gen = torch.Generator().manual_seed(hash((backend, str(dtype), pool)) % 2**31)
    off, _ = make_offsets(gen, 3, 7, 45, backend=backend, dtype=dtype, guard_page=pool * 3)
    _check_decode(off, pool, 7, KV, backend, block=16)  # 3 chunks per row
    _check_decode(off, pool, 5, 3, backend, block=None)  # one chunk, num_seqs < B


def test_decode_triton_edge_shapes():
    gen = torch.Generator().manual_seed(7)
    for M in (1, 16, 17):
        off, _ = make_offsets(gen, 2, 4, M, backend="python")
        _check_decode(off, 1, 4, KV, "python", block=16)
        _check_decode(off, 1, 4, KV, "python", block=4)
    # all-empty rows and a row backed only at its last ordinal, many chunks
    off, _ = make_offsets(gen, 1, 4, 40, backend="python", kinds=("empty", "last_only", "first_only"))
    _check_decode(off, 0, 4, KV, "python", block=4)
    # num_seqs = 0 and M = 0
    off, _ = make_offsets(gen, 1, 3, 0, backend="python")
    got = K.decode_draft_block_table(off, 0, 3, KV, "python", impl="triton")
    assert got.tables.shape == (3, 0) and got.extents.tolist() == [0, 0, 0]
    got = K.decode_draft_block_table(off, 0, 3, KV, "cpp", impl="triton")
    assert got.extents.tolist() == [0, 0, 0]
    off, _ = make_offsets(gen, 1, 3, 5, backend="python")
    got = K.decode_draft_block_table(off, 0, 0, KV, "python", impl="triton")
    assert got.tables.shape == (0, 5) and got.extents.shape == (0,)


def test_decode_reads_a_strided_offsets_view():
    gen = torch.Generator().manual_seed(11)
    off, _ = make_offsets(gen, 2, 6, 30, backend="python", dtype=torch.int64)
    big = torch.full((2, 6, 2, 50), -5, dtype=torch.int64)
    big[..., 10:40] = off
    view = big[..., 10:40]
    assert not view.is_contiguous()
    _check_decode(view, 1, 6, KV, "python", block=8)


@pytest.mark.parametrize("seed", range(4))
def test_rebase_triton_matches_reference(seed):
    gen = torch.Generator().manual_seed(3000 + seed)
    B, M = [(5, 37), (1, 16), (9, 8), (4, 100)][seed]
    off, _ = make_offsets(gen, 1, B, M, backend="python")
    tables, extents = K.decode_draft_block_table_reference(off, 0, B, KV, "python")
    base = torch.randint(0, M + 4, (B,), generator=gen)  # includes base > extent
    base[0] = 0
    ext_dtype = [torch.int64, torch.int32][seed % 2]
    for blk in (8, None):
        out = poisoned_rebased(B, M)
        got = K.rebase_block_table(tables, extents.to(ext_dtype), base, out=out, impl="triton", block=blk)
        want = K.rebase_block_table_reference(tables, extents, base)
        assert got.rows is out.rows
        assert_same(got.rows, want.rows, "rows")
        assert_same(got.extents, want.extents, "extents")
        assert_same(got.shift, want.shift, "shift")
    assert (want.shift <= extents).all() and (want.shift <= base).all()


PREP_CASES = [
    # B, M, P, slots, max_new, block_size, table dtype, vec dtype, block, strided
    (5, 40, 4, 3, 4, 3, torch.int32, torch.int64, 16, False),
    (6, 21, 8, 2, 7, 8, torch.int32, torch.int32, 8, True),
    (1, 1, 1, 1, 1, 1, torch.int32, torch.int64, None, False),
    (7, 64, 2, 7, 0, 5, torch.int64, torch.int64, 32, False),  # max_new = 0
    (4, 33, 16, 1, 9, 1, torch.int32, torch.int64, None, True),  # one shared slot
    (3, 12, 3, 5, 16, 16, torch.int32, torch.int64, 4, False),  # P not a power of two
]


@pytest.mark.parametrize("case", range(len(PREP_CASES)))
def test_prepare_triton_matches_reference(case):
    B, M, P, S, max_new, bs, tdt, vdt, blk, strided = PREP_CASES[case]
    gen = torch.Generator().manual_seed(4000 + case)
    for _ in range(2):
        inputs, kw = make_prepare_inputs(
            gen, B, M, P=P, num_slots=S, max_new=max_new, block_size=bs, table_dtype=tdt, vec_dtype=vdt, strided=strided
        )
        got = run_prepare("triton", inputs, kw, block=blk)
        want = K.prepare_paged_latent_reference(*inputs, **kw)
        assert_prep_equal(got, want)


def test_prepare_triton_targeted_edges():
    """Hand-made rows: empty row, released low entries, base beyond extent, clamping."""
    P = 4
    tables = torch.tensor(
        [
            [-1, -1, -1, -1, -1, -1],  # empty row
            [-1, -1, 5, 7, -1, -1],  # released low entries, extent 4
            [1, 2, 3, 4, 5, 6],  # full
            [1, 2, 3, 4, 5, 6],  # base beyond extent
            [9, 8, -1, 6, -1, -1],  # hole inside the extent
        ],
        dtype=torch.int32,
    )
    extents = torch.tensor([0, 4, 6, 3, 4])
    slot_ids = torch.tensor([0, 1, 2, 3, 0])  # rows 0 and 4 share slot 0
    ctx = torch.tensor([0, 9, 22, 20])
    base = torch.tensor([0, 2, 1, 5])
    num_new = torch.tensor([0, 3, 4, 2, 2])
    kw = dict(block_size=3, tokens_per_block=P, max_ctx=24, max_new=4)
    inputs = (tables, extents, slot_ids, ctx, base, num_new)
    want = K.prepare_paged_latent_reference(*inputs, **kw)
    assert want.read_rows[1].tolist() == [5, 7, -1, -1, -1, -1]
    assert want.read_rows[3].tolist() == [-1] * 6 and want.shift[3] == 3
    assert want.read_rows[4].tolist() == [9, 8, -1, 6, -1, -1]
    assert want.new_ctx_len.tolist() == [0, 12, 24, 22, 2]  # row 2 clamped at max_ctx
    assert want.read_lens.tolist() == [0, 4, 20, 0, 2]
    assert want.store_pages[2].tolist() == [6, 6, -1, -1]  # 22, 23 stored; 24, 25 past max_ctx
    assert want.store_offsets[2].tolist() == [2, 3, -1, -1]
    assert want.store_pages[1].tolist() == [5, 5, 5, -1]  # positions 9..11 -> ordinal 2
    assert want.store_offsets[1].tolist() == [1, 2, 3, -1]
    assert want.store_pages[3].tolist() == [6, 6, -1, -1]  # unrebased ordinal 5, past the extent
    assert want.store_pages[0].tolist() == [-1] * 4 and want.store_offsets[0].tolist() == [-1] * 4
    for blk in (2, None):
        assert_prep_equal(run_prepare("triton", inputs, kw, block=blk), want)


if HAVE_HYPOTHESIS:

    @settings(max_examples=25, deadline=None)
    @given(
        seed=st.integers(0, 2**31 - 1),
        num_pools=st.integers(1, 3),
        B=st.integers(1, 6),
        M=st.integers(0, 50),
        backend=st.sampled_from(["python", "cpp"]),
        int64=st.booleans(),
        divisor=st.sampled_from([1, 2, 3]),
        block=st.sampled_from([4, 16, None]),
    )
    def test_decode_triton_hypothesis(seed, num_pools, B, M, backend, int64, divisor, block):
        gen = torch.Generator().manual_seed(seed)
        off, _ = make_offsets(gen, num_pools, B, M, backend=backend, dtype=torch.int64 if int64 else torch.int32)
        pool = seed % num_pools
        n = 1 + seed % B
        _check_decode(off, pool, n, divisor, backend, block=block)

    @settings(max_examples=30, deadline=None)
    @given(
        seed=st.integers(0, 2**31 - 1),
        B=st.integers(1, 6),
        M=st.integers(1, 48),
        P=st.sampled_from([1, 2, 4, 5, 32]),
        S=st.integers(1, 5),
        max_new=st.integers(0, 9),
        block_size=st.integers(1, 9),
        block=st.sampled_from([8, 16, None]),
    )
    def test_prepare_triton_hypothesis(seed, B, M, P, S, max_new, block_size, block):
        gen = torch.Generator().manual_seed(seed)
        inputs, kw = make_prepare_inputs(gen, B, M, P=P, num_slots=S, max_new=max_new, block_size=block_size)
        want = K.prepare_paged_latent_reference(*inputs, **kw)
        assert_prep_equal(run_prepare("triton", inputs, kw, block=block), want)
        # the rebase kernel agrees with the prepare kernel's read rows
        tables, extents, slot_ids, _, base, _ = inputs
        rb = K.rebase_block_table(tables, extents, base[slot_ids], out=poisoned_rebased(B, M), impl="triton", block=block)
        assert_same(rb.rows, want.read_rows, "rebase rows")
        assert_same(rb.shift, want.shift, "rebase shift")

    @settings(max_examples=60, deadline=None)
    @given(
        seed=st.integers(0, 2**31 - 1),
        B=st.integers(0, 12),
        M=st.integers(0, 80),
        P=st.sampled_from([1, 3, 4, 32]),
        S=st.integers(1, 6),
        max_new=st.integers(0, 9),
        block_size=st.integers(0, 9),
    )
    def test_eager_baseline_matches_reference_hypothesis(seed, B, M, P, S, max_new, block_size):
        gen = torch.Generator().manual_seed(seed)
        if B == 0 or M == 0:
            inputs = (
                torch.empty((B, M), dtype=torch.int32),
                torch.zeros(B, dtype=torch.int64),
                torch.zeros(B, dtype=torch.int64),
                torch.zeros(S, dtype=torch.int64),
                torch.zeros(S, dtype=torch.int64),
                torch.zeros(B, dtype=torch.int64),
            )
            kw = dict(block_size=block_size, tokens_per_block=P, max_ctx=7, max_new=max_new)
        else:
            inputs, kw = make_prepare_inputs(gen, B, M, P=P, num_slots=S, max_new=max_new, block_size=block_size)
        want = K.prepare_paged_latent_reference(*inputs, **kw)
        assert_prep_equal(eager_prepare_paged_latent(*inputs, **kw), want)
        out = poisoned_prep(B, M, block_size, max_new)
        assert eager_prepare_paged_latent(*inputs, **kw, out=out) is out
        assert_prep_equal(out, want)


@pytest.mark.parametrize("seed", range(4))
def test_eager_baseline_matches_reference(seed):
    gen = torch.Generator().manual_seed(5000 + seed)
    B, M = [(1, 1), (16, 130), (64, 300), (5, 7)][seed]
    inputs, kw = make_prepare_inputs(gen, B, M, P=[1, 32, 4, 3][seed], num_slots=4, max_new=8, block_size=8)
    want = K.prepare_paged_latent_reference(*inputs, **kw)
    assert_prep_equal(eager_prepare_paged_latent(*inputs, **kw), want)


def test_prepare_without_out_allocates():
    gen = torch.Generator().manual_seed(42)
    inputs, kw = make_prepare_inputs(gen, 4, 20, P=4, num_slots=2, max_new=3, block_size=4)
    want = K.prepare_paged_latent_reference(*inputs, **kw)
    assert_prep_equal(run_prepare("triton", inputs, kw, poison=False), want)
    assert_prep_equal(run_prepare(None, inputs, kw, poison=False), want)


# --------------------------------------------------------------------------- dispatch


def _small_prepare():
    gen = torch.Generator().manual_seed(99)
    return make_prepare_inputs(gen, 3, 10, P=4, num_slots=2, max_new=3, block_size=2)


def test_interpreted_kernel_really_runs(monkeypatch):
    """Under the suite (TRITON_INTERPRET=1) the default CPU path is the Triton kernel."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert K.HAVE_TRITON
    inputs, kw = _small_prepare()
    want = K.prepare_paged_latent_reference(*inputs, **kw)

    def boom(*a, **k):
        raise AssertionError("the torch reference ran instead of the Triton kernel")

    monkeypatch.setattr(api, "prepare_paged_latent_reference", boom)
    monkeypatch.setattr(api, "decode_draft_block_table_reference", boom)
    monkeypatch.setattr(api, "rebase_block_table_reference", boom)
    before = dict(K.LAUNCH_COUNTS)
    got = run_prepare(None, inputs, kw)
    assert_prep_equal(got, want)
    assert K.LAUNCH_COUNTS["prepare_paged_latent"] == before.get("prepare_paged_latent", 0) + 1

    off, _ = make_offsets(torch.Generator().manual_seed(1), 2, 3, 9)
    K.decode_draft_block_table(off, 1, 3, KV, "python")
    assert K.LAUNCH_COUNTS["decode_draft_block_table"] == before.get("decode_draft_block_table", 0) + 1
    t, e = inputs[0], inputs[1]
    K.rebase_block_table(t, e, torch.zeros(3, dtype=torch.int64))
    assert K.LAUNCH_COUNTS["rebase_block_table"] == before.get("rebase_block_table", 0) + 1


def test_dispatch_rules(monkeypatch):
    inputs, kw = _small_prepare()
    want = K.prepare_paged_latent_reference(*inputs, **kw)
    before = K.LAUNCH_COUNTS["prepare_paged_latent"]
    assert_prep_equal(run_prepare("reference", inputs, kw), want)
    assert K.LAUNCH_COUNTS["prepare_paged_latent"] == before
    # without TRITON_INTERPRET the CPU default is the torch reference
    monkeypatch.delenv("TRITON_INTERPRET")
    assert_prep_equal(run_prepare(None, inputs, kw), want)
    assert K.LAUNCH_COUNTS["prepare_paged_latent"] == before
    # ... but impl="triton" still runs the interpreter
    assert_prep_equal(run_prepare("triton", inputs, kw), want)
    assert K.LAUNCH_COUNTS["prepare_paged_latent"] == before + 1
    with pytest.raises(ValueError):
        K.prepare_paged_latent(*inputs, **kw, impl="cuda")


def test_argument_checks():
    inputs, kw = _small_prepare()
    B, M = inputs[0].shape
    bad = poisoned_prep(B, M, kw["block_size"], kw["max_new"])
    bad.read_rows = bad.read_rows.to(torch.int64)
    with pytest.raises(ValueError):
        K.prepare_paged_latent(*inputs, **kw, out=bad)
    bad = poisoned_prep(B, M, kw["block_size"] + 1, kw["max_new"])
    with pytest.raises(ValueError):
        K.prepare_paged_latent(*inputs, **kw, out=bad)
    with pytest.raises(TypeError):
        K.prepare_paged_latent(inputs[0].float(), *inputs[1:], **kw)
    with pytest.raises(ValueError):
        K.prepare_paged_latent(*inputs, **{**kw, "tokens_per_block": 0})
    off, _ = make_offsets(torch.Generator().manual_seed(1), 2, 3, 9)
    with pytest.raises(IndexError):
        K.decode_draft_block_table(off, 2, 3, KV)
    with pytest.raises(ValueError):
        K.decode_draft_block_table(off, 0, 4, KV)
    with pytest.raises(ValueError):
        K.decode_draft_block_table(off, 0, 3, KV, backend="rust")
    with pytest.raises(ValueError):
        K.decode_draft_block_table(off, 0, 3, KV, block=12)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["python", "cpp"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_decode_cuda_matches_reference(backend, dtype):
    gen = torch.Generator().manual_seed(6000)
    for num_pools, B, M, pool in [(3, 33, 700, 2), (2, 8, 16384, 1), (1, 1024, 2048, 0), (3, 5, 1, 1)]:
        off, _ = make_offsets(gen, num_pools, B, M, backend=backend, dtype=dtype, garbage_v=True)
        off = off.cuda()
        _check_decode(off, pool, B, KV, backend, block=None, device="cuda")
        _check_decode(off, pool, max(1, B - 3), 1, backend, block=256, device="cuda")


def _big_prepare_inputs(gen, B, M, device, **over):
    """Large random inputs built with vectorised ops (the list-based builder is slow)."""
    P = over.get("P", 32)
    tables = torch.randint(0, 2**30, (B, M), generator=gen, dtype=torch.int32)
    lo = torch.randint(0, M + 1, (B,), generator=gen)
    hi = torch.minimum(lo + torch.randint(0, M + 1, (B,), generator=gen), torch.tensor(M))
    cols = torch.arange(M)
    tables[(cols[None] < lo[:, None]) | (cols[None] >= hi[:, None])] = -1
    extents = torch.where(hi > lo, hi, 0)
    S = over.get("S", max(1, B // 2))
    base = torch.randint(0, M + 2, (S,), generator=gen)
    ctx = base * P + torch.randint(0, 4 * P, (S,), generator=gen)
    slot_ids = torch.randint(0, S, (B,), generator=gen)
    slot_ids[: B // 4] = 0
    max_new = over.get("max_new", 8)
    num_new = torch.randint(0, max_new + 1, (B,), generator=gen)
    kw = dict(block_size=over.get("block_size", 8), tokens_per_block=P, max_ctx=int(M * P * 0.9), max_new=max_new)
    inputs = tuple(x.to(device) for x in (tables, extents, slot_ids, ctx, base, num_new))
    return inputs, kw


@pytest.mark.cuda
def test_prepare_and_rebase_cuda_match_reference():
    gen = torch.Generator().manual_seed(7000)
    for B, M in [(1, 128), (8, 2048), (64, 16384), (1024, 2048), (256, 16384), (3, 1)]:
        for blk in (None, 1024):
            inputs, kw = _big_prepare_inputs(gen, B, M, "cuda")
            want = K.prepare_paged_latent_reference(*inputs, **kw)
            assert_prep_equal(run_prepare(None, inputs, kw, block=blk), want)
            tables, extents, slot_ids, _, base, _ = inputs
            rb = K.rebase_block_table(tables, extents, base[slot_ids], out=poisoned_rebased(B, M, "cuda"), block=blk)
            assert_same(rb.rows, want.read_rows, "rebase rows")
            assert_same(rb.extents, extents.clamp(0, M) - want.shift, "rebase extents")
            assert_same(eager_prepare_paged_latent(*inputs, **kw).read_rows, want.read_rows, "eager")
    # the small edge generator too
    for case in PREP_CASES:
        B, M, P, S, max_new, bs, tdt, vdt, blk, strided = case
        inputs, kw = make_prepare_inputs(
            gen, B, M, P=P, num_slots=S, max_new=max_new, block_size=bs, table_dtype=tdt, vec_dtype=vdt,
            device="cuda", strided=strided,
        )
        assert_prep_equal(run_prepare(None, inputs, kw, block=blk), K.prepare_paged_latent_reference(*inputs, **kw))


@pytest.mark.cuda
def test_prepare_cuda_graph_capture_and_replay():
    gen = torch.Generator().manual_seed(8000)
    B, M = 64, 700
    static, kw = _big_prepare_inputs(gen, B, M, "cuda", S=20)
    out = K.PagedLatentPrep.empty(B, M, kw["block_size"], kw["max_new"], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile + warm up outside the capture
        K.prepare_paged_latent(*static, **kw, out=out)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    before = K.LAUNCH_COUNTS["prepare_paged_latent"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.prepare_paged_latent(*static, **kw, out=out)
    assert K.LAUNCH_COUNTS["prepare_paged_latent"] == before + 1
    for trial in range(4):
        fresh, _ = _big_prepare_inputs(gen, B, M, "cpu", S=20)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        for t in out.tensors().values():
            t.fill_(POISON32 if t.dtype == torch.int32 else POISON64)
        graph.replay()
        torch.cuda.synchronize()
        assert_prep_equal(out, K.prepare_paged_latent_reference(*static, **kw))


@pytest.mark.cuda
def test_prepare_is_one_kernel_launch_cuda():
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(9000)
    inputs, kw = _big_prepare_inputs(gen, 256, 2048, "cuda")
    out = K.PagedLatentPrep.empty(256, 2048, kw["block_size"], kw["max_new"], device="cuda")
    K.prepare_paged_latent(*inputs, **kw, out=out)
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            K.prepare_paged_latent(*inputs, **kw, out=out)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    except RuntimeError as exc:  # pragma: no cover - depends on CUPTI
        pytest.skip(f"profiler unavailable: {exc}")
    if not kernels:
        pytest.skip("profiler recorded no CUDA activity (CUPTI unavailable)")
    assert len(kernels) == 1, kernels
