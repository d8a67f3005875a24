"""The executor's side of the DFlash drafter: hidden states in, drafts out.

`DFlashSpeculator` owns the drafter's slots (`DFlashSpecMetadata`), the toy
drafter over the draft pool (`DFlashDrafter`) and the ownership checker, and
calls them in the order the metadata's docstring prescribes. The executor
hands it token ids and absolute positions; it turns them into the target's
stand-in hidden states (`TokenFeatures`). When more requests want a slot than
there are slots, it evicts the least recently used slots of requests that are
not in the step; an evicted request is reseeded when it returns.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..manager import DraftKVCacheManagerV2
from ..manager.mirror_sizing import MirrorSizing
from ..request import LlmRequest, ScheduledRequests
from ..speculative import DFlashSpecMetadata, Seeding
from .drafter import DFlashDrafter, DFlashDrafterConfig
from .features import TokenFeatures
from .ownership import OwnershipChecker

FEATURE_SEED = 2024
ROW_CHECK_EVERY = 16  # steps between full row checks of the ownership checker


class DFlashSpeculator:
    """Drives one DFlash drafter for an executor (see executor/engine.py's Speculator)."""

    def __init__(
        self,
        draft_manager: DraftKVCacheManagerV2,
        *,
        vocab_size: int,
        block_size: int,
        num_slots: int,
        max_ctx_len: int,
        seeding: Seeding,
        feature_dim: int,
        page_aligned_seed: bool | None = None,
    ) -> None:
        cfg = draft_manager.config
        self.draft_manager = draft_manager
        self.features = TokenFeatures(vocab_size, feature_dim, history=block_size - 1, seed=FEATURE_SEED, device=cfg.device)
        self.meta = DFlashSpecMetadata(
            num_slots,
            block_size=block_size,
            tokens_per_block=cfg.tokens_per_block,
            max_ctx_len=max_ctx_len,
            device=cfg.device,
            seeding=seeding,
            backend="cpp",
            page_aligned_seed=page_aligned_seed,
        )
        self.checker = OwnershipChecker(draft_manager)
        self.drafter = DFlashDrafter(
            DFlashDrafterConfig(
                vocab_size=vocab_size,
                block_size=block_size,
                feature_dim=feature_dim,
                num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                dtype=cfg.dtype,
            ),
            self.features,
            self.meta,
            draft_manager,
            checker=self.checker,
        )
        self._recent: OrderedDict[int, None] = OrderedDict()  # slot holders, least recent first
        self._accepted: dict[int, torch.Tensor] = {}
        self._optimistic: dict[int, torch.Tensor] = {}
        self._steps = 0
        self._had_slot: set[int] = set()  # requests that held a slot at some point
        #: generation rows seeded again after losing their slot (evicted, then back)
        self.slot_reseeds = 0
        #: largest p - b*P of any generation seed: how far a seeded slot trails its request
        self.max_seed_lag_tokens = 0

    @property
    def foreign_page_accesses(self) -> int:
        return self.checker.foreign_page_accesses

    @property
    def stale_reads(self) -> int:
        return self.checker.stale_reads

    @property
    def unbacked_accesses(self) -> int:
        return self.checker.unbacked_accesses

    @property
    def accounting_errors(self) -> int:
        return getattr(self.checker, "accounting_errors", 0)

    # -- per step --------------------------------------------------------------------
    def prepare(self, batch: ScheduledRequests) -> None:
        wanted = [r.py_request_id for r in batch.all_requests()]
        need = sum(1 for rid in wanted if not self.meta.has_slot(rid))
        free = len(self.meta.free_slots)
        for rid in list(self._recent):
            if need <= free:
                break
            if rid not in wanted and self.meta.has_slot(rid):
                self.meta.evict(rid)  # the request lives on; its slot is reseeded when it returns
                del self._recent[rid]
                free += 1
        self.meta.prepare(batch, self.draft_manager)
        # The checker's own page -> owner map against the pools, every step; against
        # every live row now and then (rows are long on long prompts).
        self.checker.check_accounting()
        self._steps += 1
        if self._steps % ROW_CHECK_EVERY == 0:
            self.checker.check_rows()
            ids = self.meta.request_ids
            if ids:
                self.checker.check_export(ids, self.draft_manager.get_block_offsets(ids, "cpp"), "cpp")
        for row in self.meta.rows:
            seed = self.meta.seeds.get(row.request_id)
            if seed is None or row.kind != "generation":
                continue
            self.max_seed_lag_tokens = max(self.max_seed_lag_tokens, seed.offset)
            if row.request_id in self._had_slot:
                self.slot_reseeds += 1
        self._had_slot.update(r.request_id for r in self.meta.rows if r.kind != "dummy")
        for rid in wanted:
            self._recent.pop(rid, None)
            self._recent[rid] = None
        self._accepted.clear()
        self._optimistic.clear()

    def _hidden(self, tokens: torch.Tensor, start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end, device=tokens.device)
        return self.features.hidden_states(tokens[: end + 1], positions, tokens[start + 1 : end + 1])

    def store_context(self, req: LlmRequest, tokens: torch.Tensor, start: int, end: int) -> None:
        """A prefill chunk [start, end): tokens[start + 1 .. end] are known (the last may be the first output)."""
        positions = torch.arange(start, end, device=tokens.device)
        self.drafter.store_context(req, positions, self._hidden(tokens, start, end))

    def store_accepted(
        self, req: LlmRequest, tokens: torch.Tensor, start: int, end: int, verified_end: int | None = None
    ) -> None:
        """Verified tokens [start, end) continue the slot; [end, verified_end) were rejected drafts."""
        self._accepted[req.py_request_id] = self._hidden(tokens, start, end)
        if verified_end is not None and verified_end > end:
            self._optimistic[req.py_request_id] = self._hidden(tokens, start, verified_end)

    def propose(self, reqs: list[LlmRequest], tokens: dict[int, torch.Tensor]) -> dict[int, list[int]]:
        if self._optimistic:
            # Commit every verified token, then roll back: the slot's lengths and
            # bases return to where they were and only the accepted ones are kept.
            snap = self.meta.snapshot()
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

    def release(self, request_id: int) -> None:
        self.meta.free(request_id, missing_ok=True)
        self._recent.pop(request_id, None)
        self._had_slot.discard(request_id)


def build_speculator(setup, draft_manager: DraftKVCacheManagerV2, sizing: MirrorSizing, slots: int) -> DFlashSpeculator:
    """The fix seeds fresh slots with a base; legacy restarts them at slot-local 0.

    Without the trail page (`setup.trail_page=False`, an ablation) the seed stays
    page-aligned, so the run shows what the trail page prevents.
    """
    return DFlashSpeculator(
        draft_manager,
        vocab_size=setup.vocab_size,
        block_size=setup.block_size,
        num_slots=slots,
        max_ctx_len=setup.max_seq_len,
        seeding=Seeding.BASE if sizing is MirrorSizing.HISTORY else Seeding.SLOT_LOCAL,
        feature_dim=setup.draft_head_dim - 2,
        page_aligned_seed=None if setup.trail_page else True,
    )
