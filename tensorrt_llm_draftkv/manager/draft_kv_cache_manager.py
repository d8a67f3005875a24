"""DraftKVCacheManagerV2: the separate draft pool and its per-request mirrors.

The same manager as the target's, built with a mirror policy: every cache is
sized by `rules.StepSizing` with the `history` (fix) or `legacy` rules, and
every window keeps the trail page of a DFlash/DSpark pool below it. What this
class adds is the policy itself, upstream's `request_context(True, batch)`
around its sizing calls, and admission against the estimator's charge.
Coordinates: absolute token positions, like the target cache.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

from ..config import KVPoolConfig, SpeculativeDecodingMode
from ..request import LlmRequest, ScheduledRequests, request_context, target_view
from . import admission, rules
from .kv_cache_manager import KVCacheManagerV2


class DraftKVCacheManagerV2(KVCacheManagerV2):
    """Draft mirrors for one speculative mode, sized by the `history` or `legacy` rules.

    `is_draft=False` makes it a target-side manager: it then sizes exactly as
    `KVCacheManagerV2`, whatever drafter runs.
    """

    error_label = "Draft KV cache"
    missing_label = "draft KV cache"
    _draft_class = True

    @classmethod
    def from_pool_config(
        cls,
        config: KVPoolConfig,
        *,
        spec_mode: SpeculativeDecodingMode | str,
        max_draft_len: int = 0,
        num_extra_kv_tokens: int = 0,
        joint_kv_cache_reuse: bool = False,
        sizing: str | rules.MirrorSizing = rules.MirrorSizing.HISTORY,
        trail_page: bool = True,
        is_draft: bool = True,
    ) -> "DraftKVCacheManagerV2":
        """A draft manager over pools of exactly this geometry (the simulator's and the tests' way in).

        `sizing`: the `history` rules (the fix, default) or `legacy` (pre-fix, to reproduce
        the failures); `trail_page=False` drops the DFlash/DSpark trail page.
        """
        manager = object.__new__(cls)
        manager._init_draft(
            config, spec_mode=spec_mode, max_draft_len=max_draft_len, num_extra_kv_tokens=num_extra_kv_tokens,
            joint_kv_cache_reuse=joint_kv_cache_reuse, sizing=sizing, trail_page=trail_page, is_draft=is_draft,
        )
        return manager

    def _init_draft(
        self,
        config: KVPoolConfig,
        *,
        spec_mode: SpeculativeDecodingMode | str,
        max_draft_len: int,
        num_extra_kv_tokens: int,
        joint_kv_cache_reuse: bool,
        sizing: str | rules.MirrorSizing,
        trail_page: bool,
        is_draft: bool,
        layer_slots=None,
    ) -> None:
        """The mirror policy and the trail page, then the pools (every draft constructor ends here)."""
        self.is_draft = is_draft
        self.spec_mode = SpeculativeDecodingMode.parse(spec_mode)  # a mode or its name ("dflash")
        self.policy = rules.DraftPoolTraits(self.spec_mode, rules.MirrorSizing.parse(sizing), joint_kv_cache_reuse)
        trail = rules.draft_slot_trail_tokens(
            self.policy,
            tokens_per_block=config.tokens_per_block,
            any_windowed_group=any(g.window is not None for g in config.layer_groups),
            trail_page=trail_page and is_draft,
        )
        self._init_pools(
            config,
            max_draft_len=max_draft_len,
            num_extra_kv_tokens=num_extra_kv_tokens,
            mirror_policy=self.policy if is_draft else None,
            trail_tokens=trail,
            layer_slots=layer_slots,
        )

    @property
    def sizing(self) -> rules.MirrorSizing:
        return self.policy.sizing

    @property
    def joint_kv_cache_reuse(self) -> bool:
        return self.policy.joint_kv_cache_reuse

    @property
    def after_step_headroom(self) -> int:
        """A draft mirror (the fix's sizing) keeps, after `update_resources`, the slots the next
        generation step reserves anyway (up to history + `generation_headroom` tokens of its
        capacity): otherwise about every other step releases a page there only for the next
        `prepare_resources` to take it back, and each such page costs a pool call, a row edit and
        a block-table update. A target-side manager and the legacy sizing keep upstream's rule."""
        if not self.is_draft or self.policy.sizing is rules.MirrorSizing.LEGACY:
            return 1
        return self.generation_headroom

    # -- upstream's request_context around the sizing calls -----------------------
    def _draft_request_context(self, batch: ScheduledRequests):
        """`request_context(True, batch)`, as upstream's `_prepare_draft_resources`; none for a target one,
        nor for a batch without context requests (a generation step's sizing reads no view)."""
        if self.is_draft and batch.context_requests:
            return request_context(True, batch)
        return contextlib.nullcontext(batch)

    def prepare_resources(self, scheduled_batch: ScheduledRequests) -> None:
        if not scheduled_batch.context_requests:  # a generation step: no context to enter (every step pays it)
            super().prepare_resources(scheduled_batch)
            return
        with self._draft_request_context(scheduled_batch):
            super().prepare_resources(scheduled_batch)

    def update_context_resources(self, scheduled_batch: ScheduledRequests) -> None:
        with self._draft_request_context(scheduled_batch):
            super().update_context_resources(scheduled_batch)

    prepare_resources.__doc__ = KVCacheManagerV2.prepare_resources.__doc__
    update_context_resources.__doc__ = KVCacheManagerV2.update_context_resources.__doc__

    # -- the V2 scheduler's draft call ---------------------------------------------------
    def try_allocate_draft_context(self, req: LlmRequest, num_tokens: int) -> bool:
        """Room in the mirror for the next `num_tokens` prompt tokens, sized as `prepare_resources`
        sizes a context chunk (the fix's view and history). Creates the mirror if it is new. False
        when the pool cannot: a new mirror is dropped, an existing one left as it was
        (`last_refusal` says why)."""
        if not self.is_draft:
            raise ValueError(f"{self.error_label}: try_allocate_draft_context is a draft manager's call")
        if num_tokens < 0:
            raise ValueError(f"{self.error_label}: request {req.py_request_id}: num_tokens must be >= 0, got {num_tokens}")
        rid = req.py_request_id
        fresh = rid not in self.caches
        if fresh:
            self.caches[rid] = self.caches.new(rid)
        elif not self.resume_request(req):
            return False
        with self._draft_request_context(ScheduledRequests(context_requests=[req])):
            capacity, history = self.sizing_rules.context(req, self.caches[rid], chunk=num_tokens)
        if self._grow_or_refuse(req, "context", capacity, history):
            return True
        if fresh:
            self.caches.pop(rid).free()
        return False

    # -- admission -------------------------------------------------------------------
    def admit_mirror(self, req: LlmRequest) -> bool:
        """Could the mirror take this request's next step now? Changes nothing but `last_refusal`.

        For a scheduler that would rather defer a request than fail it. False sets
        `last_refusal` to the explicit `KVCacheResizeError`: the request, the capacity
        and history asked, the pages needed against the pages free per group.
        """
        cache = self.caches.get(req.py_request_id) or self.caches.new(req.py_request_id)
        sizing = self.sizing_rules
        with self._draft_request_context(ScheduledRequests(context_requests=[req])):  # as prepare sizes it
            if req.is_disagg_generation_init_state:
                capacity, history = sizing.disagg_gen_init(req, cache)
            elif req.is_context_init_state:
                capacity, history = sizing.context(req, cache)
            else:
                capacity, history = sizing.generation(req, cache)
        if cache.can_resize(capacity, history):
            return True
        self.last_refusal = self._mirror_resize_error(
            req.py_request_id, "admission", capacity, history, demand=cache.page_demand(capacity, history)
        )
        return False

    def pages_per_request_charge(
        self, chunk: int, *, max_seq_len: int | None = None, aligned: bool = True
    ) -> tuple[int, ...]:
        """Pages per layer group the estimator charges one request in this pool.

        With this pool's trail tokens, drafts, extra tokens and sinks, and
        `config.max_seq_len` unless given. `aligned`: chunks start at multiples of
        `chunk` from position 0 (see `admission.request_charge`).
        """
        return admission.request_charge(
            self.config.layer_groups,
            self.tokens_per_block,
            chunk=chunk,
            max_seq_len=self.config.max_seq_len if max_seq_len is None else max_seq_len,
            max_draft_len=self.max_draft_len,
            num_extra_kv_tokens=self.num_extra_kv_tokens,
            trail_tokens=self.draft_slot_trail_tokens,
            aligned=aligned,
        )

    def check_admission(self, req: LlmRequest, *, chunk: int, charge: Sequence[int] | None = None) -> None:
        """Raise `AdmissionRefused` if this request's mirror would ever hold more pages than charged,
        or than this pool has in a layer group.

        A context request's chunks are `[p + k * chunk, ...)` from `p =
        req.target_view.position` (absolute); a disaggregated generation-init request
        is sized from its prompt. Generation runs to `req.max_new_tokens`, and never
        past `config.max_seq_len` tokens (the block table's width). `charge` (pages per
        group) defaults to the aligned `pages_per_request_charge(chunk)`. Changes nothing.
        """
        disagg = req.is_disagg_generation_init_state
        if not (disagg or req.is_context_init_state):
            raise ValueError(f"request {req.py_request_id}: admission is checked for a new request, not {req.state}")
        admission.check_request(
            self.policy if self.is_draft else None,  # a target-side manager sizes as the target does
            [g.life_cycle for g in self.layer_groups],
            self.tokens_per_block,
            request_id=req.py_request_id,
            charged=self.pages_per_request_charge(chunk) if charge is None else tuple(charge),
            prompt_len=req.prompt_len,
            chunk=chunk,
            start=0 if disagg else target_view(req).position,
            max_draft_len=self.max_draft_len,
            num_extra_kv_tokens=self.num_extra_kv_tokens,
            disagg_generation_init=disagg,
            max_new_tokens=min(req.max_new_tokens, self.config.max_seq_len - req.prompt_len),
            label=self.error_label,
            pool_pages=tuple(g.pool.total for g in self.layer_groups),
        )
