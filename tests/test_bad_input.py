"""Bad input raises an explicit error that names the offending numbers / request id,
and leaves every cache and every pool exactly as it was (invariant 4 of docs/design.md)."""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm_draftkv import (
    KVPoolConfig,
    KVCacheManagerV2,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    ScheduledRequests,
)
from tensorrt_llm_draftkv.runtime import KVCache, LayerGroup, LifeCycle, PagePool


def make_mgr(pages=(32, 32), p=4):
    config = KVPoolConfig(
        layer_groups=(LayerGroupConfig(1, window=6), LayerGroupConfig(1)),
        pages_per_group=pages,
        tokens_per_block=p,
        max_seq_len=128,
    )
    return KVCacheManagerV2.from_pool_config(config, max_draft_len=2)


def live_mgr():
    """A manager with two requests mid-flight (one in generation, one mid-prefill)."""
    mgr = make_mgr()
    gen = LlmRequest(1, prompt_len=20)
    mgr.prepare_resources(ScheduledRequests(context_requests=[gen]))
    gen.advance_context_chunk()
    mgr.update_context_resources(ScheduledRequests(context_requests=[gen]))
    gen.state = LlmRequestState.GENERATION_IN_PROGRESS
    gen.tokens.append(0)
    mgr.update_resources(ScheduledRequests(generation_requests=[gen]))
    mgr.prepare_resources(ScheduledRequests(generation_requests=[gen]))
    ctx = LlmRequest(2, prompt_len=30)
    ctx.target_view.chunk_size = 8
    mgr.prepare_resources(ScheduledRequests(context_requests=[ctx]))
    return mgr, gen, ctx


def full_state(mgr):
    """Everything observable: ids, every cache snapshot, every free list in order, held sets, storage."""
    return (
        mgr.request_ids(),
        {rid: mgr.get_cache(rid).checkpoint() for rid in mgr.request_ids()},
        [(pool.free_order(), pool.held_pages(), pool.total) for pool in mgr.pools()],
        [[layer.clone() for layer in pool.layers] for pool in mgr.pools()],
    )


def assert_same(a, b):
    assert a[:3] == b[:3]
    for pa, pb in zip(a[3], b[3]):
        for la, lb in zip(pa, pb):
            assert torch.equal(la, lb)


# -- non-positive tokens per block -----------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0, -1, -32])
def test_non_positive_tokens_per_block(p):
    with pytest.raises(ValueError, match=rf"tokens_per_block must be >= 1, got {p}\b"):
        KVPoolConfig(layer_groups=(LayerGroupConfig(1),), pages_per_group=(4,), tokens_per_block=p)
    with pytest.raises(ValueError, match=rf"got {p}\b"):
        PagePool(4, tokens_per_block=p)
    with pytest.raises(ValueError, match=rf"got {p}\b"):
        KVCache([LayerGroup(LifeCycle(None), PagePool(4, tokens_per_block=4))], p)
    with pytest.raises(ValueError, match=rf"got {p}\b"):
        LifeCycle(8).stale_range(10, p)


# -- negative capacity ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [-1, -100])
def test_negative_capacity(capacity):
    mgr, gen, ctx = live_mgr()
    before = full_state(mgr)
    # a fresh cache has history 0, so the only complaint is the negative capacity
    fresh = KVCache(mgr.layer_groups, mgr.tokens_per_block, name="fresh")
    with pytest.raises(ValueError, match=rf"capacity must be >= 0 tokens, got {capacity}\b"):
        fresh.resize(capacity)
    with pytest.raises(ValueError, match=rf"{capacity}\b"):
        mgr.get_cache(2).resize(capacity)
    assert_same(full_state(mgr), before)
    mgr.check_accounting()


def test_generation_request_whose_capacity_falls_below_history():
    """A request that lost tokens would shrink capacity below its history: ValueError, nothing changes."""
    mgr, gen, ctx = live_mgr()
    history = mgr.get_cache(1).history_length
    del gen.tokens[-10:]  # 11 tokens: capacity 10 + 1 + 2 drafts = 13
    before = full_state(mgr)
    with pytest.raises(ValueError, match=rf"capacity 13 is below history length {history}"):
        mgr.prepare_resources(ScheduledRequests(generation_requests=[gen]))
    assert_same(full_state(mgr), before)


# -- windows and sinks --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [0, -1, -4096])
def test_window_below_one(window):
    with pytest.raises(ValueError, match=rf"window={window}\b"):
        LayerGroupConfig(2, window=window)
    with pytest.raises(ValueError, match=rf"window={window}\b"):
        LifeCycle(window)


def test_negative_sinks_and_layers():
    with pytest.raises(ValueError, match=r"sink_blocks must be >= 0, got -1"):
        LayerGroupConfig(2, window=8, sink_blocks=-1)
    with pytest.raises(ValueError, match=r"num_layers=0"):
        LayerGroupConfig(0)


