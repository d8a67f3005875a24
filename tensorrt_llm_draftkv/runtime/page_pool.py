"""Physical pages of one layer group: real storage, a free list, exact accounting."""
from __future__ import annotations

import torch

BAD_PAGE_INDEX = -1
"""Block-table value for an ordinal no page backs (released or never allocated)."""


class OutOfPagesError(RuntimeError):
    pass


class PagePool:
    """`num_pages` pages of `tokens_per_block` token slots for every layer of a group.

    Storage per layer is `[pages, kv_factor, kv_heads, P, head_dim]`. With
    `guard_page`, one extra page (index `num_pages`) is reserved: it is never
    handed out and is not counted in `total`, so unbacked entries can point at it
    instead of at a page some request owns.
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

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def is_held(self, page: int) -> bool:
        return page in self._held

    def allocate(self, count: int) -> list[int]:
        """Hand out `count` pages, all or none."""
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({count})")
        if count > len(self._free):
            raise OutOfPagesError(f"asked for {count} pages, {len(self._free)} free of {self.total}")
        pages = [self._free.pop() for _ in range(count)]
        self._held.update(pages)
        return pages

    def take(self, pages: list[int]) -> None:
        """Claim these particular free pages, all or none (used to undo a release)."""
        busy = [p for p in pages if p in self._held]
        if busy or len(set(pages)) != len(pages):
            raise ValueError(f"cannot take pages that are held (or repeated): {sorted(set(busy)) or pages}")
        missing = set(pages) - set(self._free)
        if missing:
            raise ValueError(f"pages {sorted(missing)} are not pages of this pool's free list")
        wanted = set(pages)
        self._free = [p for p in self._free if p not in wanted]
        self._held.update(pages)

    def release(self, pages: list[int]) -> None:
        """Return pages to the free list; every one must be held (no double free)."""
        bad = [p for p in pages if p not in self._held]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"release of pages not held (or repeated): {sorted(set(bad)) or pages}")
        for page in pages:
            self._held.remove(page)
            self._free.append(page)

    def check_accounting(self) -> None:
        """held + free == total, and no page is both."""
        free = set(self._free)
        if len(free) != len(self._free) or free & self._held or len(free) + len(self._held) != self.total:
            raise AssertionError(
                f"pool accounting broken: held={len(self._held)} free={len(self._free)} total={self.total}"
            )
