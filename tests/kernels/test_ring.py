"""The ring form of `prepare_paged_latent`: the step read straight from a device block table.

Oracle: the two-step reference on each row's absolute `"python"` table (what decoding
the row's export gives), built here from the same random rows. Rings hold random
garbage outside every live span (a kernel that reads past a span returns it), spans
hold released (-1) holes, batch rows pick table rows in any order, outputs are poisoned.
Both the torch reference of the ring form and its Triton kernel (interpreted on CPU,
compiled on CUDA) must equal the oracle, windowed or not.
"""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm_draftkv.kernels import (
    PagedLatentPrep,
    prepare_paged_latent,
    prepare_paged_latent_reference,
    prepare_paged_latent_ring_reference,
)

P, BS, MAX_NEW = 8, 5, 6


def random_step(seed: int, *, R: int = 7, B: int = 5, C: int = 12, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    ri = lambda lo, hi, n=(): torch.randint(lo, hi, n, generator=g)  # noqa: E731
    first = ri(0, 40, (R,))
    span = ri(0, C + 1, (R,))
    ext = first + span
    M = int(ext.max()) + 3
    absolute = torch.full((R, M), -1, dtype=torch.int32)
    ring = ri(1000, 2000, (R, C)).to(torch.int32)  # garbage outside every span
    for r in range(R):
        for o in range(int(first[r]), int(ext[r])):
            page = int(ri(0, 500)) if (o in (int(first[r]), int(ext[r]) - 1) or float(torch.rand((), generator=g)) > 0.2) else -1
            absolute[r, o] = page
            ring[r, o % C] = page
        if span[r] == 0:
            first[r] = int(ri(0, 40))  # an empty row: first is its length, extent 0
            ext[r] = 0
    rows = torch.randperm(R, generator=g)[:B]
    num_slots = B + 2
    slot_ids = torch.randperm(num_slots, generator=g)[:B]
    L = ri(0, (M + 2) * P, (num_slots,))
    base = (L // P - ri(0, 20, (num_slots,))).clamp_min(0)
    n = ri(0, MAX_NEW + 1, (B,))
    dev = torch.device(device)
    ring_args = [t.to(dev) for t in (ring, ext, rows, first, slot_ids, L, base, n)]
    oracle_tables = absolute[rows].to(dev)
    oracle_ext = ext[rows].to(dev)
    return ring_args, (oracle_tables, oracle_ext, *ring_args[4:]), M


def poisoned(B: int, width: int, device) -> PagedLatentPrep:
    out = PagedLatentPrep.empty(B, width, BS, MAX_NEW, device=device)
    for t in out.tensors().values():
        t.copy_(torch.randint(-7, 9999, t.shape, dtype=t.dtype))
    return out


def _widen(rows: torch.Tensor, width: int) -> torch.Tensor:
    if rows.shape[1] >= width:
        return rows[:, :width]
    pad = torch.full((rows.shape[0], width - rows.shape[1]), -1, dtype=rows.dtype, device=rows.device)
    return torch.cat([rows, pad], 1)


def check_equal(got: PagedLatentPrep, want: PagedLatentPrep, width: int) -> None:
    assert torch.equal(got.read_rows.cpu(), _widen(want.read_rows, width).cpu())
    for name in ("read_lens", "query_pos", "store_pages", "store_offsets", "new_ctx_len", "shift"):
        assert torch.equal(getattr(got, name).cpu().to(torch.int64), getattr(want, name).cpu().to(torch.int64)), name


def run_case(seed: int, window, impl, device: str = "cpu", max_ctx: int | None = None) -> None:
    ring_args, oracle_args, M = random_step(seed, device=device)
    C = ring_args[0].shape[1]
    max_ctx = max_ctx if max_ctx is not None else 10_000
    kw = dict(block_size=BS, tokens_per_block=P, max_ctx=max_ctx, max_new=MAX_NEW, read_window=window)
    want = prepare_paged_latent_reference(*oracle_args, **kw)
    width = (-(-window // P) + 1) if window is not None else C
    ring, ext, rows, first, *vectors = ring_args
    out = poisoned(rows.shape[0], width, device)
    got = prepare_paged_latent(ring, ext, *vectors, table_rows=rows, table_first=first, out=out, impl=impl, **kw)
    check_equal(got, want, width)
    ref = prepare_paged_latent_ring_reference(*ring_args, **kw)
    check_equal(ref, want, width)


@pytest.mark.parametrize("window", [None, 16, 40, 120])
@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("seed", range(8))
def test_ring_form_equals_the_two_step_form_on_the_decoded_rows(seed, impl, window):
    """Window 120 reads 16 columns, wider than the ring's 12."""
    run_case(seed, window, impl)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_ring_form_clamps_stores_at_max_ctx(impl):
    for seed in range(4):
        run_case(100 + seed, 24, impl, max_ctx=60)


@pytest.mark.parametrize("block", [2, 4, 16])
def test_ring_form_split_over_programs(block):
    """A read row split over several programs (6 columns in blocks of 2 and 4): chunk 0 alone writes
    the row's scalars and store targets, every chunk its own columns."""
    for seed in range(6):
        ring_args, oracle_args, _ = random_step(200 + seed)
        kw = dict(block_size=BS, tokens_per_block=P, max_ctx=10_000, max_new=MAX_NEW, read_window=40)
        want = prepare_paged_latent_reference(*oracle_args, **kw)
        ring, ext, rows, first, *vectors = ring_args
        out = poisoned(rows.shape[0], 6, "cpu")
        got = prepare_paged_latent(ring, ext, *vectors, table_rows=rows, table_first=first, out=out, impl="triton",
                                   block=block, **kw)
        check_equal(got, want, 6)


def test_ring_form_refuses_bad_arguments_before_writing():
    ring_args, _, _ = random_step(0)
    ring, ext, rows, first, *vectors = ring_args
    kw = dict(block_size=BS, tokens_per_block=P, max_ctx=100, max_new=MAX_NEW)
    out = poisoned(rows.shape[0], ring.shape[1], "cpu")
    before = {k: v.clone() for k, v in out.tensors().items()}
    with pytest.raises(ValueError, match="table_first"):
        prepare_paged_latent(ring, ext, *vectors, table_rows=rows, table_first=first[:-1], out=out, **kw)
    with pytest.raises(ValueError, match="table_rows"):
        prepare_paged_latent(ring, ext, *vectors, table_rows=rows[:-1], table_first=first, out=out, **kw)
    with pytest.raises(ValueError, match="ring form"):
        prepare_paged_latent(ring, ext, *vectors, table_rows=rows, out=out, **kw)
    with pytest.raises(ValueError, match="one column"):
        prepare_paged_latent(ring[:, :0], ext, *vectors, table_rows=rows, table_first=first, out=out, **kw)
    assert all(torch.equal(before[k], v) for k, v in out.tensors().items())


@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 16, 120])
@pytest.mark.parametrize("seed", range(4))
def test_ring_form_on_cuda(seed, window):
    run_case(seed, window, None, device="cuda")


def test_ring_launch_size_on_a_gpu_is_one_column_per_thread():
    """Compiled: at most `RING_BLOCK` columns a program, a warp per 32 of them (the sizing the H100
    replays timed fastest); interpreted: the generic big block; a caller's sizes are kept."""
    from tensorrt_llm_draftkv.kernels.spec_tail_kernels import RING_BLOCK, ring_launch_size

    for B in (1, 8, 64, 256, 4096):
        for out_w in (3, 33, 129, 257, 1025):
            blk, warps = ring_launch_size(B, out_w, None, None, True)
            assert blk <= RING_BLOCK and blk & (blk - 1) == 0, (B, out_w, blk)
            assert warps == max(1, blk // 32), (B, out_w, blk, warps)
            assert ring_launch_size(B, out_w, None, None, False)[0] >= min(blk, out_w)
    assert ring_launch_size(64, 129, None, None, True) == (128, 4)
    assert ring_launch_size(64, 129, 256, None, True) == (256, 8)
    assert ring_launch_size(64, 129, None, 2, True) == (128, 2)
