"""DFlashDraftSlots: the executor-facing object of a DFlash drafter, step by step.

It maps each step's rows (context requests, then generation requests) to
slots kept by :class:`~.slot_table.SlotTable`, seeds fresh slots by
:mod:`.slot_start` (each row placed by :mod:`.slot_assignment`), and hands out
the step's addressing from :mod:`.addressing`.
A slot ``(ctx_len L, base_pages b)`` holds context at slot positions
``[b*P, L)`` (absolute token positions, minus a lag ``< P`` after a
page-aligned generation seed); reads see ``row[b:]`` (pages) with length
``L - b*P`` (tokens), and the block is appended at ``[L, L + block_size)``.

Executor call order, every step (``drafter``: the simulator's toy drafter)::

    dm.prepare_resources(batch)                    # (0) size the mirrors
    meta.prepare_step(batch, dm)                     # (a) free departed slots, assign/seed, decode tables
    drafter.store_context(req, positions, hidden)  # (b) every context row, after the target forward
    drafter.commit_step({rid: hidden})             # (c) hidden [a + 1, F] of the accepted tokens
    #   optimistic: snap = meta.slots.snapshot(); commit all K + 1; meta.rollback(snap)  (lengths AND
    #   bases back); commit the a + 1 accepted
    drafts = drafter.propose()                     # (d) [B, block_size - 1], -1 for rows not proposing
    dm.update_context_resources(batch); dm.update_resources(batch)
    meta.evict(request_id) / meta.free(request_id) # between steps (prepare_step() also frees departed)

The draft manager must leave room for the block: ``max_draft_len =
block_size - 1``, ``num_extra_kv_tokens >= block_size``
(:func:`.addressing.required_extra_kv_tokens`). Errors are explicit and change nothing: an
unknown request is a ``KeyError`` naming the live slots, running out of slots a
:class:`NoFreeSlotError` naming the requests and the counts.
"""
from __future__ import annotations

import operator
from typing import Mapping, Optional, Sequence

import torch

from ..kernels import PagedLatentPrep
from ..request import LlmRequest, ScheduledRequests
from . import addressing, slot_assignment
from .addressing import ContextStorePlan, Row, StepTables
from .draft_pool import DraftPool
from .handoff_seed import check_seed_range, mirror_backed_from
from .slot_start import Seeding, SlotStart
from .slot_snapshot import SlotPlan, SlotSnapshot
from .slot_table import SlotTable
from .step_buffers import StepBuffers

def _check_args(max_batch_size: int, block_size: int, tokens_per_block: int, max_ctx_len: int, backend: str) -> None:
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (bonus token + at least one mask), got {block_size}")
    if tokens_per_block < 1 or max_ctx_len < 1:
        raise ValueError(f"tokens_per_block ({tokens_per_block}) and max_ctx_len ({max_ctx_len}) must be >= 1")
    if backend not in ("cpp", "python"):
        raise ValueError(f"unknown block-offset backend {backend!r}; use 'cpp' or 'python'")
    if max_ctx_len < tokens_per_block:
        raise ValueError(
            f"max_ctx_len ({max_ctx_len} tokens) must hold at least one page of {tokens_per_block} tokens: "
            "a clamped context is read from a page boundary"
        )


_CAPACITY = operator.attrgetter("capacity")


