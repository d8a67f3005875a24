"""Block reuse through the managers: the hit at context init, publishing after chunks, joint draft reuse.

P = 4 throughout; a prompt's pages are block ordinals i covering [4i, 4i + 4).
Expected hits are computed by hand from docs/block_reuse.md.
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
from tensorrt_llm_draftkv.manager.admission import request_charge
from tensorrt_llm_draftkv.request import skip_reused_prefix

P = 4
PREFIX = list(range(100, 128))  # 28 tokens: 7 full pages


def config(groups=((None, 0), (8, 0)), pages=64, reuse=True, p=P) -> KVPoolConfig:
    layer_groups = tuple(LayerGroupConfig(1, window=w, sink_blocks=s) for w, s in groups)
    return KVPoolConfig(layer_groups, (pages,) * len(layer_groups), tokens_per_block=p, head_dim=1,
                        max_seq_len=256, enable_block_reuse=reuse)


def request(rid: int, tokens: list[int], chunk: int = 8) -> LlmRequest:
    req = LlmRequest(rid, prompt_len=len(tokens), tokens=list(tokens))
    req.target_view.chunk_size = min(chunk, len(tokens))
    return req


def check(*managers) -> None:
    for mgr in managers:
        mgr.check_accounting()
        for pool in mgr.pools():
            assert pool.num_held + pool.num_cached_free + pool.num_plain_free == pool.total


def prefill(req: LlmRequest, *managers, chunk: int = 8) -> list[tuple[int, int]]:
    """Chunked prefill through every manager in executor order; returns each chunk's (start, size)."""
    chunks = []
    while True:
        batch = ScheduledRequests([req])
        for mgr in managers:
            mgr.prepare_resources(batch)
        check(*managers)
        chunks.append((req.target_view.position, req.target_view.chunk_size))
        last = req.is_last_context_chunk
        req.advance_context_chunk(chunk)
        for mgr in managers:
            mgr.update_context_resources(batch)
        check(*managers)
        if last:
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
            req.tokens.append(7)
            return chunks


# -- off by default ----------------------------------------------------------------------
def test_block_reuse_is_off_by_default_and_then_nothing_is_published_or_shared():
    cfg = config(reuse=False)
    assert KVPoolConfig(cfg.layer_groups, cfg.pages_per_group).enable_block_reuse is False
    mgr = KVCacheManagerV2.from_pool_config(cfg)
    events = []
    for pool in mgr.pools():
        assert pool.prefix is None and not pool.block_reuse
        pool.add_listener(lambda e, pages, owner: events.append(e))
    for rid in (1, 2):
        req = request(rid, PREFIX + [rid])
        assert prefill(req, mgr)[0] == (0, 8) and req.prepopulated_prompt_len == 0
        assert mgr.find_prefix_hit(request(9, PREFIX + [5])) == 0
    assert set(events) == {"allocate", "release"}
    assert set(mgr.get_cache(1).block_row(0)).isdisjoint(mgr.get_cache(2).block_row(0))


# -- the target's hit ----------------------------------------------------------------------
def test_a_second_request_starts_past_the_shared_pages_and_shares_them():
    mgr = KVCacheManagerV2.from_pool_config(config())
    first = request(1, PREFIX + [1, 2, 3])
    prefill(first, mgr)
    assert mgr.get_cache(1).committed == 31
    second = request(2, PREFIX + [5, 6, 7, 8, 9])
    assert mgr.find_prefix_hit(second) == 28
    mgr.prepare_resources(ScheduledRequests([second]))
    check(mgr)
    assert second.prepopulated_prompt_len == 28 and (second.target_view.position, second.target_view.chunk_size) == (28, 5)
    cache = mgr.get_cache(2)
    assert (cache.capacity, cache.history_length, cache.committed) == (33, 28, 28)
    full_1, full_2 = mgr.get_cache(1).block_row(0), cache.block_row(0)
    assert full_2[:7] == full_1[:7] and all(mgr.pools()[0].refcount(p) == 2 for p in full_2[:7])
    assert set(full_2[7:]).isdisjoint(full_1) and len(full_2) == 9
    # The window group (W = 8) shares only what its window reads at history 28, [21, 28): ordinals 5, 6.
    win_1, win_2 = mgr.get_cache(1).block_row(1), cache.block_row(1)
    assert win_2[:5] == [BAD_PAGE_INDEX] * 5
    pool = mgr.pools()[1]
    # Ordinal 6 is still in the first request's window (shared); ordinal 5 left it, was cached-free, is revived.
    assert win_1[5] == BAD_PAGE_INDEX and win_2[6] == win_1[6] and pool.refcount(win_2[6]) == 2
    assert pool.refcount(win_2[5]) == 1 and pool.is_published(win_2[5]) and not pool.is_writable(win_2[5])
    assert set(win_2[7:]).isdisjoint(win_1) and all(pool.is_writable(p) for p in win_2[7:])
    second.advance_context_chunk(8)
    mgr.update_context_resources(ScheduledRequests([second]))
    check(mgr)


