"""Upstream's method signatures, accessors and the V2 scheduler's contract, on real pool tensors.

Requests here are objects of the test's own (`UpstreamRequest`) carrying only upstream
LlmRequest's attributes, so the managers are shown to read nothing else.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from tensorrt_llm_draftkv import BAD_PAGE_INDEX, KVCacheManagerV2, LlmRequestState, ScheduledRequests
from tensorrt_llm_draftkv import request_context
from tensorrt_llm_draftkv.bindings import CacheType, DataType
from tensorrt_llm_draftkv.config import KVPoolConfig, LayerGroupConfig
from tensorrt_llm_draftkv.llmapi import DFlashDecodingConfig, KvCacheConfig, MTPDecodingConfig
from tensorrt_llm_draftkv.manager import KVCacheResizeError, MissingKVCacheError
from tensorrt_llm_draftkv.mapping import Mapping
from support import UpstreamRequest

E = inspect.Parameter.empty


def request(rid: int, prompt: int, chunk: int | None = None) -> UpstreamRequest:
    return UpstreamRequest(rid, prompt, list(range(100 + rid, 100 + rid + prompt)), 0, chunk or prompt)


P = 8


def target(pages: tuple[int, int] = (64, 64), max_util_for_resume: float = 0.95) -> KVCacheManagerV2:
    """A hybrid target: layers 0, 2 on a 32-token window, 1, 3 full; drafts of 3."""
    cfg = KvCacheConfig(max_tokens=pages[1] * P, max_attention_window=[32, 4096], enable_block_reuse=False,
                        max_util_for_resume=max_util_for_resume)
    return KVCacheManagerV2(cfg, CacheType.SELF, num_layers=4, num_kv_heads=2, head_dim=4, tokens_per_block=P,
                            max_seq_len=4096, max_batch_size=4, mapping=Mapping(), dtype=DataType.FLOAT,
                            spec_config=MTPDecodingConfig(max_draft_len=3), max_num_tokens=64, device="cpu")


def ctx(*reqs) -> ScheduledRequests:
    return ScheduledRequests(context_requests=list(reqs))


def gen(*reqs) -> ScheduledRequests:
    return ScheduledRequests(generation_requests=list(reqs))


def pools(mgr) -> list[tuple]:
    return [p.state() for p in mgr.distinct_pools()]


def rows(mgr) -> dict:
    return {rid: (c.capacity, c.history_length, tuple(tuple(c.block_row(g)) for g in range(mgr.num_pools)))
            for rid, c in ((r, mgr.get_cache(r)) for r in mgr.request_ids())}


def prefill(mgr, req, chunk: int) -> None:
    """Chunked prefill through upstream's calls only."""
    while req.is_context_init_state:
        req.context_chunk_size = min(chunk, req.prompt_len - req.context_current_position)
        mgr.prepare_resources(ctx(req))
        req.context_current_position += req.context_chunk_size
        if req.context_current_position == req.prompt_len:
            req.tokens.append(7)
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
        mgr.update_context_resources(ctx(req))
        mgr.update_resources(ctx(req))


# -- signatures --------------------------------------------------------------------------------------------------
UPSTREAM_METHODS = {
    "prepare_resources": [("scheduled_batch", E)],
    "update_resources": [("scheduled_batch", E), ("attn_metadata", None), ("kv_cache_dtype_byte_size", None)],
    "update_context_resources": [("scheduled_batch", E)],
    "free_resources": [("request", E), ("pin_on_release", False)],
    "copy_batch_block_offsets": [("dst_tensor", E), ("request_ids", E), ("beam_width", E), ("num_contexts", E),
                                 ("num_seqs", E), ("max_blocks", None)],
    "get_buffers": [("layer_idx", E), ("kv_layout", "NHD")],
    "get_num_free_blocks": [],
    "get_kv_cache_stats": [],
    "get_batch_cache_indices": [("request_ids", E), ("layer_idx", None), ("num_blocks_per_seq", None),
                                ("raw_indices", False)],
    "get_block_ids_per_seq": [("request_ids", E)],
    "get_num_available_tokens": [("token_num_upper_bound", E), ("batch_size", 1), ("max_num_draft_tokens", 0)],
    "prepare_context": [("req", E)],
    "prepare_context_cache": [("req", E), ("reuse_limit", None)],
    "resize_context": [("req", E), ("num_tokens", E)],
    "try_allocate_generation": [("req", E)],
    "revert_allocate_generation": [("req", E)],
    "revert_allocate_context": [("req", E)],
    "extend_capacity_for_tokens": [("request", E)],
    "suspend_request": [("req", E)],
    "resume_request": [("req", E)],
    "get_history_length": [("req", E)],
    "release_index_slot": [("request_id", E)],
    "is_request_active": [("request_id", E)],
    "try_allocate_draft_context": [("req", E), ("num_tokens", E)],
}


