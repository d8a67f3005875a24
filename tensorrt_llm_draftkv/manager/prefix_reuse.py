"""Block reuse in a manager: find a prompt's prefix hit, adopt it, publish history after each chunk.

Coordinates: token counts from absolute position 0; a hit is a whole number of
pages, block ordinals `[0, n)`. The public functions are `KVCacheManagerV2`
methods (hence `self`), kept here; docs/block_reuse.md tells the whole story.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..request import LlmRequest, reused_prefix, skip_reused_prefix, target_view
from .rules import drafter_window_hit_cap
from ..runtime import BAD_PAGE_INDEX
from ..runtime.prefix_cache import PageKey, longest_valid_prefix, page_tokens

if TYPE_CHECKING:
    from .kv_cache_manager import KVCacheManagerV2


@dataclass(frozen=True)
class PrefixLookup:
    """One manager's view of a prompt's first full pages, per layer group.

    `keys[g][i]` is ordinal i's key and `pages[g][i]` the page published under it
    (None if none). A full-attention group's lists stop at its first miss (no
    hit can reach past it); a windowed group's cover every page asked for.
    """

    keys: list[list[PageKey]]
    pages: list[list[int | None]]
    windows: list[tuple[int | None, int]]  # (window, sinks) per group, widened as the pool's

    def present(self) -> list[list[bool]]:
        return [[p is not None for p in row] for row in self.pages]


def lookup(manager: KVCacheManagerV2, req: LlmRequest, num_pages: int) -> PrefixLookup:
    """Keys and published pages of `req`'s first `num_pages` pages in `manager`'s pools. Changes nothing."""
    probe = manager._new_cache(req.py_request_id)  # holds no page: only its chain roots are used
    tokens = page_tokens(req.get_tokens(0), manager.tokens_per_block, 0, num_pages)
    hashes = [hash(t) for t in tokens]  # shared by every group: only the chain differs
    keys, pages, windows = [], [], []
    for g, group in enumerate(manager.layer_groups):
        lc = group.life_cycle
        group_keys, group_pages = group.pool.prefix.match(
            tokens, hashes, probe.prefix_root(g), stop_at_miss=lc.window is None
        )
        keys.append(group_keys)
        pages.append(group_pages)
        windows.append((lc.window, lc.sink_blocks))
    return PrefixLookup(keys, pages, windows)


def find_prefix_hit(self: KVCacheManagerV2, req: LlmRequest) -> int:
    """Tokens of `req`'s prompt, from position 0, that can be reused: a whole number of pages.

    Valid in every layer group of this manager and of every joint partner
    (`pair_joint_reuse`): a full-attention group needs every page below the hit
    published, a windowed group only the pages its window (and sinks) still reads
    at history = hit. At least one prompt token is always left to compute. 0
    without block reuse. Changes nothing.
    """
    tokens, _ = _find(self, req)
    return tokens


def _find(self: KVCacheManagerV2, req: LlmRequest) -> tuple[int, list[PrefixLookup]]:
    managers = [self, *self._reuse_partners]
    if not all(m.block_reuse for m in managers):
        return 0, []
    cap = max(req.prompt_len - 1, 0) // self.tokens_per_block
    if self._drafter_windows is not None:
        cap = min(cap, drafter_window_hit_cap(req.prompt_len, self._drafter_windows, self.tokens_per_block)
                  // self.tokens_per_block)
    if cap == 0:
        return 0, []
    found = [lookup(m, req, cap) for m in managers]
    windows = [w for f in found for w in f.windows]
    present = [row for f in found for row in f.present()]
    return longest_valid_prefix(windows, present, cap, self.tokens_per_block) * self.tokens_per_block, found


def adoption_rows(
    manager: KVCacheManagerV2,
    tokens: int,
    found: PrefixLookup,
    stale_at: int,
    missing_error: Callable[[int, list[int]], Exception],
) -> list[list[int]]:
    """Per group, block ordinal -> published page for `[0, tokens // P)`; `BAD_PAGE_INDEX` where the
    group's window no longer reads the ordinal at history `stale_at` (absolute tokens).

    Raises `missing_error(group, ordinals)` for the first group lacking a page it reads.
    """
    p = manager.tokens_per_block
    n = tokens // p
    rows = []
    for g, group in enumerate(manager.layer_groups):
        lo, hi = group.life_cycle.stale_range(stale_at, p)
        have = found.pages[g]
        row = [BAD_PAGE_INDEX if lo <= i < hi else (have[i] if i < len(have) else None) for i in range(n)]
        missing = [i for i, page in enumerate(row) if page is None]
        if missing:
            raise missing_error(g, missing)
        rows.append(row)
    return rows


def adopt(manager: KVCacheManagerV2, req: LlmRequest, tokens: int, found: PrefixLookup) -> None:
    """Create `req`'s cache at `tokens` of history on the published pages of `found` (see `KVCache.adopt_prefix`)."""
    rows = adoption_rows(
        manager, tokens, found, tokens, lambda g, missing: manager._prefix_error(req, tokens, g, missing)
    )
    cache = manager._new_cache(req.py_request_id)
    cache.adopt_prefix(tokens, rows, found.keys)
    manager._caches[req.py_request_id] = cache


