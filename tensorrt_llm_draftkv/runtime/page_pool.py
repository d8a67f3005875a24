"""Physical pages of one layer group: real storage, a free list, exact accounting."""
from __future__ import annotations

from collections.abc import Hashable
from typing import Callable

import torch

from .pool_journal import PageSets, PoolJournal
from .prefix_cache import PageKey, PrefixCache

BAD_PAGE_INDEX = -1
"""Block-table value for an ordinal no page backs (released or never allocated)."""


class OutOfPagesError(RuntimeError):
    pass


PoolListener = Callable[[str, "list[int]", object], None]
"""`fn(event, pages, owner)`: pages are page indices of the pool; events are listed in `PagePool`."""


class PagePool:
    """`num_pages` pages of `tokens_per_block` token slots for every layer of a group.

    Storage per layer is `[pages, kv_factor, kv_heads, P, head_dim]`. With
    `guard_page`, one extra page (index `num_pages`) is reserved: it is never
    handed out and is not counted in `total`, so unbacked entries can point at it
    instead of at a page some request owns.

    Listeners (`add_listener`) hear every successful `allocate` (event
    "allocate") and `release` (event "release") of at least one page,
    after the pool changed, with the pages and the `owner` the caller named
    (None if it named none).

    With `block_reuse`, pages can also be shared and cached (see
    docs/block_reuse.md). A page is then held by a *refcount* of owners; a
    published page whose last owner leaves becomes *cached-free* (still found by
    its key, evicted least recently used first when an allocation needs it). Held
    (distinct pages) + cached-free + plain free = total. `num_free` counts what an
    allocation can get: plain free and cached-free. Listeners then also hear, all
    with pages that no listener needs to track unless it tracks sharing:

    - "allocate": the owner now holds these pages alone (fresh, evicted first, or a
      cached-free page revived by a hit: ask `is_published`);
    - "release": the owner was the last holder; the pages are now free or
      cached-free (`is_cached_free`);
    - "share": the owner joins pages other owners already hold;
    - "unshare": the owner leaves pages other owners still hold;
    - "publish": pages enter the prefix table (owner: the publisher; None when a
      rollback puts back an evicted page);
    - "evict": pages leave the prefix table (owner None; before an "allocate" that
      hands them out, or when a rollback undoes a publish).

    Without `block_reuse` only "allocate" and "release" ever happen, as before.

    A batch transaction opens the pool's journal (`begin_journal`), then keeps
    (`end_journal`) or undoes (`rollback_journal`) what changed; the pool owns one
    `PoolJournal` component that logs the changes and knows their inverses.
    """

    def __init__(
        self,
        num_pages: int,
        *,
        tokens_per_block: int,
        num_layers: int = 1,
        kv_factor: int = 2,
        num_kv_heads: int = 1,
        head_dim: int = 8,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        guard_page: bool = False,
        block_reuse: bool = False,
        reuse_salt: Hashable = None,
    ) -> None:
        """`block_reuse`: keep a prefix table (salted by `reuse_salt`, the pool's geometry)."""
        if num_pages < 0:
            raise ValueError(f"a pool needs >= 0 pages, got num_pages={num_pages}")
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        if num_layers < 1:
            raise ValueError(f"a pool needs >= 1 layer, got num_layers={num_layers}")
        self.total = num_pages
        self.tokens_per_block = tokens_per_block
        self.guard_page_index: int | None = num_pages if guard_page else None
        physical = num_pages + (1 if guard_page else 0)
        shape = (physical, kv_factor, num_kv_heads, tokens_per_block, head_dim)
        self.layers: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        # Popped from the end: the lowest page first on a fresh pool, most recently freed next.
        self._sets = PageSets(free=list(range(num_pages - 1, -1, -1)))
        self.prefix: PrefixCache | None = PrefixCache(reuse_salt) if block_reuse else None
        self._listeners: list[PoolListener] = []
        #: Pages handed out over the pool's life: fresh from the free list, and reused (a published
        #: page joined or revived by `share`). A journal rollback does not take them back.
        self.pages_handed_out = 0
        self.pages_reused = 0
        self._journal = PoolJournal()

    # -- listeners ----------------------------------------------------------------
    def add_listener(self, fn: PoolListener) -> None:
        """Call `fn(event, pages, owner)` after every change of the pool (events as in the class docstring)."""
        self._listeners.append(fn)

    def remove_listener(self, fn: PoolListener) -> None:
        """Stop calling `fn` (ValueError if it was never added)."""
        self._listeners.remove(fn)

    @property
    def listeners(self) -> tuple[PoolListener, ...]:
        """The listeners called on every change, in the order they were added (a copy)."""
        return tuple(self._listeners)

    def _emit(self, event: str, pages: list[int], owner: object | None) -> None:
        if not pages:  # an empty call changes nothing, so nobody hears it
            return
        for fn in list(self._listeners):
            fn(event, list(pages), owner)

    @property
    def block_reuse(self) -> bool:
        return self.prefix is not None

    @property
    def num_free(self) -> int:
        """Pages an allocation can get: plain free plus cached-free (evicted on demand)."""
        return len(self._sets.free) + (self.prefix.num_cached_free if self.prefix is not None else 0)

    @property
    def num_cached_free(self) -> int:
        """Published pages nobody holds, kept for reuse until an allocation evicts them."""
        return self.prefix.num_cached_free if self.prefix is not None else 0

    @property
    def num_plain_free(self) -> int:
        """Free pages that hold nothing anyone can find."""
        return len(self._sets.free)

    @property
    def num_held(self) -> int:
        """Distinct held pages (a shared page counts once)."""
        return len(self._sets.held)

    def held_pages(self) -> frozenset[int]:
        """Every held page (a shared page once)."""
        return frozenset(self._sets.held)

    def is_held(self, page: int) -> bool:
        return page in self._sets.held

    def refcount(self, page: int) -> int:
        """How many owners hold `page` (0 when free or cached-free)."""
        return 1 + self._sets.extra.get(page, 0) if page in self._sets.held else 0

    def is_shared(self, page: int) -> bool:
        """Held by more than one owner: readable by each, writable by none."""
        return page in self._sets.extra

    def is_published(self, page: int) -> bool:
        """In the prefix table (held or cached-free): its K/V is final and must not be written."""
        return self.prefix is not None and self.prefix.is_published(page)

    def is_cached_free(self, page: int) -> bool:
        return self.prefix is not None and self.prefix.is_cached_free(page)

    def is_writable(self, page: int) -> bool:
        """Held by exactly one owner and not published: the only pages a writer may be handed."""
        return page in self._sets.held and page not in self._sets.extra and not self.is_published(page)

    def pages_returned_by(self, pages: list[int]) -> int:
        """How many of `pages` a `release` would make allocatable again (a shared page stays held)."""
        if not self._sets.extra:
            return len(pages)
        return sum(1 for p in pages if p not in self._sets.extra)

    def allocate(self, count: int, *, owner: object | None = None) -> list[int]:
        """Hand out `count` pages, all or none; listeners hear "allocate" with `owner`.

        Plain free pages go first; then cached-free pages, least recently used
        first, are evicted (listeners hear "evict" before "allocate").
        """
        free = self._sets.free
        if 0 <= count <= len(free) and not self._listeners and not self._journal.is_open:
            # Plain pages only, nobody to tell, nothing to log (every generation step's page):
            # what the general path below does for this case, without its bookkeeping calls.
            pages = free[len(free) - count :][::-1] if count else []  # popped from the end, in order
            del free[len(free) - count :]
            self._sets.held.update(pages)
            self.pages_handed_out += count
            return pages
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({count})")
        if count > self.num_free:
            raise OutOfPagesError(f"asked for {count} pages, {self.num_free} free of {self.total}")
        evicted: list[int] = []
        while len(self._sets.free) < count:
            assert self.prefix is not None  # num_free counted cached-free pages
            page = self.prefix.oldest()
            stamp = self.prefix.unpark(page)
            key = self.prefix.unpublish(page)
            self._sets.free.append(page)
            self._journal.record("evict", page, None, (key, stamp))
            evicted.append(page)
        pages = [self._sets.free.pop() for _ in range(count)]
        self._sets.held.update(pages)
        self._journal.record_many("pop", pages, owner)
        self.pages_handed_out += count
        self._emit("evict", evicted, None)
        self._emit("allocate", pages, owner)
        return pages

    # -- sharing and publishing (block reuse only) ---------------------------------------
    def lookup(self, key: PageKey) -> int | None:
        """The page published under `key` (held or cached-free), or None."""
        return None if self.prefix is None else self.prefix.page_for(key)

    def share(self, pages: list[int], *, owner: object | None = None) -> None:
        """`owner` becomes one more holder of these published pages, all or none.

        A held page gains a holder (listeners hear "share"); a cached-free page is
        revived and held by `owner` alone ("allocate").
        """
        if self.prefix is None:
            raise ValueError("share needs a pool built with block_reuse=True")
        bad = [p for p in pages if not self.prefix.is_published(p)]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"share of pages that are not published (or repeated): {sorted(set(bad)) or pages}")
        joined: list[int] = []
        revived: list[int] = []
        for page in pages:
            if page in self._sets.held:
                self._sets.extra[page] = self._sets.extra.get(page, 0) + 1
                self._journal.record("share", page, owner)
                joined.append(page)
            else:
                stamp = self.prefix.unpark(page)
                self._sets.held.add(page)
                self._journal.record("revive", page, owner, stamp)
                revived.append(page)
        self.pages_reused += len(pages)
        self._emit("share", joined, owner)
        self._emit("allocate", revived, owner)

    def publish(self, page: int, key: PageKey, *, owner: object | None = None) -> bool:
        """Put a held page in the prefix table under `key`; False (nothing changes) if the page
        or the key is already published (another request computed the same page first)."""
        if self.prefix is None:
            raise ValueError("publish needs a pool built with block_reuse=True")
        if page not in self._sets.held:
            raise ValueError(f"cannot publish page {page}: it is not held")
        if self.prefix.is_published(page) or self.prefix.has_link(key[0]):
            return False
        self.prefix.publish(page, key)
        self._journal.record("publish", page, owner)
        self._emit("publish", [page], owner)
        return True

    # -- the journal (what a batch transaction rolls back) ----------------------------------
    def begin_journal(self) -> None:
        """Log every change from now on, so `rollback_journal` can undo them."""
        self._journal.begin()

    def end_journal(self) -> None:
        """Keep the changes; stop logging."""
        self._journal.end()

    def rollback_journal(self) -> None:
        """Undo every change since `begin_journal`, latest first: free-list order, holders,
        prefix table and LRU order are as they were. Listeners hear the inverse events (an
        allocation undone is a "release", a share an "unshare", ...) with the owners named."""
        for event, owner, pages in self._journal.undo(self._sets, self.prefix):
            self._emit(event, pages, owner)

    def free_order(self) -> list[int]:
        """The plain free list in allocation order (last is handed out first)."""
        return list(self._sets.free)

    def state(self) -> tuple:
        """Everything that defines the pool's bookkeeping, comparable: free list, held pages,
        extra holders, prefix table and LRU order."""
        table = self.prefix.state() if self.prefix is not None else ()
        return (tuple(self._sets.free), frozenset(self._sets.held), tuple(sorted(self._sets.extra.items())), table)

    def release(self, pages: list[int], *, owner: object | None = None) -> None:
        """`owner` gives these pages up; every one must be held (no double free).

        A page others still hold only loses a holder ("unshare"). Otherwise it is
        no longer held ("release"): a published page becomes cached-free, the
        others go back to the free list. Pages parked by one call are stamped in
        reverse, so the first listed (a request's lowest ordinal, which every
        longer prefix needs) is evicted last.
        """
        held = self._sets.held
        if len(pages) == 1 and pages[0] in held and self.prefix is None and not self._listeners \
                and not self._journal.is_open:
            # One plain page, nobody to tell, nothing to log (a generation step's dropped slot page):
            # what the general path below does for this case, without its bookkeeping calls.
            held.remove(pages[0])
            self._sets.free.append(pages[0])
            return
        bad = [p for p in pages if p not in held]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"release of pages not held (or repeated): {sorted(set(bad)) or pages}")
        if self.prefix is None:
            for page in pages:
                self._sets.held.remove(page)
                self._sets.free.append(page)
            self._journal.record_many("push", pages, owner)
            self._emit("release", pages, owner)
            return
        left = [p for p in pages if p in self._sets.extra]
        for page in left:
            self._sets.drop_extra(page)
            self._journal.record("unshare", page, owner)
        shared = set(left)
        gone = [p for p in pages if p not in shared]
        for page in reversed(gone):
            self._sets.held.remove(page)
            if self.prefix.is_published(page):
                self.prefix.park(page)
                self._journal.record("park", page, owner)
            else:
                self._sets.free.append(page)
                self._journal.record("push", page, owner)
        self._emit("unshare", left, owner)
        self._emit("release", gone, owner)

    def check_accounting(self) -> None:
        """held (distinct) + cached-free + plain free == total, and no page is in two of them.

        With block reuse also: only held pages have extra holders, every
        cached-free page is published, and no plain free page is.
        """
        free = set(self._sets.free)
        cached = self.prefix.cached_free_pages() if self.prefix is not None else set()
        if (
            len(free) != len(self._sets.free)
            or free & self._sets.held
            or cached & (free | self._sets.held)
            or len(free) + len(cached) + len(self._sets.held) != self.total
        ):
            raise AssertionError(
                f"pool accounting broken: held={len(self._sets.held)} cached-free={len(cached)} free={len(self._sets.free)} "
                f"total={self.total}"
            )
        stray = set(self._sets.extra) - self._sets.held
        if stray or any(n < 1 for n in self._sets.extra.values()):
            raise AssertionError(f"pool accounting broken: extra holders on pages not held: {sorted(stray)}")
        if self.prefix is not None:
            published = self.prefix.published_pages()
            if published & free or not cached <= published or not self.prefix.links_match():
                raise AssertionError(
                    f"pool accounting broken: published pages on the free list {sorted(published & free)}, "
                    f"cached-free pages not published {sorted(cached - published)}"
                )
