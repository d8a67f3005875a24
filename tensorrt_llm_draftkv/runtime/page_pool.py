"""Physical pages of one layer group: real storage, a free list, exact accounting."""
from __future__ import annotations

from typing import Callable

import torch

BAD_PAGE_INDEX = -1
"""Block-table value for an ordinal no page backs (released or never allocated)."""


class OutOfPagesError(RuntimeError):
    pass


PoolListener = Callable[[str, "list[int]", object], None]
"""`fn(event, pages, owner)`: event is "allocate" or "release", pages are page indices of the pool."""


class PagePool:
    """`num_pages` pages of `tokens_per_block` token slots for every layer of a group.

    Storage per layer is `[pages, kv_factor, kv_heads, P, head_dim]`. With
    `guard_page`, one extra page (index `num_pages`) is reserved: it is never
    handed out and is not counted in `total`, so unbacked entries can point at it
    instead of at a page some request owns.

    Listeners (`add_listener`) hear every successful `allocate` and `take`
    (event "allocate") and `release` (event "release") of at least one page,
    after the pool changed, with the pages and the `owner` the caller named
    (None if it named none).
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
    ) -> None:
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
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._held: set[int] = set()
        self._listeners: list[PoolListener] = []
        # While a journal is open: every page handed out ("pop") or returned ("push"), in order.
        self._log: list[tuple[str, int, object]] | None = None

    # -- listeners ----------------------------------------------------------------
    def add_listener(self, fn: PoolListener) -> None:
        """Call `fn(event, pages, owner)` after every successful allocate/take/release."""
        self._listeners.append(fn)

    def remove_listener(self, fn: PoolListener) -> None:
        """Stop calling `fn` (ValueError if it was never added)."""
        self._listeners.remove(fn)

    def _emit(self, event: str, pages: list[int], owner: object | None) -> None:
        if not pages:  # an empty call changes nothing, so nobody hears it
            return
        for fn in list(self._listeners):
            fn(event, list(pages), owner)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def is_held(self, page: int) -> bool:
        return page in self._held

    def allocate(self, count: int, *, owner: object | None = None) -> list[int]:
        """Hand out `count` pages, all or none; listeners hear "allocate" with `owner`."""
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({count})")
        if count > len(self._free):
            raise OutOfPagesError(f"asked for {count} pages, {len(self._free)} free of {self.total}")
        pages = [self._free.pop() for _ in range(count)]
        self._held.update(pages)
        if self._log is not None:
            self._log.extend(("pop", p, owner) for p in pages)
        self._emit("allocate", pages, owner)
        return pages

    def free_order(self) -> list[int]:
        """The free list in allocation order (last is handed out first)."""
        return list(self._free)

    # -- the journal (what a batch transaction rolls back) ----------------------------------
    def begin_journal(self) -> None:
        """Log every allocate and release from now on, so `rollback_journal` can undo them."""
        if self._log is not None:
            raise ValueError("this pool's journal is already open")
        self._log = []

    def end_journal(self) -> None:
        """Keep the changes; stop logging."""
        self._log = None

    def rollback_journal(self) -> None:
        """Undo every allocate and release since `begin_journal`, latest first.

        The free list only ever pops and pushes at its end, so undoing in reverse
        puts every page back in the very position it had: the pool, its free-list
        order included, is as it was. Listeners hear the undo as releases and
        allocations, with the owners that were named.
        """
        log, self._log = self._log or [], None
        runs: list[tuple[str, object, list[int]]] = []  # consecutive undo steps of one kind and owner
        for kind, page, owner in reversed(log):
            if runs and runs[-1][:2] == (kind, owner):
                runs[-1][2].append(page)
            else:
                runs.append((kind, owner, [page]))
        for kind, owner, pages in runs:
            if kind == "pop":  # handed out: back onto the end, latest first
                self.release(pages, owner=owner)
            else:  # returned: it sits at the end again, claim it back
                self.take(pages, owner=owner)

    def take(self, pages: list[int], *, owner: object | None = None) -> None:
        """Claim these particular free pages, all or none (used to undo a release).

        Listeners hear "allocate" with `owner`: the pages are held again. Not while a
        journal is open (it takes pages from the middle of the free list).
        """
        if self._log is not None:
            raise ValueError("take cannot run while this pool's journal is open")
        busy = [p for p in pages if p in self._held]
        if busy or len(set(pages)) != len(pages):
            raise ValueError(f"cannot take pages that are held (or repeated): {sorted(set(busy)) or pages}")
        missing = set(pages) - set(self._free)
        if missing:
            raise ValueError(f"pages {sorted(missing)} are not pages of this pool's free list")
        wanted = set(pages)
        self._free = [p for p in self._free if p not in wanted]
        self._held.update(pages)
        self._emit("allocate", pages, owner)

    def release(self, pages: list[int], *, owner: object | None = None) -> None:
        """Return pages to the free list; every one must be held (no double free).

        Listeners hear "release" with `owner`.
        """
        bad = [p for p in pages if p not in self._held]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"release of pages not held (or repeated): {sorted(set(bad)) or pages}")
        for page in pages:
            self._held.remove(page)
            self._free.append(page)
        if self._log is not None:
            self._log.extend(("push", p, owner) for p in pages)
        self._emit("release", pages, owner)

    def check_accounting(self) -> None:
        """held + free == total, and no page is both."""
        free = set(self._free)
        if len(free) != len(self._free) or free & self._held or len(free) + len(self._held) != self.total:
            raise AssertionError(
                f"pool accounting broken: held={len(self._held)} free={len(self._free)} total={self.total}"
            )
