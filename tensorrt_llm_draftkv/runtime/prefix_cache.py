"""Prefix reuse for one page pool: the page key chain, the published table, the cached-free LRU.

Coordinates: block ordinals (ordinal i covers absolute token positions
`[i*P, (i+1)*P)`) and page indices of one pool. Only full pages are ever keyed.

A page's *key* is `(link, parent, tokens)`: `parent` is the previous page's
link (the chain root for ordinal 0), `tokens` the page's own token ids as a
tuple, and `link = hash((parent, hash(tokens)))` what the next page chains on
and what the table is indexed by. A hit compares the whole key, tokens
included, so a 64-bit collision can only cost a miss, never a wrong page. The
root mixes the pool's geometry salt with the layer group's index, window and
sinks, so two pools (or groups) with different geometry never share a chain.
"""
from __future__ import annotations

import hashlib
import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

PageKey = tuple[int, int, tuple[int, ...]]
"""`(link, parent link, token ids of the page)`: what a published page is found by."""


def chain_root(salt: Hashable, group: int, window: int | None, sink_blocks: int) -> int:
    """The parent link of ordinal 0 for one layer group of a pool salted by `salt`.

    `repr(salt)` goes through blake2b so the root does not depend on the
    process's string-hash seed (two processes agree on every key).
    """
    text = repr((salt, group, window, sink_blocks)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def page_tokens(token_ids: Sequence[int], tokens_per_block: int, first: int, end: int) -> list[tuple[int, ...]]:
    """The token ids of full pages (block ordinals) `[first, end)`, one tuple per page.

    Raises ValueError if a page of the span is not full in `token_ids`: a partial
    page is never keyed.
    """
    p = tokens_per_block
    if end * p > len(token_ids):
        raise ValueError(f"page keys up to ordinal {end} need {end * p} token ids, got {len(token_ids)}")
    return [tuple(token_ids[i * p : (i + 1) * p]) for i in range(first, end)]


def chain(pages: Sequence[tuple[int, ...]], parent: int) -> list[PageKey]:
    """Keys of consecutive pages chained from `parent` (the root, or the link of the page before)."""
    keys: list[PageKey] = []
    for tokens in pages:
        link = hash((parent, hash(tokens)))
        keys.append((link, parent, tokens))
        parent = link
    return keys


def page_keys(
    token_ids: Sequence[int], tokens_per_block: int, root: int, *, first: int = 0, end: int, parent: int | None = None
) -> list[PageKey]:
    """Keys of the full pages with ordinals `[first, end)` of `token_ids`.

    `parent` is the link of ordinal `first - 1` (the root is used when `first` is 0).
    """
    if first > 0 and parent is None:
        raise ValueError(f"page keys from ordinal {first} need the parent link of ordinal {first - 1}")
    pages = page_tokens(token_ids, tokens_per_block, first, end)
    return chain(pages, root if first == 0 else parent)


def longest_valid_prefix(
    groups: Sequence[tuple[int | None, int]], present: Sequence[Sequence[bool]], cap: int, tokens_per_block: int
) -> int:
    """The largest hit `n <= cap` pages valid in every group.

    `groups[g]` is `(window, sink_blocks)` of group g's life cycle (window already
    widened); `present[g][i]` says whether ordinal i's page is published (a list
    may stop early: missing entries are absent pages). A hit of `n` pages means
    history `h = n * P`: a full-attention group needs ordinals `[0, n)`; a windowed
    one only its sinks `[0, min(n, sinks))` and `[max(lo, (h + 1 - W) // P), n)`,
    the pages its window still reads (vLLM's sliding-window hit). The answer is a
    fixpoint: lowering `n` for one group may invalidate it for another.
    O(cap) to count, O(1) per candidate.
    """
    p = tokens_per_block
    counts = []  # counts[g][i]: present ordinals in [0, i), for i <= cap
    for have in present:
        have = list(have[:cap]) + [False] * (cap - min(len(have), cap))
        counts.append(list(accumulate(have, initial=0)))

    def valid(g: int, n: int) -> bool:
        window, sinks = groups[g]
        count = counts[g]
        if window is None:
            return count[n] == n
        lo = min(n, sinks)
        hi = max(lo, (n * p + 1 - window) // p)
        return count[lo] == lo and count[n] - count[hi] == n - hi

    n = cap
    while True:
        lowered = n
        for g in range(len(groups)):
            while lowered > 0 and not valid(g, lowered):
                lowered -= 1
        if lowered == n:
            return n
        n = lowered


@dataclass
class PrefixCache:
    """Published pages of one pool (`key -> page`) and the cached-free ones, least recently used first.

    A published page is either held (refcount >= 1, tracked by the pool) or
    cached-free (refcount 0, here in the LRU). Cached-free pages carry a stamp;
    the smallest stamp is evicted first. Stamps let an undo put a page back at
    its old place in O(log n).
    """

    salt: Hashable = None
    _page_of: dict[int, int] = field(default_factory=dict)  # link -> page
    _key_of: dict[int, PageKey] = field(default_factory=dict)
    _stamp: dict[int, int] = field(default_factory=dict)  # cached-free page -> stamp
    _heap: list[tuple[int, int]] = field(default_factory=list)  # (stamp, page), stale entries allowed
    _clock: int = 0

    # -- the table ---------------------------------------------------------------------
    def page_for(self, key: PageKey) -> int | None:
        """The page published under `key` (the whole key equal, tokens included), or None."""
        page = self._page_of.get(key[0])
        return page if page is not None and self._key_of[page] == key else None

    def match(
        self, pages: Sequence[tuple[int, ...]], hashes: Sequence[int], parent: int, *, stop_at_miss: bool
    ) -> tuple[list[PageKey], list[int | None]]:
        """Keys of consecutive pages chained from `parent` and the page published under each (None).

        The lookup's hot loop, in one place: `chain` and `page_for` inlined.
        `stop_at_miss`: stop before the first page not published (full attention).
        """
        keys: list[PageKey] = []
        found: list[int | None] = []
        page_of, key_of = self._page_of, self._key_of
        for tokens, token_hash in zip(pages, hashes):
            link = hash((parent, token_hash))
            key = (link, parent, tokens)
            page = page_of.get(link)
            if page is not None and key_of[page] != key:
                page = None  # a link collision: a miss, never a wrong page
            if page is None and stop_at_miss:
                break
            keys.append(key)
            found.append(page)
            parent = link
        return keys, found

    def has_link(self, link: int) -> bool:
        """Is some page published under this link (a key equal or a rare collision)?"""
        return link in self._page_of

    def key_of(self, page: int) -> PageKey | None:
        return self._key_of.get(page)

    def is_published(self, page: int) -> bool:
        return page in self._key_of

    def published_pages(self) -> set[int]:
        """Every published page, held or cached-free (a copy)."""
        return set(self._key_of)

    def links_match(self) -> bool:
        """Does every published page have exactly one link, and every link one page?"""
        return len(self._page_of) == len(self._key_of) and all(
            self._page_of.get(key[0]) == page for page, key in self._key_of.items()
        )

    @property
    def num_published(self) -> int:
        return len(self._key_of)

    def publish(self, page: int, key: PageKey) -> None:
        if page in self._key_of or key[0] in self._page_of:
            raise ValueError(f"page {page} or its key's link is already published")
        self._page_of[key[0]] = page
        self._key_of[page] = key

    def unpublish(self, page: int) -> PageKey:
        key = self._key_of.pop(page)
        del self._page_of[key[0]]
        return key

    # -- the cached-free LRU -------------------------------------------------------------
    @property
    def num_cached_free(self) -> int:
        return len(self._stamp)

    def is_cached_free(self, page: int) -> bool:
        return page in self._stamp

    def cached_free_pages(self) -> set[int]:
        """Every cached-free page (a copy)."""
        return set(self._stamp)

    def park(self, page: int, stamp: int | None = None) -> int:
        """Make a published page cached-free, newest (or at `stamp`, to undo an unpark); returns its stamp."""
        if page not in self._key_of or page in self._stamp:
            raise ValueError(f"page {page} cannot be parked (unpublished, or already cached-free)")
        if stamp is None:
            stamp, self._clock = self._clock, self._clock + 1
        self._stamp[page] = stamp
        heapq.heappush(self._heap, (stamp, page))
        return stamp

    def unpark(self, page: int) -> int:
        """Take a cached-free page out of the LRU (a hit revives it, or an undo); returns its stamp."""
        stamp = self._stamp.pop(page)
        if len(self._heap) > 2 * len(self._stamp) + 64:  # drop stale heap entries now and then
            self._heap = [(s, p) for p, s in self._stamp.items()]
            heapq.heapify(self._heap)
        return stamp

    def oldest(self) -> int:
        """The least recently parked cached-free page (ValueError if none)."""
        while self._heap:
            stamp, page = self._heap[0]
            if self._stamp.get(page) == stamp:
                return page
            heapq.heappop(self._heap)
        raise ValueError("no cached-free page to evict")

    def lru_order(self) -> list[int]:
        """Cached-free pages, the next to be evicted first (for tests and diagnostics; O(n log n))."""
        return [p for p, _ in sorted(self._stamp.items(), key=lambda item: item[1])]

    def state(self) -> tuple:
        """Everything that defines the table and the LRU order (stamps compared by rank only)."""
        return (tuple(sorted(self._key_of.items())), tuple(self.lru_order()))