# -- pool sizes ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pages", [-1, -12])
def test_negative_pool_size(pages):
    with pytest.raises(ValueError, match=rf"layer group 1: pool size must be >= 0 pages, got {pages}\b"):
        KVPoolConfig(layer_groups=(LayerGroupConfig(1), LayerGroupConfig(1, window=4)), pages_per_group=(4, pages))
    with pytest.raises(ValueError, match=rf"num_pages={pages}\b"):
        PagePool(pages, tokens_per_block=4)


def test_config_shape_errors():
    with pytest.raises(ValueError, match=r"pages_per_group has 1 entries for 2 layer groups"):
        KVPoolConfig(layer_groups=(LayerGroupConfig(1), LayerGroupConfig(1)), pages_per_group=(4,))
    with pytest.raises(ValueError, match="at least one layer group"):
        KVPoolConfig(layer_groups=(), pages_per_group=())
    with pytest.raises(ValueError, match=r"num_kv_heads must be >= 1, got 0"):
        KVPoolConfig(layer_groups=(LayerGroupConfig(1),), pages_per_group=(4,), num_kv_heads=0)


# -- unknown request ids -------------------------------------------------------------------------------------------
def test_unknown_request_id_free():
    mgr, gen, ctx = live_mgr()
    before = full_state(mgr)
    with pytest.raises(KeyError, match=r"cannot free request 4242"):
        mgr.free_resources(4242)
    with pytest.raises(KeyError, match=r"cannot free request 77: .*; nothing was freed"):
        mgr.free_resources([1, 77])  # a list of ids is strict, all or nothing
    assert_same(full_state(mgr), before)
    # A request object, as upstream: the draft manager sees requests it never mirrored, so freeing
    # one that holds nothing here is a no-op (and the others keep their pages).
    mgr.free_resources(LlmRequest(77, prompt_len=3))
    assert_same(full_state(mgr), before)


def test_unknown_request_id_get_cache():
    mgr, gen, ctx = live_mgr()
    before = full_state(mgr)
    with pytest.raises(KeyError, match=r"request 4242 has no cache") as info:
        mgr.get_cache(4242)
    assert "[1, 2]" in str(info.value)  # the live requests are listed
    assert_same(full_state(mgr), before)


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_unknown_request_id_get_block_offsets(backend):
    mgr, gen, ctx = live_mgr()
    before = full_state(mgr)
    with pytest.raises(KeyError, match=r"request 4242"):
        mgr.get_block_offsets([1, 4242, 2], backend=backend)
    assert_same(full_state(mgr), before)


def test_updates_skip_a_request_without_a_cache_as_upstream_does():
    mgr, gen, ctx = live_mgr()
    stranger = LlmRequest(99, prompt_len=8)
    before = full_state(mgr)
    mgr.update_context_resources(ScheduledRequests(context_requests=[stranger]))
    stranger.tokens.append(5)  # a generated token: update_resources would size it, had it a cache
    mgr.update_resources(ScheduledRequests(generation_requests=[stranger]))
    assert_same(full_state(mgr), before)
    assert not mgr.has_cache(99)


# -- double free ----------------------------------------------------------------------------------------------------
def test_double_free():
    mgr, gen, ctx = live_mgr()
    mgr.free_resources(gen)
    mgr.check_accounting()
    before = full_state(mgr)
    with pytest.raises(KeyError, match=r"cannot free request 1: it holds no cache \(never added, or already freed\)"):
        mgr.free_resources(gen.py_request_id)  # by id: strict
    assert_same(full_state(mgr), before)
    mgr.free_resources(gen)  # the request object again: upstream's no-op, nothing freed twice
    assert_same(full_state(mgr), before)


def test_double_free_of_a_cache():
    pool = PagePool(8, tokens_per_block=4)
    cache = KVCache([LayerGroup(LifeCycle(None), pool)], 4, name="request 5")
    cache.resize(12)
    cache.free()
    free = pool.free_order()
    with pytest.raises(ValueError, match=r"'request 5' was already freed"):
        cache.free()
    assert pool.free_order() == free and pool.num_held == 0


# -- dummies and requests ------------------------------------------------------------------------------------------
def test_dummy_and_request_errors_name_numbers():
    mgr, gen, ctx = live_mgr()
    before = full_state(mgr)
    with pytest.raises(ValueError, match=r"dummy request 9: token count must be >= 1, got -3"):
        mgr.add_dummy_requests([9], [-3])
    with pytest.raises(ValueError, match=r"dummy request 2 already has a cache"):
        mgr.add_dummy_requests([2])
    assert_same(full_state(mgr), before)
    with pytest.raises(ValueError, match=r"request 6: prompt_len must be >= 0, got -2"):
        LlmRequest(6, prompt_len=-2)
