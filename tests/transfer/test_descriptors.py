"""Descriptor building from page ids (numpy, runs merged) and region registration, CUDA pools included.

No engine and no GPU: CUDA pool layers are stand-ins with a tensor's attributes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tensorrt_llm_draftkv.transfer import (MemoryType, PoolRegion, RankMemory, TransferRequest, layer_region,
                                           page_runs, page_write_descs, pool_regions, slot_descs)
from tensorrt_llm_draftkv.transfer.agent import MemoryDescs


def _region(base: int, pages: int = 100, page_bytes: int = 256, stride: int | None = None, **kw) -> PoolRegion:
    return PoolRegion(base, pages, page_bytes, stride or page_bytes, 32, **kw)


def test_runs_merge_only_where_both_sides_step_by_one():
    s0, d0, n = page_runs([4, 5, 6, 9, 10, 11, 3], [7, 8, 9, 1, 2, 20, 21])
    assert s0.tolist() == [4, 9, 11, 3] and d0.tolist() == [7, 1, 20, 21] and n.tolist() == [3, 2, 1, 1]


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), max_size=40))
def test_runs_expand_back_to_the_pages(pairs):
    src = np.array([p[0] for p in pairs], dtype=np.int64)
    dst = np.array([p[1] for p in pairs], dtype=np.int64)
    s0, d0, n = page_runs(src, dst)
    assert n.sum() == len(pairs) and (n >= 1).all()
    assert np.concatenate([np.arange(a, a + c) for a, c in zip(s0, n)] or [[]]).tolist() == src.tolist()
    assert np.concatenate([np.arange(a, a + c) for a, c in zip(d0, n)] or [[]]).tolist() == dst.tolist()
    # maximal: two neighbouring runs could not have been one
    joinable = (s0[:-1] + n[:-1] == s0[1:]) & (d0[:-1] + n[:-1] == d0[1:])
    assert not joinable.any()


def test_write_descriptors_per_layer_with_addresses_and_lengths():
    src = [_region(0x1000), _region(0x100000)]
    dst = [_region(0x9000, device_id=3), _region(0x900000, device_id=3)]
    s, d = page_write_descs(src, [2, 3, 7], dst, [10, 11, 0])
    assert s.tolist() == [[0x1000 + 2 * 256, 512, 0], [0x1000 + 7 * 256, 256, 0],
                          [0x100000 + 2 * 256, 512, 0], [0x100000 + 7 * 256, 256, 0]]
    assert d.tolist() == [[0x9000 + 10 * 256, 512, 3], [0x9000, 256, 3],
                          [0x900000 + 10 * 256, 512, 3], [0x900000, 256, 3]]
    TransferRequest("WRITE", MemoryDescs("DRAM", s), MemoryDescs("VRAM", d), "peer", b"req:1")  # pairs up


def test_pages_with_gaps_between_them_are_one_descriptor_each():
    src, dst = [_region(0, stride=512)], [_region(1 << 20)]
    s, d = page_write_descs(src, [2, 3], dst, [4, 5])
    assert s.tolist() == [[1024, 256, 0], [1536, 256, 0]] and d.tolist() == [[(1 << 20) + 1024, 256, 0],
                                                                            [(1 << 20) + 1280, 256, 0]]


@pytest.mark.parametrize(
    "src_pages, dst_pages, dst_kw, match",
    [
        ([1, 2], [3], {}, "2 source pages for 1 destination pages"),
        ([1, 100], [3, 4], {}, "source page 100"),
        ([1, 2], [3, -1], {}, "destination page -1"),
        ([1], [3], {"page_bytes": 128}, "page sizes differ"),
    ],
)
def test_bad_pages_are_refused_naming_the_request_and_numbers(src_pages, dst_pages, dst_kw, match):
    with pytest.raises(ValueError, match=match) as err:
        page_write_descs([_region(0)], src_pages, [_region(1 << 20, **dst_kw)], dst_pages, what="request 7")
    assert "request 7" in str(err.value)


def test_slot_descriptor_and_its_bounds():
    aux = PoolRegion(0x5000, 4, 1024, 1024, 1)
    assert slot_descs(aux, 2, 100).tolist() == [[0x5000 + 2048, 100, 0]]
    with pytest.raises(ValueError, match="slot 4 outside"):
        slot_descs(aux, 4, 10)
    with pytest.raises(ValueError, match="2000 bytes do not fit"):
        slot_descs(aux, 0, 2000)


@dataclass
class FakeCudaLayer:
    """A CUDA pool layer as far as registration reads it (no GPU here)."""

    ptr: int
    shape: tuple[int, ...]
    device: torch.device
    contiguous: bool = True

    def data_ptr(self) -> int:
        return self.ptr

    def element_size(self) -> int:
        return 2  # bf16

    def stride(self, dim: int) -> int:
        return int(np.prod(self.shape[dim + 1 :]))

    def is_contiguous(self) -> bool:
        return self.contiguous


def test_cuda_pool_layers_register_as_device_memory_on_their_device():
    layers = [FakeCudaLayer(0x7F0000000000 + i * (1 << 30), (1000, 2, 8, 32, 128), torch.device("cuda", 1))
              for i in range(2)]
    regions = pool_regions(layers, 32)
    assert all(r.mem_type == MemoryType.VRAM and r.device_id == 1 for r in regions)
    assert regions[0].page_bytes == regions[0].stride == 2 * 8 * 32 * 128 * 2
    memory = RankMemory((regions,), (), PoolRegion(0x1000, 1, 4096, 4096, 1))
    kinds = {d.type: d.descs.tolist() for d in memory.memory_descs()}
    assert kinds[MemoryType.VRAM] == [[layers[0].ptr, 1000 * regions[0].page_bytes, 1],
                                      [layers[1].ptr, 1000 * regions[0].page_bytes, 1]]
    assert kinds[MemoryType.DRAM] == [[0x1000, 4096, 0]]
    s, d = page_write_descs(regions, [5, 6], regions, [0, 1])
    assert d.tolist()[0] == [layers[0].ptr, 2 * regions[0].page_bytes, 1]
    with pytest.raises(ValueError, match="contiguous"):
        layer_region(FakeCudaLayer(0, (4, 8), torch.device("cuda", 0), contiguous=False), 32)


def test_host_pool_layer_and_rank_memory_round_trip_through_ints():
    t = torch.zeros(10, 2, 1, 4, 16)
    r = layer_region(t, 4)
    assert (r.base, r.num_pages, r.page_bytes, r.stride, r.mem_type) == (t.data_ptr(), 10, 512, 512, "DRAM")
    memory = RankMemory(((r, r), (r,)), ((r,),), PoolRegion(7, 2, 64, 64, 1))
    assert RankMemory.from_wire(memory.to_wire()) == memory


def test_unpaired_descriptors_are_refused():
    a = MemoryDescs("DRAM", np.array([[0, 256, 0]]))
    b = MemoryDescs("DRAM", np.array([[0, 128, 0]]))
    with pytest.raises(ValueError, match="do not pair up"):
        TransferRequest("WRITE", a, b, "peer", b"req:3")
    with pytest.raises(ValueError, match="length 0"):
        MemoryDescs("DRAM", np.array([[0, 0, 0]]))


def _python_calls(fn) -> int:
    """Python-level function calls (and C calls made from Python) while `fn` runs."""
    import sys

    count = 0

    def tally(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(tally)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


@pytest.mark.parametrize("scattered", [False, True])
def test_a_requests_descriptors_cost_the_same_python_at_any_page_count(scattered):
    """One request's WRITE (two layers of pages, then its auxiliary slot) runs the same number of Python calls
    for 8 pages as for 2,048: the page count reaches only numpy, never a Python loop."""
    src, dst = [_region(0x1000, pages=5000), _region(0x900000, pages=5000)], [_region(0x9000, pages=5000),
                                                                               _region(0xF00000, pages=5000)]
    aux_src, aux_dst = _region(0x77000, pages=4), _region(0x88000, pages=4)
    rng = np.random.default_rng(3)

    def pages(n: int) -> tuple[np.ndarray, np.ndarray]:  # drawn outside the counted calls
        if scattered:
            return rng.choice(5000, n, replace=False), rng.choice(5000, n, replace=False)
        return np.arange(100, 100 + n), np.arange(900, 900 + n)

    def build(ours: np.ndarray, theirs: np.ndarray):
        s, d = page_write_descs(src, ours, dst, theirs)
        return np.concatenate([s, slot_descs(aux_src, 1, 64)]), np.concatenate([d, slot_descs(aux_dst, 2, 64)])

    build(*pages(3))  # the regions' per-layer arrays are worked out once (cached)
    few, many = pages(8), pages(2048)
    small, large = _python_calls(lambda: build(*few)), _python_calls(lambda: build(*many))
    assert small == large
    s, _ = build(*many)
    assert len(s) == (2 * 2048 + 1 if scattered else 2 + 1)  # and the pages really were there