class DFlashDraftSlots:
    """Slots, bases, and the per-step addressing of a DFlash drafter (see the module docstring)."""

    #: A worker that reads the *unrebased* table sets this to False: a context tail
    #: after a prefix it did not compute is then stored with slot-local numbering
    #: (except on a pool paired with the target's block reuse).
    _ctx_reads_rebased_view: bool = True

    def __init__(
        self,
        max_batch_size: int,
        *,
        block_size: int,
        tokens_per_block: int,
        max_ctx_len: int = 1 << 20,
        device: str | torch.device = "cpu",
        seeding: str | Seeding = Seeding.BASE,
        fused: bool = True,
        backend: str = "cpp",
        page_aligned_seed: bool | None = None,
        max_new_tokens: int | None = None,
        num_dummy_slots: int | None = None,
        draft_manager: Optional[DraftPool] = None,
        read_bound: str = "window",
    ) -> None:
        _check_args(max_batch_size, block_size, tokens_per_block, max_ctx_len, backend)
        addressing.read_windows(None, read_bound)  # refuses an unknown bound before anything is built
        num_dummy_slots = max_batch_size if num_dummy_slots is None else num_dummy_slots
        if num_dummy_slots < 0:
            raise ValueError(f"num_dummy_slots must be >= 0, got {num_dummy_slots}")
        self.slots = SlotTable(
            max_batch_size,
            num_dummy_slots,
            tokens_per_block=tokens_per_block,
            max_ctx_len=max_ctx_len,
            device=torch.device(device),
        )
        # the slot table's constants, copied (the table itself is `slots`; its state lives only there)
        self.max_batch_size = max_batch_size
        self.num_dummy_slots = num_dummy_slots
        self.num_slots = self.slots.num_slots
        self.dummy_slot = self.slots.dummy_slot
        self.tokens_per_block = tokens_per_block
        self.device = self.slots.device
        self.block_size = block_size
        self.max_new_tokens = block_size if max_new_tokens is None else max_new_tokens
        self.seeding = Seeding.parse(seeding)
        self.fused = fused
        self.backend = backend
        self.page_aligned_seed = page_aligned_seed
        #: "window": generation read rows bounded by each pool's window; "base": upstream's layout
        self.read_bound = read_bound
        # this step
        self.rows: list[Row] = []
        self.draft_manager: Optional[DraftPool] = None
        self.tables: list[StepTables] = []
        self.slot_ids = torch.zeros(0, dtype=torch.int64, device=self.device)
        #: the step's inputs and outputs kept in place, its launches bound to them
        self.buffers = StepBuffers(self.device)
        self._prep: list[PagedLatentPrep] | None = None
        #: (requests, pool, slot-table version) of the last generation-only step, for `_repeats_last_step`
        self._last_step: Optional[tuple] = None
        self._rows_version = -1  # the slot table's version when `rows` were made
        self._row_facts: Optional[tuple[list[Row], addressing.RowFacts]] = None  # (rows, their RowFacts)
        self.seeds: dict[int, SlotStart] = {}  # request id -> start given by the last prepare_step()
        if draft_manager is not None:
            self.check_pool(draft_manager)

    # ------------------------------------------------------------------ queries
    @property
    def request_ids(self) -> list[int]:
        """The rows' request ids, in row order (kept with the rows: read it, do not change it)."""
        return self._facts().request_ids

    def _facts(self) -> addressing.RowFacts:
        """The rows' request ids, slots and kinds, worked out once per list of rows."""
        if self._row_facts is None or self._row_facts[0] is not self.rows:
            self._row_facts = (self.rows, addressing.row_facts(self.rows))
        return self._row_facts[1]

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def arena_pages_per_slot(self) -> int:
        """Pages of a private per-slot arena: the maximum context plus one block."""
        P = self.tokens_per_block
        return -(-(self.slots.max_ctx_len + self.block_size) // P)

    def row_index(self, request_id: int) -> int:
        for i, row in enumerate(self.rows):
            if row.request_id == request_id:
                return i
        raise KeyError(
            f"DFlash drafter: request {request_id} is not a row of this step (rows: {self.request_ids[:16]})"
        )

    # ------------------------------------------------------------------ slot lifetime
    def evict(self, request_id: int) -> None:
        """Take the request's slot away (it stays alive; its next row is seeded afresh)."""
        self.slots.evict(request_id)
        self._prep = None

    def free(self, request_id: int, *, missing_ok: bool = False) -> None:
        """Release the slot of a finished request."""
        if self.slots.free(request_id, missing_ok=missing_ok):
            self._prep = None

    def rollback(self, snap: SlotSnapshot) -> None:
        """Restore the lengths and bases of :meth:`snapshot` (the slot map is unchanged)."""
        self.slots.rollback(snap)
        self._prep = None

    def seed_context(self, request_id: int, lo: int, end: int, draft_manager: Optional[DraftPool] = None) -> SlotStart:
        """Seed the request's next fresh slot with a drafter context ``[lo, end)`` it received.

        Absolute token positions: ``end`` is the prompt length ``m`` (the row's
        position at its first generation step) and ``lo`` the first position
        whose drafter K/V was written onto the request's draft mirror. The slot
        then starts at ``L = end`` with base ``b = lo // P`` (pages) instead of
        the empty seed; only the request's first slot takes it (a reseed after
        eviction is empty, as always). Call after ``prepare_disagg_gen_init``
        and the writes, before the request's first ``prepare``.

        Raises ``ValueError`` naming the request and the numbers, and changes
        nothing, when ``lo`` is below the first page the mirror backs in every
        layer group or above ``end``, the mirror does not back up to ``end``,
        the request already holds a slot, or there is no draft pool.
        """
        dm = draft_manager if draft_manager is not None else self.draft_manager
        if dm is None:
            raise ValueError(f"request {request_id}: seeding a received drafter context needs the draft manager")
        if self.seeding is Seeding.SLOT_LOCAL:
            raise ValueError(f"request {request_id}: slot-local seeding cannot place a context at absolute positions")
        backed = mirror_backed_from(dm, request_id, end)
        check_seed_range(request_id, lo, end, backed_from=backed, tokens_per_block=self.tokens_per_block)
        start = self.slots.seed_context(request_id, lo, end)
        self._prep = None
        return start

    def check_pool(self, draft_manager: DraftPool) -> None:
        """Refuse a pool this metadata cannot address safely (see :func:`.addressing.check_pool`)."""
        addressing.check_pool(
            draft_manager, tokens_per_block=self.tokens_per_block, rebased_view=self._ctx_reads_rebased_view
        )

    # ------------------------------------------------------------------ prepare
    def prepare_step(self, batch: ScheduledRequests, draft_manager: Optional[DraftPool] = None) -> list[Row]:
        """Map this step's rows to slots, seed fresh slots, decode the rows' block tables.

        Call after ``draft_manager.prepare_resources(batch)``. ``draft_manager=None``
        means a private per-slot arena (the drafter owns its storage). Frees the
        slots of requests whose mirror is gone, gives every new request a slot
        (a reused slot starts from base 0), seeds every generation row that gets a
        fresh slot, and places every context chunk by the store-start rules. All
        or nothing: on an error nothing changes.
        """
        dm = draft_manager
        reqs = [*batch.context_requests, *batch.generation_requests]
        kinds = ["context"] * len(batch.context_requests) + ["generation"] * len(batch.generation_requests)
        ids = [r.py_request_id for r in reqs]
        if self._repeats_last_step(reqs, dm):
            try:
                tables = self._decode_tables(dm, ids, [r.slot for r in self.rows])
            except KeyError:  # a mirror is gone (the decode looks every one up): planning below names it
                tables = None
            if tables is not None:
                self.tables = tables
                self.seeds = {}
                self._prep = None
                self._rows_version = self.slots.version
                return self.rows
        self._validate(ids, dm)
        dummy_ids = [r.py_request_id for r in reqs if r.is_dummy]
        plan = self.slots.plan(ids, dummy_ids, None if dm is None else dm.has_cache)
        starts = slot_assignment.start_rules(
            dm, tokens_per_block=self.tokens_per_block, max_ctx_len=self.slots.max_ctx_len,
            page_aligned_seed=self.page_aligned_seed, rebased_view=self._ctx_reads_rebased_view, seeding=self.seeding,
        )
        rows, seeds = slot_assignment.plan_rows(plan, reqs, kinds, starts, self.slots.take_context_seed)
        tables = self._decode_tables(dm, ids, [r.slot for r in rows])
        self._apply(plan, rows, seeds, tables, dm)
        generation_only = all(r.kind == "generation" for r in rows)
        self._last_step = (reqs, dm, self.slots.version) if generation_only else None
        self._rows_version = self.slots.version
        return rows

    def _decode_tables(self, dm: Optional[DraftPool], ids: list[int], slots: list[int]) -> list[StepTables]:
        return addressing.decode_tables(
            dm, ids, slots, backend=self.backend, fused=self.fused,
            pages_per_slot=self.arena_pages_per_slot, device=self.device,
            # the pre-fix slot-local seeding keeps the exported tables, so its hazard stays reproducible
            ring=self.read_bound == "window" and self.seeding is not Seeding.SLOT_LOCAL,
        )

    def _repeats_last_step(self, reqs: list[LlmRequest], dm: Optional[DraftPool]) -> bool:
        """The same generation requests (the same objects, in the same rows) as the last step, on the same
        pool, with no slot gained, lost or seeded since: the rows, slots and seeds would come out the same,
        so the step keeps them (a slot whose request left the pool meanwhile is freed by the next step that
        plans). That every mirror is still there is shown by the tables' decode, which looks each one up."""
        last = self._last_step
        return (
            last is not None and last[1] is dm and last[2] == self.slots.version and len(reqs) == len(last[0])
            and all(map(operator.is_, reqs, last[0])) and not any(r.is_dummy for r in reqs)
        )

    def _validate(self, ids: list[int], dm: Optional[DraftPool]) -> None:
        """No request twice; with a pool: the pool is addressable and every row has a mirror."""
        seen: set[int] = set()
        dup = sorted({i for i in ids if i in seen or seen.add(i)})  # type: ignore[func-returns-value]
        if dup:
            raise ValueError(f"DFlash drafter: requests {dup} appear twice in one batch")
        if dm is None:
            return
        self.check_pool(dm)
        missing = [rid for rid in ids if not dm.has_cache(rid)]
        if missing:
            raise KeyError(
                f"DFlash drafter: requests {missing} have no draft mirror; call the draft manager's "
                "prepare_resources (or prepare_disagg_gen_init) first"
            )

    def _apply(
        self, plan: SlotPlan, rows: list[Row], seeds: dict[int, SlotStart], tables: list[StepTables], dm: Optional[DraftPool]
    ) -> None:
        self.slots.apply(plan)
        self.rows = rows
        self.draft_manager = dm
        self.slots.private_arena = dm is None
        self.tables = tables
        self.slot_ids = self.buffers.slot_ids([r.slot for r in rows])
        self.seeds = seeds
        self._prep = None

    def _check_rows_current(self) -> None:
        """Every row still holds the slot prepare_step() gave it (no evict/free in between)."""
        slots = self.slots
        if slots.version == self._rows_version:
            return  # no slot was taken, freed or seeded since the rows were made
        stale = [r.request_id for r in self.rows if r.kind != "dummy" and not slots.holds(r.request_id, r.slot)]
        if stale:
            raise RuntimeError(
                f"DFlash drafter: requests {stale} lost their slots after prepare_step(); evict or free between "
                "steps, then call prepare_step() again"
            )

    def _mirror_capacities(self) -> Optional[list[int]]:
        """Each row's mirror capacity (tokens): the rows' room checked at once. None without a pool, or
        when a row's mirror is gone (the per-row checks then name it)."""
        dm = self.draft_manager
        if dm is None:
            return None
        try:
            return list(map(_CAPACITY, dm.get_caches(self.request_ids)))
        except KeyError:
            return None

    def _check_room(self, row: Row, new_ctx: int) -> None:
        addressing.check_block_room(self.draft_manager, row.request_id, new_ctx, self.block_size)

    # ------------------------------------------------------------------ addressing
    def advance_slot_for_context(self, request: LlmRequest | int, positions: torch.Tensor | Sequence[int]) -> ContextStorePlan:
        """Store targets of a context chunk, and advance the slot past it.

        ``positions`` are the chunk's absolute target positions, contiguous and
        starting where the slot continues (``L + offset``). In a private arena
        tokens at slot positions ``>= max_ctx_len`` are not stored (clamping);
        on a shared pool every token is stored at its slot position and the
        base rises so the slot reads at most ``max_ctx_len`` tokens.
        """
        rid = request if isinstance(request, int) else request.py_request_id
        index = self.row_index(rid)
        self._check_rows_current()
        row = self.rows[index]
        if row.kind != "context":
            raise ValueError(f"DFlash drafter: request {rid} is a {row.kind} row, not a context row")
        plan = addressing.advance_slot_for_context(self.slots, self.tables, index, row, positions, self._check_room)
        self._prep = None
        return plan

    def prepare_generation(self, num_new: Sequence[int] | Mapping[int, int] | None = None) -> list[PagedLatentPrep]:
        """The generation step's addressing for every row, one :class:`PagedLatentPrep` per pool.

        ``num_new``: accepted tokens stored this step per row (row order), or a
        mapping request id -> count (absent rows 0). Context and dummy rows
        store nothing here. Advances each slot's ``ctx_len`` to ``min(L + n,
        max_ctx_len)``. The fused path is one ``prepare_paged_latent`` launch per
        pool; without it, its torch reference (`impl="reference"`).

        Read rows (``read_bound="window"``, the default): on a windowed pool each
        row starts at the window's first page (``shift``, ordinals of the
        unrebased row) or the slot base if higher, holds the pages up to the
        block's last one and -1 after, ``ceil(W / P) + 1`` columns wide; reading
        ``[0, read_lens + block_size)`` tokens of it touches only the request's
        pages. ``read_bound="base"`` keeps upstream's rows (from the base, as wide
        as the export).
        """
        counts = addressing.generation_counts(num_new, self.request_ids)
        self._check_rows_current()
        self._prep = addressing.prepare_generation(
            self.slots, self.rows, self.tables, self.slot_ids, counts, block_size=self.block_size,
            max_new=self.max_new_tokens, fused=self.fused, check_room=self._check_room,
            read_windows=addressing.read_windows(self.draft_manager, self.read_bound), buffers=self.buffers,
            capacities=self._mirror_capacities(), facts=self._facts(),
        )
        return self._prep

    def generation_prep(self) -> list[PagedLatentPrep]:
        """This step's preparation; computed with no new tokens if nothing was committed yet."""
        if self._prep is None:
            self.prepare_generation(None)
        assert self._prep is not None
        return self._prep


__all__ = ["DFlashDraftSlots"]
