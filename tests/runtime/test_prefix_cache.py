"""Block reuse in the runtime: the key chain, the sliding-window hit, LRU eviction, refcounts, the journal.

Coordinates: block ordinals (ordinal i covers positions [i*P, (i+1)*P)) and page
indices. Expected values are written out by hand from docs/block_reuse.md.
"""
from __future__ import annotations

import pytest

from tensorrt_llm_draftkv.runtime import BAD_PAGE_INDEX, KVCache, LayerGroup, LifeCycle, OutOfPagesError, PagePool
from tensorrt_llm_draftkv.runtime.prefix_cache import chain_root, longest_valid_prefix, page_keys

P = 4


def reuse_pool(pages: int = 8, salt=("geo", P)) -> PagePool:
    return PagePool(pages, tokens_per_block=P, head_dim=2, block_reuse=True, reuse_salt=salt)


def accounting(pool: PagePool) -> None:
    """The identity docs/block_reuse.md states, checked from the public counters too."""
    pool.check_accounting()
    assert pool.num_held + pool.num_cached_free + pool.num_plain_free == pool.total
    assert pool.num_free == pool.num_cached_free + pool.num_plain_free


class Events:
    def __init__(self, pool: PagePool) -> None:
        self.seen: list[tuple[str, list[int], object]] = []
        pool.add_listener(lambda e, pages, owner: self.seen.append((e, pages, owner)))


# -- the key chain -------------------------------------------------------------------------
TOKENS = list(range(100, 118))  # 4 full pages and a partial one of 2 tokens


def test_same_tokens_and_salt_give_the_same_keys_and_the_partial_page_is_never_keyed():
    root = chain_root(("geo", P), 0, None, 0)
    a = page_keys(TOKENS, P, root, end=4)
    b = page_keys(list(TOKENS), P, chain_root(("geo", P), 0, None, 0), end=4)
    assert a == b
    assert [k[2] for k in a] == [tuple(TOKENS[i * P : (i + 1) * P]) for i in range(4)]
    # Each key's parent is the link of the page before; the first page's is the root.
    assert a[0][1] == root and all(a[i][1] == a[i - 1][0] for i in range(1, 4))
    assert all(k[0] == hash((k[1], hash(k[2]))) for k in a)
    with pytest.raises(ValueError, match=r"up to ordinal 5 need 20 token ids, got 18"):
        page_keys(TOKENS, P, root, end=5)


@pytest.mark.parametrize("position", [0, 5, 15])
def test_any_token_change_changes_its_page_and_every_later_key(position):
    root = chain_root("s", 0, None, 0)
    base = page_keys(TOKENS, P, root, end=4)
    changed = list(TOKENS)
    changed[position] += 1
    other = page_keys(changed, P, root, end=4)
    page = position // P
    assert other[:page] == base[:page]
    assert all(o[0] != b[0] for o, b in zip(other[page:], base[page:]))  # the links differ too


@pytest.mark.parametrize(
    "other",
    [
        (("geo", 8), 0, None, 0),  # page size
        (("geo", P, "kv1"), 0, None, 0),  # kv layout
        (("geo", P), 1, None, 0),  # group index
        (("geo", P), 0, 64, 0),  # window
        (("geo", P), 0, None, 1),  # sinks
    ],
)
def test_a_different_salt_gives_different_keys_for_the_same_tokens(other):
    mine = page_keys(TOKENS, P, chain_root(("geo", P), 0, None, 0), end=4)
    theirs = page_keys(TOKENS, P, chain_root(*other), end=4)
    assert all(a[0] != b[0] and a[2] == b[2] for a, b in zip(mine, theirs))


def test_a_different_parent_gives_a_different_key_for_the_same_page():
    root = chain_root("s", 0, None, 0)
    keys = page_keys(TOKENS, P, root, end=4)
    again = page_keys(TOKENS, P, root, first=2, end=4, parent=keys[1][0])
    assert again == keys[2:]
    moved = page_keys(TOKENS, P, root, first=2, end=4, parent=keys[0][0])
    assert moved[0][0] != keys[2][0] and moved[0][2] == keys[2][2]
    with pytest.raises(ValueError, match="parent link of ordinal 1"):
        page_keys(TOKENS, P, root, first=2, end=4)