@pytest.mark.parametrize("length,hit", [(28, 24), (29, 28), (32, 28), (5, 4), (4, 0), (1, 0)])
def test_the_hit_always_leaves_at_least_one_token_to_compute(length, hit):
    mgr = KVCacheManagerV2.from_pool_config(config(groups=((None, 0),)))
    prefill(request(1, PREFIX + [1, 2, 3, 4, 5]), mgr)
    req = request(2, (PREFIX + [1, 2, 3, 4, 5])[:length])
    assert mgr.find_prefix_hit(req) == hit
    mgr.prepare_resources(ScheduledRequests([req]))
    assert req.prepopulated_prompt_len == hit and req.target_view.position == hit
    assert req.target_view.chunk_size == min(8, length - hit)
    check(mgr)


def test_a_windowed_hit_fails_when_the_lru_evicted_a_window_page():
    mgr = KVCacheManagerV2.from_pool_config(config(groups=((8, 0),), pages=16))
    pool = mgr.pools()[0]
    tokens = list(range(200, 241))  # 41 tokens: the cap is 10 pages
    keys = mgr.caches.new(2).keys.chain(0, tokens, 10)
    p7, p8, p9 = pool.allocate(3, owner="seed")
    for page, key in zip((p7, p8, p9), keys[7:10]):
        pool.publish(page, key)
    pool.release([p9], owner="seed")  # cached first: the least recently used
    pool.release([p7, p8], owner="seed")
    # At a hit of 10 pages (history 40) the window reads [33, 40): ordinals 8 and 9 only.
    assert mgr.find_prefix_hit(request(2, tokens)) == 40
    filler = pool.allocate(pool.num_plain_free + 1, owner="filler")  # one eviction: page 9's
    assert p9 in filler and pool.lookup(keys[9]) is None and pool.lookup(keys[8]) == p8
    pool.release(filler, owner="filler")
    # 40 now fails; 36 reads [29, 36): ordinals 7 and 8, both cached.
    req = request(2, tokens)
    assert mgr.find_prefix_hit(req) == 36
    mgr.prepare_resources(ScheduledRequests([req]))
    assert req.prepopulated_prompt_len == 36 and mgr.get_cache(2).block_row(0)[7:9] == [p7, p8]
    check(mgr)


def test_the_hit_ignores_evicted_low_pages_of_a_window_group():
    """A crafted pool: only ordinals 8 and 9 of the prompt are cached; a window group hits 40 tokens,
    a full-attention group nothing."""
    tokens = list(range(300, 341))
    for groups, expected in (((8, 0),), 40), (((None, 0),), 0):
        mgr = KVCacheManagerV2.from_pool_config(config(groups=groups, pages=16))
        pool = mgr.pools()[0]
        keys = mgr.caches.new(1).keys.chain(0, tokens, 10)
        pages = pool.allocate(2, owner="seed")
        for page, key in zip(pages, keys[8:10]):
            pool.publish(page, key)
        pool.release(pages, owner="seed")
        req = request(1, tokens)
        assert mgr.find_prefix_hit(req) == expected
        mgr.prepare_resources(ScheduledRequests([req]))
        assert req.prepopulated_prompt_len == expected
        if expected:
            assert mgr.get_cache(1).block_row(0) == [BAD_PAGE_INDEX] * 8 + pages + [mgr.get_cache(1).block_row(0)[10]]
        check(mgr)