@pytest.mark.parametrize("name", sorted(UPSTREAM_METHODS))
def test_method_signatures_are_upstreams(name):
    params = list(inspect.signature(getattr(KVCacheManagerV2, name)).parameters.values())[1:]
    ours = {"prepare_disagg_gen_init": ["reused_tokens"]}.get(name, [])
    assert [(p.name, p.default) for p in params if p.name not in ours] == UPSTREAM_METHODS[name]


def test_prepare_disagg_gen_init_and_request_context_are_upstreams():
    params = list(inspect.signature(KVCacheManagerV2.prepare_disagg_gen_init).parameters.values())[1:]
    assert [(p.name, p.kind.name) for p in params] == [("req", "POSITIONAL_OR_KEYWORD"), ("reused_tokens", "KEYWORD_ONLY")]
    assert list(inspect.signature(request_context).parameters) == ["is_draft", "scheduled_requests"]


# -- the managers read only upstream's request attributes ----------------------------------------------------------
def test_an_upstream_request_goes_through_prefill_generation_and_completion():
    mgr = target()
    req = request(1, 70)
    prefill(mgr, req, chunk=32)
    cache = mgr.get_cache(1)
    assert (cache.capacity, cache.history_length) == (71, 70)
    # the windowed group released what the window no longer reads: rows hold -1 below it
    row = mgr.get_batch_cache_indices([1], layer_idx=0)[0]
    assert row[: (71 - 32) // P] == [BAD_PAGE_INDEX] * ((71 - 32) // P) and BAD_PAGE_INDEX not in row[-2:]
    req.py_draft_tokens = [1, 2, 3]
    mgr.prepare_resources(gen(req))
    assert cache.capacity == 71 + 3 + mgr.num_extra_kv_tokens
    req.tokens += [1, 2]  # two drafts accepted
    mgr.update_resources(gen(req), None, None)
    assert cache.history_length == 72
    mgr.free_resources(req)
    assert mgr.request_ids() == [] and all(p.num_free == p.total for p in mgr.pools())
    mgr.free_resources(req)  # upstream: freeing what holds nothing here is a no-op


# -- accessors on real pool tensors ----------------------------------------------------------------------------------
def test_get_buffers_is_the_storage_the_block_table_addresses():
    mgr = target()
    req = request(1, 20)
    prefill(mgr, req, chunk=20)
    for layer in range(4):
        nhd, hnd = mgr.get_buffers(layer), mgr.get_buffers(layer, kv_layout="HND")
        pages = mgr.get_batch_cache_indices([1], layer_idx=layer)[0]
        assert nhd.shape == (hnd.shape[0], 2, P, 2, 4) and hnd.shape[1:] == (2, 2, P, 4)
        page, offset = pages[19 // P], 19 % P
        value = torch.randn(2, 4)
        nhd[page, 1, offset] = value  # V of position 19, every head
        assert torch.equal(hnd[page, 1, :, offset], value)  # a view: the same storage
        slot = mgr.layer_slots[layer]
        assert torch.equal(mgr.layer_groups[slot.group].pool.layers[slot.index][page, 1, :, offset], value)
    with pytest.raises(IndexError, match=r"layer 4 is not one of this manager's 4 layers"):
        mgr.get_buffers(4)
    with pytest.raises(ValueError, match="kv_layout must be 'NHD' or 'HND'"):
        mgr.get_buffers(0, kv_layout="NDH")


def test_cache_indices_block_ids_and_free_blocks():
    mgr = target()
    a, b = request(1, 70), request(2, 9)
    prefill(mgr, a, chunk=32)
    prefill(mgr, b, chunk=9)
    full = mgr.get_batch_cache_indices([1, 2], layer_idx=1)
    assert [len(r) for r in full] == [mgr.get_cache(1).num_blocks, mgr.get_cache(2).num_blocks]
    assert mgr.get_batch_cache_indices([1], layer_idx=1, num_blocks_per_seq=[2], raw_indices=True) == [
        [p * 2 for p in full[0][:2]]
    ]
    ids = mgr.get_block_ids_per_seq([1, 2])
    windowed = mgr.get_batch_cache_indices([1, 2])  # pool 0: the windowed group
    assert ids.shape == (2, max(len(r) for r in windowed)) and ids.dtype == torch.int32
    assert ids[0].tolist() == [max(p, 0) for p in windowed[0]]
    assert ids[1, len(windowed[1]):].eq(0).all()
    assert mgr.get_num_free_blocks() == min(mgr.free_pages())
    with pytest.raises(MissingKVCacheError, match="get_batch_cache_indices names request 9"):
        mgr.get_batch_cache_indices([1, 9])
    with pytest.raises(ValueError, match="asks for 99 blocks"):
        mgr.get_batch_cache_indices([2], num_blocks_per_seq=[99])


def test_stats_count_pages_handed_out_and_free_by_window():
    mgr = target()
    before = mgr.get_kv_cache_stats()
    assert before.used_num_blocks == 0 and before.max_num_blocks == sum(p.total for p in mgr.pools())
    prefill(mgr, request(1, 40), chunk=40)
    stats = mgr.get_kv_cache_stats()
    assert stats.used_num_blocks == sum(p.num_held for p in mgr.pools()) > 0
    assert stats.alloc_new_blocks >= stats.used_num_blocks and stats.reused_blocks == 0
    assert stats.num_free_blocks_per_window_size == {32: mgr.free_pages()[0], 4096: mgr.free_pages()[1]}
    assert stats.allocated_bytes == sum(
        p.total * sum(layer[0].numel() * layer.element_size() for layer in p.layers) for p in mgr.pools())


def test_available_tokens_follow_the_free_full_attention_pages():
    mgr = target(pages=(64, 16))  # 16 full-attention pages: 128 tokens
    assert mgr.get_num_available_tokens(token_num_upper_bound=1000) == 128 - mgr.num_extra_kv_tokens
    assert mgr.get_num_available_tokens(token_num_upper_bound=1000, batch_size=2, max_num_draft_tokens=3) == 64 - 2 - 3
    assert mgr.get_num_available_tokens(token_num_upper_bound=10) == 10


# -- the V2 scheduler's contract -----------------------------------------------------------------------------------
def test_scheduler_sized_steps_leave_prepare_resources_nothing_to_do():
    mgr = target()
    req = request(1, 40)
    assert mgr.prepare_context(req) and mgr.is_request_active(1)
    assert mgr.resize_context(req, 16)  # the scheduler's chunk: 16 tokens
    req.context_chunk_size = 16
    sized = (pools(mgr), rows(mgr))
    mgr.prepare_resources(ctx(req))
    assert (pools(mgr), rows(mgr)) == sized
    req.context_current_position, req.context_chunk_size = 16, 24
    mgr.update_context_resources(ctx(req))
    assert mgr.get_history_length(req) == 16
    assert mgr.resize_context(req, 24)
    mgr.prepare_resources(ctx(req))
    req.context_current_position = 40
    req.tokens.append(7)
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    mgr.update_context_resources(ctx(req))
    mgr.update_resources(gen(req))
    req.py_draft_tokens = [1, 2, 3]
    before = mgr.get_cache(1).capacity
    assert mgr.try_allocate_generation(req)
    assert mgr.get_cache(1).capacity == 40 + 1 + 3 + mgr.num_extra_kv_tokens > before
    sized = (pools(mgr), rows(mgr))
    mgr.prepare_resources(gen(req))
    assert (pools(mgr), rows(mgr)) == sized
    mgr.revert_allocate_generation(req)  # the step was dropped: its room is given back
    assert mgr.get_cache(1).capacity == before
    mgr.revert_allocate_generation(req)  # nothing left to revert: no-op
    assert mgr.get_cache(1).capacity == before


def test_a_refused_resize_answers_false_changes_nothing_and_says_why():
    mgr = target(pages=(64, 4))  # 4 full pages: 32 tokens
    req = request(1, 80)
    assert mgr.prepare_context(req)
    before = (pools(mgr), rows(mgr))
    assert mgr.resize_context(req, 80) is False
    assert (pools(mgr), rows(mgr)) == before
    assert "context resize failed for request 1: could not resize to" in str(mgr.last_refusal)
    # a first chunk that never got a page: reverting drops the cache, the request starts over
    assert mgr.revert_allocate_context(req) is False and not mgr.has_cache(1)
    assert all(p.num_free == p.total for p in mgr.pools())


def test_suspended_requests_are_skipped_and_resume_waits_for_the_pool_to_drain():
    mgr = target(pages=(64, 8), max_util_for_resume=0.5)
    a, b = request(1, 20), request(2, 20)
    prefill(mgr, a, chunk=20)
    prefill(mgr, b, chunk=20)
    mgr.suspend_request(a)
    assert not mgr.is_request_active(1) and mgr.has_cache(1)
    held = rows(mgr)[1]
    a.tokens += [3, 4]
    mgr.update_resources(gen(a, b))  # a is skipped, b is updated
    assert rows(mgr)[1] == held and mgr.get_history_length(b) == 20
    before = (pools(mgr), rows(mgr))
    with pytest.raises(KVCacheResizeError, match=r"^Failed to resume KV cache for request 1: the fullest pool is 75% used"):
        mgr.prepare_resources(gen(a, b))  # scheduled while the pool is too full to resume it: refused, nothing changed
    assert (pools(mgr), rows(mgr)) == before and not mgr.is_request_active(1)
    # 6 of 8 full pages held (75 %) > 50 %: resume refused, explicitly
    assert mgr.resume_request(a) is False and not mgr.is_request_active(1)
    assert "stays suspended: the fullest pool is 75% used, above max_util_for_resume 50%" in str(mgr.last_refusal)
    mgr.free_resources(b)
    assert mgr.resume_request(a) is True and mgr.is_request_active(1)
    assert mgr.try_allocate_generation(a)
    mgr.free_resources(a)
    assert all(p.num_free == p.total for p in mgr.pools())


def test_extend_capacity_for_padded_drafts_and_release_index_slot():
    mgr = target()
    req = request(1, 16)
    prefill(mgr, req, chunk=16)
    req.py_draft_tokens = [1]
    assert mgr.try_allocate_generation(req)
    req.py_draft_tokens = [1, 0, 0]  # padded to the CUDA graph's draft length
    mgr.extend_capacity_for_tokens(req)
    assert mgr.get_cache(1).capacity == 16 + 1 + 3 + mgr.num_extra_kv_tokens
    mgr.release_index_slot(1)  # no index slots here: the cache is untouched
    assert mgr.is_request_active(1)


# -- upstream's return conventions ---------------------------------------------------------------------------------
def test_generation_init_and_dummies_answer_a_full_pool_with_false_and_none():
    mgr = target(pages=(64, 4))
    req = request(5, 100)
    req.state = LlmRequestState.DISAGG_GENERATION_INIT
    before = pools(mgr)
    assert mgr.prepare_disagg_gen_init(req) is False
    assert pools(mgr) == before and not mgr.has_cache(5)
    assert isinstance(mgr.last_refusal, KVCacheResizeError) and mgr.last_refusal.request_id == 5
    assert mgr.add_dummy_requests([8, 9], [10, 40], is_gen=True) is None
    assert pools(mgr) == before and mgr.request_ids() == []
    assert "dummy resize failed for request 9" in str(mgr.last_refusal)
    assert mgr.prepare_disagg_gen_init(request(6, 10)) is True


def test_a_whole_prompt_chunk_that_does_not_fit_says_so():
    mgr = target(pages=(64, 4))
    req = request(1, 70001)
    with pytest.raises(KVCacheResizeError) as info:
        mgr.prepare_resources(ctx(req))
    text = str(info.value)
    assert text.splitlines()[0].startswith("KV cache context resize failed for request 1: could not resize to")
    assert "context chunk [0, 70001) of a 70001-token prompt (target view): the whole prompt as one chunk" in text
    assert "context_chunk_size" in text


def test_a_joint_mtp_mirror_reads_the_target_view_and_keeps_the_old_resize():
    cfg = KVPoolConfig((LayerGroupConfig(1),), pages_per_group=(64,), tokens_per_block=P)
    from tensorrt_llm_draftkv import DraftKVCacheManagerV2

    draft = DraftKVCacheManagerV2.from_pool_config(cfg, spec_mode="mtp", max_draft_len=3, joint_kv_cache_reuse=True)
    from tensorrt_llm_draftkv import LlmRequest
    from tensorrt_llm_draftkv.request import ContextView

    # the target view at its second chunk; the draft view, that nothing advanced, at 0 with the whole prompt
    req = LlmRequest(1, prompt_len=200, target_view=ContextView(64, 64))
    assert (req.draft_view.position, req.draft_view.chunk_size) == (0, 200)
    draft.prepare_resources(ctx(req))
    # the target view's chunk [64, 128) (not the draft view's whole prompt: 204), old resize (no history)
    assert (draft.get_cache(1).capacity, draft.get_cache(1).history_length) == (128, 0)


def test_a_plan_becomes_a_pool():
    from tensorrt_llm_draftkv.manager.planner import PoolGeometry, plan_pool

    geometry = PoolGeometry((LayerGroupConfig(2, window=256), LayerGroupConfig(1)), num_kv_heads=4, head_dim=16,
                            dtype=torch.bfloat16, tokens_per_block=16, tp_size=2)
    report = plan_pool("target", geometry, budget_bytes=1 << 22, max_seq_len=8192, chunk=512)
    mgr = KVCacheManagerV2.from_pool_config(report.to_pool_config(geometry, max_seq_len=8192))
    assert mgr.free_pages() == tuple(g.pool_pages for g in report.groups)
    assert mgr.config.num_kv_heads == 2 and mgr.windows == (256, None)
    with pytest.raises(ValueError, match="buys no page"):
        plan_pool("tiny", geometry, budget_bytes=10, max_seq_len=8192, chunk=512).to_pool_config(geometry, max_seq_len=8192)


def test_try_allocate_draft_context_sizes_the_mirror_as_prepare_would():
    spec = DFlashDecodingConfig(max_draft_len=3)
    cfg = KvCacheConfig(max_tokens=64 * P, max_attention_window=[32])
    args = dict(num_layers=2, num_kv_heads=1, head_dim=4, tokens_per_block=P, max_seq_len=4096, max_batch_size=2,
                mapping=Mapping(), dtype=DataType.FLOAT, spec_config=spec, device="cpu")
    draft = KVCacheManagerV2(cfg, CacheType.SELF, is_draft=True, **args)
    twin = KVCacheManagerV2(cfg, CacheType.SELF, is_draft=True, **args)
    a, b = request(1, 120, chunk=40), request(1, 120, chunk=40)
    for step in range(3):
        assert draft.try_allocate_draft_context(a, 40)
        twin.prepare_resources(ctx(b))
        assert rows(draft) == rows(twin), step  # the same capacity, history and rows
        for r, m in ((a, draft), (b, twin)):
            r.context_current_position += 40
            m.update_context_resources(ctx(r))
    # a window of 32 (+ the trail page): the mirror held the window and the chunk, never the prompt
    assert draft.get_cache(1).history_length == 120
    tiny = KVCacheManagerV2(KvCacheConfig(max_tokens=4 * P, max_attention_window=[32]), CacheType.SELF, is_draft=True,
                            **args)
    assert tiny.try_allocate_draft_context(request(2, 400), 400) is False and not tiny.has_cache(2)
    assert "Draft KV cache context resize failed for request 2" in str(tiny.last_refusal)
    with pytest.raises(ValueError, match="is a draft manager's call"):
        target().try_allocate_draft_context(request(3, 8), 8)
