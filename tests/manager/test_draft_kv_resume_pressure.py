"""A draft mirror that exists but cannot resume is an explicit error, never a silent skip.

In the spirit of upstream's `test_draft_kv_resume_pressure`: the V2 scheduler suspends caches
under pool pressure; when a suspended request is scheduled again, the draft manager's
`prepare_resources` resumes its mirror first. A resume the pool refuses (the fullest pool above
`KvCacheConfig.max_util_for_resume`) raises `Failed to resume draft KV cache for request N`,
before any mirror of the batch changed. Once the pressure drops the same step goes through.
Real draft pools, upstream's constructor, context and generation requests.
"""
from __future__ import annotations

import pytest

from tensorrt_llm_draftkv import (
    CacheType,
    DataType,
    DFlashDecodingConfig,
    KVCacheManagerV2,
    KVCacheResizeError,
    KvCacheConfig,
    LlmRequest,
    LlmRequestState,
    Mapping,
    ScheduledRequests,
)
from tensorrt_llm_draftkv.request import ContextView

P = 8


def draft_manager(pages: int, max_util: float) -> KVCacheManagerV2:
    """A full-attention DFlash draft pool of `pages` pages (no window: pressure is easy to count)."""
    cfg = KvCacheConfig(max_tokens=pages * P, enable_block_reuse=False, max_util_for_resume=max_util)
    return KVCacheManagerV2(cfg, CacheType.SELF, num_layers=1, num_kv_heads=1, head_dim=4, tokens_per_block=P,
                            max_seq_len=1024, max_batch_size=4, mapping=Mapping(), dtype=DataType.FLOAT,
                            spec_config=DFlashDecodingConfig(max_draft_len=3), is_draft=True, device="cpu")


def state(mgr):
    return [p.state() for p in mgr.pools()], {
        r: (mgr.get_cache(r).capacity, mgr.get_cache(r).history_length, mgr.is_request_active(r))
        for r in mgr.request_ids()
    }


def context(rid: int, prompt: int, chunk: int) -> LlmRequest:
    return LlmRequest(rid, prompt_len=prompt, target_view=ContextView(0, chunk))


@pytest.mark.parametrize("phase", ["context", "generation"])
def test_a_refused_resume_raises_before_anything_changes_then_succeeds_once_pressure_drops(phase):
    dm = draft_manager(pages=16, max_util=0.5)
    hog = context(1, 64, 64)  # 64 tokens + the block: 9 of the 16 pages
    dm.prepare_resources(ScheduledRequests(context_requests=[hog]))
    req = context(2, 16, 16)
    dm.prepare_resources(ScheduledRequests(context_requests=[req]))
    if phase == "generation":
        req.target_view = ContextView(16, 0)
        req.tokens.append(5)
        req.state = LlmRequestState.GENERATION_IN_PROGRESS
        dm.update_resources(ScheduledRequests(generation_requests=[req]))
    else:
        req.target_view = ContextView(8, 8)  # its next chunk (it was sized for [0, 16))
    dm.suspend_request(req)
    batch = (ScheduledRequests(generation_requests=[req]) if phase == "generation"
             else ScheduledRequests(context_requests=[req]))
    before = state(dm)
    with pytest.raises(KVCacheResizeError, match=r"^Failed to resume draft KV cache for request 2: the fullest pool "
                                                 r"is \d+% used, above max_util_for_resume 50%") as info:
        dm.prepare_resources(batch)
    assert info.value.request_id == 2 and info.value.phase == "resume"
    assert state(dm) == before  # not resumed, not resized: never skipped silently either
    dm.free_resources(hog)
    dm.prepare_resources(batch)  # the pressure dropped: resumed, then sized
    assert dm.is_request_active(2)
    dm.free_resources(req)
    assert all(p.num_free == p.total for p in dm.pools())


def test_the_first_refused_request_names_every_suspended_one_of_the_batch():
    dm = draft_manager(pages=12, max_util=0.25)
    a, b = context(1, 24, 24), context(2, 24, 24)
    dm.prepare_resources(ScheduledRequests(context_requests=[a, b]))
    for r in (a, b):
        r.target_view = ContextView(16, 8)
        dm.suspend_request(r)
    before = state(dm)
    with pytest.raises(KVCacheResizeError, match=r"for request 1 \(and \[2\]\)"):
        dm.prepare_resources(ScheduledRequests(context_requests=[a, b]))
    assert state(dm) == before


def test_resume_and_admission_agree_with_the_pressure_rule():
    dm = draft_manager(pages=16, max_util=0.5)
    hog = context(1, 64, 64)
    dm.prepare_resources(ScheduledRequests(context_requests=[hog]))
    req = context(2, 8, 8)
    dm.prepare_resources(ScheduledRequests(context_requests=[req]))
    dm.suspend_request(req)
    assert dm.resume_request(req) is False and "stays suspended" in str(dm.last_refusal)
    assert dm.resume_request(context(3, 8, 8)) is False  # no mirror at all: nothing to resume
    dm.free_resources(hog)
    assert dm.resume_request(req) is True and dm.resume_request(req) is True  # resuming an active one: True
