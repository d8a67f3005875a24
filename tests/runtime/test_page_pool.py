"""PagePool: real storage, a free list, exact accounting, the guard page."""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm_draftkv.runtime import OutOfPagesError, PagePool


def pool_state(pool: PagePool):
    return (pool.free_order(), pool.held_pages())


def test_storage_is_real_and_shaped_per_layer():
    pool = PagePool(6, tokens_per_block=4, num_layers=3, kv_factor=2, num_kv_heads=2, head_dim=5, dtype=torch.bfloat16)
    assert len(pool.layers) == 3
    for layer in pool.layers:
        assert layer.shape == (6, 2, 2, 4, 5)
        assert layer.dtype == torch.bfloat16
        assert layer.device.type == "cpu"
    # layers are distinct tensors, not views of one another
    pool.layers[0][2].fill_(7)
    assert torch.all(pool.layers[1] == 0) and torch.all(pool.layers[2] == 0)
    assert pool.layers[0].data_ptr() != pool.layers[1].data_ptr()


def test_allocate_release_accounting():
    pool = PagePool(5, tokens_per_block=2)
    assert (pool.total, pool.num_free, pool.num_held) == (5, 5, 0)
    a = pool.allocate(2)
    assert len(set(a)) == 2 and all(0 <= p < 5 for p in a)
    assert all(pool.is_held(p) for p in a)
    b = pool.allocate(3)
    assert set(a).isdisjoint(b)
    assert (pool.num_free, pool.num_held) == (0, 5)
    pool.check_accounting()
    pool.release([a[1]])
    assert not pool.is_held(a[1])
    assert (pool.num_free, pool.num_held) == (1, 4)
    pool.check_accounting()
    # the freed page is handed out again
    assert pool.allocate(1) == [a[1]]
    pool.release(a + b)
    assert (pool.num_free, pool.num_held) == (5, 0)
    pool.check_accounting()


def test_allocate_zero_is_a_no_op():
    pool = PagePool(3, tokens_per_block=2)
    before = pool_state(pool)
    assert pool.allocate(0) == []
    assert pool_state(pool) == before


def test_out_of_pages_is_all_or_none_and_names_numbers():
    pool = PagePool(4, tokens_per_block=2)
    pool.allocate(3)
    before = pool_state(pool)
    with pytest.raises(OutOfPagesError, match=r"asked for 2 pages, 1 free of 4"):
        pool.allocate(2)
    assert pool_state(pool) == before
    pool.check_accounting()


@pytest.mark.parametrize("bad", [[99], [-1]])
def test_release_of_unheld_page_rejected_unchanged(bad):
    pool = PagePool(4, tokens_per_block=2)
    held = pool.allocate(2)
    before = pool_state(pool)
    with pytest.raises(ValueError, match=str(bad[0])):
        pool.release([held[0], *bad])
    assert pool_state(pool) == before


def test_double_release_rejected_unchanged():
    pool = PagePool(4, tokens_per_block=2)
    (page,) = pool.allocate(1)
    pool.release([page])
    before = pool_state(pool)
    with pytest.raises(ValueError, match=str(page)):
        pool.release([page])
    assert pool_state(pool) == before
    # repeated within one call
    (page,) = pool.allocate(1)
    before = pool_state(pool)
    with pytest.raises(ValueError):
        pool.release([page, page])
    assert pool_state(pool) == before


def test_guard_page_never_handed_out_and_not_counted():
    pool = PagePool(3, tokens_per_block=4, num_layers=2, guard_page=True)
    assert pool.total == 3
    assert pool.guard_page_index == 3
    assert all(layer.shape[0] == 4 for layer in pool.layers)  # physical page exists
    pages = pool.allocate(3)
    assert sorted(pages) == [0, 1, 2]
    assert pool.num_free == 0
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)
    pool.release(pages)
    pool.check_accounting()
    assert pool.guard_page_index not in pool.free_order()
    with pytest.raises(ValueError):
        pool.release([pool.guard_page_index])


def test_no_guard_page_by_default():
    pool = PagePool(3, tokens_per_block=4)
    assert pool.guard_page_index is None
    assert pool.layers[0].shape[0] == 3


def test_check_accounting_detects_corruption():
    pool = PagePool(4, tokens_per_block=2)
    pages = pool.allocate(2)
    pool._sets.free.append(pages[0])  # corrupt on purpose: a page both held and free
    with pytest.raises(AssertionError, match="held=2"):
        pool.check_accounting()


def test_empty_pool_is_valid():
    pool = PagePool(0, tokens_per_block=4)
    assert pool.total == 0 and pool.allocate(0) == []
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)
    pool.check_accounting()


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(num_pages=-1, tokens_per_block=4), "num_pages=-1"),
        (dict(num_pages=-7, tokens_per_block=4), "num_pages=-7"),
        (dict(num_pages=4, tokens_per_block=0), "got 0"),
        (dict(num_pages=4, tokens_per_block=-2), "got -2"),
        (dict(num_pages=4, tokens_per_block=4, num_layers=0), "num_layers=0"),
    ],
)
def test_bad_construction_names_numbers(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        PagePool(**kwargs)


def test_negative_allocate_rejected():
    pool = PagePool(4, tokens_per_block=2)
    before = pool_state(pool)
    with pytest.raises(ValueError, match="-1"):
        pool.allocate(-1)
    assert pool_state(pool) == before
