"""Where each row of a DFlash step goes: its slot, and where a fresh or restarted slot starts.

:func:`start_rules` gathers one step's store-start rules for the draft pool (a
private per-slot arena when there is no draft manager); :func:`plan_rows`
gives every row of the step (context rows, then generation rows) its slot and,
where the slot is fresh or a context chunk does not continue it, its start.
Everything happens on a :class:`~.slot_snapshot.SlotPlan`'s working copies, so a
step that fails changes nothing; ``DFlashDraftSlots.prepare`` applies the plan.

Coordinates: a row's position is an absolute token position (its history for
a generation row, the chunk's first position for a context row); a start is
``(ctx_len L, base_pages b, offset)``: slot positions (tokens), pages, and the
absolute position of slot position 0 (see :mod:`.slot_start`). Split from
:mod:`.draft_slots`, whose private ``_starts`` and ``_plan_rows`` these were.
"""
from __future__ import annotations

from typing import Callable, Optional

from ..request import LlmRequest, target_view
from . import slot_start as rules
from .addressing import Row
from .draft_pool import DraftPool
from .slot_snapshot import SlotPlan
from .slot_start import Seeding, SlotStart, StartRules
from .slot_table import NO_STORE_LIMIT

#: ``take_context_seed(plan, request_id, position)``: the start a received context gives, or None
#: (``SlotTable.take_context_seed``).
ContextSeedTaker = Callable[[SlotPlan, int, int], Optional[SlotStart]]


def seed_is_page_aligned(dm: Optional[DraftPool], *, page_aligned_seed: bool | None, tokens_per_block: int) -> bool:
    """Whether a generation seed on ``dm``'s pool starts at a page boundary (``page_aligned_seed`` overrides)."""
    if page_aligned_seed is not None:
        return page_aligned_seed
    return rules.page_aligned_seed(
        windows=tuple(g.window for g in dm.config.layer_groups),
        trail_tokens=dm.draft_slot_trail_tokens,
        tokens_per_block=tokens_per_block,
    )


def start_rules(
    dm: Optional[DraftPool],
    *,
    tokens_per_block: int,
    max_ctx_len: int,
    page_aligned_seed: bool | None,
    rebased_view: bool,
    seeding: Seeding,
) -> StartRules:
    """The store-start rules of a step on ``dm``'s pool, or of a private arena when ``dm`` is None."""
    arena = dm is None
    return StartRules(
        tokens_per_block=tokens_per_block,
        store_limit=max_ctx_len if arena else NO_STORE_LIMIT,
        paired_pool=bool(dm is not None and getattr(dm, "joint_kv_cache_reuse", False)),
        page_aligned=True if arena else seed_is_page_aligned(
            dm, page_aligned_seed=page_aligned_seed, tokens_per_block=tokens_per_block
        ),
        private_arena=arena,
        rebased_view=rebased_view,
        seeding=seeding,
    )


def plan_rows(
    plan: SlotPlan,
    reqs: list[LlmRequest],
    kinds: list[str],
    starts: StartRules,
    take_context_seed: ContextSeedTaker,
) -> tuple[list[Row], dict[int, SlotStart]]:
    """Each row's slot and start, on the plan's copies (a fresh generation row is seeded)."""
    rows: list[Row] = []
    seeds: dict[int, SlotStart] = {}
    for req, kind in zip(reqs, kinds):
        rid = req.py_request_id
        if req.is_dummy:
            # Each dummy gets a slot of its own, seeded from its own position every
            # step: dummies of different sizes must not share lengths or bases.
            slot, fresh, kind = plan.take_dummy_slot(), True, "dummy"
        else:
            slot, fresh = plan.slot_for(rid)
        if kind == "context":
            proposing = place_context(plan, seeds, req, slot, fresh, starts)
        else:
            if fresh:
                # The row's absolute position is its history: the first position the slot stores.
                # A received drafter context (seed_context) seeds the slot instead of an empty one.
                position = max(req.max_beam_num_tokens - 1, 0)
                received = take_context_seed(plan, rid, position) if kind == "generation" else None
                seeds[rid] = start = received or starts.generation(position)
                plan.place(slot, start)
            proposing = True
        rows.append(Row(req, slot, kind, proposing))
    return rows, seeds


def place_context(
    plan: SlotPlan, seeds: dict[int, SlotStart], req: LlmRequest, slot: int, fresh: bool, starts: StartRules
) -> bool:
    """Place a context chunk that does not continue its slot; True if the row proposes."""
    view = target_view(req)
    if fresh or plan.continues_at(slot) != view.position:
        seeds[req.py_request_id] = start = starts.context(view.position)
        plan.place(slot, start)
        if not fresh:
            plan.restarted.append(req.py_request_id)
    return view.position + view.chunk_size >= req.prompt_len


__all__ = [
    "ContextSeedTaker",
    "place_context",
    "plan_rows",
    "seed_is_page_aligned",
    "start_rules",
]