def reuse_prefixes(self: KVCacheManagerV2, requests: list[LlmRequest]) -> None:
    """Before any growth of a step, give each fresh context request its prefix hit.

    A target manager leads: a request still at position 0 gets the hit of
    `find_prefix_hit`, its cache adopts the pages and its target view skips them
    (`request.skip_reused_prefix`). A joint draft mirror follows: it adopts
    exactly `req.prepopulated_prompt_len` from its own pool (the target's lookup already
    required them there). All hits are pinned before the step allocates, so one
    request's growth cannot evict the pages another's hit needs.
    """
    if not self.block_reuse:
        return
    for req in requests:
        if req.is_dummy or req.py_request_id in self._caches:
            continue
        if self._mirror_policy is None:
            if target_view(req).position != 0 or reused_prefix(req):
                continue
            tokens, found = _find(self, req)
            if tokens:
                adopt(self, req, tokens, found[0])
                skip_reused_prefix(req, tokens, self.tokens_per_block)
        elif reused_prefix(req) > 0:
            tokens = reused_prefix(req)
            if tokens % self.tokens_per_block or tokens >= req.prompt_len:
                raise ValueError(
                    f"{self.error_label}: request {req.py_request_id} reuses {tokens} tokens of a {req.prompt_len}-token "
                    f"prompt, not a whole number of {self.tokens_per_block}-token pages below the prompt's end"
                )
            adopt(self, req, tokens, lookup(self, req, tokens // self.tokens_per_block))


def publish_history(self: KVCacheManagerV2, req: LlmRequest, position: int) -> None:
    """After a chunk: publish the prompt's full pages below `position` that the cache still backs."""
    cache = self._caches[req.py_request_id]
    done = min(position, req.prompt_len, cache.history_length)
    if done > cache.committed:
        cache.commit(done, req.get_tokens(0))


def pair_joint_reuse(self: KVCacheManagerV2, draft_manager: KVCacheManagerV2) -> None:
    """Make this target manager's hits joint with `draft_manager`'s pool (`joint_kv_cache_reuse`).

    From now on a hit counts only pages both pools hold, so the draft mirror can
    adopt the same prefix with the drafter's K/V. Both managers need block reuse
    and the same page size (ValueError naming both otherwise).
    """
    if draft_manager is self:
        raise ValueError(f"{self.error_label}: a manager cannot pair with itself")
    if not (self.block_reuse and draft_manager.block_reuse):
        raise ValueError(
            f"joint block reuse needs block reuse on both pools: {self.error_label} {self.block_reuse}, "
            f"{draft_manager.error_label} {draft_manager.block_reuse} (a draft pool also needs joint_kv_cache_reuse)"
        )
    if draft_manager.tokens_per_block != self.tokens_per_block:
        raise ValueError(
            f"joint block reuse needs one page size: {self.error_label} P={self.tokens_per_block}, "
            f"{draft_manager.error_label} P={draft_manager.tokens_per_block}"
        )
    if draft_manager not in self._reuse_partners:
        self._reuse_partners.append(draft_manager)


def keep_drafter_window(self: KVCacheManagerV2, draft_manager: KVCacheManagerV2) -> None:
    """Target-only reuse with a drafter whose pool does not reuse: stop every hit short of the
    draft pool's windows, so the executor computes the positions the drafter reads at the
    prompt end (`rules.drafter_window_hit_cap`) and its context is whole there.

    Without this, a hit leaves the drafter's context behind the prefix empty and its
    acceptance falls. A draft pool in joint reuse (`pair_joint_reuse`) needs no cap
    and is refused here (ValueError naming both), as is a manager that does not reuse.
    """
    if not self.block_reuse:
        raise ValueError(f"{self.error_label}: keep_drafter_window needs block reuse on this pool")
    if draft_manager in self._reuse_partners:
        raise ValueError(
            f"{self.error_label}: {draft_manager.error_label} is paired for joint reuse; its pool already holds "
            "the prefix's drafter K/V, so no hit needs to stop short of its window"
        )
    self._drafter_windows = tuple(g.window for g in draft_manager.config.layer_groups)

