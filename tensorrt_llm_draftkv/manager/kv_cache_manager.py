"""KVCacheManagerV2: the target side. One KVCache per request over the manager's pools.

Coordinates: absolute token positions. A step's cache holds `history` tokens of
history plus the space for the step's input above it (its *headroom*).
"""
from __future__ import annotations

from operator import attrgetter
from typing import Any, Iterable, List, Optional, Sequence, Union

from ..bindings import CacheType, DataType
from ..config import KVPoolConfig
from ..llmapi import KvCacheConfig
from ..mapping import Mapping
from ..request import LlmRequest, ScheduledRequests, reused_prefix, set_target_view, target_view
from ..runtime import KVCache, LayerGroup, PagePool, batch_resize
from . import dummies, export, layer_pools, rules, upstream_geometry, upstream_init
from .block_table import DeviceBlockTable
from .buffers import LayerSlot, sequential_layer_slots
from .diagnostics import KVCacheResizeError, MissingKVCacheError, context_step, resize_error
from .offset_calls import OffsetCalls
from .offset_destinations import OffsetDestinations
from .prefix_reuse import PrefixReuse
from .request_caches import RequestCaches
from .scheduler_contract import SchedulerContract
from .upstream_accessors import UpstreamAccessors


_REQUEST_ID = attrgetter("py_request_id")
_NUM_TOKENS = attrgetter("max_beam_num_tokens")
_HISTORY = attrgetter("history_length")
_CAPACITY = attrgetter("capacity")


