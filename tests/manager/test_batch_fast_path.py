"""The batch fast path of prepare_resources / update_resources (`runtime.batch_resize`) leaves
exactly the state, and raises exactly the errors, of the journaled per-request path.

Two managers are driven the same way, one forced onto the per-request path; after every
call their caches' checkpoints, their pools (free-list order included) and any error must
be the same. Small pools run out mid-batch; windows, sinks, full attention, a two-group
pool, warmup dummies, rejected drafts and steps past the reserved slots are all drawn.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorrt_llm_draftkv import (
    DraftKVCacheManagerV2,
    KVCacheManagerV2,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    ScheduledRequests,
)
from tensorrt_llm_draftkv.runtime import KVCache, LayerGroup, LifeCycle, PagePool, batch_resize

P = 4
DRAFTS = 3

GROUPS = {
    "window": (LayerGroupConfig(1, window=12),),
    "window-sinks": (LayerGroupConfig(1, window=9, sink_blocks=1),),
    "full": (LayerGroupConfig(1),),
    "window+full": (LayerGroupConfig(1, window=10), LayerGroupConfig(1)),
}


def _manager(kind: str, groups: str, pages: int) -> KVCacheManagerV2:
    layer_groups = GROUPS[groups]
    cfg = KVPoolConfig(layer_groups, pages_per_group=(pages,) * len(layer_groups), tokens_per_block=P,
                       head_dim=1, max_seq_len=1024)
    if kind == "draft":
        return DraftKVCacheManagerV2.from_pool_config(cfg, spec_mode="dflash", max_draft_len=DRAFTS,
                                                      num_extra_kv_tokens=2)
    return KVCacheManagerV2.from_pool_config(cfg, max_draft_len=DRAFTS)


def _state(mgr: KVCacheManagerV2) -> tuple:
    caches = tuple((rid, mgr.get_cache(rid).checkpoint()) for rid in mgr.request_ids())
    return caches, tuple(p.state() for p in mgr.pools())


def _outcome(call) -> tuple[str, str] | None:
    try:
        call()
    except Exception as err:  # the same type and message from both paths
        return type(err).__name__, str(err)
    return None


step = st.tuples(
    st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True),  # which live requests, in order
    st.lists(st.integers(0, DRAFTS + 1), min_size=8, max_size=8),  # accepted + bonus per request (0: none)
    st.booleans(),  # one request jumps far past its reserved slots
)


@settings(deadline=None, max_examples=150)
@given(
    kind=st.sampled_from(["draft", "target"]),
    groups=st.sampled_from(sorted(GROUPS)),
    pages=st.integers(6, 40),
    prompts=st.lists(st.integers(1, 60), min_size=1, max_size=6),
    dummies=st.integers(0, 2),
    steps=st.lists(step, min_size=1, max_size=12),
)
def test_fast_and_journaled_paths_leave_the_same_state(kind, groups, pages, prompts, dummies, steps):
    fast = _manager(kind, groups, pages)
    slow = _manager(kind, groups, pages)
    slow._resize_known_to_fit = lambda *args: False  # the per-request path, always
    live: list[LlmRequest] = []
    for rid, prompt in enumerate(prompts):
        req = LlmRequest(rid, prompt_len=prompt, state=LlmRequestState.DISAGG_GENERATION_INIT)
        req.tokens.append(1)
        ok = fast.prepare_disagg_gen_init(req)
        assert slow.prepare_disagg_gen_init(req) == ok
        if ok:
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
            live.append(req)
    if dummies:
        ids = [100 + i for i in range(dummies)]
        made = fast.add_dummy_requests(ids, is_gen=True, max_num_draft_tokens=DRAFTS)
        assert (slow.add_dummy_requests(ids, is_gen=True, max_num_draft_tokens=DRAFTS) is None) == (made is None)
        live += made or []
    assert _state(fast) == _state(slow)
    for picks, advances, jump in steps:
        batch_reqs = [live[i] for i in picks if i < len(live)]
        if not batch_reqs:
            continue
        batch = ScheduledRequests(generation_requests=batch_reqs)
        failed = _outcome(lambda: fast.prepare_resources(batch))
        assert _outcome(lambda: slow.prepare_resources(batch)) == failed
        assert _state(fast) == _state(slow)
        if failed:
            continue
        for req, n in zip(batch_reqs, advances):
            req.tokens.extend([1] * n)  # fewer than DRAFTS + 1: drafts rejected
        if jump:
            batch_reqs[0].tokens.extend([1] * 3 * P)  # history past the reserved capacity
        outcome = _outcome(lambda: fast.update_resources(batch))
        assert _outcome(lambda: slow.update_resources(batch)) == outcome
        assert _state(fast) == _state(slow)
        fast.check_accounting()


def _cache_pair(window: int | None, pages: int) -> tuple[list[LayerGroup], list[KVCache]]:
    groups = [LayerGroup(LifeCycle(window), PagePool(pages, tokens_per_block=P, head_dim=1))]
    return groups, [KVCache(groups, P, name=f"r{i}", owner=i) for i in range(2)]


def test_a_short_pool_at_the_second_request_changes_nothing():
    groups, caches = _cache_pair(None, 3)
    before = [c.checkpoint() for c in caches], groups[0].pool.state()
    # 2 pages for the first, 2 for the second: the pool has 3, so the batch is refused whole
    assert batch_resize.plan_in_order(groups, caches, [(8, 0), (8, 0)]) is None
    assert not batch_resize.resize_in_order(groups, caches, [(8, 0), (8, 0)])
    assert ([c.checkpoint() for c in caches], groups[0].pool.state()) == before
    assert batch_resize.resize_in_order(groups, caches, [(8, 0), (4, 0)])
    assert [c.capacity for c in caches] == [8, 4] and groups[0].pool.num_free == 0


def test_pages_a_request_gives_back_count_for_the_ones_after_it():
    groups, caches = _cache_pair(4, 3)
    assert caches[0].resize(12, 0)  # 3 pages, none free
    # the first's window releases 2 pages (history 11: stale below (11+1-4)//4 = 2), the second takes them
    assert batch_resize.resize_in_order(groups, caches, [(12, 11), (8, 0)])
    assert caches[1].block_row(0) == [1, 0]  # the released pages, popped from the free list's end


@pytest.mark.parametrize("sizes", [[(4, 8)], [(-1, None)], [(4, 0), (8, 2)]])
def test_an_invalid_size_or_a_repeated_cache_takes_the_journaled_path(sizes):
    groups, caches = _cache_pair(None, 8)
    named = [caches[0]] * len(sizes)  # the third case names one cache twice
    before = caches[0].checkpoint()
    assert not batch_resize.resize_in_order(groups, named, sizes)
    assert caches[0].checkpoint() == before


def test_pools_with_listeners_or_block_reuse_are_not_plain():
    groups, _ = _cache_pair(None, 4)
    assert batch_resize.plain_pools(groups)
    groups[0].pool.add_listener(lambda event, pages, owner: None)
    assert not batch_resize.plain_pools(groups)
    reuse = [LayerGroup(LifeCycle(None), PagePool(4, tokens_per_block=P, head_dim=1, block_reuse=True))]
    assert not batch_resize.plain_pools(reuse)


def test_the_batch_sizing_rules_are_the_per_request_ones():
    from tensorrt_llm_draftkv.manager import rules

    # history = tokens - 1, never below the cache's; capacity one above it
    assert rules.after_step_sizes([10, 3, 1], [4, 7, 0]) == [(10, 9), (8, 7), (1, 0)]
    assert [rules.after_step_sizing(t, h) for t, h in [(10, 4), (3, 7), (1, 0)]] == [(10, 9), (8, 7), (1, 0)]
    sizing = rules.StepSizing(max_draft_len=3, num_extra_kv_tokens=2)
    reqs = [LlmRequest(i, prompt_len=5, tokens=[1] * (5 + i)) for i in range(3)]
    assert sizing.generation_sizes(reqs) == [sizing.generation(r, None) for r in reqs] == [(10, None), (11, None), (12, None)]


def test_after_a_step_a_cache_keeps_only_the_slots_the_next_step_reserves():
    from tensorrt_llm_draftkv.manager import rules

    # tokens, history, capacity before the update, headroom 6: capacity = max(h + 1, min(c, h + 6))
    tokens, hist, caps = [10, 10, 10, 30, 3], [4, 4, 4, 4, 7], [20, 12, 9, 9, 8]
    assert rules.after_step_sizes(tokens, hist, caps, 6) == [(15, 9), (12, 9), (10, 9), (30, 29), (8, 7)]
    assert [rules.after_step_sizing(t, h, c, 6) for t, h, c in zip(tokens, hist, caps)] == \
        rules.after_step_sizes(tokens, hist, caps, 6)
    assert rules.after_step_sizes(tokens, hist, caps, 1) == rules.after_step_sizes(tokens, hist)


@pytest.mark.parametrize("kind", ["draft", "target"])
def test_a_draft_mirror_does_not_give_back_a_page_the_next_prepare_takes_again(kind):
    mgr = _manager(kind, "window", 64)
    req = LlmRequest(1, prompt_len=9, state=LlmRequestState.DISAGG_GENERATION_INIT)
    req.tokens.append(1)
    assert mgr.prepare_disagg_gen_init(req)
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    batch = ScheduledRequests(generation_requests=[req])
    headroom = mgr.generation_headroom
    churn = 0
    for _ in range(24):
        mgr.prepare_resources(batch)
        cache = mgr.get_cache(1)
        reserved, held = cache.capacity, cache.num_held_pages()
        req.tokens.append(1)  # every draft rejected: one new token
        mgr.update_resources(batch)
        h = req.max_beam_num_tokens - 1
        if kind == "draft":
            assert cache.capacity == max(h + 1, min(reserved, h + headroom))
        else:  # upstream's rule: only the next token's slot
            assert cache.capacity == h + 1
        churn += held - cache.num_held_pages() > 0 and cache.num_blocks < -(-reserved // P)
        mgr.check_accounting()
    # the draft mirror never drops a top page the next prepare grows back into; the target does
    assert (churn == 0) == (kind == "draft")


@pytest.mark.parametrize("kind", ["draft", "target"])
def test_a_generation_batch_naming_a_request_twice_is_refused_and_changes_nothing(kind):
    """The generation-only fast path looks the batch up once; a request named twice must still get the
    error naming it, with every cache and pool as before."""
    mgr = _manager(kind, "window", 64)
    reqs = []
    for rid in (1, 2):
        req = LlmRequest(rid, prompt_len=9, state=LlmRequestState.DISAGG_GENERATION_INIT)
        req.tokens.append(1)
        assert mgr.prepare_disagg_gen_init(req)
        req.state = LlmRequestState.GENERATION_IN_PROGRESS
        req.tokens += [1] * 7  # the next step crosses a page: a resize would change rows
        reqs.append(req)
    before = _state(mgr)
    with pytest.raises(ValueError, match=r"requests \[2\] appear more than once"):
        mgr.prepare_resources(ScheduledRequests(generation_requests=[reqs[1], reqs[0], reqs[1]]))
    assert _state(mgr) == before


def _one_group_caches(window: int, sinks: int, pages: int, count: int) -> tuple[list[LayerGroup], list[KVCache]]:
    groups = [LayerGroup(LifeCycle(window, sink_blocks=sinks), PagePool(pages, tokens_per_block=P, head_dim=1))]
    caches = [KVCache(groups, P, name=f"r{i}", owner=i) for i in range(count)]
    for cache in caches:
        cache.changes.start(set())
    return groups, caches


def _full_state(groups: list[LayerGroup], caches: list[KVCache]) -> tuple:
    """What the resizes left, the change logs (drained) and the counters a mirror reads included."""
    return (tuple(c.checkpoint() for c in caches), groups[0].pool.state(),
            tuple(tuple((g, list(o), None if p is None else list(p)) for g, o, p in c.changes.drain()) for c in caches),
            tuple(c.num_held_pages() for c in caches), tuple(c.version for c in caches))


@settings(deadline=None, max_examples=200)
@given(
    window=st.integers(P, 5 * P),
    sinks=st.integers(0, 1),
    pages=st.integers(4, 40),
    prompts=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    steps=st.lists(st.lists(st.tuples(st.integers(0, 2 * P), st.integers(0, 2 * P)), min_size=5, max_size=5),
                   min_size=1, max_size=16),
)
def test_a_page_crossing_taken_in_one_step_is_the_resize_it_replaces(window, sinks, pages, prompts, steps):
    """`resize_in_order` answers one-group windowed page crossings without a plan
    (`KVCache.one_page_step`): the same rows, settled marks, pool free list, change-log chunks, held
    counts and versions as consecutive `resize` calls, with pools running short mid-batch."""
    fast_groups, fast = _one_group_caches(window, sinks, pages, len(prompts))
    slow_groups, slow = _one_group_caches(window, sinks, pages, len(prompts))
    for caches in (fast, slow):
        for cache, prompt in zip(caches, prompts):
            cache.resize(prompt, 0)
    taken = 0
    for moves in steps:
        # capacity and history each grow by a few tokens (history never past capacity): crossings of
        # one page at either end, several at once, and steps inside a page
        sizes = []
        for cache, (grow, advance) in zip(fast, moves):
            capacity = cache.capacity + grow
            sizes.append((capacity, min(capacity, cache.history_length + advance)))
        done = batch_resize.resize_in_order(fast_groups, fast, sizes)
        if done:
            taken += sum(c.one_page_step(*size) != 0 for c, size in zip(slow, sizes))
            for cache, (capacity, history) in zip(slow, sizes):
                assert cache.resize(capacity, history)
        assert _full_state(fast_groups, fast) == _full_state(slow_groups, slow)


def test_the_two_page_crossings_are_the_only_steps_taken_without_a_plan():
    groups, caches = _one_group_caches(8, 0, 16, 1)
    cache = caches[0]
    cache.resize(8, 0)  # ordinals 0, 1
    assert cache.one_page_step(9, 0) == 1  # ordinal 2 at the end
    assert cache.one_page_step(13, 0) == 0  # two ordinals more: a plan
    cache.resize(16, 11)  # history 11 in a window of 8: ordinal 0 stale, (11 + 1 - 8) // 4 = 1
    assert cache.block_row(0)[0] == -1 and cache.settled_blocks(0) == 1
    assert cache.one_page_step(16, 15) == -1  # (15 + 1 - 8) // 4 = 2: ordinal 1 goes stale
    assert cache.one_page_step(16, 19) == 0  # ordinals 1 and 2 at once: a plan
    assert cache.one_page_step(16, 8) == 0  # history going back: resize refuses it
    assert cache.one_page_step(17, 8) == 0  # the same with a page more
    assert cache.one_page_step(12, 15) == 0  # history past capacity: resize refuses it
    assert cache.one_page_step(8, 8) == 0  # a shrink
    cache.begin_journal()
    assert cache.one_page_step(16, 15) == 0  # the journal's undo record needs the plan
    _, (sunk,) = _one_group_caches(8, 1, 16, 1)
    sunk.resize(12, 0)
    # a sink block: ordinal 0 is never stale, though the stale range's end (1) is one past the settled mark
    assert sunk.one_page_step(12, 4) == 0