# -- the draft pool ----------------------------------------------------------------------------
def pair(mode=Mode.DFLASH, joint=True, draft_groups=((8, 0), (None, 0))):
    target = KVCacheManagerV2.from_pool_config(config(), max_draft_len=2)
    draft = DraftKVCacheManagerV2.from_pool_config(config(groups=draft_groups), spec_mode=mode, max_draft_len=2,
                                  joint_kv_cache_reuse=joint)
    if joint:
        target.pair_joint_reuse(draft)
    return target, draft


def test_joint_reuse_shares_the_drafters_prefix_pages_in_the_draft_pool():
    target, draft = pair()
    prefill(request(1, PREFIX + [1, 2, 3]), target, draft)
    second = request(2, PREFIX + [5, 6, 7])
    prefill(second, target, draft)
    assert second.prepopulated_prompt_len == 28
    d1, d2 = draft.get_cache(1), draft.get_cache(2)
    full = draft.pools()[1]
    assert d2.block_row(1)[:7] == d1.block_row(1)[:7]
    # The drafter may read these pages, never write them: each is shared and published.
    assert all(full.is_shared(p) and not full.is_writable(p) for p in d2.block_row(1)[:7])
    assert all(full.is_writable(p) for p in d2.block_row(1)[7:] if not full.is_published(p))
    # The draft keys are salted by the draft pool's geometry: the same tokens, other keys.
    assert d2.keys.chain(1, second.tokens, 7) != target.get_cache(2).keys.chain(0, second.tokens, 7)
    for rid in (1, 2):
        target.free_resources(rid)
        draft.free_resources(rid)
    check(target, draft)
    for pool in target.pools() + draft.pools():
        assert pool.num_held == 0 and pool.num_free == pool.total


def test_without_joint_reuse_a_dflash_mirror_takes_the_chunk_start_as_history():
    target, draft = pair(joint=False)
    assert not draft.block_reuse and all(p.prefix is None for p in draft.pools())
    prefill(request(1, PREFIX + [1]), target, draft)
    second = request(2, PREFIX + [5, 6])
    batch = ScheduledRequests([second])
    target.prepare_resources(batch)
    draft.prepare_resources(batch)
    mirror = draft.get_cache(2)
    assert second.prepopulated_prompt_len == 28 and mirror.history_length == 28
    assert all(p != BAD_PAGE_INDEX for p in mirror.block_row(1)) and mirror.committed == 0
    assert not set(mirror.held_pages(1)) & set(draft.get_cache(1).held_pages(1))
    check(target, draft)


def test_without_joint_reuse_a_pard_mirror_keeps_the_old_sizing_past_zero():
    target, draft = pair(mode=Mode.PARD, joint=False)
    prefill(request(1, PREFIX + [1]), target, draft)
    second = request(2, PREFIX + [5, 6])
    batch = ScheduledRequests([second])
    target.prepare_resources(batch)
    draft.prepare_resources(batch)
    mirror = draft.get_cache(2)
    assert mirror.history_length == 0 and mirror.capacity == 30 + 2
    assert all(p != BAD_PAGE_INDEX for p in mirror.block_row(1))


def test_a_joint_hit_counts_only_pages_both_pools_hold():
    target, draft = pair()
    prefill(request(1, PREFIX + [1]), target, draft)
    target.free_resources(1)
    draft.free_resources(1)
    # Evict every cached page of the draft pool's full group: allocate the whole pool once.
    pool = draft.pools()[1]
    pages = pool.allocate(pool.total, owner="filler")
    pool.release(pages, owner="filler")
    req = request(2, PREFIX + [5])
    assert target.find_prefix_hit(req) == 0
    prefill(req, target, draft)
    assert req.prepopulated_prompt_len == 0


def test_a_joint_mirror_told_to_reuse_pages_its_pool_lacks_fails_explicitly_and_changes_nothing():
    _, draft = pair()
    req = request(5, PREFIX + [1])
    skip_reused_prefix(req, 16, draft.tokens_per_block)
    before = [p.state() for p in draft.pools()]
    with pytest.raises(KVCacheResizeError, match=r"request 5: it reuses 16 prompt tokens but layer group 0"):
        draft.prepare_resources(ScheduledRequests([req]))
    assert [p.state() for p in draft.pools()] == before and not draft.has_cache(5)


