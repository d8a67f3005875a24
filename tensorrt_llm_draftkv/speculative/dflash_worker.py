"""`DFlashWorker`: upstream's DFlash worker, over the fix's slots and the draft pool's own tensors.

What an executor written for TensorRT-LLM calls, with upstream's names:

- `_lazy_init_ctx_buffers(draft_model, spec_metadata, attn_metadata, draft_kv_cache_manager)`
  binds the drafter's context store to the draft manager's pool tensors
  (`get_buffers(layer, "HND")`), or to a private per-slot arena without one;
- `DFlashSpecMetadata.prepare()` (through `map_batch_rows`) maps the step's rows
  to slots, seeding a fresh generation slot with the fix's base;
- `_refresh_ctx_block_tables(attn_metadata, num_seqs)` decodes the step's draft
  block offsets (`attn_metadata.draft_kv_cache_block_offsets`) into the worker's
  tables, one per draft pool;
- `_store_context_kv_paged(k, v, rows, positions)` writes K/V into the pool at
  the pages those tables name, after checking each page is one the row's
  request holds;
- `_ensure_spec_dec_state_restored(attn_metadata, spec_metadata)` puts the slot
  lengths *and* bases back after a failed or discarded forward.

The slot state itself (lengths, bases, seeds, eviction) is `DFlashDraftSlots`,
exposed as `draft_slots`; the generation step's addressing comes from it
(`_advance_ctx_len`). Coordinates: positions are slot positions, which on a
shared draft pool are absolute token positions; tables are indexed by page
ordinal `position // tokens_per_block`.
"""
from __future__ import annotations

import warnings
from collections import deque
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from ..kernels import PagedLatentPrep
from ..request import ScheduledRequests
from ..staging import to_device
from .draft_pool import DraftPool
from .draft_slots import DFlashDraftSlots
from .slot_table import SlotSnapshot
from .worker_pool import PoolBinding, arena_binding, pool_binding

#: Upstream's CUDA-graph padding ids count down from this one.
CUDA_GRAPH_DUMMY_REQUEST_ID = (1 << 64) - 1


