"""Block reuse on a disaggregated generation worker: a new request adopts its prompt's cached prefix.

Coordinates: absolute token positions from 0; `m` is the prompt length; a hit
is a whole number of pages `h = n * P` (block ordinals `[0, n)`), always below
the prompt's last page boundary that leaves one position to receive
(`n <= (m - 1) // P`). Pages are indices of one pool.

A generation-init cache sits at history `m` (the whole prompt is history), so
the hit rule is taken at `m`, not at `h` as on a context worker: a
full-attention group needs every ordinal of `[0, n)` published, a windowed
group (window widened by the trail page where the pool keeps one) only the
ordinals its window still reads at `m`, its sinks and `[(m + 1 - W) // P, n)`.
At a fixed history that rule is downward closed, so the hit is the smallest
per-group maximum; a hit that would adopt no page at all (every ordinal below
it stale in every group) is no hit (0).

The public functions are `KVCacheManagerV2` methods (hence `self`), kept here;
docs/block_reuse.md ("The generation worker") tells the whole story.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..request import LlmRequest
from .diagnostics import KVCacheResizeError
from .prefix_reuse import adoption_rows, lookup

if TYPE_CHECKING:
    from .kv_cache_manager import KVCacheManagerV2


def receive_start(window: int | None, prompt_len: int, reused_tokens: int = 0) -> int:
    """First absolute position of `[lo, m)` a generation worker must receive for one layer group.

    `window`: the group's attention window in tokens (widened by the trail page
    for a draft pool), None for full attention. The first query sits at `m` and
    reads `[m + 1 - W, m]`; positions below `reused_tokens` sit on adopted pages.
    """
    lo = 0 if window is None else max(0, prompt_len + 1 - window)
    return min(max(lo, reused_tokens), prompt_len)


def _needed_max(pages: list[int | None], stale: tuple[int, int], cap: int) -> int:
    """Largest `n <= cap` such that every ordinal of `[0, n)` outside `stale` is published."""
    lo, hi = stale
    for ordinal in (*range(0, min(lo, cap)), *range(max(hi, lo), cap)):
        if ordinal >= len(pages) or pages[ordinal] is None:
            return ordinal
    return cap


def _adopts_a_page(stale: tuple[int, int], n: int) -> bool:
    lo, hi = stale
    return min(n, lo) > 0 or n > max(hi, lo)


def find_gen_init_hit(self: KVCacheManagerV2, req: LlmRequest) -> int:
    """Tokens of `req`'s prompt, from position 0, a generation-init cache can adopt from this worker's pools.

    Valid in every layer group of this manager and of its joint partners
    (`pair_joint_reuse`) at history `m = req.prompt_len` (module docstring).
    Unlike `find_prefix_hit` it ignores `keep_drafter_window`: the drafter
    context is handed over apart from the target's K/V. 0 without block reuse.
    Changes nothing.
    """
    managers = [self, *self._reuse_partners]
    if not all(m.block_reuse for m in managers):
        return 0
    P, m = self.tokens_per_block, req.prompt_len
    cap = max(m - 1, 0) // P
    if cap == 0:
        return 0
    found = [(mgr, lookup(mgr, req, cap)) for mgr in managers]
    n = cap
    stales: list[tuple[int, int]] = []
    for mgr, f in found:
        for g, group in enumerate(mgr.layer_groups):
            stale = group.life_cycle.stale_range(m, P)
            stales.append(stale)
            n = min(n, _needed_max(f.pages[g], stale, cap))
    if n == 0 or not any(_adopts_a_page(stale, n) for stale in stales):
        return 0
    return n * P


def _gen_init_error(self: KVCacheManagerV2, req: LlmRequest, tokens: int, why: str) -> KVCacheResizeError:
    return KVCacheResizeError(
        f"{self.error_label} generation resize failed for request {req.py_request_id}: its generation init "
        f"reuses {tokens} prompt tokens of {req.prompt_len}, but {why}; nothing was changed\n" + self.pool_diagnostic(),
        request_id=req.py_request_id,
        phase="generation",
        capacity=tokens,
        history=req.prompt_len,
    )


def _check_reuse_arguments(self: KVCacheManagerV2, req: LlmRequest, tokens: int) -> None:
    rid, P = req.py_request_id, self.tokens_per_block
    if rid in self._caches:
        raise ValueError(f"{self.error_label}: request {rid} already holds a cache; a generation init adopts only afresh")
    if tokens < 0 or tokens % P or tokens > max(req.prompt_len - 1, 0) // P * P:
        raise ValueError(
            f"{self.error_label}: request {rid} reuses {tokens} tokens of a {req.prompt_len}-token prompt at "
            f"generation init, not a whole number of {P}-token pages below its last received position"
        )
    if not self.block_reuse:
        raise ValueError(f"{self.error_label}: request {rid} reuses {tokens} tokens but this pool has no block reuse")
    if len(req.get_tokens(0)) < tokens:
        raise ValueError(f"{self.error_label}: request {rid} carries {len(req.get_tokens(0))} token ids, fewer than its hit {tokens}")


def _missing_error(self: KVCacheManagerV2, req: LlmRequest, tokens: int):
    def error(group: int, missing: list[int]) -> KVCacheResizeError:
        return _gen_init_error(
            self, req, tokens,
            f"layer group {group} of this pool has no published page for block ordinals {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''} ({len(missing)} missing; find the hit with find_gen_init_hit "
            "just before, with nothing allocated in between)",
        )

    return error


def prepare_disagg_gen_init(self: KVCacheManagerV2, req: LlmRequest, *, reused_tokens: int = 0) -> None:
    """A generation worker's new request: the prompt is history, a step of headroom above it.

    `reused_tokens` (a hit of `find_gen_init_hit`, block reuse only): the cache
    first adopts, shared, the published pages of ordinals `[0, reused_tokens // P)`
    each group still reads at history `m` (`KVCache.adopt_prefix(stale_at=m)`),
    then grows to the generation-init size, allocating only the rest. The caller
    then writes only `[receive_start(...), m)` per group. All or nothing: a page
    missing (`KVCacheResizeError`, phase `generation`), a pool too small or a bad
    argument (`ValueError`) leaves every pool, cache and the request as before.
    """
    rules_ = self.sizing_rules
    if not reused_tokens:
        self._resize_or_raise(req, rules_.disagg_gen_init_phase, rules_.disagg_gen_init)
        return
    _check_reuse_arguments(self, req, reused_tokens)
    found = lookup(self, req, reused_tokens // self.tokens_per_block)
    rows = adoption_rows(self, reused_tokens, found, req.prompt_len, _missing_error(self, req, reused_tokens))
    with self._batch_transaction([req.py_request_id]):
        cache = self._new_cache(req.py_request_id)
        self._caches[req.py_request_id] = cache
        cache.adopt_prefix(reused_tokens, rows, found.keys, stale_at=req.prompt_len)
        self._resize_or_raise(req, rules_.disagg_gen_init_phase, rules_.disagg_gen_init)


def publish_gen_init(self: KVCacheManagerV2, req: LlmRequest, *, written_from: int = 0) -> int:
    """After the generation worker wrote a new request's prompt K/V: publish its whole prompt pages.

    Group g publishes the full pages of ordinals `[ceil(s_g / P), m // P)` it
    backs, `s_g = max(receive_start(W_g, m, hit), written_from)` with `hit` the
    tokens the cache adopted: a page that starts below the first written position
    is not whole here and is never published. `written_from`: the lowest position
    the caller wrote (e.g. a drafter context sent from a higher floor). Adopted
    pages are published already. No-op without block reuse. Returns the pages
    published. `MissingKVCacheError` naming the request if it holds no cache here.
    """
    self._require_caches([req.py_request_id], "publish_gen_init")
    cache = self._caches[req.py_request_id]
    m, P = req.prompt_len, self.tokens_per_block
    if not self.block_reuse or cache.committed >= m or cache.history_length < m:
        return 0
    hit = cache.committed  # what the generation init adopted (0 without a hit)
    first = [
        -(-max(receive_start(group.life_cycle.window, m, hit), written_from) // P) for group in self.layer_groups
    ]
    pools = self.distinct_pools()
    before = sum(pool.prefix.num_published for pool in pools)
    cache.commit(m, req.get_tokens(0), first_ordinals=first)
    return sum(pool.prefix.num_published for pool in pools) - before