def test_pairing_needs_reuse_on_both_pools_and_one_page_size():
    target = KVCacheManagerV2.from_pool_config(config())
    not_joint = DraftKVCacheManagerV2.from_pool_config(config(), spec_mode=Mode.DFLASH)
    with pytest.raises(ValueError, match="needs block reuse on both pools"):
        target.pair_joint_reuse(not_joint)
    other_p = DraftKVCacheManagerV2.from_pool_config(config(p=8), spec_mode=Mode.DFLASH, joint_kv_cache_reuse=True)
    with pytest.raises(ValueError, match="P=4.*P=8"):
        target.pair_joint_reuse(other_p)
    with pytest.raises(ValueError, match="itself"):
        target.pair_joint_reuse(target)


# -- atomicity, finishing, charges -----------------------------------------------------------
def test_a_refused_batch_puts_back_the_hit_the_views_and_every_pool():
    mgr = KVCacheManagerV2.from_pool_config(config(pages=12))
    prefill(request(1, PREFIX + [1]), mgr)
    mgr.free_resources(1)
    hit = request(2, PREFIX + [5, 6])
    huge = request(3, [1] * 200, chunk=200)
    before = [p.state() for p in mgr.pools()]
    with pytest.raises(KVCacheResizeError, match="request 3"):
        mgr.prepare_resources(ScheduledRequests([hit, huge]))
    assert (hit.target_view.position, hit.target_view.chunk_size, hit.prepopulated_prompt_len) == (0, 8, 0)
    assert [p.state() for p in mgr.pools()] == before and mgr.request_ids() == []
    mgr.prepare_resources(ScheduledRequests([hit]))
    assert hit.prepopulated_prompt_len == 28
    check(mgr)


def test_a_failed_update_unpublishes_what_it_published(monkeypatch):
    from tensorrt_llm_draftkv.manager.prefix_reuse import PrefixReuse

    mgr = KVCacheManagerV2.from_pool_config(config())
    reqs = [request(1, PREFIX + [1]), request(2, [5] * 20)]
    batch = ScheduledRequests(reqs)
    mgr.prepare_resources(batch)
    for req in reqs:
        req.advance_context_chunk(8)
    before = ([p.state() for p in mgr.pools()], [mgr.get_cache(r).checkpoint() for r in (1, 2)])
    real = PrefixReuse.publish_history

    def fail_on_two(self, req, position):
        real(self, req, position)  # request 1 publishes its first two pages, then request 2 fails
        if req.py_request_id == 2:
            raise RuntimeError("executor died")

    monkeypatch.setattr(PrefixReuse, "publish_history", fail_on_two)
    with pytest.raises(RuntimeError, match="executor died"):
        mgr.update_context_resources(batch)
    assert ([p.state() for p in mgr.pools()], [mgr.get_cache(r).checkpoint() for r in (1, 2)]) == before
    assert mgr.pools()[0].prefix.num_published == 0 and mgr.get_cache(1).keys.num_known(0) == 0
    monkeypatch.setattr(PrefixReuse, "publish_history", real)
    mgr.update_context_resources(batch)
    assert mgr.pools()[0].prefix.num_published == 4 and mgr.get_cache(1).committed == 8
    check(mgr)


def test_finishing_every_request_returns_every_page_to_free_or_cached_free():
    target, draft = pair()
    reqs = [request(rid, PREFIX[: 8 + 4 * rid] + [rid] * rid) for rid in range(1, 5)]
    for req in reqs:
        prefill(req, target, draft)
    assert sum(r.prepopulated_prompt_len for r in reqs) > 0
    for req in reqs:
        target.free_resources(req)
        draft.free_resources(req)
        check(target, draft)
    for pool in target.pools() + draft.pools():
        assert pool.num_held == 0 and pool.num_free == pool.total
        assert pool.num_cached_free == pool.prefix.num_published > 0


