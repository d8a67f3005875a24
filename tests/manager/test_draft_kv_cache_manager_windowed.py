"""Windowed draft pools with real pages: what a mirror backs, derived from the window.

A query at position q of a window W reads positions [q + 1 - W, q]. A step whose
queries sit at [h, h + n) therefore reads [h + 1 - W, h + n); block ordinal i
covers [i*P, (i+1)*P) and is needed iff it overlaps that range:
i >= floor((h + 1 - W) / P). The pool keeps its windows widened by the trail
page (W + P on a DFlash/DSpark pool), so that is the W used for the expected
sets below, and the model's own window is checked separately.
"""
from __future__ import annotations

import pytest

from tensorrt_llm_draftkv import (
    BAD_PAGE_INDEX,
    DraftKVCacheManagerV2,
    KVCacheManagerV2,
    KVCacheResizeError,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    ScheduledRequests,
    SpeculativeDecodingMode as Mode,
)
from tensorrt_llm_draftkv.request import ContextView
from support import ceil_div, strict


def config(window, pages, p, sinks=0) -> KVPoolConfig:
    return KVPoolConfig(
        layer_groups=(LayerGroupConfig(1, window=window, sink_blocks=sinks),),
        pages_per_group=(pages,),
        tokens_per_block=p,
        num_kv_heads=1,
        head_dim=1,
        max_seq_len=1 << 20,
    )




def backed(cache, group=0) -> list[int]:
    return [i for i, page in enumerate(cache.block_row(group)) if page != BAD_PAGE_INDEX]


