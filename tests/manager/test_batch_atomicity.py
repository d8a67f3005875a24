"""prepare_resources is all or nothing over a batch, and the cache and pool journals undo resizes exactly."""
from __future__ import annotations

import random

import pytest

from tensorrt_llm_draftkv import (
    DraftKVCacheManagerV2,
    KVCacheManagerV2,
    KVCacheResizeError,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    ScheduledRequests,
    SpeculativeDecodingMode,
)


def _state(mgr: KVCacheManagerV2):
    caches = {rid: mgr.get_cache(rid).checkpoint() for rid in mgr.request_ids()}
    pools = [(sorted(p.free_order()), sorted(p.held_pages())) for p in mgr.pools()]
    return caches, pools


def _config(pages: tuple[int, int]) -> KVPoolConfig:
    return KVPoolConfig(
        (LayerGroupConfig(1, window=40), LayerGroupConfig(1)),
        pages_per_group=pages,
        tokens_per_block=8,
        head_dim=2,
        max_seq_len=4096,
    )


@pytest.mark.parametrize("manager", ["target", "draft"])
def test_a_failing_request_puts_the_whole_batch_back(manager):
    cfg = _config((64, 40))
    if manager == "target":
        mgr = KVCacheManagerV2.from_pool_config(cfg, max_draft_len=3)
    else:
        mgr = DraftKVCacheManagerV2.from_pool_config(cfg, spec_mode=SpeculativeDecodingMode.DFLASH, max_draft_len=3)
    # Two requests mid-prefill whose next chunk raises history (releasing window pages) and grows.
    running = [LlmRequest(i, prompt_len=160) for i in (1, 2)]
    for req in running:
        req.target_view.chunk_size = 48
        mgr.prepare_resources(ScheduledRequests([req]))
        req.advance_context_chunk(48)
    before = _state(mgr)
    hog = LlmRequest(3, prompt_len=400)  # a fresh request the full-attention pool cannot hold
    batch = ScheduledRequests([*running, hog])
    with pytest.raises(KVCacheResizeError, match="request 3"):
        mgr.prepare_resources(batch)
    assert _state(mgr) == before
    mgr.check_accounting()
    # and the batch without the hog still goes through from that state
    mgr.prepare_resources(ScheduledRequests(running))
    assert all(mgr.get_cache(r.py_request_id).capacity == 96 for r in running)


def test_journals_undo_random_resize_sequences_over_several_caches():
    rng = random.Random(7)
    for _ in range(60):
        mgr = KVCacheManagerV2.from_pool_config(_config((48, 48)))
        caches = []
        for rid in range(3):
            req = LlmRequest(rid, prompt_len=1)
            mgr.prepare_resources(ScheduledRequests(context_requests=[req]))
            caches.append(mgr.get_cache(rid))
        before = _state(mgr)
        for journaled in caches + mgr.pools():
            journaled.begin_journal()
        resized = 0
        for _ in range(rng.randint(1, 8)):
            cache = rng.choice(caches)
            history = cache.history_length + rng.randint(0, 30)
            resized += cache.resize(history + rng.randint(0, 40), history)
        assert resized == 0 or _state(mgr) != before  # the journals have something to undo
        for journaled in caches + mgr.pools():
            journaled.rollback_journal()
        assert _state(mgr) == before
        mgr.check_accounting()
