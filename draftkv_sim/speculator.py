"""The executor's side of the DFlash drafter: hidden states in, drafts out (the model itself: toy_drafter.py).

`DFlashSpeculator` owns the drafter's slots (`DFlashDraftSlots`), the toy
drafter over the draft pool (`DFlashDrafter`) and the ownership checker, and
calls them in the order the metadata's docstring prescribes. The executor
hands it token ids and absolute positions; it turns them into the target's
stand-in hidden states (`TokenFeatures`). When more requests want a slot than
there are slots, it evicts the least recently used slots of requests that are
not in the step; an evicted request is reseeded when it returns.

`build_drafter` is the one factory of metadata, features, checker and drafter
over a draft manager (or a private per-slot arena).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from tensorrt_llm_draftkv.manager import DraftKVCacheManagerV2
from tensorrt_llm_draftkv.manager.rules import MirrorSizing
from tensorrt_llm_draftkv.request import LlmRequest, ScheduledRequests
from tensorrt_llm_draftkv.speculative import DFlashDraftSlots, DFlashSpecMetadata, Seeding
from tensorrt_llm_draftkv.speculative.handoff import DrafterContextGeometry, HandoffForm
from .disagg_wire import clipped_hidden_range, clipped_ranges
from .toy_drafter import DFlashDrafter, DFlashDrafterConfig
from .features import TokenFeatures
from .ownership import OwnershipChecker

FEATURE_SEED = 2024
ROW_CHECK_EVERY = 16  # steps between full row checks of the ownership checker


def build_drafter(
    draft_manager: DraftKVCacheManagerV2,
    *,
    vocab_size: int,
    block_size: int,
    num_slots: int,
    max_ctx_len: int,
    feature_dim: int,
    seeding: Seeding | str = Seeding.BASE,
    page_aligned_seed: bool | None = None,
    fused: bool = True,
    backend: str = "cpp",
    feature_seed: int = FEATURE_SEED,
    private_arena: bool = False,
    checker: bool = True,
    raise_on_violation: bool = False,
) -> DFlashDrafter:
    """Metadata (``num_slots`` slots), token features, ownership checker and toy drafter.

    Geometry (page size, heads, head dim, dtype, device) comes from the draft
    pool's config. ``private_arena``: the drafter keeps its K/V in a per-slot
    arena of its own instead of the pool (the manager still sizes mirrors and
    the checker still follows its pools).
    """
    cfg = draft_manager.config
    features = TokenFeatures(vocab_size, feature_dim, block_size - 1, seed=feature_seed, device=cfg.device)
    meta = DFlashDraftSlots(
        num_slots,
        block_size=block_size,
        tokens_per_block=cfg.tokens_per_block,
        max_ctx_len=max_ctx_len,
        device=cfg.device,
        seeding=seeding,
        fused=fused,
        backend=backend,
        page_aligned_seed=page_aligned_seed,
    )
    chk = OwnershipChecker(draft_manager, raise_on_violation=raise_on_violation) if checker else None
    config = DFlashDrafterConfig(
        vocab_size=vocab_size,
        block_size=block_size,
        feature_dim=feature_dim,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=cfg.dtype,
    )
    return DFlashDrafter(config, features, meta, None if private_arena else draft_manager, checker=chk)


class DFlashSpeculator:
    """Drives one DFlash drafter for an executor (see engine.py's Speculator).

    ``evict_idle_slots``: make room by evicting the least recently used slots
    of requests outside the step (else running out of slots raises
    ``NoFreeSlotError``). ``audit``: check the checker's owner map against the
    pools every step, and the rows and the export every ``ROW_CHECK_EVERY``.
    """

    def __init__(
        self,
        draft_manager: DraftKVCacheManagerV2,
        drafter: DFlashDrafter,
        *,
        evict_idle_slots: bool = True,
        audit: bool = True,
    ) -> None:
        self.draft_manager = draft_manager
        self.drafter = drafter
        self.meta: DFlashDraftSlots = drafter.meta
        # the step's rows reach the slots as an executor's do: upstream's metadata, prepare(), the worker
        block = drafter.config.block_size
        self.spec_metadata = DFlashSpecMetadata(max_num_requests=self.meta.num_slots, max_draft_len=block - 1,
                                                max_total_draft_tokens=block - 1, device=self.meta.device)
        self.spec_metadata.attach_worker(drafter.worker)
        self.features: TokenFeatures = drafter.features
        self.checker: OwnershipChecker | None = drafter.checker
        self.evict_idle_slots = evict_idle_slots
        self.audit = audit
        self._recent: OrderedDict[int, None] = OrderedDict()  # slot holders, least recent first
        self._accepted: dict[int, torch.Tensor] = {}
        self._optimistic: dict[int, torch.Tensor] = {}
        self._steps = 0
        self._had_slot: set[int] = set()  # requests that held a slot at some point
        #: generation rows seeded again after losing their slot (evicted, then back)
        self.slot_reseeds = 0
        #: largest p - b*P of any generation seed: how far a seeded slot trails its request
        self.max_seed_lag_tokens = 0
        #: generation slots seeded from a received drafter context (disaggregated handoff)
        self.handoff_seeds = 0
        #: reseeds, after a slot loss, of requests whose first slot had a received context: nothing to draw on
        self.reseeds_without_handoff = 0
        self._handed_off: set[int] = set()  # requests whose first slot was seeded from a received context
        #: (draft layer group, page) -> the next token its last position's K/V was stored with (block reuse)
        self._page_end_next: dict[tuple[int, int], int] = {}

    def _count(self, name: str) -> int:
        return 0 if self.checker is None else getattr(self.checker, name, 0)

    @property
    def foreign_page_accesses(self) -> int:
        return self._count("foreign_page_accesses")

    @property
    def stale_reads(self) -> int:
        return self._count("stale_reads")

    @property
    def unbacked_accesses(self) -> int:
        return self._count("unbacked_accesses")

    @property
    def accounting_errors(self) -> int:
        return self._count("accounting_errors")

    @property
    def shared_page_writes(self) -> int:
        """Drafter writes to pages it does not hold alone or that are published (block reuse)."""
        return self._count("shared_page_writes")

    # -- per step --------------------------------------------------------------------
    def prepare(self, batch: ScheduledRequests) -> None:
        """Map the step's rows (warmup dummies included) to slots; evict idle ones first if allowed."""
        wanted = [r.py_request_id for r in batch.all_requests()]
        if self.evict_idle_slots:
            self._evict_idle(wanted)
        md = self.spec_metadata
        md.request_ids = [r.py_request_id for r in batch.all_requests()]
        md.num_generations = len(batch.generation_requests)
        md.scheduled_requests = batch
        md.prepare()
        if self.audit:
            self._audit()
        received = set(self.meta.slots.last_context_seeded)
        for row in self.meta.rows:
            seed = self.meta.seeds.get(row.request_id)
            if seed is None or row.kind != "generation":
                continue
            self.max_seed_lag_tokens = max(self.max_seed_lag_tokens, seed.offset)
            if row.request_id in received:
                self.handoff_seeds += 1
                self._handed_off.add(row.request_id)
            elif row.request_id in self._had_slot:
                self.slot_reseeds += 1
                if row.request_id in self._handed_off:
                    self.reseeds_without_handoff += 1
        self._had_slot.update(r.request_id for r in self.meta.rows if r.kind != "dummy")
        for rid in wanted:
            self._recent.pop(rid, None)
            self._recent[rid] = None
        self._accepted.clear()
        self._optimistic.clear()

    def _evict_idle(self, wanted: list[int]) -> None:
        need = sum(1 for rid in wanted if not self.meta.slots.has_slot(rid))
        free = len(self.meta.slots.free_slots)
        for rid in list(self._recent):
            if need <= free:
                break
            if rid not in wanted and self.meta.slots.has_slot(rid):
                self.meta.evict(rid)  # the request lives on; its slot is reseeded when it returns
                del self._recent[rid]
                free += 1

    def _audit(self) -> None:
        """The checker's own page -> owner map against the pools, every step; against
        every live row now and then (rows are long on long prompts)."""
        if self.checker is None:
            return
        self.checker.check_accounting()
        self._steps += 1
        if self._steps % ROW_CHECK_EVERY == 0:
            self.checker.check_rows()
            ids = self.meta.request_ids
            if ids and self.drafter.draft_manager is not None:
                self.checker.check_export(ids, self.draft_manager.get_block_offsets(ids, "cpp"), "cpp")

    def _hidden(
        self, tokens: torch.Tensor, start: int, end: int, next_tokens: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Hidden states of absolute positions ``[start, end)``; next tokens default to the tokens after them."""
        positions = torch.arange(start, end, device=tokens.device)
        nxt = tokens[start + 1 : end + 1] if next_tokens is None else next_tokens
        return self.features.hidden_states(tokens[: end + 1], positions, nxt)

    def store_context(self, req: LlmRequest, tokens: torch.Tensor, start: int, end: int) -> None:
        """A prefill chunk [start, end): tokens[start + 1 .. end] are known (the last may be the first output)."""
        if self._real_joint_reuse(req):
            self._declare_reused_prefix(req, tokens)
        else:
            self._write_reused_prefix(req, tokens)
        positions = torch.arange(start, end, device=tokens.device)
        self.drafter.store_context(req, positions, self._hidden(tokens, start, end))
        if getattr(self.drafter.draft_manager, "block_reuse", False):
            self._note_page_ends(req, tokens, start, end)

    def _real_joint_reuse(self, req: LlmRequest) -> bool:
        """The draft pool takes part in real block reuse and this request's mirror adopted a prefix hit."""
        dm = self.drafter.draft_manager
        return bool(
            getattr(dm, "joint_kv_cache_reuse", False) and getattr(dm, "block_reuse", False) and req.prepopulated_prompt_len
        )

    def _fresh_over_base_zero(self, req: LlmRequest) -> int:
        """Context length of a slot placed this step past 0 over base 0 (it reads [0, L) from the pool), or 0."""
        seed = self.meta.seeds.get(req.py_request_id)
        if seed is None or seed.base_pages != 0:
            return 0
        return seed.ctx_len

    def _write_reused_prefix(self, req: LlmRequest, tokens: torch.Tensor) -> None:
        """A pool marked joint (`joint_kv_cache_reuse`) but without real block reuse: a chunk placed past 0
        over base 0 reads the prefix's drafter K/V [0, ctx_len) from the pool. Nobody computed it here, so
        put it there (what an earlier request sharing the prefix would have left), on the pages the mirror
        backs. Never under real block reuse (`_declare_reused_prefix`): those pages are shared, not writable."""
        if not getattr(self.drafter.draft_manager, "joint_kv_cache_reuse", False) or self._real_joint_reuse(req):
            return
        ctx_len = self._fresh_over_base_zero(req)
        if ctx_len == 0:
            return
        positions = torch.arange(0, ctx_len, device=tokens.device)
        self.drafter.write_reused_prefix(req, positions, self._hidden(tokens, 0, ctx_len))

    def _note_page_ends(self, req: LlmRequest, tokens: torch.Tensor, start: int, end: int) -> None:
        """Remember, per (layer group, page), the next token the drafter's K/V of the page's last position was
        stored with. That one position of a published page depends on a token past the page (the toy hidden
        state carries the next token), so a later request that reuses the page finds the publisher's."""
        P = self.meta.tokens_per_block
        first_end = (start // P + 1) * P - 1  # the first page-end position >= start
        if first_end >= end:
            return
        cache = self.draft_manager.get_cache(req.py_request_id)
        for g in range(len(self.draft_manager.layer_groups)):
            row = cache.block_row(g)
            for pos in range(first_end, end, P):
                ordinal = pos // P
                if ordinal < len(row) and row[ordinal] >= 0:
                    self._page_end_next[(g, row[ordinal])] = int(tokens[pos + 1])

    def _declare_reused_prefix(self, req: LlmRequest, tokens: torch.Tensor) -> None:
        """Real joint block reuse: the mirror adopted published pages holding the drafter's K/V of the prefix
        [0, reused_tokens), written by the request that first computed it. Nothing is written here (the pages
        are shared); the checker learns the values they hold, for every ordinal the mirror backs below the
        slot's start: the K/V of this prompt's tokens, except at a page's last position, whose next token is
        the one its writer stored it with (`_note_page_ends`; the publisher's on a reused page)."""
        ctx_len = self._fresh_over_base_zero(req)
        if ctx_len == 0 or self.checker is None:
            return
        # ctx_len is the hit at the first chunk; a slot lost during prefill and placed afresh at a later chunk
        # start also reads [hit, ctx_len), which this request stored itself on pages it still holds.
        P = self.meta.tokens_per_block
        cache = self.draft_manager.get_cache(req.py_request_id)
        for gi in range(self.drafter.num_groups):
            row = torch.tensor(cache.block_row(gi)[: ctx_len // P], dtype=torch.int64)
            ordinals = (row >= 0).nonzero().reshape(-1)
            if ordinals.numel() == 0:
                continue
            positions = (ordinals[:, None] * P + torch.arange(P)[None, :]).reshape(-1).to(tokens.device)
            nxt = tokens[positions + 1].clone()
            ends = ((positions + 1) % P == 0).nonzero().reshape(-1)
            for i in ends.tolist():
                page = int(row[int(positions[i]) // P])
                nxt[i] = self._page_end_next.get((gi, page), int(nxt[i]))
            hidden = self.features.hidden_states(tokens[: ctx_len + 1], positions, nxt)
            kv = self.drafter.project(gi, hidden, positions)
            group = self.drafter.group_layers(gi)
            self.checker.mark_reused(req.py_request_id, group[0], group[1], positions.to(self.drafter.device), kv)

    def store_verified(
        self, req: LlmRequest, tokens: torch.Tensor, preds: Sequence[int], keep: int, *, optimistic: bool = False
    ) -> None:
        """A generation row verified absolute positions ``[n - 1, n - 1 + len(preds))`` (``n``: tokens held
        before the step): ``tokens[p]`` is what the target read at ``p`` (the last token, then the drafts)
        and ``preds[i]`` its greedy next token after ``n - 1 + i``. The first ``keep`` positions (accepted
        drafts + bonus) continue the slot; ``optimistic``: every verified one is committed first, then rolled back.
        """
        n = req.max_beam_num_tokens
        hidden = self._hidden(tokens, n - 1, n - 1 + len(preds), preds)
        self._accepted[req.py_request_id] = hidden[:keep]
        if optimistic:
            self._optimistic[req.py_request_id] = hidden

    def propose(self, reqs: list[LlmRequest], tokens: dict[int, torch.Tensor]) -> dict[int, list[int]]:
        """Commit the step's verified tokens, then block-decode each request's next drafts."""
        if self._optimistic:
            # One trial commit of the whole batch (optimistic rows: every verified token;
            # the others: their accepted ones), then roll back: the slots' lengths and
            # bases return to where they were and only the accepted tokens are kept.
            snap = self.meta.slots.snapshot()
            self.drafter.commit_step({**self._accepted, **self._optimistic})
            self.meta.rollback(snap)
        self.drafter.commit_step(self._accepted)
        drafts = self.drafter.propose()
        out: dict[int, list[int]] = {}
        wanted = {r.py_request_id for r in reqs}
        for row, rid in enumerate(self.meta.request_ids):
            if rid in wanted:
                out[rid] = [int(t) for t in drafts[row].tolist() if t >= 0]
        return out

    # -- disaggregated handoff ---------------------------------------------------------
    def handoff_geometry(self, form: HandoffForm | str = HandoffForm.KV) -> DrafterContextGeometry:
        """This drafter's context geometry: what it sends (context worker) or accepts (generation worker)."""
        return DrafterContextGeometry.of_pool(
            self.draft_manager, form, hidden_size=self.features.feature_dim, hidden_dtype=self.features.E.dtype
        )

    def export_context(
        self, req: LlmRequest, tokens: torch.Tensor, geometry: DrafterContextGeometry, *, floor: int = 0
    ) -> list[torch.Tensor]:
        """Context worker, prompt computed (pages still held): the drafter context the generation worker can read.

        Form ``kv``: per layer group, the K/V this drafter stored for positions
        ``geometry.group_range(g, m)``, read from the request's own pages. Form
        ``hidden``: one ``[n, F]`` tensor of the hidden states of ``geometry.hidden_range(m)``.
        ``floor``: every range starts there or later (a drafter that computed only ``[floor, m)``, after a
        prefix hit without joint reuse).
        """
        m = req.prompt_len
        if geometry.form is HandoffForm.HIDDEN:
            lo, hi = clipped_hidden_range(geometry, m, floor)
            return [self._hidden(tokens, lo, hi)]
        return [
            self.drafter.read_stored(req.py_request_id, gi, lo, hi)
            for gi, (lo, hi) in enumerate(clipped_ranges(geometry, m, floor))
        ]

    def import_context(
        self, request_id: int, prompt_len: int, geometry: DrafterContextGeometry, payload: Sequence[torch.Tensor],
        *, floor: int = 0, seed_floor: int | None = None,
    ) -> tuple[int, int]:
        """Generation worker, after ``prepare_disagg_gen_init``: write a received drafter context and seed the slot.

        Every position goes through the drafter's checked store onto the
        request's own pages (the mirror's window below ``m``); the request's
        first slot then starts with context ``[lo, m)``, ``lo`` the first received
        position of every group. Returns ``(lo, m)``. The caller has checked the
        geometry; a tensor of the wrong shape or an unbacked page raises
        ``ValueError`` before the slot is seeded. ``floor``: the context was
        sent from there on (see ``export_context``); the slot starts there,
        or at ``seed_floor`` when given (joint block reuse on this worker: the
        mirror adopted pages holding ``[seed_floor, floor)``; see
        ``check_adopted_context``).
        """
        m = prompt_len
        ranges = clipped_ranges(geometry, m, floor)
        if geometry.form is HandoffForm.HIDDEN:
            (hidden,) = payload
            hlo, hi = clipped_hidden_range(geometry, m, floor)
            if tuple(hidden.shape) != (hi - hlo, self.features.feature_dim):
                raise ValueError(
                    f"request {request_id}: received hidden states {tuple(hidden.shape)}, expected "
                    f"[{hi - hlo}, {self.features.feature_dim}] for positions [{hlo}, {hi})"
                )
            hidden = hidden.to(device=self.features.E.device)
            kvs = [
                self.drafter.project(gi, hidden[lo - hlo :], torch.arange(lo, m)) for gi, (lo, _) in enumerate(ranges)
            ]
        else:
            kvs = list(payload)
            if len(kvs) != len(ranges):
                raise ValueError(f"request {request_id}: received {len(kvs)} drafter K/V tensors for {len(ranges)} groups")
            for (lo, hi), n, kv in zip(ranges, geometry.layers, kvs):
                want = (hi - lo, n, 2, geometry.num_kv_heads, geometry.head_dim)
                if tuple(kv.shape) != want:
                    raise ValueError(
                        f"request {request_id}: received drafter K/V {tuple(kv.shape)}, expected {want} for "
                        f"positions [{lo}, {hi})"
                    )
        if self.meta.slots.has_slot(request_id):
            raise ValueError(f"request {request_id}: a received drafter context arrived while it holds a slot")
        for gi, (lo, hi) in enumerate(ranges):  # every page checked before anything is written
            self.drafter.mirror_pages(request_id, gi, lo, hi, "writing a received drafter context")
        for gi, ((lo, _), kv) in enumerate(zip(ranges, kvs)):
            self.drafter.write_received(request_id, gi, lo, kv)
        lo = min(max(geometry.seed_start(m), floor if seed_floor is None else seed_floor), m)
        self.meta.seed_context(request_id, lo, m, self.draft_manager)
        return lo, m

    def check_adopted_context(
        self, request_id: int, tokens: torch.Tensor, prompt_len: int, seed_floor: int, hit: int,
        geometry: DrafterContextGeometry,
    ) -> int:
        """Generation worker, joint block reuse: the slot reads absolute positions ``[lo, hit)`` (``lo`` its seed
        start) from pages its mirror adopted, written for an earlier request with the same prefix.

        Checks them against what this prompt's ``tokens`` give (``RuntimeError`` naming the request, group and
        position otherwise) and declares them to the ownership checker. A page's last position is exempt from
        the comparison: the toy hidden state carries the next token, which lies past the page (see
        ``_note_page_ends``). Returns the positions checked.
        """
        lo = min(max(geometry.seed_start(prompt_len), seed_floor), prompt_len)
        if hit <= lo:
            return 0
        P = self.meta.tokens_per_block
        positions = torch.arange(lo, hit, device=tokens.device)
        hidden = self._hidden(tokens, lo, hit)
        for gi in range(self.drafter.num_groups):
            stored = self.drafter.read_stored(request_id, gi, lo, hit)
            want = self.drafter.project(gi, hidden, positions).to(stored.dtype)
            close = torch.isclose(stored, want, rtol=1e-5, atol=1e-6).flatten(1).all(dim=1)
            bad = (~close & ((positions + 1) % P != 0).to(close.device)).nonzero().reshape(-1)
            if bad.numel():
                p = int(positions[int(bad[0])])
                raise RuntimeError(
                    f"request {request_id}: adopted drafter K/V at position {p} (layer group {gi}) differs from "
                    f"what its tokens give; {bad.numel()} of {hit - lo} adopted positions differ (hit of {hit} tokens)"
                )
            if self.checker is not None:
                group = self.drafter.group_layers(gi)
                self.checker.mark_reused(request_id, group[0], group[1], positions.to(self.drafter.device), stored)
        return hit - lo

    def evict(self, request_id: int) -> None:
        """Take a live request's slot away; its next row is seeded afresh."""
        self.meta.evict(request_id)
        self._recent.pop(request_id, None)

    def release(self, request_id: int) -> None:
        """A finished request (or a warmup dummy): its slot, and everything the checker knows of it."""
        self.meta.free(request_id, missing_ok=True)
        self._recent.pop(request_id, None)
        self._had_slot.discard(request_id)
        self._handed_off.discard(request_id)
        if self.checker is not None:
            self.checker.forget(request_id)


def build_speculator(setup, draft_manager: DraftKVCacheManagerV2, sizing: MirrorSizing, slots: int) -> DFlashSpeculator:
    """The fix seeds fresh slots with a base; legacy restarts them at slot-local 0.

    Without the trail page (`setup.trail_page=False`, an ablation) the seed stays
    page-aligned, so the run shows what the trail page prevents.
    """
    drafter = build_drafter(
        draft_manager,
        vocab_size=setup.vocab_size,
        block_size=setup.block_size,
        num_slots=slots,
        max_ctx_len=setup.max_seq_len,
        seeding=Seeding.BASE if sizing is MirrorSizing.HISTORY else Seeding.SLOT_LOCAL,
        feature_dim=setup.draft_head_dim - 2,
        page_aligned_seed=None if setup.trail_page else True,
    )
    return DFlashSpeculator(draft_manager, drafter)