class KVCacheManagerV2(SchedulerContract, UpstreamAccessors, OffsetCalls):
    """Sizes and addresses every request's cache in one set of per-group pools.

    Built as upstream builds it (the constructor below: the model's shape, a `Mapping`, an
    LLM-API `KvCacheConfig`; `is_draft=True` with a drafter's `spec_config` makes the draft
    manager, a `DraftKVCacheManagerV2`), or over a pool geometry of one's own with
    `from_pool_config`.

    Its calls by job: upstream's hooks, queries and block reuse here; the V2 scheduler's
    contract (`SchedulerContract`), upstream's accessors (`UpstreamAccessors`) and the
    block-offset export and device block table (`OffsetCalls`) in mixins of their own.
    """

    error_label = "KV cache"
    missing_label = "KV cache"  # "Missing <label> for generation request N"
    is_draft = False
    _draft_class = False  # the subclass that holds a mirror policy

    def __new__(cls, *args: Any, **kwargs: Any) -> "KVCacheManagerV2":
        # Upstream has one class for both sides; a draft manager here is the subclass that holds the
        # mirror policy, so `KVCacheManagerV2(..., is_draft=True)` builds one.
        # The subclass is found among this class's subclasses rather than imported, so the two
        # modules do not import each other (the package imports both before any call).
        if cls is KVCacheManagerV2 and kwargs.get("is_draft", False):
            cls = next(sub for sub in KVCacheManagerV2.__subclasses__() if sub._draft_class)
        return object.__new__(cls)

    def __init__(
        self,
        kv_cache_config: KvCacheConfig,
        kv_cache_type: CacheType,
        *,
        num_layers: int,
        num_kv_heads: Union[int, List[Optional[int]]],
        head_dim: Union[int, List[int]],
        tokens_per_block: int,
        max_seq_len: int,
        max_batch_size: int,
        mapping: Mapping,
        dtype: DataType = DataType.HALF,
        spec_config=None,
        layer_mask: Optional[List[bool]] = None,
        vocab_size: int = None,
        max_num_tokens: int = 8192,
        model_config: Optional[object] = None,
        max_beam_width: int = 1,
        is_draft: bool = False,
        kv_connector_manager: Optional[object] = None,
        execution_stream: Optional[object] = None,
        is_disagg: bool = False,
        enable_stats: bool = False,
        num_reserved_index_slots: int = 1,
        disable_overlap_scheduler: bool = False,
        kv_events_config: Optional[object] = None,
        is_estimating_kv_cache: bool = False,
        cold_page_codec_provider: Optional[object] = None,
        joint_kv_cache_reuse: bool = False,
        max_cuda_graph_batch_size: Optional[int] = None,
        **kwargs,
    ) -> None:
        """Upstream's constructor, argument for argument (docs/upstream.md lists what each does here).

        Pools: `manager/upstream_geometry.py` turns the model's shape and the budget of
        `kv_cache_config` into one pool per attention window. Drafts: `spec_config`'s
        `max_draft_len`, and upstream's extra tokens for a one-engine drafter. Ours, as
        keywords: `device` (default: CUDA when available), `sizing` and `trail_page` (a
        draft manager only). Refused with ValueError: beam width > 1, a KV connector, a
        cold-page codec, cross attention, pipeline or context parallelism.
        """
        options = upstream_init.check_options(
            self.error_label, kwargs, is_draft=is_draft, max_beam_width=max_beam_width,
            kv_connector_manager=kv_connector_manager, cold_page_codec_provider=cold_page_codec_provider,
        )
        drafts = upstream_init.draft_numbers(spec_config, is_draft=is_draft)
        policy, trail = upstream_init.mirror_policy(
            spec_config, is_draft=is_draft, joint_kv_cache_reuse=joint_kv_cache_reuse, options=options,
            tokens_per_block=tokens_per_block,
            windowed=any(w is not None for w in upstream_geometry.layer_windows(
                kv_cache_config.max_attention_window, num_layers, max_seq_len)),
        )
        geometry = upstream_geometry.pool_geometry(
            kv_cache_config, kv_cache_type, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
            tokens_per_block=tokens_per_block, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
            mapping=mapping, dtype=dtype, layer_mask=layer_mask, max_num_tokens=max_num_tokens,
            max_draft_len=drafts.max_draft_len, num_extra_kv_tokens=drafts.num_extra_kv_tokens,
            trail_tokens=trail, device=options.device, label=self.error_label,
        )
        self._upstream_args = upstream_init.UpstreamArgs(
            kv_cache_config=kv_cache_config, kv_cache_type=kv_cache_type, mapping=mapping, spec_config=spec_config,
            max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, is_disagg=is_disagg,
            enable_stats=enable_stats, budget_bytes=geometry.budget_bytes, budget_source=geometry.budget_source,
        )
        if policy is None:
            if self._draft_class:
                raise ValueError(
                    f"{type(self).__name__} is the draft manager: pass is_draft=True (and the drafter's spec_config), "
                    "or build a KVCacheManagerV2 for the target side"
                )
            self._init_pools(
                geometry.config, max_draft_len=drafts.max_draft_len, num_extra_kv_tokens=drafts.num_extra_kv_tokens,
                mirror_policy=None, trail_tokens=0, layer_slots=geometry.layer_slots,
            )
        else:
            self._init_draft(
                geometry.config, spec_mode=policy.mode, max_draft_len=drafts.max_draft_len,
                num_extra_kv_tokens=drafts.num_extra_kv_tokens, joint_kv_cache_reuse=joint_kv_cache_reuse,
                sizing=policy.sizing, trail_page=options.trail_page, is_draft=True,
                layer_slots=geometry.layer_slots,
            )

    @classmethod
    def from_pool_config(
        cls,
        config: KVPoolConfig,
        *,
        max_draft_len: int = 0,
        num_extra_kv_tokens: int = 0,
        mirror_policy: rules.DraftPoolTraits | None = None,
        trail_tokens: int = 0,
    ) -> "KVCacheManagerV2":
        """A manager over pools of exactly this geometry (the simulator's and the tests' way in).

        `mirror_policy`: size every cache as a draft mirror under these rules (None: a
        target cache); `trail_tokens`: tokens every window keeps below itself (the trail
        page). An executor written for TensorRT-LLM calls the constructor instead.
        """
        manager = object.__new__(cls)
        KVCacheManagerV2._init_pools(
            manager, config, max_draft_len=max_draft_len, num_extra_kv_tokens=num_extra_kv_tokens,
            mirror_policy=mirror_policy, trail_tokens=trail_tokens,
        )
        return manager

    def _init_pools(
        self,
        config: KVPoolConfig,
        *,
        max_draft_len: int,
        num_extra_kv_tokens: int,
        mirror_policy: rules.DraftPoolTraits | None,
        trail_tokens: int,
        layer_slots: tuple[LayerSlot, ...] | None = None,
    ) -> None:
        """Build the pools of `config` and the empty request table (every constructor ends here).

        `layer_slots`: model layer -> (group, layer tensor); default group 0's layers first.
        """
        self.layer_slots = layer_slots or sequential_layer_slots([g.num_layers for g in config.layer_groups])
        if not hasattr(self, "_upstream_args"):
            self._upstream_args = None
        if max_draft_len < 0 or num_extra_kv_tokens < 0:
            raise ValueError(
                f"max_draft_len ({max_draft_len}) and num_extra_kv_tokens ({num_extra_kv_tokens}) must be >= 0"
            )
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self.max_draft_len = max_draft_len
        self.num_extra_kv_tokens = num_extra_kv_tokens
        self._mirror_policy = mirror_policy
        self._sizing_key: tuple | None = None
        self._sizing: rules.StepSizing | None = None
        #: Tokens kept below every window for a trailing drafter slot (one page, or 0): the one
        #: answer the drafter's seeding, the estimators and the planner read.
        self.draft_slot_trail_tokens = trail_tokens
        #: Publish full pages and share them by prefix (a draft mirror only with joint reuse).
        self.block_reuse = config.enable_block_reuse and (
            mirror_policy is None or mirror_policy.joint_kv_cache_reuse
        )
        self.layer_groups: list[LayerGroup] = layer_pools.build_layer_groups(config, self.error_label, trail_tokens, self.block_reuse)
        #: Every live request's cache (request id -> `KVCache`) and the batch transaction over them.
        self.caches = RequestCaches(self.layer_groups, self.tokens_per_block, self.error_label)
        #: Block reuse: hits, adoption, publishing, and the joint partners a hit must also cover.
        self.prefix_reuse = PrefixReuse(
            self.caches, self.layer_groups, self.tokens_per_block, self.error_label,
            enabled=self.block_reuse, follows_target=mirror_policy is not None,
        )
        #: What the block-offset export reads of this manager.
        self.offset_layout = export.OffsetLayout(
            label=self.error_label, kv_factor=config.kv_factor, max_blocks_per_seq=config.max_blocks_per_seq,
            device=str(config.device), guard_pages=tuple(g.pool.guard_page_index for g in self.layer_groups),
        )
        #: The rows on the pools' device, updated by what changed (`device_block_table`), and what
        #: `copy_batch_block_offsets` wrote into each destination before.
        self._block_table: DeviceBlockTable | None = None
        self.offset_destinations = OffsetDestinations()
        # The V2 scheduler's state: suspended caches (kept, not grown) and each generation
        # step's reserved draft slots (`try_allocate_generation`).
        self._suspended: set[int] = set()
        #: The batch of the last successful `prepare_resources` (ours): what a drafter's worker
        #: reads the step's request objects from, since upstream's metadata carries only ids.
        self.last_prepared_batch: ScheduledRequests | None = None
        self._allocated_draft_lens: dict[int, int] = {}
        self._capacity_before: dict[int, int] = {}  # a step's growth, for the reverts
        #: The explicit error behind the last False of a call that answers False (upstream's convention).
        self.last_refusal: KVCacheResizeError | None = None

    @property
    def sizing_rules(self) -> rules.StepSizing:
        """(capacity, history) per phase for this manager's caches (see `rules.StepSizing`)."""
        key = (self.max_draft_len, self.num_extra_kv_tokens, self._mirror_policy)
        if self._sizing_key != key:  # rebuilt only if the manager's numbers change
            self._sizing_key, self._sizing = key, rules.StepSizing(*key)
        return self._sizing

    @property
    def _draft_slot_trail_tokens(self) -> int:
        """Upstream's name for `draft_slot_trail_tokens`."""
        return self.draft_slot_trail_tokens

    @property
    def generation_headroom(self) -> int:
        """Tokens a generation step puts above history: the new token, drafts, extra."""
        return rules.generation_headroom(self.max_draft_len, self.num_extra_kv_tokens)

    @property
    def after_step_headroom(self) -> int:
        """Tokens above history a cache may keep of its capacity after `update_resources` (1: only the
        next token's slot, upstream's rule for a target cache). See `rules.after_step_sizes`."""
        return 1

    def context_headroom(self, chunk: int, is_last_chunk: bool) -> int:
        """Tokens a context chunk puts above its start: the chunk, the extra tokens, drafts on the last chunk."""
        return rules.context_headroom(chunk, is_last_chunk, self.max_draft_len, self.num_extra_kv_tokens)

    @property
    def _mirror_uses_draft_view(self) -> bool:
        """Does this cache read the request's draft view (upstream's name)? Never for a target cache."""
        return self.sizing_rules.reads_draft_view

    def _mirror_resize_error(
        self, req_id: int, phase: str, capacity: int, history: int | None, step: str = "",
        demand: Sequence[int] | None = None,
    ) -> KVCacheResizeError:
        """The one place resize errors (context, generation, dummy) are built, named as upstream.

        `<label> <phase> resize failed for request N: could not resize to C tokens
        (history H)`, then every live cache's capacity, history and logical blocks,
        the windows and the free pages per group.
        """
        return resize_error(
            label=self.error_label,
            request_id=req_id,
            phase=phase,
            capacity=capacity,
            history=history,
            diagnostic=self.pool_diagnostic(),
            step=step,
            pages_needed=demand,
            pages_free=None if demand is None else self.free_pages(),
        )

    # -- queries ----------------------------------------------------------------
    @property
    def num_pools(self) -> int:
        return len(self.layer_groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.life_cycle.window for g in self.layer_groups)

    def pools(self) -> list[PagePool]:
        return [g.pool for g in self.layer_groups]

    def distinct_pools(self) -> list[PagePool]:
        """Each pool once (layer groups may share one), in group order."""
        return self.caches.distinct_pools()

    def free_pages(self) -> tuple[int, ...]:
        return tuple(g.pool.num_free for g in self.layer_groups)

    def request_ids(self) -> list[int]:
        return self.caches.ids()

    def has_cache(self, request_id: int) -> bool:
        return request_id in self.caches

    def get_cache(self, request_id: int) -> KVCache:
        try:
            return self.caches[request_id]
        except KeyError:
            raise KeyError(
                f"{self.error_label}: request {request_id} has no cache here "
                f"(live requests: {self.request_ids()[:16]})"
            ) from None

    def get_caches(self, request_ids: Sequence[int]) -> list[KVCache]:
        """The caches of `request_ids`, in order (ours: one lookup for a batch; a repeated batch gets the
        same list back, so read it, do not change it). KeyError naming the ids without one."""
        caches = self.caches.lookup(request_ids)
        if caches is None:
            missing = self.caches.missing(request_ids)
            raise KeyError(f"{self.error_label}: requests {missing} have no cache here "
                           f"(live requests: {self.request_ids()[:16]})")
        return caches

    def pool_diagnostic(self) -> str:
        """Every live cache's capacity, history and blocks, the windows and the free pages per group."""
        return self.caches.diagnostic()

    # -- resizing -----------------------------------------------------------------
    def resize_or_raise(self, req: LlmRequest, phase: str, sizing) -> None:
        """Size `req`'s cache by `sizing(req, cache) -> (capacity, history)` (absolute tokens), creating
        it if needed, or raise `KVCacheResizeError` for `phase`, leaving nothing behind."""
        fresh = req.py_request_id not in self.caches
        cache = self.caches[req.py_request_id] if not fresh else self.caches.new(req.py_request_id)
        capacity, history = sizing(req, cache)
        if fresh:
            self.caches[req.py_request_id] = cache
        try:
            ok = cache.resize(capacity, history)
        except ValueError:
            if fresh:
                del self.caches[req.py_request_id]
            raise
        if not ok:
            demand = cache.page_demand(capacity, history)
            if fresh:
                # A fresh cache that got nothing is dropped: no silent half-admitted request.
                del self.caches[req.py_request_id]
            step = ""
            if phase == "context":
                view = self.sizing_rules.view(req)
                step = context_step(view.position, view.chunk_size, req.prompt_len,
                                    draft_view=self.sizing_rules.reads_draft_view)
            raise self._mirror_resize_error(req.py_request_id, phase, capacity, history, step, demand)

    def prepare_resources(self, scheduled_batch: ScheduledRequests) -> None:
        """Size every request's cache for this step (context chunk or generation step).

        A cache the V2 scheduler already sized (`resize_context`, `try_allocate_generation`)
        is left as it is: the rules give the same capacity.

        A generation request must already hold a cache (from its context
        chunks, `prepare_disagg_gen_init` or `add_dummy_requests`); one that does
        not raises `MissingKVCacheError` ("Missing ... for generation request N").
        All or nothing: if one request cannot be sized, every request of the
        batch is put back as it was (fresh caches dropped) and the error raised.
        """
        batch = scheduled_batch
        gen = batch.generation_requests
        if not batch.context_requests and not self._suspended:
            # The usual step, generation only: one lookup gives the caches (None when one is missing),
            # then one checked pass (which refuses a request named twice); the path below names either.
            caches = self.caches.lookup(list(map(_REQUEST_ID, gen)))
            if caches is not None and self._resize_known_to_fit(gen, self.sizing_rules.generation_sizes(gen), caches):
                self.last_prepared_batch = batch
                return
        missing = self.caches.missing(r.py_request_id for r in gen)
        if missing:
            raise MissingKVCacheError(
                f"Missing {self.missing_label} for generation request "
                f"{missing[0]}" + (f" (and requests {missing[1:]})" if len(missing) > 1 else "")
                + "; a generation request needs its cache from its context chunks or prepare_disagg_gen_init",
                request_ids=missing,
            )
        self._check_unique(batch)
        self._resume_scheduled(batch)
        steps = [(r, "context", self.sizing_rules.context) for r in batch.context_requests]
        steps += [(r, "generation", self.sizing_rules.generation) for r in batch.generation_requests]
        views = [(r, target_view(r), reused_prefix(r)) for r in batch.context_requests]
        try:
            with self.caches.transaction(r.py_request_id for r, _, _ in steps):
                self.prefix_reuse.reuse_prefixes(batch.context_requests)  # pins every hit before any growth
                for req, phase, sizing in steps:
                    self.resize_or_raise(req, phase, sizing)
        except BaseException:
            for req, view, reused in views:  # a prefix hit moved the view: put it back
                set_target_view(req, view.position, view.chunk_size)
                if reused_prefix(req) != reused:
                    req.prepopulated_prompt_len = reused
            raise
        self.last_prepared_batch = batch

    def _resize_known_to_fit(self, reqs: Sequence[LlmRequest], sizes: Sequence[tuple[int, int | None]],
                             caches: Sequence[KVCache] | None = None) -> bool:
        """Size every request's existing cache to its `(capacity, history)` of `sizes` (absolute tokens) in
        order, without a transaction, when the sizes are valid and the pools have the pages for all of them
        (`runtime.batch_resize`). False, changing nothing, otherwise: the caller then takes the
        journaled per-request path, whose errors and rollback are the batch's contract."""
        if caches is None:
            caches = [self.caches[r.py_request_id] for r in reqs]
        return batch_resize.resize_in_order(self.layer_groups, caches, sizes)

    def _resume_scheduled(self, batch: ScheduledRequests) -> None:
        """A scheduled request whose cache is suspended is resumed first, as upstream's draft manager
        does; a refused resume raises `KVCacheResizeError` ("Failed to resume ...", phase "resume")
        before anything changes, never a silent skip."""
        if not self._suspended:  # the usual step: nothing to look for
            return
        suspended = [r for r in batch.all_requests() if r.py_request_id in self._suspended]
        if not suspended:
            return
        refusal = self._resume_refusal(suspended[0].py_request_id)
        if refusal is not None:
            raise KVCacheResizeError(
                f"Failed to resume {self.missing_label} for request {suspended[0].py_request_id}"
                + (f" (and {[r.py_request_id for r in suspended[1:]]})" if len(suspended) > 1 else "")
                + f": {refusal}\n" + self.pool_diagnostic(),
                request_id=suspended[0].py_request_id, phase="resume",
                capacity=self.caches[suspended[0].py_request_id].capacity,
                history=self.caches[suspended[0].py_request_id].history_length,
            )
        for req in suspended:
            self._suspended.discard(req.py_request_id)

    def _resume_refusal(self, rid: int) -> str | None:
        """Why a suspended cache may not resume now (upstream's pressure rule), or None."""
        limit = 1.0 if self._upstream_args is None else self._upstream_args.kv_cache_config.max_util_for_resume
        used = max((1 - p.num_free / p.total) if p.total else 1.0 for p in self.pools())
        if used > limit:
            return f"the fullest pool is {used:.0%} used, above max_util_for_resume {limit:.0%}"
        return None

    def _check_unique(self, batch: ScheduledRequests) -> None:
        ids = [r.py_request_id for r in batch.all_requests()]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"{self.error_label}: requests {dup} appear more than once in one batch")

    def update_context_resources(self, scheduled_batch: ScheduledRequests) -> None:
        """After the executor advanced each context view: history follows its position.

        As upstream, a request with no cache here or a suspended one is skipped. All or
        nothing over the rest of the batch.
        """
        reqs = [r for r in scheduled_batch.context_requests if self.is_request_active(r.py_request_id)]
        with self.caches.transaction(r.py_request_id for r in reqs):
            for req in reqs:
                cache = self.caches[req.py_request_id]
                position = self.sizing_rules.view(req).position
                if position > cache.history_length:
                    cache.resize(max(cache.capacity, position), position)
                if self.block_reuse and not req.is_dummy:  # a dummy's placeholder K/V is never published
                    self.prefix_reuse.publish_history(req, position)
        for req in reqs:
            self._capacity_before.pop(req.py_request_id, None)

    def prepare_disagg_gen_init(self, req: LlmRequest, *, reused_tokens: int = 0) -> bool:
        """A generation worker's new request: the prompt is history, a step of headroom above it.

        Upstream's convention: False when the pool cannot hold it, and then nothing is left
        behind (no cache, every pool as before); `last_refusal` keeps the explicit
        `KVCacheResizeError` (request, capacity, history, every live cache). True once sized.
        `reused_tokens` (ours): a prefix hit of `find_gen_init_hit` the cache adopts first
        (manager/gen_init_reuse.py). A bad argument still raises ValueError.
        """
        try:
            self._size_gen_init(req, reused_tokens)
        except KVCacheResizeError as err:
            self.last_refusal = err
            return False
        self._suspended.discard(req.py_request_id)
        return True

    def _size_gen_init(self, req: LlmRequest, reused_tokens: int) -> None:
        """Adopt the hit (if any) and grow to the generation-init size, all or nothing; raises."""
        sizing = self.sizing_rules
        if not reused_tokens:
            self.resize_or_raise(req, sizing.disagg_gen_init_phase, sizing.disagg_gen_init)
            return
        with self.caches.transaction([req.py_request_id]):
            self.prefix_reuse.adopt_for_gen_init(req, reused_tokens)
            self.resize_or_raise(req, sizing.disagg_gen_init_phase, sizing.disagg_gen_init)

    def update_resources(
        self, scheduled_batch: ScheduledRequests, attn_metadata: object = None, kv_cache_dtype_byte_size: float = None
    ) -> None:
        """After a step: history = tokens − 1 (the last has no KV); the rejected draft slots are dropped
        down to the next token's slot, as upstream, except on a draft mirror (`after_step_headroom`).

        Every request holding generated tokens, as upstream; one with no cache here, a
        suspended one or a dummy is skipped. All or nothing over the rest. `attn_metadata` and
        `kv_cache_dtype_byte_size` (upstream's, for moving accepted drafts inside the cache
        and for its stats) are not needed here: drafts are written at their final positions.
        """
        live, suspended = self.caches, self._suspended  # `is_request_active`, once per request
        # (`generated_tokens(r) >= 1` inlined: this runs for every request of every step)
        reqs = [r for r in scheduled_batch.all_requests() if r.max_beam_num_tokens > r.prompt_len and not r.is_dummy]
        caches = None if suspended else live.lookup(list(map(_REQUEST_ID, reqs)))  # usually every one is live
        if caches is None:
            reqs = [r for r in reqs if r.py_request_id in live and r.py_request_id not in suspended]
            caches = [live[r.py_request_id] for r in reqs]
        # C-level maps, not comprehensions: at small batches each comprehension's frame is a fixed cost
        sizes = rules.after_step_sizes(list(map(_NUM_TOKENS, reqs)), list(map(_HISTORY, caches)),
                                       list(map(_CAPACITY, caches)), self.after_step_headroom)
        if not self._resize_known_to_fit(reqs, sizes, caches):
            # Each size depends on its own cache only, untouched until its turn: the same sizes hold.
            with self.caches.transaction(r.py_request_id for r in reqs):
                for cache, (capacity, history) in zip(caches, sizes):
                    if not cache.resize(capacity, history):
                        # Every draft was accepted and the pool has no page for the next token's
                        # slot: still advance history (this only releases pages); the next
                        # prepare reserves the slot, or raises the explicit resize error.
                        cache.resize(max(cache.capacity, history), history)
        if self._allocated_draft_lens or self._capacity_before:  # the V2 scheduler's calls left some
            for req in reqs:  # the step is over: nothing of it is left to revert
                self._allocated_draft_lens.pop(req.py_request_id, None)
                self._capacity_before.pop(req.py_request_id, None)

    def add_dummy_requests(
        self,
        request_ids: List[int],
        token_nums: Optional[List[int]] = None,
        is_gen: bool = False,
        materialize_history: bool = False,
        prepare_resource: bool = True,
        max_num_draft_tokens: int = 0,
        kv_reserve_draft_tokens: Optional[int] = None,
        use_mrope: bool = False,
        max_beam_width: int = 1,
        encoder_output_lens: Optional[List[int]] = None,
        draft_kv_cache_manager: Optional["KVCacheManagerV2"] = None,
        capture_sampling_params: Optional[object] = None,
        *,
        num_extra_decoding_steps: int = 0,
        history_hint: int | None = None,
    ) -> Optional[List[LlmRequest]]:
        """CUDA-graph warmup dummies, upstream's signature (rules in `dummies.add_dummies`).

        Upstream's convention: None when a pool cannot hold them, and then no dummy is left in
        either manager (`last_refusal` keeps the explicit `KVCacheResizeError`); the dummies
        otherwise. `draft_kv_cache_manager`: the same dummies there too, all or nothing across
        both. `use_mrope` and `capture_sampling_params` have no meaning here; a beam width other
        than 1 or `encoder_output_lens` is a ValueError. Ours, keyword-only:
        `num_extra_decoding_steps` (a capturable drafting loop's extra steps), `history_hint`.
        """
        draft = draft_kv_cache_manager
        if draft is not None and not isinstance(draft, KVCacheManagerV2):
            raise TypeError(f"draft_kv_cache_manager must be a KVCacheManagerV2, got {type(draft).__name__}")
        if draft is self:
            raise ValueError(f"{self.error_label}: draft_kv_cache_manager is this manager itself")

        def add_to_draft() -> None:
            made = draft.add_dummy_requests(
                request_ids, token_nums, is_gen, materialize_history, True, max_num_draft_tokens,
                kv_reserve_draft_tokens, max_beam_width=max_beam_width, history_hint=history_hint,
            )
            if made is None:
                raise draft.last_refusal

        try:
            return dummies.add_dummies(
                self, request_ids, token_nums, is_gen=is_gen, materialize_history=materialize_history,
                prepare_resource=prepare_resource, max_num_draft_tokens=max_num_draft_tokens,
                kv_reserve_draft_tokens=kv_reserve_draft_tokens, max_beam_width=max_beam_width,
                encoder_output_lens=encoder_output_lens, add_to_draft=None if draft is None else add_to_draft,
                num_extra_decoding_steps=num_extra_decoding_steps, history_hint=history_hint,
            )
        except KVCacheResizeError as err:
            self.last_refusal = err
            if draft_kv_cache_manager is not None:
                draft_kv_cache_manager.last_refusal = err
            return None

    # -- block reuse (manager/prefix_reuse.py) ----------------------------------------------
    def find_prefix_hit(self, req: LlmRequest) -> int:
        """Tokens of `req`'s prompt, from position 0, this manager (and its joint partners) can reuse:
        a whole number of pages, at least one prompt token left to compute. Changes nothing."""
        return self.prefix_reuse.find_hit(req)

    def pair_joint_reuse(self, draft_manager: "KVCacheManagerV2") -> None:
        """Make this target manager's hits joint with `draft_manager`'s pool (`joint_kv_cache_reuse`):
        a hit then counts only pages both pools hold (`PrefixReuse.pair_with`)."""
        self.prefix_reuse.pair_with(draft_manager.prefix_reuse)

    def is_paired_with(self, draft_manager: "KVCacheManagerV2") -> bool:
        """Has `pair_joint_reuse(draft_manager)` made this manager's hits joint with that pool?"""
        return draft_manager.prefix_reuse in self.prefix_reuse.partners

    def keep_drafter_window(self, draft_manager: "KVCacheManagerV2") -> None:
        """Target-only reuse with a drafter whose pool does not reuse: every hit stops short of the
        draft pool's windows (`PrefixReuse.keep_drafter_window`)."""
        windows = tuple(g.window for g in draft_manager.config.layer_groups)
        self.prefix_reuse.keep_drafter_window(draft_manager.prefix_reuse, windows)

    def find_gen_init_hit(self, req: LlmRequest) -> int:
        """Tokens of `req`'s prompt a generation-init cache can adopt here (`PrefixReuse.find_gen_init_hit`)."""
        return self.prefix_reuse.find_gen_init_hit(req)

    def publish_gen_init(self, req: LlmRequest, *, written_from: int = 0) -> int:
        """After a generation worker wrote a new request's prompt K/V, publish its whole prompt pages;
        returns how many (`PrefixReuse.publish_gen_init`)."""
        return self.prefix_reuse.publish_gen_init(req, written_from=written_from)

    def free_resources(
        self, request: "LlmRequest | int | ScheduledRequests | Iterable[LlmRequest | int]", pin_on_release: bool = False
    ) -> None:
        """Return every page of one request, or (ours) of every request of a batch or list of ids.

        A request object, as upstream: a no-op when it holds no cache here (the draft
        manager sees requests it never mirrored). Ids and lists (ours) are strict: an
        unknown, repeated or already freed id raises KeyError before any cache is freed.
        `pin_on_release` (upstream: keep the pages for reuse in a host tier) is accepted
        and has nothing to pin here: published pages stay cached-free either way.
        """
        if hasattr(request, "py_request_id"):
            if request.py_request_id not in self.caches:
                return
            items: list = [request]
        elif isinstance(request, ScheduledRequests):
            items = request.all_requests()
        elif isinstance(request, int):
            items = [request]
        else:
            items = list(request)
        ids = [r if isinstance(r, int) else r.py_request_id for r in items]
        missing = self.caches.missing(ids)
        if missing or len(set(ids)) != len(ids):
            bad = missing or sorted({i for i in ids if ids.count(i) > 1})
            what = "it holds no cache (never added, or already freed)" if missing else "it is named twice"
            raise MissingKVCacheError(
                f"{self.error_label}: cannot free request {bad[0]}: {what}"
                + (f"; also {bad[1:]}" if len(bad) > 1 else "")
                + ("" if len(ids) == 1 else "; nothing was freed"),
                request_ids=bad,
            )
        for rid in ids:
            self.caches.pop(rid).free()
            if self._block_table is not None:
                self._block_table.forget(rid)
            self._suspended.discard(rid)
            self._allocated_draft_lens.pop(rid, None)
            self._capacity_before.pop(rid, None)

    def check_accounting(self) -> None:
        """Every pool balances (held + cached-free + free = total), and every held page is in exactly
        as many rows as the pool counts holders: a page held alone is in one row only."""
        layer_pools.check_accounting(self.layer_groups, self.caches)