class DFlashWorker:
    """DFlash worker: slots, the context store into the draft pool, and rollback (module docstring)."""

    def __init__(self, spec_config: Any, mapping: Any, use_separate_draft_kv_cache: bool = False, *,
                 device: Optional[torch.device | str] = None) -> None:
        if spec_config.max_draft_len is None or spec_config.max_draft_len < 1:
            raise ValueError(f"DFlashWorker: spec_config.max_draft_len must be >= 1, got {spec_config.max_draft_len}")
        self.spec_config = spec_config
        self.mapping = mapping
        self.use_separate_draft_kv_cache = use_separate_draft_kv_cache
        self.device = torch.device(device) if device is not None else None
        self._ctx_buf_inited = False
        self._step = 0  # steps mapped by map_batch_rows
        self._ctx_paged = True
        self._ctx_kv_manager: Optional[DraftPool] = None
        self._graph_dummy_id_floor = CUDA_GRAPH_DUMMY_REQUEST_ID - self.max_draft_len
        self.draft_slots: DFlashDraftSlots | None = None
        self._pool: PoolBinding | None = None
        self._batch_to_slot: torch.Tensor | None = None
        self._batch_to_slot_host: list[int] = []
        #: host -> device copies of the batch-row -> slot table (a step with the same rows copies nothing)
        self.batch_to_slot_copies = 0
        self._saved_ctx_len: SlotSnapshot | None = None
        self._ctx_len_restore_pending = False

    # ------------------------------------------------------------------ upstream's read-only state
    @property
    def max_draft_len(self) -> int:
        return int(self.spec_config.max_draft_len)

    @property
    def _draft_tokens_per_req(self) -> int:
        """Target tokens a generation row feeds per step: the drafts and the bonus token."""
        return self.max_draft_len + 1

    def _slots(self) -> DFlashDraftSlots:
        if self.draft_slots is None:
            raise RuntimeError("DFlashWorker: call _lazy_init_ctx_buffers (or bind_draft_slots) first")
        return self.draft_slots

    @property
    def _ctx_len(self) -> torch.Tensor:
        """Device int64 `[num_slots]`: each slot's context length (slot positions)."""
        return self._slots().slots.ctx_len

    @property
    def _base_pages(self) -> torch.Tensor:
        """Device int64 `[num_slots]`: each slot's base (pages); reads start at `base * P`."""
        return self._slots().slots.base_pages

    @property
    def _req_to_slot(self) -> dict[int, int]:
        """Request id -> slot (a copy)."""
        return self._slots().slots.live_requests()

    @property
    def _free_slots(self) -> deque[int]:
        return deque(self._slots().slots.free_slots)

    @property
    def _dummy_slot(self) -> int:
        return self._slots().dummy_slot

    @property
    def _max_ctx(self) -> int:
        return self._slots().slots.max_ctx_len

    @property
    def _ctx_kv_buf(self) -> list[torch.Tensor]:
        """One `[pages, kv_factor, heads, P, head_dim]` tensor per drafter layer (the pool's own, or the arena)."""
        return self._bound().layers

    @property
    def _ctx_block_tables(self) -> torch.Tensor | None:
        """int32 `[num_slots, max_blocks]`: pages per batch row of the drafter's first layer's pool."""
        pool = self._bound()
        return None if pool.arena else pool.tables[pool.layer_pool[0]]

    @property
    def _ctx_page_table(self) -> torch.Tensor | None:
        """int32 `[num_slots, pages_per_slot]`: the private arena's static per-slot pages (None on a pool)."""
        pool = self._bound()
        return pool.tables[0] if pool.arena else None

    @property
    def _ctx_page_size(self) -> int:
        return self._bound().tokens_per_block

    def _bound(self) -> PoolBinding:
        if self._pool is None:
            raise RuntimeError("DFlashWorker: call _lazy_init_ctx_buffers (or bind_draft_slots) first")
        return self._pool

    # ------------------------------------------------------------------ binding
    def _lazy_init_ctx_buffers(self, draft_model: Any, spec_metadata: Any, attn_metadata: Any,
                               draft_kv_cache_manager: Optional[DraftPool] = None) -> None:
        """Build the slots and bind the context store, once per draft manager (upstream's first forward).

        The drafter's shape is read from `draft_model` where it has upstream's
        attributes (`block_size`, `_num_attn_layers`, `_num_kv_heads`, `_head_dim`,
        `_kv_factor`, `config.max_position_embeddings`), else from the pool. The
        longest context is the smaller of `attn_metadata.max_seq_len` and the
        model's position limit. A draft manager needs the attention metadata's
        `draft_kv_cache_block_offsets`; without them the worker falls back to a
        private arena, as upstream does, with a warning.
        """
        dm = draft_kv_cache_manager
        if dm is not None and not hasattr(attn_metadata, "draft_kv_cache_block_offsets"):
            warnings.warn(
                f"DFlashWorker: {type(attn_metadata).__name__} carries no draft_kv_cache_block_offsets; "
                "the drafter context uses a private arena", stacklevel=2,
            )
            dm = None
        if self._ctx_buf_inited and self._ctx_kv_manager is dm:
            return
        block_size = getattr(draft_model, "block_size", None) or self.max_draft_len + 1
        limits = [getattr(attn_metadata, "max_seq_len", None),
                  getattr(getattr(draft_model, "config", None), "max_position_embeddings", None)]
        max_ctx = min([int(v) for v in limits if v is not None] or [8192])
        device = self.device or (dm.config.device if dm is not None else spec_metadata.device)
        P = dm.tokens_per_block if dm is not None else int(getattr(draft_model, "_ctx_page_size", 32))
        slots = DFlashDraftSlots(
            spec_metadata.max_num_requests, block_size=int(block_size), tokens_per_block=P,
            max_ctx_len=max(max_ctx, P), device=device, draft_manager=dm,
        )
        self.bind_draft_slots(slots, dm, draft_model=draft_model)
        spec_metadata.attach_worker(self)

    @property
    def is_bound(self) -> bool:
        """Are the slots and the context store bound (upstream's `_ctx_buf_inited`)?"""
        return self._ctx_buf_inited

    def bind_draft_slots(self, draft_slots: DFlashDraftSlots, draft_manager: Optional[DraftPool] = None, *,
                         draft_model: Any = None) -> None:
        """Ours: bind slots built by the caller (the simulator chooses seeding and export backend).

        With a draft manager the context store writes into its pool tensors; without
        one the worker allocates a private arena of `arena_pages_per_slot` pages per slot.
        """
        if draft_manager is not None:
            draft_slots.check_pool(draft_manager)
            binding = pool_binding(draft_manager, draft_slots.num_slots, _model_shape(draft_model))
        else:
            binding = arena_binding(draft_slots, _model_shape(draft_model), getattr(draft_model, "dtype", torch.float32))
        self.draft_slots = draft_slots
        self._pool = binding
        self._ctx_kv_manager = draft_manager
        # every slot, dummy slots included: a step may hold all of them
        self._batch_to_slot = torch.zeros(draft_slots.num_slots, dtype=torch.int64, device=draft_slots.device)
        self._batch_to_slot_host = []
        self._saved_ctx_len = None
        self._ctx_len_restore_pending = False
        self._ctx_buf_inited = True

    # ------------------------------------------------------------------ slots
    def _assign_slot(self, req_id: int, reset: bool = False) -> Optional[int]:
        """The request's slot, a fresh one if it holds none; None when no slot is free.

        `reset`: a request id reused by a new request gives its slot back and starts over.
        """
        return self._slots().slots.assign(req_id, reset=reset)

    def map_batch_rows(self, spec_metadata: Any) -> None:
        """`DFlashSpecMetadata.prepare()`'s work: the step's rows to slots, then the row -> slot table.

        The rows' request objects come from `spec_metadata.scheduled_requests` or,
        by default, the draft manager's last `prepare_resources` batch; each id of
        `request_ids` must be one of them (KeyError naming the ids otherwise).
        """
        ids = list(spec_metadata.request_ids)
        num_contexts = len(ids) - spec_metadata.num_generations
        reqs = self._requests_of(ids, getattr(spec_metadata, "scheduled_requests", None))
        batch = ScheduledRequests(context_requests=reqs[:num_contexts], generation_requests=reqs[num_contexts:])
        rows = self._slots().prepare_step(batch, self._ctx_kv_manager)
        self._step += 1  # the block tables must be refreshed for these rows before a store
        self._rebuild_batch_to_slot([row.slot for row in rows])

    def _requests_of(self, ids: list[int], batch: Optional[ScheduledRequests]) -> list[Any]:
        if batch is None and self._ctx_kv_manager is not None:
            batch = self._ctx_kv_manager.last_prepared_batch
        known = {} if batch is None else {r.py_request_id: r for r in batch.all_requests()}
        missing = [rid for rid in ids if rid not in known]
        if missing:
            raise KeyError(
                f"DFlashWorker: requests {missing[:16]} of this step are not in the scheduled batch the draft "
                f"manager last prepared ({sorted(known)[:16]}); call its prepare_resources(scheduled_batch) "
                "before spec_metadata.prepare(), or set spec_metadata.scheduled_requests"
            )
        return [known[rid] for rid in ids]

    def _rebuild_batch_to_slot(self, slots: list[int]) -> None:
        """Copy the row -> slot table to the device only when it changed (most steps keep their rows)."""
        assert self._batch_to_slot is not None
        if slots == self._batch_to_slot_host:
            return
        n = len(slots)
        self._batch_to_slot[:n].copy_(torch.tensor(slots, dtype=torch.int64))
        self._batch_to_slot_host = list(slots)
        self.batch_to_slot_copies += 1

    # ------------------------------------------------------------------ block tables
    def _refresh_ctx_block_tables(self, attn_metadata: Any, num_seqs: int) -> bool:
        """Decode this step's draft block offsets into the worker's tables (batch rows, page ordinals).

        `attn_metadata.draft_kv_cache_block_offsets`: int32 `[num_pools, >= num_seqs, 2,
        width]` as `copy_batch_block_offsets` writes them (`page * kv_factor + k`).
        In place, so a captured graph keeps reading the same tensors. False on a
        private arena (its table is static). RuntimeError when bound to a pool and the
        offsets are missing, or when `attn_metadata.request_ids` are not this step's rows.
        """
        pool = self._bound()
        if pool.arena or num_seqs <= 0:
            return False
        src = getattr(attn_metadata, "draft_kv_cache_block_offsets", None)
        if src is None:
            raise RuntimeError(
                f"DFlashWorker: bound to the draft pool, but {type(attn_metadata).__name__} carries no "
                "draft_kv_cache_block_offsets this step"
            )
        rows = self._slots().request_ids
        ids = getattr(attn_metadata, "request_ids", None)
        if ids is not None and list(ids)[:num_seqs] != rows[:num_seqs]:
            raise RuntimeError(
                f"DFlashWorker: the attention metadata's rows {list(ids)[:num_seqs]} are not the rows "
                f"spec_metadata.prepare() mapped ({rows[:num_seqs]})"
            )
        pool.decode(src, num_seqs)
        pool.note_owned(rows[:num_seqs], self._step)
        return True

    # ------------------------------------------------------------------ stores
    def _store_context_kv_paged(self, k: torch.Tensor, v: Optional[torch.Tensor], rows: torch.Tensor,
                                positions: torch.Tensor) -> None:
        """Write K/V `[n, layers, heads, head_dim]` of `n` tokens into the drafter's context store.

        `rows`: batch rows (slots on a private arena); `positions`: slot positions
        (absolute on a shared pool). Each token lands on page
        `table[row, position // P]` of its layer's pool. On a shared pool every page
        is first checked against the row's request's mirror: a token whose ordinal
        the mirror does not back (released by the window, or past it) raises
        `DraftStoreRefused` naming the request, position and page, and nothing is written.
        `v=None`: a single-latent (MLA) pool.
        """
        pool = self._bound()
        rows = torch.as_tensor(rows, device=pool.device).long().reshape(-1)
        positions = torch.as_tensor(positions, device=pool.device).long().reshape(-1)
        if k.shape[0] != rows.numel() or positions.numel() != rows.numel():
            raise ValueError(
                f"DFlashWorker: {k.shape[0]} K rows, {rows.numel()} batch rows and {positions.numel()} positions"
            )
        pages = pool.pages_for(rows, positions) if pool.arena else pool.checked_pages(self._step, rows, positions)
        pool.write(pages, positions % pool.tokens_per_block, k, v)

    def store_kv_at_pages(self, layers: Sequence[int], pages: torch.Tensor, offsets: torch.Tensor,
                          kv: torch.Tensor) -> None:
        """Ours: write `kv` `[n, len(layers), kv_factor, heads, head_dim]` at explicit `(pages, offsets)`.

        For a caller that already holds checked addresses (the generation step's
        `store_pages`/`store_offsets`, a received drafter context). Entries with a
        negative page or offset are skipped.
        """
        self._bound().write_layers(list(layers), pages, offsets, kv)

    def _store_prefill_context(self, draft_model: Any, spec_metadata: Any, attn_metadata: Any,
                               position_ids: torch.Tensor, total_target_tokens: int) -> None:
        """Project each context chunk's captured hidden states and store them as the drafter's context.

        Upstream's flow: the chunks are the first `attn_metadata.num_contexts` rows,
        `attn_metadata.seq_lens[i]` tokens each, at absolute `position_ids`; the model's
        `project_target_hidden(h)` and `precompute_context_kv(proj, positions) -> (k, v)`
        (`[n, layers, heads, head_dim]`) make the K/V. Each chunk advances its slot
        (`DFlashDraftSlots.advance_slot_for_context`: where the fix says it continues)
        and is written through `_store_context_kv_paged`, so every page is checked.
        """
        num_contexts = int(attn_metadata.num_contexts)
        hidden = spec_metadata.get_hidden_states(total_target_tokens)
        if num_contexts == 0 or hidden is None:
            return
        seq_lens = [int(n) for n in list(attn_metadata.seq_lens)[:num_contexts]]
        projected = draft_model.project_target_hidden(hidden[: sum(seq_lens)])
        position_ids = torch.as_tensor(position_ids).reshape(-1)
        slots, offset = self._slots(), 0
        for row, n in enumerate(seq_lens):
            rid = spec_metadata.request_ids[row]
            plan = slots.advance_slot_for_context(rid, position_ids[offset : offset + n])
            keep = (plan.offsets >= 0).to(plan.positions.device)
            if n and bool(keep.any()):
                k, v = draft_model.precompute_context_kv(projected[offset : offset + n], plan.positions)
                positions = plan.positions[keep]
                rows = torch.full_like(positions, row if not self._bound().arena else plan_slot(slots, row))
                self._store_context_kv_paged(k[keep], None if v is None else v[keep], rows, positions)
            offset += n

    def store_accepted_kv(self, k: torch.Tensor, v: Optional[torch.Tensor],
                          num_accepted: Sequence[int] | Mapping[int, int]) -> list[PagedLatentPrep]:
        """Ours: advance the generation rows (`_advance_ctx_len`) and store the accepted tokens' K/V.

        `k`, `v`: `[sum of counts, layers, heads, head_dim]`, the rows' tokens in row
        order. Each lands where the step's preparation puts it (`store_pages`,
        `store_offsets` of its layer's pool). Returns the preparation.
        """
        slots = self._slots()
        counts = num_accepted
        if isinstance(num_accepted, Mapping):
            counts = [int(num_accepted.get(rid, 0)) for rid in slots.request_ids]
        counts = [int(c) for c in counts]
        if k.shape[0] != sum(counts):
            raise ValueError(f"DFlashWorker: {k.shape[0]} K rows for {sum(counts)} accepted tokens ({counts})")
        preps = self._advance_ctx_len(counts)
        pool = self._bound()
        dev = pool.device
        # token t of the batch is entry (row, col) of the store targets: its flat index, built on the
        # host and moved in one copy (no per-row launches, no wait for the device)
        n = np.asarray(counts, dtype=np.int64)
        width = self._slots().max_new_tokens
        flat = np.repeat(np.arange(n.size) * width - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
        index = to_device(flat, dev, pool.staging())
        kv = torch.stack([k, k if v is None else v], dim=2)[:, :, : pool.kv_factor]
        for p in sorted(set(pool.layer_pool)):
            layers = [i for i, q in enumerate(pool.layer_pool) if q == p]
            pages = preps[p].store_pages.to(dev).reshape(-1).index_select(0, index)
            offsets = preps[p].store_offsets.to(dev).reshape(-1).index_select(0, index)
            pool.write_layers(layers, pages, offsets, kv[:, layers])
        return preps

    # ------------------------------------------------------------------ generation step and rollback
    def _advance_ctx_len(self, num_accepted: Sequence[int] | Mapping[int, int] | None) -> list[PagedLatentPrep]:
        """Advance every generation row by its accepted tokens; the step's addressing, one per pool.

        `num_accepted`: tokens stored this step per row (row order), or request id ->
        count. Saves the slot state first, so `_ensure_spec_dec_state_restored` can
        undo the step until `finish_step()`.
        """
        if not self._ctx_len_restore_pending:
            self.save_step_state()
        return self._slots().prepare_generation(num_accepted)

    def generation_prep(self) -> list[PagedLatentPrep]:
        """This step's addressing (read rows rebased to each slot's base) for the block decode."""
        return self._slots().generation_prep()

    def save_step_state(self) -> None:
        """Ours: snapshot lengths and bases before the forward changes them."""
        self._saved_ctx_len = self._slots().slots.snapshot()
        self._ctx_len_restore_pending = True

    def finish_step(self) -> None:
        """Ours: the forward succeeded; keep this step's lengths and bases."""
        self._ctx_len_restore_pending = False
        self._saved_ctx_len = None

    def _ensure_spec_dec_state_restored(self, attn_metadata: Any, spec_metadata: Any) -> None:
        """After a failed or discarded forward: lengths and bases back to the saved snapshot."""
        if self._ctx_len_restore_pending and self._saved_ctx_len is not None:
            self._slots().rollback(self._saved_ctx_len)
        self._ctx_len_restore_pending = False
        self._saved_ctx_len = None


def plan_slot(slots: DFlashDraftSlots, row: int) -> int:
    """The slot of this step's row `row` (a private arena's table is indexed by slot)."""
    return slots.rows[row].slot


def _model_shape(draft_model: Any) -> dict[str, int]:
    """Upstream's drafter attributes, where the model has them."""
    names = {"_num_attn_layers": "layers", "_num_kv_heads": "heads", "_head_dim": "head_dim", "_kv_factor": "kv_factor"}
    return {ours: int(getattr(draft_model, name)) for name, ours in names.items() if hasattr(draft_model, name)}


__all__ = ["CUDA_GRAPH_DUMMY_REQUEST_ID", "DFlashWorker"]