def test_the_root_is_the_same_in_every_process():
    # blake2b over repr: no dependence on PYTHONHASHSEED (a fixed value pins it).
    assert chain_root(("a", 1), 0, None, 0) == chain_root(("a", 1), 0, None, 0)
    assert isinstance(chain_root("x", 0, None, 0), int)


# -- the hit -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "window,sinks,present,cap,expected",
    [
        (None, 0, "11111111", 8, 8),
        (None, 0, "11011111", 8, 2),  # full attention: the first missing page ends the hit
        (None, 0, "11111111", 5, 5),  # the cap (one token left to compute) wins
        (8, 0, "00001111", 8, 8),  # at n=8 the window (8) reads [25, 32): ordinals 6, 7 only
        (8, 0, "00000011", 8, 8),
        (8, 0, "00000001", 8, 0),  # ordinal 6 missing: 8 fails; 7 needs 5, 6; ... nothing
        (8, 0, "11111101", 8, 6),  # ordinal 6 evicted: 8 and 7 fail, 6 needs 4, 5
        (8, 1, "01111111", 8, 0),  # the sink page is missing: every n > 0 needs it
        (8, 1, "10000011", 8, 8),  # sink + window pages: nothing in between is needed
        (1, 0, "00000001", 8, 8),  # a one-token window reads only the last page
    ],
)
def test_sliding_window_hit_table(window, sinks, present, cap, expected):
    have = [c == "1" for c in present]
    assert longest_valid_prefix([(window, sinks)], [have], cap, P) == expected
    # The same answer from the life cycle's own stale ranges, by brute force.
    lc = LifeCycle(window, sinks)

    def ok(n):
        lo, hi = lc.stale_range(n * P, P)
        return all(have[i] for i in range(n) if not lo <= i < hi)

    assert expected == max(n for n in range(cap + 1) if ok(n))


def test_the_hit_is_a_fixpoint_over_groups():
    # full group: 7 pages present; window group (W=8): ordinal 5 missing, so n=7 fails there (needs 5, 6),
    # n=6 fails (needs 4, 5), n=5 needs 3, 4: valid in both.
    full = [True] * 7 + [False]
    window = [True] * 5 + [False] + [True] * 2
    assert longest_valid_prefix([(None, 0), (8, 0)], [full, window], 8, P) == 5
    assert longest_valid_prefix([(None, 0)], [full], 8, P) == 7
    assert longest_valid_prefix([(None, 0)], [full[:3]], 8, P) == 3  # a list that stops early: absent pages


# -- refcounts, cached-free, LRU ----------------------------------------------------------
def key(i: int):
    return (1000 + i, 0, (i,))


def test_a_shared_page_is_freed_only_when_the_last_holder_leaves_and_then_is_cached_free():
    pool = reuse_pool()
    events = Events(pool)
    a, b = pool.allocate(2, owner=1)
    assert pool.publish(a, key(0), owner=1) is True
    pool.share([a], owner=2)
    assert (pool.refcount(a), pool.is_shared(a), pool.is_writable(a)) == (2, True, False)
    assert (pool.refcount(b), pool.is_shared(b), pool.is_writable(b)) == (1, False, True)
    accounting(pool)
    pool.release([a, b], owner=1)
    assert pool.refcount(a) == 1 and pool.is_held(a) and not pool.is_held(b) and pool.num_plain_free == 7
    accounting(pool)
    pool.release([a], owner=2)
    assert pool.is_cached_free(a) and pool.lookup(key(0)) == a and pool.num_cached_free == 1
    assert pool.num_free == 8 and pool.num_held == 0
    accounting(pool)
    assert [e for e, _, _ in events.seen] == ["allocate", "publish", "share", "unshare", "release", "release"]
    assert events.seen[3] == ("unshare", [a], 1) and events.seen[5] == ("release", [a], 2)


def test_an_unpublished_page_goes_back_to_the_free_list():
    pool = reuse_pool()
    (a,) = pool.allocate(1, owner=1)
    pool.release([a], owner=1)
    assert not pool.is_cached_free(a) and pool.free_order()[-1] == a
    accounting(pool)


