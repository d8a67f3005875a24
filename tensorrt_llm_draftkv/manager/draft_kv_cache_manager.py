"""DraftKVCacheManagerV2: the separate draft pool and its per-request mirrors.

The target manager sizes a request's cache from the request; this subclass
sizes the request's *mirror* in the draft pool, choosing the view and the
history through the pure rules in `mirror_sizing`. Coordinates: absolute
token positions, like the target cache.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..config import KvCacheConfig, SpeculativeDecodingMode
from ..request import ContextView, LlmRequest
from ..runtime import KVCache
from . import admission
from . import mirror_sizing as rules
from .diagnostics import KVCacheResizeError
from .kv_cache_manager import KVCacheManagerV2


class DraftKVCacheManagerV2(KVCacheManagerV2):
    """Draft mirrors for one speculative mode, sized by the `history` or `legacy` rules."""

    error_label = "Draft KV cache"
    missing_label = "draft KV cache"

    def __init__(
        self,
        config: KvCacheConfig,
        *,
        spec_mode: SpeculativeDecodingMode,
        max_draft_len: int = 0,
        num_extra_kv_tokens: int = 0,
        joint_kv_cache_reuse: bool = False,
        sizing: str | rules.MirrorSizing = rules.MirrorSizing.HISTORY,
        trail_page: bool = True,
        is_draft: bool = True,
    ) -> None:
        self.is_draft = is_draft
        self.spec_mode = spec_mode
        self.policy = rules.MirrorPolicy(spec_mode, rules.MirrorSizing.parse(sizing), joint_kv_cache_reuse)
        self._trail_page = trail_page
        self.config = config  # the base class sets it too; the trail answer needs it first
        super().__init__(config, max_draft_len=max_draft_len, num_extra_kv_tokens=num_extra_kv_tokens)

    # -- policy answers ---------------------------------------------------------
    @property
    def sizing(self) -> rules.MirrorSizing:
        return self.policy.sizing

    @property
    def joint_kv_cache_reuse(self) -> bool:
        return self.policy.joint_kv_cache_reuse

    @property
    def _mirror_uses_draft_view(self) -> bool:
        """False only for the draft manager of an external drafter (it reads the target view)."""
        return self.is_draft and rules.mirror_uses_draft_view(self.policy)

    @property
    def draft_slot_trail_tokens(self) -> int:
        """Tokens kept below every window of this pool for a trailing drafter slot (one page, or 0).

        The one answer the drafter's seeding, the estimators and the planner read.
        """
        return rules.draft_slot_trail_tokens(
            self.policy,
            tokens_per_block=self.config.tokens_per_block,
            any_windowed_group=any(g.window is not None for g in self.config.layer_groups),
            trail_page=self._trail_page and self.is_draft,
        )

    @property
    def _draft_slot_trail_tokens(self) -> int:
        """Upstream's name for :attr:`draft_slot_trail_tokens`."""
        return self.draft_slot_trail_tokens

    def _window_widening_tokens(self) -> int:
        return self.draft_slot_trail_tokens

    def _mirror_view(self, req: LlmRequest) -> ContextView:
        assert req.draft_view is not None
        return req.draft_view if self._mirror_uses_draft_view else req.target_view

    # -- sizing -------------------------------------------------------------------
    def _context_sizing(self, req: LlmRequest, cache: KVCache) -> tuple[int, int | None]:
        if not self.is_draft:  # a target manager sizes the same whatever drafter runs
            return super()._context_sizing(req, cache)
        view = self._mirror_view(req)
        is_last = view.position + view.chunk_size >= req.prompt_len
        capacity = rules.context_capacity(
            view.position, view.chunk_size, is_last, self.max_draft_len, self.num_extra_kv_tokens
        )
        # Covers [0, start): it computed the earlier chunks, or joint reuse holds them.
        covers = self.joint_kv_cache_reuse or (cache.capacity >= view.position and cache.num_blocks > 0)
        history = rules.context_history(self.policy, start=view.position, mirror_covers_start=covers)
        if history is not None:
            history = max(history, cache.history_length)
        return max(capacity, cache.history_length), history

    @property
    def _disagg_gen_init_phase(self) -> str:
        """Legacy sizes a generation-init mirror as a whole-prompt context chunk, and says so."""
        legacy_mirror = self.is_draft and self.sizing is rules.MirrorSizing.LEGACY
        return "context" if legacy_mirror else "generation"

    def _disagg_gen_init_sizing(self, req: LlmRequest, cache: KVCache) -> tuple[int, int | None]:
        if not self.is_draft:
            return super()._disagg_gen_init_sizing(req, cache)
        return rules.disagg_gen_init_sizing(
            self.policy,
            prompt_len=req.prompt_len,
            generation_headroom=self.generation_headroom,
            draft_tokens=self.max_draft_len,
            extra_tokens=self.num_extra_kv_tokens,
        )

    def _dummy_history(self, history_hint: int | None) -> int | None:
        """The fix gives a warmup dummy's mirror the target's `history_hint`; legacy drops it."""
        if not self.is_draft:
            return super()._dummy_history(history_hint)
        return rules.dummy_history(self.policy, history_hint)

    # -- admission and errors -------------------------------------------------------
    def admit_mirror(self, req: LlmRequest) -> bool:
        """Could the mirror take this request's next step now? Changes nothing.

        For a scheduler that would rather defer a request than fail it.
        """
        cache = self._caches.get(req.py_request_id) or self._new_cache(req.py_request_id)
        if req.is_disagg_generation_init_state:
            capacity, history = self._disagg_gen_init_sizing(req, cache)
        elif req.is_context_init_state:
            capacity, history = self._context_sizing(req, cache)
        else:
            capacity, history = self._generation_sizing(req, cache)
        return cache.can_resize(capacity, history)

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
        """Raise `AdmissionRefused` if this request's mirror would ever hold more pages than charged.

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
            start=0 if disagg else req.target_view.position,
            max_draft_len=self.max_draft_len,
            num_extra_kv_tokens=self.num_extra_kv_tokens,
            disagg_generation_init=disagg,
            max_new_tokens=min(req.max_new_tokens, self.config.max_seq_len - req.prompt_len),
            label=self.error_label,
        )

    def _mirror_resize_error(
        self, req_id: int, phase: str, capacity: int, history: int | None
    ) -> KVCacheResizeError:
        """The one place draft resize errors (context and generation) are built.

        `Draft KV cache <phase> resize failed for request N: could not resize to C
        tokens (history H)`, then every live mirror's capacity, history and
        logical blocks, the windows and the free pages per group.
        """
        return super()._resize_error(req_id, phase, capacity, history)

    def _resize_error(self, req_id: int, phase: str, capacity: int, history: int | None) -> KVCacheResizeError:
        return self._mirror_resize_error(req_id, phase, capacity, history)  # every draft error goes through it
