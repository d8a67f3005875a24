"""Property: random shared-prefix traffic over real target and draft managers keeps every reuse invariant.

Requests draw their prompt from a few prefix families plus a random tail (so
lengths are rarely page multiples and tails often collide), arrive at random
steps, prefill in chunks, generate a few steps with random acceptance and
finish. The target pool is sometimes too small (prepares are refused, and
cached-free pages are evicted to make room); the draft pool (DFlash, DSpark or
PARD, with or without joint reuse) is large enough never to refuse. After every
prepare and every update, in both managers:

* the pools balance: held (distinct) + cached-free + plain free = total, and
  every held page is in as many rows as the pool counts holders (so no page has
  two unique owners);
* every page a request may write (ordinals at or above history // P) is held by
  that request alone and not published: a shared or published page is never
  handed to a writer;
* every published page a request holds was published for exactly that
  request's tokens at that ordinal (a hit never hands over foreign K/V);
* a request's pages per group stay within the estimator's (unaligned) charge;
* a refused prepare leaves caches, pools and request views exactly as they were;

and finishing every request returns every page to free or cached-free.
Sizes stay small (P <= 8, prompts < 100 tokens, head_dim 1).
"""
from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import event, given, settings, strategies as st  # noqa: E402

from tensorrt_llm_draftkv import (  # noqa: E402
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
from tensorrt_llm_draftkv.manager.admission import request_charge  # noqa: E402
from tensorrt_llm_draftkv.request import ContextView  # noqa: E402

VOCAB = st.integers(0, 3)  # a tiny vocabulary: tails often share pages too


@st.composite
def workloads(draw):
    families = draw(st.lists(st.lists(VOCAB, min_size=6, max_size=60), min_size=1, max_size=3))
    requests = draw(
        st.lists(
            st.tuples(
                st.integers(0, len(families) - 1),
                st.lists(VOCAB, min_size=1, max_size=30),  # the tail
                st.integers(1, 3),  # generation steps
                st.integers(0, 10),  # arrival step
            ),
            min_size=2,
            max_size=7,
        )
    )
    return dict(
        p=draw(st.sampled_from([2, 4, 8])),
        window=draw(st.integers(1, 40)),
        sinks=draw(st.integers(0, 1)),
        mode=draw(st.sampled_from([Mode.DFLASH, Mode.DSPARK, Mode.PARD])),
        joint=draw(st.booleans()),
        drafts=draw(st.integers(0, 3)),
        chunk=draw(st.integers(3, 40)),
        tight=draw(st.integers(1, 3)),  # target pool: this many charges (fewer than the requests: refusals)
        families=families,
        requests=requests,
    )


def whole_state(mgr: KVCacheManagerV2) -> tuple:
    return (
        {rid: mgr.get_cache(rid).checkpoint() for rid in mgr.request_ids()},
        [pool.state() for pool in mgr.pools()],
    )


def check(mgr: KVCacheManagerV2, live: dict[int, LlmRequest], charge: list[int] | None) -> None:
    mgr.check_accounting()
    p = mgr.tokens_per_block
    for pool in mgr.pools():
        assert pool.num_held + pool.num_cached_free + pool.num_plain_free == pool.total
    for rid in mgr.request_ids():
        cache, req = mgr.get_cache(rid), live[rid]
        for g, pool in enumerate(mgr.pools()):
            row = cache.block_row(g)
            for ordinal in range(cache.history_length // p, len(row)):
                page = row[ordinal]
                assert page == BAD_PAGE_INDEX or pool.is_writable(page), (rid, g, ordinal, page)
            if pool.block_reuse:
                published = [(o, pg) for o, pg in enumerate(row) if pg != BAD_PAGE_INDEX and pool.is_published(pg)]
                if published:
                    last = max(o for o, _ in published)
                    assert (last + 1) * p <= len(req.tokens)
                    own = cache.keys.chain(g, req.tokens, last + 1)
                    assert all(pool.prefix.key_of(pg) == own[o] for o, pg in published), (rid, g)
            if charge is not None:
                assert cache.num_held_pages(g) <= charge[g], (rid, g, cache.num_held_pages(g), charge)


@settings(max_examples=100, deadline=None)
@given(w=workloads(), data=st.data())
def test_random_shared_prefix_traffic_keeps_every_reuse_invariant(w, data):
    p, drafts, chunk = w["p"], w["drafts"], w["chunk"]
    prompts = [w["families"][f] + tail for f, tail, _, _ in w["requests"]]
    max_seq_len = max(len(t) for t in prompts) + 4 * (1 + drafts) + drafts + 2
    t_groups = (LayerGroupConfig(1, window=None), LayerGroupConfig(1, window=w["window"], sink_blocks=w["sinks"]))
    d_groups = (LayerGroupConfig(1, window=w["window"]), LayerGroupConfig(1, window=None))
    t_charge = list(request_charge(t_groups, p, chunk=chunk, max_seq_len=max_seq_len, max_draft_len=drafts, aligned=False))
    target = KVCacheManagerV2.from_pool_config(
        KVPoolConfig(t_groups, tuple(w["tight"] * c for c in t_charge), tokens_per_block=p, head_dim=1,
                     max_seq_len=max_seq_len, enable_block_reuse=True),
        max_draft_len=drafts,
    )
    roomy = len(prompts) * (max_seq_len // p + 2)
    draft = DraftKVCacheManagerV2.from_pool_config(
        KVPoolConfig(d_groups, (roomy, roomy), tokens_per_block=p, head_dim=1, max_seq_len=max_seq_len,
                     enable_block_reuse=True),
        spec_mode=w["mode"], max_draft_len=drafts, joint_kv_cache_reuse=w["joint"],
    )
    assert draft.block_reuse == w["joint"]
    if w["joint"]:
        target.pair_joint_reuse(draft)
    # The old sizing of a PARD mirror first seen past 0 backs the prefix: outside its charge (admission refuses it).
    d_charge = (
        list(draft.pages_per_request_charge(chunk, max_seq_len=max_seq_len, aligned=False))
        if w["joint"] or w["mode"] is not Mode.PARD
        else None
    )
    evictions = []
    target.pools()[0].add_listener(lambda e, pages, owner: evictions.append(len(pages)) if e == "evict" else None)

    pending = sorted(enumerate(w["requests"]), key=lambda item: item[1][3])
    live: dict[int, LlmRequest] = {}
    steps_left: dict[int, int] = {}
    hits = 0
    for step in range(400):
        if not pending and not live:
            break
        while pending and pending[0][1][3] <= step:
            rid, (_, _, gen_steps, _) = pending.pop(0)
            tokens = prompts[rid]
            live[rid] = LlmRequest(rid, prompt_len=len(tokens), tokens=list(tokens),
                                   target_view=ContextView(0, min(chunk, len(tokens))))
            steps_left[rid] = gen_steps
        ctx = [r for r in live.values() if r.is_context_init_state]
        gen = [r for r in live.values() if r.is_generation_in_progress_state]
        ran: list[LlmRequest] = []
        for batch in [ScheduledRequests(ctx, gen)] + [ScheduledRequests([r]) for r in ctx] + [
            ScheduledRequests([], [r]) for r in gen
        ]:
            batch = ScheduledRequests(
                [r for r in batch.context_requests if r not in ran], [r for r in batch.generation_requests if r not in ran]
            )
            if not batch.batch_size:
                continue
            before = whole_state(target), whole_state(draft), [(r.target_view.position, r.prepopulated_prompt_len) for r in batch.all_requests()]
            try:
                target.prepare_resources(batch)
            except KVCacheResizeError:
                event("target prepare refused")
                after = whole_state(target), whole_state(draft), [(r.target_view.position, r.prepopulated_prompt_len) for r in batch.all_requests()]
                assert after == before
                continue
            draft.prepare_resources(batch)  # roomy: never refuses
            ran += batch.all_requests()
            for r in batch.context_requests:
                if r.prepopulated_prompt_len and r.target_view.position == r.prepopulated_prompt_len:
                    hits += 1
                    assert r.prepopulated_prompt_len % p == 0 and r.prepopulated_prompt_len < r.prompt_len
            check(target, live, t_charge)
            check(draft, live, d_charge)
        if not ran:
            if not live:
                continue
            # Nobody fits: finish the oldest request (what a scheduler's preemption would do).
            victim = min(live)
            target.free_resources(victim) if target.has_cache(victim) else None
            draft.free_resources(victim) if draft.has_cache(victim) else None
            del live[victim]
            continue
        ctx_ran = [r for r in ran if r.is_context_init_state]
        for r in ctx_ran:
            r.advance_context_chunk(chunk)
            if r.target_view.position >= r.prompt_len:
                r.state = LlmRequestState.GENERATION_IN_PROGRESS
                r.tokens.append(data.draw(VOCAB, label="first token"))
        for r in ran:
            if r not in ctx_ran:
                r.tokens += data.draw(st.lists(VOCAB, min_size=1, max_size=1 + drafts), label="accepted")
                steps_left[r.py_request_id] -= 1
        done = ScheduledRequests(ctx_ran, [r for r in ran if r not in ctx_ran])
        for mgr in (target, draft):
            mgr.update_context_resources(ScheduledRequests(ctx_ran))
            mgr.update_resources(done)
        check(target, live, t_charge)
        check(draft, live, d_charge)
        for r in list(ran):
            if r.is_generation_in_progress_state and steps_left[r.py_request_id] <= 0:
                target.free_resources(r)
                draft.free_resources(r)
                del live[r.py_request_id]
                check(target, live, t_charge)
                check(draft, live, d_charge)
    assert not live and not pending
    event(f"prefix hits: {'some' if hits else 'none'}")
    event(f"evictions: {'some' if evictions else 'none'}")
    for mgr in (target, draft):
        assert mgr.request_ids() == []
        mgr.check_accounting()
        for pool in mgr.pools():
            assert pool.num_held == 0 and pool.num_free == pool.total
            assert pool.num_cached_free + pool.num_plain_free == pool.total
            assert pool.num_cached_free == (pool.prefix.num_published if pool.prefix is not None else 0)