def test_eviction_takes_plain_free_pages_first_then_the_least_recently_cached():
    pool = reuse_pool(pages=6)
    pages = pool.allocate(6, owner=1)
    for i, page in enumerate(pages[:4]):
        pool.publish(page, key(i), owner=1)
    pool.release([pages[2]], owner=1)  # cached first
    pool.release([pages[0], pages[1]], owner=1)  # one call: the first listed is evicted last
    pool.release([pages[4]], owner=1)  # unpublished: plain free
    assert pool.prefix.lru_order() == [pages[2], pages[1], pages[0]]
    events = Events(pool)
    assert pool.allocate(1, owner=2) == [pages[4]]  # plain free first, nothing evicted
    got = pool.allocate(2, owner=2)
    assert got == [pages[1], pages[2]] or sorted(got) == sorted([pages[1], pages[2]])
    assert pool.lookup(key(2)) is None and pool.lookup(key(1)) is None and pool.lookup(key(0)) == pages[0]
    assert [e for e, _, _ in events.seen] == ["allocate", "evict", "allocate"]
    assert sorted(events.seen[1][1]) == sorted([pages[1], pages[2]]) and events.seen[1][2] is None
    with pytest.raises(OutOfPagesError, match=r"asked for 2 pages, 1 free of 6"):
        pool.allocate(2, owner=3)
    accounting(pool)


def test_a_hit_revives_a_cached_free_page_and_it_leaves_the_lru():
    pool = reuse_pool(pages=3)
    a, b, c = pool.allocate(3, owner=1)
    pool.publish(a, key(0), owner=1)
    pool.publish(b, key(1), owner=1)
    pool.release([a, b, c], owner=1)
    pool.share([b], owner=2)
    assert pool.refcount(b) == 1 and not pool.is_cached_free(b) and pool.is_published(b)
    assert pool.prefix.lru_order() == [a]
    accounting(pool)
    with pytest.raises(ValueError, match=r"not published"):
        pool.share([c], owner=2)
    accounting(pool)


def test_publish_refuses_a_key_another_page_has_and_an_unheld_page():
    pool = reuse_pool()
    a, b = pool.allocate(2, owner=1)
    assert pool.publish(a, key(0)) is True
    assert pool.publish(b, key(0)) is False and not pool.is_published(b)
    assert pool.publish(a, key(1)) is False
    pool.release([b], owner=1)
    with pytest.raises(ValueError, match=f"cannot publish page {b}"):
        pool.publish(b, key(2))
    plain = PagePool(2, tokens_per_block=P)
    with pytest.raises(ValueError, match="block_reuse=True"):
        plain.publish(0, key(0))


def test_rollback_undoes_evictions_shares_parks_and_publishes_exactly():
    pool = reuse_pool(pages=5)
    pages = pool.allocate(5, owner=1)
    for i, page in enumerate(pages[:3]):
        pool.publish(page, key(i), owner=1)
    pool.release(pages[:2], owner=1)
    pool.release(pages[3:], owner=1)
    pool.share([pages[2]], owner=2)
    before = pool.state()
    events = Events(pool)
    pool.begin_journal()
    pool.share([pages[0]], owner=3)  # revive
    pool.share([pages[2]], owner=3)  # third holder
    got = pool.allocate(3, owner=4)  # two plain free, then evicts pages[1]
    assert pages[1] in got and pool.lookup(key(1)) is None
    pool.publish(got[0], key(7), owner=4)
    pool.release([pages[2]], owner=1)  # unshare
    pool.release([pages[0]], owner=3)  # park again
    pool.release(got, owner=4)
    accounting(pool)
    pool.rollback_journal()
    assert pool.state() == before
    accounting(pool)
    # Replaying every event on a holder count gives the same counts as the pool.
    count: dict[int, int] = {}
    for page in pages:
        count[page] = pool.refcount(page)
    replay = {p: 0 for p in pages}
    for p in pages[2:3]:
        replay[p] = 2  # held by 1 and 2 before the journal
    for event, ps, _ in events.seen:
        for p in ps:
            replay[p] += {"allocate": 1, "share": 1, "release": -1, "unshare": -1}.get(event, 0)
    assert replay == count


def test_check_accounting_catches_a_published_page_on_the_free_list():
    pool = reuse_pool(pages=2)
    a, _ = pool.allocate(2, owner=1)
    pool.publish(a, key(0))
    pool._sets.held.discard(a)  # corrupt on purpose: no public path can
    pool._sets.free.append(a)
    with pytest.raises(AssertionError, match="published pages on the free list"):
        pool.check_accounting()


