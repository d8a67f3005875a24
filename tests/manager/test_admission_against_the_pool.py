"""The draft manager's admission helpers answer for this pool, with reasons.

`check_admission` refuses a request whose mirror would ever need more pages in a
layer group than the pool has (the charge alone is the geometry's figure);
`admit_mirror` answers False with `last_refusal` naming the request and the pages
needed against the pages free; a failed resize says the same in its message.
Coordinates: absolute token positions; page counts per layer group.
"""
from __future__ import annotations

import pytest

from tensorrt_llm_draftkv import (
    DraftKVCacheManagerV2,
    KVCacheResizeError,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    ScheduledRequests,
    SpeculativeDecodingMode as Mode,
)
from tensorrt_llm_draftkv.manager.admission import AdmissionRefused
from tensorrt_llm_draftkv.request import ContextView

P, W, CHUNK = 32, 1024, 2048


def draft(pages: int) -> DraftKVCacheManagerV2:
    config = KVPoolConfig(
        layer_groups=(LayerGroupConfig(1, window=W),), pages_per_group=(pages,), tokens_per_block=P,
        num_kv_heads=1, head_dim=1, max_seq_len=1 << 17,
    )
    return DraftKVCacheManagerV2.from_pool_config(config, spec_mode=Mode.DFLASH, max_draft_len=7, num_extra_kv_tokens=8)


def request(rid: int, prompt_len: int = 70001) -> LlmRequest:
    return LlmRequest(rid, prompt_len=prompt_len, max_new_tokens=16, target_view=ContextView(0, CHUNK))


def test_check_admission_refuses_a_pool_smaller_than_the_requests_peak():
    big, small = draft(4096), draft(20)
    charge = small.pages_per_request_charge(CHUNK)[0]
    assert charge > 20  # the geometry's charge alone would admit it
    big.check_admission(request(1), chunk=CHUNK)
    with pytest.raises(AdmissionRefused) as info:
        small.check_admission(request(1), chunk=CHUNK)
    assert "request 1 refused at admission" in str(info.value)
    assert "the pool has only 20 pages" in str(info.value)
    assert info.value.needed_pages > 20 and small.free_pages() == (20,)


def test_admit_mirror_false_sets_last_refusal_with_pages_needed_and_free():
    mgr = draft(70)
    first = request(1)
    assert mgr.admit_mirror(first) and mgr.last_refusal is None
    mgr.prepare_resources(ScheduledRequests(context_requests=[first]))  # holds most of the pool
    free = mgr.free_pages()
    second = request(2)
    assert not mgr.admit_mirror(second)
    err = mgr.last_refusal
    assert isinstance(err, KVCacheResizeError) and err.request_id == 2
    text = str(err)
    assert "pages this resize needs per layer group: [" in text and f"free: {list(free)}" in text
    assert "pages short" in text
    assert mgr.free_pages() == free and not mgr.has_cache(2)  # nothing changed


def test_a_failed_resize_names_the_pages_it_lacks():
    mgr = draft(30)
    with pytest.raises(KVCacheResizeError) as info:
        mgr.prepare_resources(ScheduledRequests(context_requests=[request(3)]))
    text = str(info.value)
    needed = int(text.split("needs per layer group: [")[1].split("]")[0])
    assert needed > 30 and "free: [30]" in text and f"{needed - 30} pages short" in text
    assert mgr.free_pages() == (30,) and not mgr.has_cache(3)