def test_with_reuse_a_request_holds_no_more_unique_pages_than_without_and_stays_within_its_charge():
    groups = ((None, 0), (8, 1))
    charge = request_charge(config(groups=groups).layer_groups, P, chunk=8, max_seq_len=64, max_draft_len=2,
                            aligned=False)
    shared = KVCacheManagerV2.from_pool_config(config(groups=groups), max_draft_len=2)
    alone = KVCacheManagerV2.from_pool_config(config(groups=groups, reuse=False), max_draft_len=2)
    prefill(request(1, PREFIX + [1, 2]), shared)
    a, b = request(2, PREFIX + [3, 4, 5]), request(2, PREFIX + [3, 4, 5])
    prefill(b, alone)
    held_alone = [alone.get_cache(2).num_held_pages(g) for g in range(2)]
    prefill(a, shared)
    assert a.prepopulated_prompt_len == 28
    cache = shared.get_cache(2)
    for g, pool in enumerate(shared.pools()):
        unique = sum(1 for p in cache.held_pages(g) if pool.refcount(p) == 1)
        assert unique <= held_alone[g] and cache.num_held_pages(g) <= charge[g]
    assert sum(1 for p in cache.held_pages(0) if shared.pools()[0].refcount(p) == 1) < held_alone[0]


# -- planning -----------------------------------------------------------------------------------
def test_prefix_reuse_savings_per_pool():
    import torch

    from tensorrt_llm_draftkv.manager.plan_format import format_savings
    from tensorrt_llm_draftkv.manager.planner import PoolGeometry
    from tensorrt_llm_draftkv.manager.reuse_savings import prefix_reuse_savings

    geometry = PoolGeometry(
        (LayerGroupConfig(5, window=4096), LayerGroupConfig(2, window=None)), num_kv_heads=4, head_dim=128,
        dtype=torch.bfloat16, tokens_per_block=32, tp_size=2,
    )
    saved = prefix_reuse_savings("draft", geometry, 65536 + 17, trail_tokens=32)
    # Whole pages only: 2048. The window (4096 + the 32-token trail) at history 65536 reads
    # [65536 + 1 - 4128, 65536): ordinals 1919 .. 2047 = 129 pages; full attention keeps all 2048.
    assert saved.reused_tokens == 65536 and saved.pages_per_group == (129, 2048)
    page = 2 * 4 * 128 * 2 * 32  # K and V x heads x dims x bf16 bytes x tokens, per layer
    assert saved.bytes_per_group == (129 * 5 * page, 2048 * 2 * page)
    assert saved.bytes_per_group_per_rank == (129 * 5 * page // 2, 2048 * 2 * page // 2)
    assert "129, 2048" in format_savings(saved) and "65553 tokens (65536 reused" in format_savings(saved)
    assert prefix_reuse_savings("draft", geometry, 31).pages == 0
    with pytest.raises(ValueError, match="got -1"):
        prefix_reuse_savings("draft", geometry, -1)


def test_plan_prints_the_shared_prefix_savings(capsys):
    from tensorrt_llm_draftkv.__main__ import main

    assert main(["plan", "--shared-prefix", "65536", "--target-num-full-layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "shared prefix of 65536 tokens (65536 reused, whole pages): 129 pages" in out  # dspark: trail page
    assert "2048 pages" in out and "target pool" in out


def test_dummies_are_never_published_nor_given_a_hit():
    mgr = KVCacheManagerV2.from_pool_config(config())
    prefill(request(1, [0] * 33), mgr)  # a real request of zeros publishes 8 pages per group
    published = mgr.pools()[0].prefix.num_published
    (dummy,) = mgr.add_dummy_requests([50], [33])
    assert dummy.prepopulated_prompt_len == 0 and mgr.get_cache(50).committed == 0
    dummy.advance_context_chunk()
    mgr.update_context_resources(ScheduledRequests([dummy]))
    assert mgr.pools()[0].prefix.num_published == published and mgr.get_cache(50).committed == 0
    check(mgr)


# -- a target-only hit that leaves the drafter its window ----------------------------------------------------
@pytest.mark.parametrize(
    "prompt_len,windows,p,cap",
    [
        (1061, (256,), 16, 800),  # (1061 + 1 - 256) // 16 * 16
        (1061, (256, 128), 16, 800),  # the widest window decides
        (1061, (256, None), 16, 0),  # a full-attention draft group reads the whole prompt
        (200, (256,), 16, 0),  # the window covers the whole prompt
        (287, (32,), 4, 256),  # m + 1 - W = 256 starts a page exactly
    ],
)
def test_the_drafter_window_cap_table(prompt_len, windows, p, cap):
    from tensorrt_llm_draftkv.manager.rules import drafter_window_hit_cap

    assert drafter_window_hit_cap(prompt_len, windows, p) == cap


def test_keep_drafter_window_stops_the_hit_short_of_the_draft_window():
    """Full-attention target, draft window 12: a 31-token prompt's drafter reads [20, 31) at its first
    generation step, so the hit stops at 20 (page 5), not at the 28 cached tokens."""
    target = KVCacheManagerV2.from_pool_config(config(groups=((None, 0),)))
    draft = DraftKVCacheManagerV2.from_pool_config(
        KVPoolConfig((LayerGroupConfig(1, window=12),), (64,), tokens_per_block=P, head_dim=1, max_seq_len=256),
        spec_mode=Mode.DFLASH, max_draft_len=2,
    )
    prefill(request(1, PREFIX + [1, 2, 3]), target)
    assert target.find_prefix_hit(request(2, PREFIX + [5, 6, 7])) == 28
    target.keep_drafter_window(draft)
    second = request(2, PREFIX + [5, 6, 7])
    assert target.find_prefix_hit(second) == 20
    prefill(second, target, draft)
    assert second.prepopulated_prompt_len == 20 and draft.get_cache(2).history_length >= 20
    # the draft mirror, first seen at 20, backs what the drafter stores from there on
    assert draft.get_cache(2).block_row(0)[5] != BAD_PAGE_INDEX


def test_keep_drafter_window_refuses_a_joint_partner_and_a_pool_without_reuse():
    target = KVCacheManagerV2.from_pool_config(config(groups=((None, 0),)))
    draft_cfg = KVPoolConfig((LayerGroupConfig(1, window=12),), (64,), tokens_per_block=P, head_dim=1,
                             max_seq_len=256, enable_block_reuse=True)
    joint = DraftKVCacheManagerV2.from_pool_config(draft_cfg, spec_mode=Mode.DFLASH, max_draft_len=2, joint_kv_cache_reuse=True)
    target.pair_joint_reuse(joint)
    with pytest.raises(ValueError, match="paired for joint reuse"):
        target.keep_drafter_window(joint)
    plain = KVCacheManagerV2.from_pool_config(config(groups=((None, 0),), reuse=False))
    with pytest.raises(ValueError, match="needs block reuse"):
        plain.keep_drafter_window(joint)


def test_a_joint_hit_checks_the_drafters_window_with_its_trail_page():
    """Upstream's staging-lender check, here: a joint DFlash draft pool's hit rule reads the window
    widened by the trail page. Target full attention; draft window 8 (12 with the trail page), P 4,
    a 31-token prompt prefilled in chunks of 16. The draft pool then has ordinals 5 and 6 published
    but not 4 (released at history 31 before it was published), so the unwidened window (8 tokens,
    ordinals >= 5 at a 28-token hit) would accept 28 and read ordinal 4 through the trail page."""
    from tensorrt_llm_draftkv.runtime.prefix_cache import longest_valid_prefix

    target = KVCacheManagerV2.from_pool_config(config(groups=((None, 0),)), max_draft_len=2)
    draft = DraftKVCacheManagerV2.from_pool_config(config(groups=((8, 0),)), spec_mode=Mode.DFLASH, max_draft_len=2,
                                                   joint_kv_cache_reuse=True)
    target.pair_joint_reuse(draft)
    assert draft.windows == (12,)
    prefill(request(1, PREFIX + [1, 2, 3], chunk=16), target, draft, chunk=16)
    second = request(2, PREFIX + [5, 6, 7], chunk=16)
    found = draft.prefix_reuse.lookup(second, 7)
    present = found.present()
    assert present[0][4] is False and present[0][5] and present[0][6]
    assert longest_valid_prefix([(8, 0)], present, 7, P) == 7  # what the window without its trail page would take
    assert target.find_prefix_hit(second) == 16
    batch = ScheduledRequests([second])
    target.prepare_resources(batch)
    draft.prepare_resources(batch)
    assert second.prepopulated_prompt_len == 16
    # at history 16 the widened window reads ordinals >= (16 + 1 - 12) // 4 = 1: all adopted, backed
    assert draft.get_cache(2).history_length == 16
    assert all(page >= 0 for page in draft.get_cache(2).block_row(0)[1:4])
    prefill(second, target, draft, chunk=16)
    check(target, draft)