def needed(first_query: int, end: int, window: int, p: int) -> list[int]:
    """Ordinals overlapping [first_query + 1 - window, end): what queries from first_query read."""
    lo = max(0, (first_query + 1 - window) // p)
    return list(range(lo, ceil_div(end, p)))


def overlapping(lo_pos: int, hi_pos: int, p: int) -> list[int]:
    """Ordinals overlapping the positions [lo_pos, hi_pos), by brute force over positions."""
    return sorted({pos // p for pos in range(max(0, lo_pos), hi_pos)})


# =============================================================================================
# Two-chunk prefill, reuse off: the mirror backs exactly what the next chunk attends.
# =============================================================================================
GEOMETRIES = [
    # (P, model window, chunk, prompt, drafts, extra)
    (16, 200, 256, 356, 3, 1),
    (16, 256, 256, 512, 7, 0),
    (8, 13, 40, 70, 2, 1),
    (32, 4096, 8192, 16384, 7, 0),
]


@pytest.mark.parametrize("mode", [Mode.EAGLE3_ONE_MODEL, Mode.DFLASH])
@pytest.mark.parametrize("p, window, chunk, prompt, drafts, extra", GEOMETRIES)
def test_windowed_mirror_backs_what_the_next_chunk_attends(mode, p, window, chunk, prompt, drafts, extra):
    pages = 2 * ceil_div(window + p + chunk + drafts + extra, p) + 4
    mgr = DraftKVCacheManagerV2.from_pool_config(
        config(window, pages, p),
        spec_mode=mode,
        max_draft_len=drafts,
        num_extra_kv_tokens=extra,
        joint_kv_cache_reuse=False,
    )
    target = KVCacheManagerV2.from_pool_config(config(window, pages, p), max_draft_len=drafts, num_extra_kv_tokens=extra)
    trail = p if mode is Mode.DFLASH else 0
    assert mgr.windows == (window + trail,)
    kept = window + trail

    req = LlmRequest(1, prompt_len=prompt, target_view=ContextView(0, chunk))
    batch = ScheduledRequests(context_requests=[req])
    in_step = not mode.is_external_drafter()

    # Chunk 1: [0, chunk), not the last: the extra slots above it, no drafts.
    # Nothing is history yet; every ordinal up to the capacity is backed.
    assert chunk < prompt
    if in_step:
        req.sync_draft_view()  # the executor keeps an in-step drafter's view with the target's
    mgr.prepare_resources(batch)
    target.prepare_resources(batch)
    cache = mgr.get_cache(1)
    first_end = chunk + extra
    assert (cache.capacity, cache.history_length) == (first_end, 0)
    assert backed(cache) == overlapping(0, first_end, p) == list(range(ceil_div(first_end, p)))

    # The executor advances the view and publishes the history.
    req.advance_context_chunk(chunk)
    if in_step:
        req.sync_draft_view()
    mgr.update_context_resources(batch)
    target.update_context_resources(batch)
    start = chunk
    assert cache.history_length == start

    # Chunk 2: [start, prompt), the last chunk: drafts and extra slots above it.
    assert (req.target_view.position, req.target_view.chunk_size) == (start, prompt - start)
    mgr.prepare_resources(batch)
    target.prepare_resources(batch)
    end = prompt + drafts + extra
    assert cache.capacity == end and cache.history_length == start
    # What the chunk's queries [start, end) read under the model's window...
    model_needs = overlapping(start + 1 - window, end, p)
    assert model_needs == needed(start, end, window, p)
    # ...and what the pool keeps: the same, plus exactly the trail page below it.
    expect = overlapping(start + 1 - kept, end, p)
    assert backed(cache) == expect
    assert set(model_needs) <= set(expect)
    extra_pages = sorted(set(expect) - set(model_needs))
    assert extra_pages == ([model_needs[0] - 1] if trail and model_needs[0] > 0 else [])
    assert cache.num_held_pages() == len(expect)  # nothing needlessly held
    # The target cache (its own pool) keeps the model window only.
    assert backed(target.get_cache(1)) == model_needs
    mgr.check_accounting()
    # Everything returns.
    mgr.free_resources(req)
    assert mgr.free_pages() == (pages,)


@pytest.mark.parametrize("mode", [Mode.DFLASH, Mode.DSPARK, Mode.PARD, Mode.DRAFT_TARGET_ONE_MODEL])
def test_external_drafter_needs_no_draft_view_sync(mode):
    """The external drafter's executor never touches the draft view; the mirror still slides."""
    p, window, chunk, prompt = 16, 100, 64, 640
    mgr = DraftKVCacheManagerV2.from_pool_config(config(window, 32, p), spec_mode=mode, max_draft_len=3)
    kept = mgr.windows[0]
    req = LlmRequest(2, prompt_len=prompt, target_view=ContextView(0, chunk))
    batch = ScheduledRequests(context_requests=[req])
    while req.target_view.position < prompt:
        start = req.target_view.position
        mgr.prepare_resources(batch)  # no update_context_resources at all
        cache = mgr.get_cache(2)
        end = start + req.target_view.chunk_size + (3 if start + chunk >= prompt else 0)
        assert (cache.capacity, cache.history_length) == (end, start)
        assert backed(cache) == overlapping(start + 1 - kept, end, p)
        req.advance_context_chunk(chunk)
    assert req.draft_view == ContextView(0, prompt)  # untouched


# =============================================================================================
# A 65,536-token disaggregated request on a pool that holds 8,192 tokens.
# =============================================================================================
@pytest.mark.parametrize("mode", [Mode.DFLASH, Mode.DSPARK, Mode.PARD, Mode.EAGLE3_ONE_MODEL, Mode.MTP])
def test_gen_init_mirror_survives_generation_updates(mode):
    p, window, pages, drafts, extra = 32, 4096, 256, 3, 1
    prompt = 65536
    assert pages * p == 8192
    mgr = DraftKVCacheManagerV2.from_pool_config(
        config(window, pages, p), spec_mode=mode, max_draft_len=drafts, num_extra_kv_tokens=extra
    )
    kept = mgr.windows[0]
    assert kept == window + (p if mode in (Mode.DFLASH, Mode.DSPARK) else 0)
    headroom = 1 + drafts + extra

    req = LlmRequest(7, prompt_len=prompt, state=LlmRequestState.DISAGG_GENERATION_INIT)
    assert mgr.admit_mirror(req)
    assert mgr.prepare_disagg_gen_init(req)
    cache = mgr.get_cache(7)
    assert (cache.capacity, cache.history_length) == (prompt + headroom, prompt)
    # The first generation query sits at the prompt end (position 65536).
    assert backed(cache) == overlapping(prompt + 1 - kept, prompt + headroom, p)
    assert cache.num_held_pages() <= pages
    # The pages holding the prompt's tail: the last window of the prompt.
    tail = overlapping(prompt + 1 - window, prompt, p)
    assert tail[-1] == prompt // p - 1 == 2047
    tail_pages = {i: cache.block_row(0)[i] for i in tail}
    assert all(page != BAD_PAGE_INDEX for page in tail_pages.values())

    # The context worker's first token arrives with the request.
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    req.tokens.append(1)
    batch = ScheduledRequests(generation_requests=[req])
    for step, accepted in enumerate([drafts, 0, 1]):
        h = req.max_beam_num_tokens - 1
        mgr.prepare_resources(batch)
        assert cache.capacity == h + headroom
        assert cache.history_length == h  # history follows the request (absolute positions)
        assert backed(cache) == overlapping(h + 1 - kept, h + headroom, p)
        # The step writes the new token and the drafts; `accepted` of them survive.
        req.tokens += [1] * (1 + accepted)
        reserved = cache.capacity
        mgr.update_resources(batch)
        h = req.max_beam_num_tokens - 1
        # The rejected slots are dropped, but not those the next step reserves again.
        top = max(h + 1, min(reserved, h + headroom))
        assert (cache.capacity, cache.history_length) == (top, h), step
        assert backed(cache) == overlapping(h + 1 - kept, top, p)
        # The prompt end is still in the window and still on the same pages.
        for i in tail:
            if i * p + p - 1 >= h + 1 - window:
                assert cache.block_row(0)[i] == tail_pages[i], (step, i)
        assert cache.block_row(0)[2047] == tail_pages[2047]
        mgr.check_accounting()
    assert req.max_beam_num_tokens == prompt + 1 + (1 + drafts) + (1 + 0) + (1 + 1)

    # The pre-fix sizing cannot even start this request on this pool.
    legacy = DraftKVCacheManagerV2.from_pool_config(
        config(window, pages, p), spec_mode=mode, max_draft_len=drafts, num_extra_kv_tokens=extra, sizing="legacy"
    )
    fresh = LlmRequest(7, prompt_len=prompt, state=LlmRequestState.DISAGG_GENERATION_INIT)
    assert legacy.admit_mirror(fresh) is False
    with pytest.raises(
        KVCacheResizeError,
        # Legacy presents the request as a whole-prompt context chunk, and the error says so.
        match=rf"^Draft KV cache context resize failed for request 7: could not resize to {prompt + drafts + extra} tokens",
    ):
        strict(legacy, legacy.prepare_disagg_gen_init(fresh))
    assert legacy.request_ids() == [] and legacy.free_pages() == (pages,)


# =============================================================================================
# CUDA-graph warmup dummies.
# =============================================================================================
@pytest.mark.parametrize("mode", [Mode.DFLASH, Mode.DSPARK, Mode.PARD, Mode.MTP])
@pytest.mark.parametrize("tokens", [4096, 4097, 65536])
def test_windowed_draft_pool_backs_only_the_window_of_a_generation_dummy(mode, tokens):
    p, window, drafts, extra = 16, 256, 3, 1
    mgr = DraftKVCacheManagerV2.from_pool_config(config(window, 32, p), spec_mode=mode, max_draft_len=drafts, num_extra_kv_tokens=extra)
    kept = mgr.windows[0]
    hint = tokens - 1  # the target cache's history for a generation dummy of `tokens` tokens
    (dummy,) = mgr.add_dummy_requests([900], [tokens], is_gen=True, max_num_draft_tokens=drafts, history_hint=hint)
    assert dummy.is_dummy and dummy.is_generation_in_progress_state
    cache = mgr.get_cache(900)
    capacity = tokens + drafts + extra
    assert (cache.capacity, cache.history_length) == (capacity, hint)
    assert backed(cache) == overlapping(hint + 1 - kept, capacity, p)
    # [hint + 1 - kept, capacity) spans kept + drafts + extra tokens: at most one partial page more.
    assert cache.num_held_pages() <= ceil_div(kept + drafts + extra, p) + 1

    # The target cache gets the same hint and backs its (unwidened) window.
    target = KVCacheManagerV2.from_pool_config(config(window, 32, p), max_draft_len=drafts, num_extra_kv_tokens=extra)
    target.add_dummy_requests([900], [tokens], is_gen=True, max_num_draft_tokens=drafts, history_hint=hint)
    assert backed(target.get_cache(900)) == overlapping(hint + 1 - window, capacity, p)

    # Legacy drops the hint: the dummy's mirror would back every ordinal from 0.
    legacy = DraftKVCacheManagerV2.from_pool_config(
        config(window, 32, p), spec_mode=mode, max_draft_len=drafts, num_extra_kv_tokens=extra, sizing="legacy"
    )
    with pytest.raises(KVCacheResizeError, match=rf"dummy resize failed for request 900: could not resize to {capacity} tokens \(history unchanged\)"):
        strict(legacy, legacy.add_dummy_requests([900], [tokens], is_gen=True, max_num_draft_tokens=drafts, history_hint=hint))
    assert legacy.request_ids() == [] and legacy.free_pages() == (32,)
    big = DraftKVCacheManagerV2.from_pool_config(
        config(window, 5000, p), spec_mode=mode, max_draft_len=drafts, num_extra_kv_tokens=extra, sizing="legacy"
    )
    big.add_dummy_requests([900], [tokens], is_gen=True, max_num_draft_tokens=drafts, history_hint=hint)
    assert backed(big.get_cache(900)) == list(range(ceil_div(capacity, p)))
    big.free_resources(900)
    mgr.free_resources(900)
    assert mgr.free_pages() == (32,) and big.free_pages() == (5000,)
