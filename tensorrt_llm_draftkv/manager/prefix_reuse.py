"""Block reuse in a manager: find a prompt's prefix hit, adopt it, publish history after each chunk.

Coordinates: token counts from absolute position 0; a hit is a whole number of
pages, block ordinals `[0, n)`. A manager owns one `PrefixReuse` (public as
`manager.prefix_reuse`) over its `RequestCaches`; it holds the reuse state of
its own (joint partners, drafter windows a hit stops short of).
docs/block_reuse.md tells the whole story.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from ..request import LlmRequest, reused_prefix, skip_reused_prefix, target_view
from ..runtime import BAD_PAGE_INDEX, LayerGroup
from ..runtime.prefix_cache import PageKey, longest_valid_prefix, page_tokens
from .diagnostics import KVCacheResizeError
from .gen_init_reuse import gen_init_hit_pages, receive_start
from .request_caches import RequestCaches
from .rules import drafter_window_hit_cap

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


MissingError = Callable[[int, list[int]], Exception]
"""`fn(group, block ordinals)`: the error for a group lacking published pages a hit needs."""


class PrefixReuse:
    """One manager's block reuse: hits over its pools and its joint partners', adoption, publishing.

    `enabled`: the manager's pools publish and share pages. `follows_target`: a
    draft mirror, which adopts exactly what the target's hit reused
    (`req.prepopulated_prompt_len`) instead of looking for a hit of its own.
    """

    def __init__(
        self, caches: RequestCaches, layer_groups: Sequence[LayerGroup], tokens_per_block: int, label: str,
        *, enabled: bool, follows_target: bool,
    ) -> None:
        self.caches = caches
        self.layer_groups = layer_groups  # the manager's own list
        self.tokens_per_block = tokens_per_block
        self.label = label
        self.enabled = enabled
        self.follows_target = follows_target
        #: Other managers' reuse whose pools a hit must also cover (`pair_with`).
        self.partners: list[PrefixReuse] = []
        #: Draft windows a target-only hit must stop short of (`keep_drafter_window`), or None.
        self.drafter_windows: tuple[int | None, ...] | None = None

    # -- finding a hit --------------------------------------------------------------------
    def lookup(self, req: LlmRequest, num_pages: int) -> PrefixLookup:
        """Keys and published pages of `req`'s first `num_pages` pages in these pools. Changes nothing."""
        probe = self.caches.new(req.py_request_id)  # holds no page: only its chain roots are used
        tokens = page_tokens(req.get_tokens(0), self.tokens_per_block, 0, num_pages)
        hashes = [hash(t) for t in tokens]  # shared by every group: only the chain differs
        keys, pages, windows = [], [], []
        for g, group in enumerate(self.layer_groups):
            lc = group.life_cycle
            group_keys, group_pages = group.pool.prefix.match(
                tokens, hashes, probe.keys.root(g), stop_at_miss=lc.window is None
            )
            keys.append(group_keys)
            pages.append(group_pages)
            windows.append((lc.window, lc.sink_blocks))
        return PrefixLookup(keys, pages, windows)

    def find_hit(self, req: LlmRequest) -> int:
        """Tokens of `req`'s prompt, from position 0, that can be reused: a whole number of pages.

        Valid in every layer group here and of every joint partner (`pair_with`): a
        full-attention group needs every page below the hit published, a windowed
        group only the pages its window (and sinks) still reads at history = hit. At
        least one prompt token is always left to compute. 0 without block reuse.
        Changes nothing.
        """
        tokens, _ = self._find(req)
        return tokens

    def _find(self, req: LlmRequest) -> tuple[int, list[PrefixLookup]]:
        sides = [self, *self.partners]
        if not all(side.enabled for side in sides):
            return 0, []
        P = self.tokens_per_block
        cap = max(req.prompt_len - 1, 0) // P
        if self.drafter_windows is not None:
            cap = min(cap, drafter_window_hit_cap(req.prompt_len, self.drafter_windows, P) // P)
        if cap == 0:
            return 0, []
        found = [side.lookup(req, cap) for side in sides]
        windows = [w for f in found for w in f.windows]
        present = [row for f in found for row in f.present()]
        return longest_valid_prefix(windows, present, cap, P) * P, found

    # -- adopting it ----------------------------------------------------------------------
    def adoption_rows(self, tokens: int, found: PrefixLookup, stale_at: int, missing_error: MissingError) -> list[list[int]]:
        """Per group, block ordinal -> published page for `[0, tokens // P)`; `BAD_PAGE_INDEX` where the
        group's window no longer reads the ordinal at history `stale_at` (absolute tokens).

        Raises `missing_error(group, ordinals)` for the first group lacking a page it reads.
        """
        p = self.tokens_per_block
        n = tokens // p
        rows = []
        for g, group in enumerate(self.layer_groups):
            lo, hi = group.life_cycle.stale_range(stale_at, p)
            have = found.pages[g]
            row = [BAD_PAGE_INDEX if lo <= i < hi else (have[i] if i < len(have) else None) for i in range(n)]
            missing = [i for i, page in enumerate(row) if page is None]
            if missing:
                raise missing_error(g, missing)
            rows.append(row)
        return rows

    def adopt(self, req: LlmRequest, tokens: int, found: PrefixLookup) -> None:
        """Create `req`'s cache at `tokens` of history on the published pages of `found` (see `KVCache.adopt_prefix`)."""
        rows = self.adoption_rows(tokens, found, tokens, lambda g, missing: self._missing_pages(req, tokens, g, missing))
        cache = self.caches.new(req.py_request_id)
        cache.adopt_prefix(tokens, rows, found.keys)
        self.caches[req.py_request_id] = cache

    def _missing_pages(self, req: LlmRequest, tokens: int, group: int, missing: list[int]) -> KVCacheResizeError:
        """A mirror told to reuse `tokens` whose pool lacks published pages (block ordinals `missing`)."""
        return KVCacheResizeError(
            f"{self.label} context resize failed for request {req.py_request_id}: it reuses {tokens} "
            f"prompt tokens but layer group {group} of this pool has no published page for block ordinals "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)} missing; a hit must be found with "
            "pair_joint_reuse and adopted in the same step)\n" + self.caches.diagnostic(),
            request_id=req.py_request_id,
            phase="context",
            capacity=tokens,
            history=tokens,
        )

    def reuse_prefixes(self, requests: list[LlmRequest]) -> None:
        """Before any growth of a step, give each fresh context request its prefix hit.

        A target manager leads: a request still at position 0 gets the hit of
        `find_hit`, its cache adopts the pages and its target view skips them
        (`request.skip_reused_prefix`). A joint draft mirror follows: it adopts
        exactly `req.prepopulated_prompt_len` from its own pool (the target's lookup
        already required them there). All hits are pinned before the step allocates,
        so one request's growth cannot evict the pages another's hit needs.
        """
        if not self.enabled:
            return
        for req in requests:
            if req.is_dummy or req.py_request_id in self.caches:
                continue
            if not self.follows_target:
                if target_view(req).position != 0 or reused_prefix(req):
                    continue
                tokens, found = self._find(req)
                if tokens:
                    self.adopt(req, tokens, found[0])
                    skip_reused_prefix(req, tokens, self.tokens_per_block)
            elif reused_prefix(req) > 0:
                self._follow(req, reused_prefix(req))

    def _follow(self, req: LlmRequest, tokens: int) -> None:
        """A draft mirror adopts the `tokens` the target's hit reused."""
        P = self.tokens_per_block
        if tokens % P or tokens >= req.prompt_len:
            raise ValueError(
                f"{self.label}: request {req.py_request_id} reuses {tokens} tokens of a {req.prompt_len}-token "
                f"prompt, not a whole number of {P}-token pages below the prompt's end"
            )
        self.adopt(req, tokens, self.lookup(req, tokens // P))

    def publish_history(self, req: LlmRequest, position: int) -> None:
        """After a chunk: publish the prompt's full pages below `position` that the cache still backs."""
        cache = self.caches[req.py_request_id]
        done = min(position, req.prompt_len, cache.history_length)
        if done > cache.committed:
            cache.commit(done, req.get_tokens(0))

    # -- partners ---------------------------------------------------------------------------
    def pair_with(self, draft: PrefixReuse) -> None:
        """Make this (target) side's hits joint with `draft`'s pool (`joint_kv_cache_reuse`).

        From now on a hit counts only pages both pools hold, so the draft mirror can
        adopt the same prefix with the drafter's K/V. Both sides need block reuse and
        the same page size (ValueError naming both otherwise).
        """
        if draft is self:
            raise ValueError(f"{self.label}: a manager cannot pair with itself")
        if not (self.enabled and draft.enabled):
            raise ValueError(
                f"joint block reuse needs block reuse on both pools: {self.label} {self.enabled}, "
                f"{draft.label} {draft.enabled} (a draft pool also needs joint_kv_cache_reuse)"
            )
        if draft.tokens_per_block != self.tokens_per_block:
            raise ValueError(
                f"joint block reuse needs one page size: {self.label} P={self.tokens_per_block}, "
                f"{draft.label} P={draft.tokens_per_block}"
            )
        if draft not in self.partners:
            self.partners.append(draft)

    def keep_drafter_window(self, draft: PrefixReuse, windows: tuple[int | None, ...]) -> None:
        """Target-only reuse with a drafter whose pool does not reuse: stop every hit short of the
        draft pool's `windows`, so the executor computes the positions the drafter reads at the
        prompt end (`rules.drafter_window_hit_cap`) and its context is whole there.

        Without this, a hit leaves the drafter's context behind the prefix empty and its
        acceptance falls. A draft side in joint reuse (`pair_with`) needs no cap and is
        refused here (ValueError naming both), as is a side that does not reuse.
        """
        if not self.enabled:
            raise ValueError(f"{self.label}: keep_drafter_window needs block reuse on this pool")
        if draft in self.partners:
            raise ValueError(
                f"{self.label}: {draft.label} is paired for joint reuse; its pool already holds "
                "the prefix's drafter K/V, so no hit needs to stop short of its window"
            )
        self.drafter_windows = windows

    # -- a disaggregated generation worker ------------------------------------------------------
    def find_gen_init_hit(self, req: LlmRequest) -> int:
        """Tokens of `req`'s prompt, from position 0, a generation-init cache can adopt from these pools.

        Valid in every layer group here and of the joint partners at history
        `m = req.prompt_len` (manager/gen_init_reuse.py). Unlike `find_hit` it ignores
        `keep_drafter_window`: the drafter context is handed over apart from the
        target's K/V. 0 without block reuse. Changes nothing.
        """
        sides = [self, *self.partners]
        if not all(side.enabled for side in sides):
            return 0
        P, m = self.tokens_per_block, req.prompt_len
        cap = max(m - 1, 0) // P
        if cap == 0:
            return 0
        pages, stales = [], []
        for side in sides:
            found = side.lookup(req, cap)
            for g, group in enumerate(side.layer_groups):
                pages.append(found.pages[g])
                stales.append(group.life_cycle.stale_range(m, P))
        return gen_init_hit_pages(pages, stales, cap) * P

    def adopt_for_gen_init(self, req: LlmRequest, tokens: int) -> None:
        """Create `req`'s cache at `tokens` (a hit of `find_gen_init_hit`) on the published pages each
        group still reads at history `m` (`KVCache.adopt_prefix(stale_at=m)`). The caller then grows
        it to the generation-init size, inside one transaction. `KVCacheResizeError` (phase
        "generation") for a page no longer published, ValueError for a bad argument."""
        self._check_gen_init_reuse(req, tokens)
        found = self.lookup(req, tokens // self.tokens_per_block)

        def missing_error(group: int, missing: list[int]) -> KVCacheResizeError:
            return self._gen_init_error(
                req, tokens,
                f"layer group {group} of this pool has no published page for block ordinals {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''} ({len(missing)} missing; find the hit with find_gen_init_hit "
                "just before, with nothing allocated in between)",
            )

        rows = self.adoption_rows(tokens, found, req.prompt_len, missing_error)
        cache = self.caches.new(req.py_request_id)
        self.caches[req.py_request_id] = cache
        cache.adopt_prefix(tokens, rows, found.keys, stale_at=req.prompt_len)

    def _gen_init_error(self, req: LlmRequest, tokens: int, why: str) -> KVCacheResizeError:
        return KVCacheResizeError(
            f"{self.label} generation resize failed for request {req.py_request_id}: its generation init "
            f"reuses {tokens} prompt tokens of {req.prompt_len}, but {why}; nothing was changed\n"
            + self.caches.diagnostic(),
            request_id=req.py_request_id,
            phase="generation",
            capacity=tokens,
            history=req.prompt_len,
        )

    def _check_gen_init_reuse(self, req: LlmRequest, tokens: int) -> None:
        rid, P = req.py_request_id, self.tokens_per_block
        if rid in self.caches:
            raise ValueError(f"{self.label}: request {rid} already holds a cache; a generation init adopts only afresh")
        if tokens < 0 or tokens % P or tokens > max(req.prompt_len - 1, 0) // P * P:
            raise ValueError(
                f"{self.label}: request {rid} reuses {tokens} tokens of a {req.prompt_len}-token prompt at "
                f"generation init, not a whole number of {P}-token pages below its last received position"
            )
        if not self.enabled:
            raise ValueError(f"{self.label}: request {rid} reuses {tokens} tokens but this pool has no block reuse")
        if len(req.get_tokens(0)) < tokens:
            raise ValueError(
                f"{self.label}: request {rid} carries {len(req.get_tokens(0))} token ids, fewer than its hit {tokens}"
            )

    def publish_gen_init(self, req: LlmRequest, *, written_from: int = 0) -> int:
        """After the generation worker wrote a new request's prompt K/V: publish its whole prompt pages.

        Group g publishes the full pages of ordinals `[ceil(s_g / P), m // P)` it
        backs, `s_g = max(receive_start(W_g, m, hit), written_from)` with `hit` the
        tokens the cache adopted: a page that starts below the first written position
        is not whole here and is never published. `written_from`: the lowest position
        the caller wrote (e.g. a drafter context sent from a higher floor). Adopted
        pages are published already. No-op without block reuse. Returns the pages
        published. `MissingKVCacheError` naming the request if it holds no cache here.
        """
        (cache,) = self.caches.require([req.py_request_id], "publish_gen_init")
        m, P = req.prompt_len, self.tokens_per_block
        if not self.enabled or cache.committed >= m or cache.history_length < m:
            return 0
        hit = cache.committed  # what the generation init adopted (0 without a hit)
        first = [
            -(-max(receive_start(group.life_cycle.window, m, hit), written_from) // P) for group in self.layer_groups
        ]
        pools = self.caches.distinct_pools()
        before = sum(pool.prefix.num_published for pool in pools)
        cache.commit(m, req.get_tokens(0), first_ordinals=first)
        return sum(pool.prefix.num_published for pool in pools) - before


__all__ = ["MissingError", "PrefixLookup", "PrefixReuse"]