# -- KVCache: commit publishes, adopt shares ---------------------------------------------------
def make(window=None, pages=16, sinks=0, reuse=True):
    pool = PagePool(pages, tokens_per_block=P, head_dim=2, block_reuse=reuse, reuse_salt="g")
    return [LayerGroup(LifeCycle(window, sinks), pool)]


def test_commit_publishes_only_full_backed_pages_and_a_window_does_not_publish_what_it_released():
    groups = make(window=6)
    cache = KVCache(groups, P, owner=1)
    tokens = list(range(40))
    cache.resize(22, 18)  # window 6 at history 18: ordinals [0, 3) are stale
    cache.commit(18, tokens)
    pool = groups[0].pool
    row = cache.block_row(0)
    assert row[:3] == [BAD_PAGE_INDEX] * 3
    assert [pool.is_published(p) for p in row[3:]] == [True, False, False]  # ordinal 4 holds 16..19: partial
    assert pool.prefix.num_published == 1
    cache.resize(22, 20)
    cache.commit(20, tokens)
    assert pool.is_published(row[4]) and pool.prefix.num_published == 2
    accounting(pool)
    cache.free()
    assert pool.num_cached_free == 2 and pool.num_held == 0
    accounting(pool)


def test_commit_of_too_few_token_ids_changes_nothing():
    groups = make()
    cache = KVCache(groups, P, owner=1)
    cache.resize(12, 8)
    before = (cache.checkpoint(), groups[0].pool.state())
    with pytest.raises(ValueError, match=r"committing 8 tokens needs as many token ids, got 3"):
        cache.commit(8, [1, 2, 3])
    assert (cache.checkpoint(), groups[0].pool.state()) == before


def test_adopt_shares_the_published_pages_and_rejects_bad_rows_unchanged():
    groups = make(window=6)
    pool = groups[0].pool
    tokens = list(range(40))
    first = KVCache(groups, P, owner=1)
    for h in (8, 16, 24):  # chunks of 8: each chunk's pages are published while the window still holds them
        first.resize(h + 8, h)
        first.commit(h, tokens)
    second = KVCache(groups, P, owner=2)
    keys = [second.keys.chain(0, tokens, 6)]
    lo, hi = groups[0].life_cycle.stale_range(24, P)
    assert (lo, hi) == (0, 4)  # window 6 at history 24 reads [19, 24): ordinals 4, 5
    good = [BAD_PAGE_INDEX] * 4 + [pool.lookup(keys[0][4]), pool.lookup(keys[0][5])]
    before = (second.checkpoint(), pool.state())
    for bad in ([pool.lookup(keys[0][3])] + good[1:], good[:4] + [good[5], good[4]]):
        with pytest.raises(ValueError, match="ordinal"):
            second.adopt_prefix(24, [bad], keys)
        assert (second.checkpoint(), pool.state()) == before
    with pytest.raises(ValueError, match="multiple of P=4"):
        second.adopt_prefix(22, [good], keys)
    second.adopt_prefix(24, [good], keys)
    assert (second.capacity, second.history_length, second.committed) == (24, 24, 24)
    assert all(pool.refcount(p) == 2 for p in good[4:]) and second.num_held_pages(0) == 2
    accounting(pool)
    # Growth allocates fresh pages; the shared ones are never handed to the writer.
    assert second.resize(30, 24)
    fresh = [p for p in second.block_row(0)[6:]]
    assert all(pool.is_writable(p) for p in fresh)
    with pytest.raises(ValueError, match="fresh cache"):
        second.adopt_prefix(24, [good], keys)
    first.free()
    second.free()
    assert pool.num_held == 0
    accounting(pool)


def test_the_resize_counts_a_shared_page_it_releases_as_still_held():
    groups = make(window=4, pages=4)
    pool = groups[0].pool
    tokens = list(range(40))
    first = KVCache(groups, P, owner=1)
    first.resize(8, 4)
    first.commit(4, tokens)
    second = KVCache(groups, P, owner=2)
    keys = [second.keys.chain(0, tokens, 1)]
    second.adopt_prefix(4, [[pool.lookup(keys[0][0])]], keys)
    # 4 pages: first holds 2 (one shared). second asks for 3 more while releasing its shared page 0:
    # the release returns nothing, 2 are free, so it does not fit.
    assert not second.can_resize(16, 8)
    assert second.resize(16, 8) is False
    assert second.resize(12, 8) is True
    accounting(pool)
