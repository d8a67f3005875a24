"""The V2 scheduler's contract: the calls upstream's KVCacheV2Scheduler makes before `prepare_resources`.

`SchedulerContract` is a mixin of `KVCacheManagerV2`: prepare a context cache, grow it
for a chunk or a generation step, revert that growth, suspend and resume. Coordinates:
absolute token positions (capacity and history, as `rules.StepSizing` gives them).
Sizes come from the same rules as `prepare_resources`, so that call then changes
nothing. There is no host tier here: a suspended cache keeps its pages and is not
grown or updated.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..request import LlmRequest, reused_prefix, skip_reused_prefix, target_view
from .diagnostics import KVCacheResizeError

if TYPE_CHECKING:
    from .prefix_reuse import PrefixReuse
    from .request_caches import RequestCaches
    from .rules import DraftPoolTraits, StepSizing


class SchedulerContract:
    """The V2 scheduler's calls on a manager's caches (mixed into `KVCacheManagerV2`)."""

    # What these calls read and change of the manager (`KVCacheManagerV2` provides each).
    error_label: str
    tokens_per_block: int
    caches: RequestCaches
    prefix_reuse: PrefixReuse
    sizing_rules: StepSizing
    last_refusal: KVCacheResizeError | None
    _mirror_policy: DraftPoolTraits | None
    _suspended: set[int]
    _allocated_draft_lens: dict[int, int]
    _capacity_before: dict[int, int]
    find_prefix_hit: Callable[[LlmRequest], int]
    pool_diagnostic: Callable[[], str]
    _resume_refusal: Callable[[int], str | None]
    _mirror_resize_error: Callable[..., KVCacheResizeError]

    def is_request_active(self, request_id: int) -> bool:
        """The request holds a cache here and it is not suspended."""
        return request_id in self.caches and request_id not in self._suspended

    def get_history_length(self, req: LlmRequest) -> int | None:
        """Tokens of the request's cache that are history only (None: no cache here)."""
        cache = self.caches.get(req.py_request_id)
        return None if cache is None else cache.history_length

    def prepare_context_cache(self, req: LlmRequest, reuse_limit: int | None = None) -> int | None:
        """The request's cache before a context chunk: created if new (adopting its prefix hit, at most
        `reuse_limit` tokens), resumed if suspended. Returns the prefix it holds from a hit (tokens; 0
        without), never moves the request's view. Refused requests: None (`last_refusal` says why)."""
        rid = req.py_request_id
        if rid not in self.caches:
            hit = self.find_prefix_hit(req) if self._mirror_policy is None and not req.is_dummy else 0
            if reuse_limit is not None:
                hit = min(hit, max(0, reuse_limit) // self.tokens_per_block * self.tokens_per_block)
            if hit:
                self.prefix_reuse.adopt(req, hit, self.prefix_reuse.lookup(req, hit // self.tokens_per_block))
            else:
                self.caches[rid] = self.caches.new(rid)
        if not self.resume_request(req):
            return None
        return self.caches[rid].committed

    def prepare_context(self, req: LlmRequest) -> bool:
        """`prepare_context_cache`, then a first chunk starts past the prefix it reused."""
        if req.is_disagg_generation_init_state:
            raise ValueError(
                f"{self.error_label}: request {req.py_request_id} is a generation-init request; "
                "use prepare_disagg_gen_init"
            )
        first = target_view(req).position == 0 and reused_prefix(req) == 0
        reused = self.prepare_context_cache(req)
        if reused is None:
            return False
        if first and reused:
            skip_reused_prefix(req, reused, self.tokens_per_block)
        return True

    def _grow_or_refuse(self, req: LlmRequest, phase: str, capacity: int, history: int | None) -> bool:
        """Resize the request's cache up to `capacity` (never down); False with `last_refusal` set, the
        cache as it was, when the pool cannot. The capacity before is kept for the reverts."""
        cache = self.caches[req.py_request_id]
        before = cache.capacity
        if not cache.resize(max(capacity, before), history):
            demand = cache.page_demand(max(capacity, before), history)
            self.last_refusal = self._mirror_resize_error(req.py_request_id, phase, capacity, history, demand=demand)
            return False
        self._capacity_before.setdefault(req.py_request_id, before)
        return True

    def resize_context(self, req: LlmRequest, num_tokens: int) -> bool:
        """Room for the next `num_tokens` prompt tokens from the view's position (the extra tokens
        too, the drafts on the last chunk). False when the pool cannot (the cache as it was)."""
        cache = self.caches.get(req.py_request_id)
        if cache is None or num_tokens < 0:
            raise ValueError(
                f"{self.error_label}: resize_context for request {req.py_request_id} with {num_tokens} tokens "
                + ("needs its cache from prepare_context first" if cache is None else "(must be >= 0)")
            )
        capacity, history = self.sizing_rules.context(req, cache, chunk=num_tokens)
        return self._grow_or_refuse(req, "context", capacity, history)

    def try_allocate_draft_context(self, req: LlmRequest, num_tokens: int) -> bool:
        """A draft manager's call (`DraftKVCacheManagerV2`); upstream asserts `is_draft`, so here a
        target manager raises ValueError."""
        raise ValueError(f"{self.error_label}: try_allocate_draft_context is a draft manager's call")

    def try_allocate_generation(self, req: LlmRequest) -> bool:
        """Room for a generation step (new token, drafts, extra). False: no cache, suspended and not
        resumable, or the pool cannot (the cache as it was)."""
        rid = req.py_request_id
        if rid not in self.caches or not self.resume_request(req):
            return False
        capacity, history = self.sizing_rules.generation(req, self.caches[rid])
        if not self._grow_or_refuse(req, "generation", capacity, history):
            return False
        self._allocated_draft_lens[rid] = len(req.py_draft_tokens)
        return True

    def revert_allocate_generation(self, req: LlmRequest) -> None:
        """Undo this step's `try_allocate_generation` (nothing to undo: no-op)."""
        rid = req.py_request_id
        if self._allocated_draft_lens.pop(rid, None) is None:
            return
        self._shrink_back(rid)

    def revert_allocate_context(self, req: LlmRequest) -> bool:
        """Undo this step's context growth and suspend the cache. True: the cache is kept; False: it
        had nothing before this step and is dropped (the request starts over)."""
        rid = req.py_request_id
        if rid not in self.caches:
            return False
        self._shrink_back(rid)
        cache = self.caches[rid]
        if cache.num_blocks == 0 and cache.committed == 0:
            del self.caches[rid]
            cache.free()
            return False
        self.suspend_request(req)
        return True

    def _shrink_back(self, rid: int) -> None:
        before = self._capacity_before.pop(rid, None)
        cache = self.caches[rid]
        if before is not None and before < cache.capacity:
            cache.resize(max(before, cache.history_length), None)

    def extend_capacity_for_tokens(self, request: LlmRequest) -> None:
        """Grow a generation step's room to the request's drafts now (after padding for a CUDA graph
        added some). Raises the explicit `KVCacheResizeError` if the pool cannot."""
        rid = request.py_request_id
        self.caches.require([rid], "extend_capacity_for_tokens")
        capacity, history = self.sizing_rules.generation(request, self.caches[rid])
        if not self._grow_or_refuse(request, "generation", capacity, history):
            raise self.last_refusal
        self._allocated_draft_lens[rid] = len(request.py_draft_tokens)

    def suspend_request(self, req: LlmRequest) -> None:
        """Stop growing and updating the request's cache (its pages stay: there is no host tier)."""
        if req.py_request_id in self.caches:
            self._suspended.add(req.py_request_id)

    def resume_request(self, req: LlmRequest) -> bool:
        """Make a suspended cache active again. False: no cache here, or the tightest pool is fuller
        than `KvCacheConfig.max_util_for_resume` (upstream's pressure rule; `last_refusal` says so)."""
        rid = req.py_request_id
        if rid not in self.caches:
            return False
        if rid not in self._suspended:
            return True
        refusal = self._resume_refusal(rid)
        if refusal is not None:
            self.last_refusal = KVCacheResizeError(
                f"{self.error_label}: request {rid} stays suspended: {refusal}\n" + self.pool_diagnostic(),
                request_id=rid, phase="resume", capacity=self.caches[rid].capacity,
                history=self.caches[rid].history_length,
            )
            return False
        self._suspended.discard(rid)
        return True

    def release_index_slot(self, request_id: int) -> None:
        """Upstream frees a request's page-index slot early and keeps its pages; there are no index
        slots here (block offsets are exported per call), so nothing to do."""
