"""DFlashSpecMetadata: the DFlash drafter's slots, their bases, and each step's addressing.

A slot is the drafter's per-request context state ``(ctx_len L, base_pages b)``
(DESIGN.md §3). There are ``max_batch_size + 1`` slots; the last one is a
shared dummy slot for CUDA-graph warmup dummies. ``ctx_len`` and
``base_pages`` live on the device (what the kernels and the drafter read), with
host mirrors kept in step from host-known quantities (no device→host sync).

Coordinates. Slot positions are absolute token positions: a slot holds context
at ``[b*P, L)``, a token at slot position ``s`` is stored on ordinal ``s // P``
of the request's own (unrebased) draft-mirror row, the block decode reads the
row rebased past the base, ``row[b:]``, with context length ``L - b*P``, and
appends its block at ``[L, L + block_size)`` onto ``row[q // P]``. After a
page-aligned generation seed the slot trails its request by ``p - b*P < P``
tokens (its positions are the absolute ones minus that lag). The drafter never
reads context below ``b*P`` nor anything at or past ``L + block_size``.

Executor call order, every step (``meta`` = this object, ``drafter`` =
:class:`~tensorrt_llm_draftkv.sim.DFlashDrafter` (the simulator's toy drafter) bound to it and to the
draft manager ``dm``)::

    dm.prepare_resources(batch)                    # (0) size the mirrors (and
                                                   #     dm.prepare_disagg_gen_init(req)
                                                   #     once for a new disagg request)
    meta.prepare(batch, dm)                        # (a) free slots of departed requests,
                                                   #     assign/seed slots, decode block tables
    # target forward; then, for every context row of the batch:
    drafter.store_context(req, positions, hidden)  # (b) the chunk's hidden states [n, F]
    # for the generation rows, after target verification:
    drafter.commit_step({rid: hidden})             # (c) hidden [a + 1, F] of the accepted tokens
                                                   #     (positions L+offset .. , i.e. from the
                                                   #     request's history on)
    #   an executor that commits every verified token before acceptance is known:
    #   snap = meta.snapshot(); drafter.commit_step({rid: hidden[K + 1, F]}); ...
    #   meta.rollback(snap)                        # (e) on rejection: lengths AND bases back,
    #   drafter.commit_step({rid: hidden[a + 1, F]})   then commit what was accepted
    # append the accepted tokens and the bonus token to req.tokens, then:
    drafts = drafter.propose()                     # (d) [B, block_size - 1], -1 for rows that
                                                   #     do not propose (non-last context chunks);
                                                   #     bonus = req.tokens[-1] (or pass them)
    dm.update_context_resources(batch); dm.update_resources(batch)
    # between steps (after propose, before the next prepare):
    meta.evict(request_id)                         # (f) when slots run out (request stays alive)
    meta.free(request_id)                          # (g) on completion (before or after
                                                   #     dm.free_resources; prepare() also frees
                                                   #     slots whose mirror is gone)

Rows are the batch's context requests then its generation requests, in order;
``meta.request_ids`` lists them. ``propose()`` takes each row's bonus token from
``req.tokens[-1]`` unless given. The draft manager must leave room for the
block above the accepted tokens: ``max_draft_len = block_size - 1`` and
``num_extra_kv_tokens >= block_size`` (:func:`required_extra_kv_tokens`); a step
that would append the block past a mirror's capacity raises before anything
changes.

Errors are explicit and leave every structure as it was: an unknown request id
is a ``KeyError`` naming it and the live slots, running out of slots is a
:class:`NoFreeSlotError` naming the requests and the counts.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import torch

from ..kernels import (
    BlockTables,
    PagedLatentPrep,
    decode_draft_block_table,
    prepare_paged_latent,
    rebase_block_table,
)
from ..request import LlmRequest, ScheduledRequests
from . import slot_rules as rules
from .slot_rules import Seeding, SlotStart


#: Stores on a shared pool are never clamped (int32-safe stand-in for "no limit").
_NO_STORE_LIMIT = (1 << 31) - 1


class NoFreeSlotError(RuntimeError):
    """More requests need a drafter slot than there are free slots."""

    def __init__(self, message: str, *, request_ids: list[int], needed: int, free: int) -> None:
        super().__init__(message)
        self.request_ids = request_ids
        self.needed = needed
        self.free = free


def required_extra_kv_tokens(block_size: int) -> int:
    """``num_extra_kv_tokens`` a draft manager needs so the block fits above all accepted tokens."""
    return block_size


@dataclasses.dataclass(frozen=True)
class SlotSnapshot:
    """Context lengths and bases of every slot (device and host), for :meth:`DFlashSpecMetadata.rollback`."""

    ctx_len: torch.Tensor
    base_pages: torch.Tensor
    ctx_len_host: tuple[int, ...]
    base_pages_host: tuple[int, ...]
    offsets_host: tuple[int, ...]


@dataclasses.dataclass
class Row:
    """One row of this step: its request, slot, kind, and whether it proposes drafts."""

    request: LlmRequest
    slot: int
    kind: str  # "context" | "generation" | "dummy"
    proposing: bool

    @property
    def request_id(self) -> int:
        return self.request.py_request_id


@dataclasses.dataclass
class ContextStorePlan:
    """Where a context chunk goes: slot positions and, per pool, page and in-page offset.

    ``pages[g][i] == -1`` marks a token that is not stored (past ``max_ctx`` or
    past the table); ``positions`` are slot positions (the RoPE positions).
    """

    row: int
    positions: torch.Tensor  # int64 [n] slot positions
    pages: list[torch.Tensor]  # per pool, int32 [n]
    offsets: torch.Tensor  # int32 [n], -1 = not stored


class DFlashSpecMetadata:
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
        seeding: "str | Seeding" = Seeding.BASE,
        fused: bool = True,
        backend: str = "cpp",
        page_aligned_seed: bool | None = None,
        max_new_tokens: int | None = None,
        num_dummy_slots: int | None = None,
        draft_manager=None,
    ) -> None:
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
        num_dummy_slots = max_batch_size if num_dummy_slots is None else num_dummy_slots
        if num_dummy_slots < 0:
            raise ValueError(f"num_dummy_slots must be >= 0, got {num_dummy_slots}")
        self.max_batch_size = max_batch_size
        self.num_dummy_slots = num_dummy_slots
        self.num_slots = max_batch_size + num_dummy_slots
        #: First of the slots reserved for warmup dummies; each dummy row of a step takes its own.
        self.dummy_slot = max_batch_size
        self.block_size = block_size
        self.tokens_per_block = tokens_per_block
        self.max_ctx_len = max_ctx_len
        self.max_new_tokens = block_size if max_new_tokens is None else max_new_tokens
        self.device = torch.device(device)
        self.seeding = Seeding.parse(seeding)
        self.fused = fused
        self.backend = backend
        self.page_aligned_seed = page_aligned_seed

        self.ctx_len = torch.zeros(self.num_slots, dtype=torch.int64, device=self.device)
        self.base_pages = torch.zeros(self.num_slots, dtype=torch.int64, device=self.device)
        self._ctx_host = [0] * self.num_slots
        self._base_host = [0] * self.num_slots
        self._offset_host = [0] * self.num_slots
        self._free: list[int] = list(range(max_batch_size))
        self._slot_of: dict[int, int] = {}
        self._release_listeners: list[Callable[[int, str], None]] = []

        # this step
        self.rows: list[Row] = []
        self.draft_manager = None
        self.private_arena = False
        self.tables: list[BlockTables] = []
        self.slot_ids = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._prep: list[PagedLatentPrep] | None = None
        self._last_num_new: list[int] | None = None
        self.seeds: dict[int, SlotStart] = {}  # request id -> start given by the last prepare()
        if draft_manager is not None:
            self.check_pool(draft_manager)

    # ------------------------------------------------------------------ queries
    @property
    def request_ids(self) -> list[int]:
        return [r.request_id for r in self.rows]

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def free_slots(self) -> list[int]:
        return list(self._free)

    @property
    def ctx_len_host(self) -> list[int]:
        return list(self._ctx_host)

    @property
    def base_pages_host(self) -> list[int]:
        return list(self._base_host)

    @property
    def arena_pages_per_slot(self) -> int:
        """Pages of a private per-slot arena: the maximum context plus one block."""
        P = self.tokens_per_block
        return -(-(self.max_ctx_len + self.block_size) // P)

    def live_requests(self) -> dict[int, int]:
        """Request id -> slot, for every request holding a slot."""
        return dict(self._slot_of)

    def has_slot(self, request_id: int) -> bool:
        return request_id in self._slot_of

    def slot_of(self, request_id: int) -> int:
        try:
            return self._slot_of[request_id]
        except KeyError:
            raise KeyError(
                f"DFlash drafter: request {request_id} holds no slot "
                f"(requests holding slots: {sorted(self._slot_of)[:16]})"
            ) from None

    def slot_state(self, request_id: int) -> tuple[int, int]:
        """``(ctx_len, base_pages)`` of the request's slot (host mirror)."""
        s = self.slot_of(request_id)
        return self._ctx_host[s], self._base_host[s]

    def slot_offset(self, request_id: int) -> int:
        """Absolute position of the request's slot position 0 (the trailing lag in the base design)."""
        return self._offset_host[self.slot_of(request_id)]

    def row_index(self, request_id: int) -> int:
        for i, row in enumerate(self.rows):
            if row.request_id == request_id:
                return i
        raise KeyError(
            f"DFlash drafter: request {request_id} is not a row of this step (rows: {self.request_ids[:16]})"
        )

    def check_host_mirror(self) -> None:
        """The device tensors equal their host mirrors (one host sync; tests and debugging)."""
        dev_ctx = self.ctx_len.tolist()
        dev_base = self.base_pages.tolist()
        if dev_ctx != self._ctx_host or dev_base != self._base_host:
            raise AssertionError(
                f"slot state out of sync: ctx_len device={dev_ctx} host={self._ctx_host}, "
                f"base_pages device={dev_base} host={self._base_host}"
            )

    def add_release_listener(self, fn: Callable[[int, str], None]) -> None:
        """``fn(request_id, reason)`` is called whenever a request loses its slot."""
        self._release_listeners.append(fn)

    # ------------------------------------------------------------------ slot lifetime
    def _release(self, request_id: int, reason: str) -> None:
        slot = self._slot_of.pop(request_id)
        self._ctx_host[slot] = self._base_host[slot] = self._offset_host[slot] = 0
        self.ctx_len[slot] = 0
        self.base_pages[slot] = 0
        self._free.append(slot)
        self._free.sort()
        for fn in self._release_listeners:
            fn(request_id, reason)

    def evict(self, request_id: int) -> None:
        """Take the request's slot away (it stays alive; its next row is seeded afresh)."""
        self.slot_of(request_id)  # explicit KeyError
        self._release(request_id, "evict")
        self._prep = None

    def free(self, request_id: int, *, missing_ok: bool = False) -> None:
        """Release the slot of a finished request."""
        if request_id not in self._slot_of:
            if missing_ok:
                return
            self.slot_of(request_id)
        self._release(request_id, "free")
        self._prep = None

    def snapshot(self) -> SlotSnapshot:
        """Lengths AND bases of every slot; take it after :meth:`prepare`, before a commit."""
        return SlotSnapshot(
            self.ctx_len.clone(),
            self.base_pages.clone(),
            tuple(self._ctx_host),
            tuple(self._base_host),
            tuple(self._offset_host),
        )

    def rollback(self, snap: SlotSnapshot) -> None:
        """Restore the lengths and bases of :meth:`snapshot` (the slot map is unchanged)."""
        if not isinstance(snap, SlotSnapshot) or len(snap.ctx_len_host) != self.num_slots:
            raise ValueError("rollback needs a snapshot taken from this metadata")
        self.ctx_len.copy_(snap.ctx_len)
        self.base_pages.copy_(snap.base_pages)
        self._ctx_host = list(snap.ctx_len_host)
        self._base_host = list(snap.base_pages_host)
        self._offset_host = list(snap.offsets_host)
        self._prep = None

    # ------------------------------------------------------------------ clamping
    def _store_limit(self) -> int:
        """Slot positions at or past this are not stored.

        A private arena holds ``max_ctx_len`` tokens per slot, so stores clamp
        there. On a shared pool slot positions are absolute and the mirror is
        sized in absolute positions, so nothing is clamped: ``max_ctx_len``
        bounds what a slot *reads* instead (see :meth:`_clamped_base`).
        """
        return self.max_ctx_len if self.private_arena else _NO_STORE_LIMIT

    def _clamped_base(self, ctx_len: int, base: int) -> int:
        """Base pages that keep a shared-pool slot's read ``L - b*P`` within ``max_ctx_len``.

        The base only rises, to whole pages, and never past ``L // P``; the
        context below it stays stored on the request's pages but is not read.
        """
        if self.private_arena:
            return base
        over = ctx_len - self.max_ctx_len
        if over <= 0:
            return base
        P = self.tokens_per_block
        return max(base, min(-(-over // P), ctx_len // P))

    def _advance_host(self, slot: int, new_len: int, consumed: int) -> None:
        """The slot took ``consumed`` tokens and now holds ``new_len``.

        ``L + offset`` stays the absolute position the slot continues at: in a
        private arena a clamped slot drops tokens, and its offset takes them.
        """
        self._offset_host[slot] += consumed - (new_len - self._ctx_host[slot])
        self._ctx_host[slot] = new_len

    def check_pool(self, draft_manager) -> None:
        """Refuse a pool this metadata cannot address safely (ValueError naming the numbers).

        A worker that reads the unrebased table (``_ctx_reads_rebased_view =
        False``) stores a tail after a prefix it did not compute at slot
        position 0; its mirror, sized for the tail's absolute position, has
        released those low pages on a windowed pool that does not join the
        target's block reuse, so the stores would land on other requests' pages.
        """
        if draft_manager.tokens_per_block != self.tokens_per_block:
            raise ValueError(
                f"DFlash drafter: metadata built for {self.tokens_per_block}-token pages, draft manager uses "
                f"{draft_manager.tokens_per_block}"
            )
        windows = tuple(g.window for g in draft_manager.config.layer_groups)
        paired = bool(getattr(draft_manager, "joint_kv_cache_reuse", False))
        if not self._ctx_reads_rebased_view and not paired and any(w is not None for w in windows):
            raise ValueError(
                "DFlash drafter: a worker that reads the unrebased table (_ctx_reads_rebased_view=False) "
                f"cannot use a windowed draft pool (windows {list(windows)}, {self.tokens_per_block}-token "
                "pages) without joint_kv_cache_reuse: a context tail after a prefix it did not compute is "
                "stored at slot position 0, on pages the mirror has released. Read the rebased view, join "
                "the target's block reuse, or use a full-attention draft pool."
            )

    # ------------------------------------------------------------------ prepare
    def _seed_is_page_aligned(self, dm) -> bool:
        if self.page_aligned_seed is not None:
            return self.page_aligned_seed
        return rules.page_aligned_seed(
            windows=tuple(g.window for g in dm.config.layer_groups),
            trail_tokens=dm.draft_slot_trail_tokens,
            tokens_per_block=self.tokens_per_block,
        )

    def prepare(self, batch: ScheduledRequests, draft_manager=None) -> list[Row]:
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
        seen: set[int] = set()
        dup = sorted({i for i in ids if i in seen or seen.add(i)})  # type: ignore[func-returns-value]
        if dup:
            raise ValueError(f"DFlash drafter: requests {dup} appear twice in one batch")
        P = self.tokens_per_block
        if dm is not None:
            self.check_pool(dm)
            missing = [rid for rid in ids if not dm.has_cache(rid)]
            if missing:
                raise KeyError(
                    f"DFlash drafter: requests {missing} have no draft mirror; call the draft manager's "
                    "prepare_resources (or prepare_disagg_gen_init) first"
                )

        # -- plan on copies ---------------------------------------------------
        slot_of = dict(self._slot_of)
        free = list(self._free)
        ctx, base, off = list(self._ctx_host), list(self._base_host), list(self._offset_host)
        departed = [rid for rid in slot_of if dm is not None and not dm.has_cache(rid)]
        for rid in departed:
            free.append(slot_of.pop(rid))
        free.sort()
        new_ids = [r.py_request_id for r in reqs if not r.is_dummy and r.py_request_id not in slot_of]
        dummy_ids = [r.py_request_id for r in reqs if r.is_dummy]
        if len(dummy_ids) > self.num_dummy_slots:
            raise NoFreeSlotError(
                f"DFlash drafter: {len(dummy_ids)} warmup dummies {dummy_ids[:16]} in one step, but only "
                f"{self.num_dummy_slots} dummy slots (num_dummy_slots={self.num_dummy_slots})",
                request_ids=dummy_ids,
                needed=len(dummy_ids),
                free=self.num_dummy_slots,
            )
        if len(new_ids) > len(free):
            raise NoFreeSlotError(
                f"DFlash drafter: no free slot for requests {new_ids}: {len(new_ids)} needed, {len(free)} free "
                f"of {self.max_batch_size} slots (max_batch_size={self.max_batch_size}); requests holding "
                f"slots: {sorted(slot_of)[:16]}. Evict a request (meta.evict) or raise max_batch_size.",
                request_ids=new_ids,
                needed=len(new_ids),
                free=len(free),
            )

        arena = dm is None
        store_limit = self.max_ctx_len if arena else _NO_STORE_LIMIT
        paired = bool(dm is not None and getattr(dm, "joint_kv_cache_reuse", False))
        page_aligned = True if arena else self._seed_is_page_aligned(dm)
        seeds: dict[int, SlotStart] = {}
        def seed_generation(req: LlmRequest) -> rules.SlotStart:
            # The row's absolute position is its history: the first position the slot stores.
            return rules.generation_seed(
                max(req.max_beam_num_tokens - 1, 0),
                tokens_per_block=P,
                max_ctx=store_limit,
                page_aligned=page_aligned,
                private_arena=arena,
                seeding=self.seeding,
            )

        rows: list[Row] = []
        next_dummy_slot = self.dummy_slot
        restarted: list[int] = []  # existing slots restarted by a chunk that does not continue them
        for req, kind in zip(reqs, kinds):
            rid = req.py_request_id
            if req.is_dummy:
                # Each dummy gets a slot of its own, seeded from its own position every
                # step: dummies of different sizes must not share lengths or bases.
                slot, next_dummy_slot = next_dummy_slot, next_dummy_slot + 1
                start = seed_generation(req)
                ctx[slot], base[slot], off[slot] = start
                seeds[rid] = start
                rows.append(Row(req, slot, "dummy", True))
                continue
            fresh = rid not in slot_of
            if fresh:
                slot = free.pop(0)
                slot_of[rid] = slot
                ctx[slot] = base[slot] = off[slot] = 0  # a reused slot starts from base 0
            slot = slot_of[rid]
            if kind == "context":
                view = req.target_view
                # L + offset is the absolute position the slot continues at, clamped or not.
                cont = not fresh and ctx[slot] + off[slot] == view.position
                if not cont:
                    start = rules.context_store_start(
                        view.position,
                        tokens_per_block=P,
                        max_ctx=store_limit,
                        paired_pool=paired,
                        rebased_view=self._ctx_reads_rebased_view,
                        private_arena=arena,
                        seeding=self.seeding,
                    )
                    ctx[slot], base[slot], off[slot] = start
                    seeds[rid] = start
                    if not fresh:
                        restarted.append(rid)
                proposing = view.position + view.chunk_size >= req.prompt_len
            else:
                if fresh:
                    start = seed_generation(req)
                    ctx[slot], base[slot], off[slot] = start
                    seeds[rid] = start
                proposing = True
            rows.append(Row(req, slot, kind, proposing))

        tables = self._decode_tables(dm, ids, [r.slot for r in rows])

        # -- apply ---------------------------------------------------------------
        for rid in departed:
            self._slot_of.pop(rid)
            for fn in self._release_listeners:
                fn(rid, "departed")
        for rid in restarted:
            for fn in self._release_listeners:
                fn(rid, "restart")
        self._slot_of = slot_of
        self._free = free
        self._ctx_host, self._base_host, self._offset_host = ctx, base, off
        self.ctx_len.copy_(torch.tensor(ctx, dtype=torch.int64))
        self.base_pages.copy_(torch.tensor(base, dtype=torch.int64))
        self.rows = rows
        self.draft_manager = dm
        self.private_arena = arena
        self.tables = tables
        self.slot_ids = torch.tensor([r.slot for r in rows], dtype=torch.int64, device=self.device)
        self.seeds = seeds
        self._prep = None
        self._last_num_new = None
        return rows

    def _decode_tables(self, dm, ids: list[int], slots: list[int]) -> list[BlockTables]:
        """Unrebased page tables ``[B, M]`` and extents, one per pool (layer group)."""
        impl = None if self.fused else "reference"
        if dm is None:
            pps = self.arena_pages_per_slot
            slot_t = torch.tensor(slots, dtype=torch.int64, device=self.device)
            tables = (slot_t[:, None] * pps + torch.arange(pps, device=self.device)[None, :]).to(torch.int32)
            extents = torch.full((len(slots),), pps, dtype=torch.int64, device=self.device)
            return [BlockTables(tables, extents)]
        offsets = dm.get_block_offsets(ids, self.backend).to(self.device)
        return [
            decode_draft_block_table(offsets, g, len(ids), dm.config.kv_factor, self.backend, impl=impl)
            for g in range(dm.num_pools)
        ]

    def _check_rows_current(self) -> None:
        """Every row still holds the slot prepare() gave it (no evict/free in between)."""
        stale = [r.request_id for r in self.rows if r.kind != "dummy" and self._slot_of.get(r.request_id) != r.slot]
        if stale:
            raise RuntimeError(
                f"DFlash drafter: requests {stale} lost their slots after prepare(); evict or free between "
                "steps, then call prepare() again"
            )

    # ------------------------------------------------------------------ block room
    def _check_block_room(self, row: int, new_ctx: int) -> None:
        """The block ``[new_ctx, new_ctx + block_size)`` must lie inside the request's mirror."""
        dm = self.draft_manager
        if dm is None:
            return
        rid = self.rows[row].request_id
        cap = dm.get_cache(rid).capacity
        if new_ctx + self.block_size > cap:
            raise ValueError(
                f"DFlash drafter: request {rid}'s block [{new_ctx}, {new_ctx + self.block_size}) would be "
                f"appended past its draft mirror's capacity of {cap} tokens; build the draft manager with "
                f"max_draft_len={self.block_size - 1} and num_extra_kv_tokens>="
                f"{required_extra_kv_tokens(self.block_size)}"
            )

    # ------------------------------------------------------------------ context stores
    def plan_context_store(
        self, request: LlmRequest | int, positions: torch.Tensor | Sequence[int]
    ) -> ContextStorePlan:
        """Store targets of a context chunk, and advance the slot past it.

        ``positions`` are the chunk's absolute target positions, contiguous and
        starting where the slot continues (``L + offset``). In a private arena
        tokens at slot positions ``>= max_ctx_len`` are not stored (clamping);
        on a shared pool every token is stored at its slot position and the
        base rises so the slot reads at most ``max_ctx_len`` tokens.
        """
        rid = request if isinstance(request, int) else request.py_request_id
        row = self.row_index(rid)
        self._check_rows_current()
        if self.rows[row].kind != "context":
            raise ValueError(f"DFlash drafter: request {rid} is a {self.rows[row].kind} row, not a context row")
        slot = self.rows[row].slot
        pos = torch.as_tensor(positions, dtype=torch.int64).reshape(-1).cpu()
        n = pos.numel()
        L, offset = self._ctx_host[slot], self._offset_host[slot]
        expected = L + offset
        if n and (int(pos[0]) != expected or not torch.equal(pos, torch.arange(expected, expected + n))):
            raise ValueError(
                f"DFlash drafter: request {rid}'s context store must continue its slot at absolute position "
                f"{expected} with contiguous positions, got [{int(pos[0])}, ..., {int(pos[-1])}] ({n} tokens)"
            )
        P = self.tokens_per_block
        limit = self._store_limit()
        new_L = min(L + n, limit)
        if self.rows[row].proposing:
            self._check_block_room(row, new_L)
        slot_pos = torch.arange(L, L + n, dtype=torch.int64, device=self.device)
        keep = slot_pos < limit
        pages = []
        for bt in self.tables:
            M = bt.tables.shape[1]
            ordinal = slot_pos // P
            inside = keep & (ordinal < M)
            pg = bt.tables[row].long().gather(0, torch.where(inside, ordinal, 0)) if M else ordinal
            pages.append(torch.where(inside, pg, -1).to(torch.int32))
        offsets = torch.where(keep, slot_pos % P, -1).to(torch.int32)
        self._advance_host(slot, new_L, n)
        self.ctx_len[slot] = new_L
        base = self._clamped_base(new_L, self._base_host[slot])
        if base != self._base_host[slot]:
            self._base_host[slot] = base
            self.base_pages[slot] = base
        self._prep = None
        return ContextStorePlan(row, slot_pos, pages, offsets)

    # ------------------------------------------------------------------ generation step
    def prepare_generation(self, num_new: Sequence[int] | Mapping[int, int] | None = None) -> list[PagedLatentPrep]:
        """The generation step's addressing for every row, one :class:`PagedLatentPrep` per pool.

        ``num_new``: accepted tokens stored this step per row (row order), or a
        mapping request id -> count (absent rows 0). Context and dummy rows
        store nothing here. Advances each slot's ``ctx_len`` to ``min(L + n,
        max_ctx_len)``. The fused path is one ``prepare_paged_latent`` launch per
        pool; the eager path is the reference decode/rebase plus plain torch.
        """
        B = self.num_rows
        counts = self._counts(num_new)
        self._check_rows_current()
        P = self.tokens_per_block
        new_host: dict[int, int] = {}
        for i, (row, n) in enumerate(zip(self.rows, counts)):
            if n and row.kind != "generation":
                raise ValueError(
                    f"DFlash drafter: request {row.request_id} is a {row.kind} row; only generation rows "
                    f"commit accepted tokens (got {n})"
                )
            if not 0 <= n <= self.max_new_tokens:
                raise ValueError(
                    f"DFlash drafter: request {row.request_id} commits {n} tokens; allowed 0..{self.max_new_tokens}"
                )
            new = min(self._ctx_host[row.slot] + n, self._store_limit())
            if row.slot in new_host and new_host[row.slot] != new:
                raise ValueError(f"DFlash drafter: rows sharing slot {row.slot} disagree on its new length")
            new_host[row.slot] = new
            if row.proposing:
                self._check_block_room(i, new)
        consumed = {row.slot: n for row, n in zip(self.rows, counts)}
        for slot, new in new_host.items():
            # Raise the base before the launch, so the read is clamped with the new length.
            base = self._clamped_base(new, self._base_host[slot])
            if base != self._base_host[slot]:
                self._base_host[slot] = base
                self.base_pages[slot] = base
        n_t = torch.tensor(counts, dtype=torch.int64, device=self.device)
        preps = []
        for bt in self.tables:
            if self.fused:
                prep = prepare_paged_latent(
                    bt.tables,
                    bt.extents,
                    self.slot_ids,
                    self.ctx_len,
                    self.base_pages,
                    n_t,
                    block_size=self.block_size,
                    tokens_per_block=P,
                    max_ctx=self._store_limit(),
                    max_new=self.max_new_tokens,
                )
            else:
                prep = self._eager_prep(bt, n_t)
            preps.append(prep)
        if B:
            self.ctx_len.index_copy_(0, self.slot_ids, preps[0].new_ctx_len)
        for slot, new in new_host.items():
            self._advance_host(slot, new, consumed[slot])
        self._prep = preps
        self._last_num_new = counts
        return preps

    def _counts(self, num_new) -> list[int]:
        if num_new is None:
            return [0] * self.num_rows
        if isinstance(num_new, Mapping):
            unknown = [rid for rid in num_new if rid not in set(self.request_ids)]
            if unknown:
                raise KeyError(
                    f"DFlash drafter: requests {unknown} are not rows of this step (rows: {self.request_ids[:16]})"
                )
            return [int(num_new.get(rid, 0)) for rid in self.request_ids]
        counts = [int(n) for n in num_new]
        if len(counts) != self.num_rows:
            raise ValueError(f"DFlash drafter: {len(counts)} counts for {self.num_rows} rows")
        return counts

    def _eager_prep(self, bt: BlockTables, n_t: torch.Tensor, max_ctx: int | None = None) -> PagedLatentPrep:
        """The same preparation as the fused kernel, composed from the reference decode/rebase.

        ``max_ctx``: the store limit (default: this step's, see :meth:`_store_limit`).
        """
        P, bs, max_new = self.tokens_per_block, self.block_size, self.max_new_tokens
        max_ctx = self._store_limit() if max_ctx is None else max_ctx
        tables, extents = bt.tables, bt.extents
        B, M = tables.shape
        dev = tables.device
        base = self.base_pages.index_select(0, self.slot_ids)
        L = self.ctx_len.index_select(0, self.slot_ids)
        rb = rebase_block_table(tables, extents, base, impl="reference")
        new_ctx = torch.clamp(L + n_t, max=max_ctx)
        read_lens = torch.minimum((new_ctx - base * P).clamp_min(0), rb.extents * P)
        query_pos = new_ctx[:, None] + torch.arange(bs, dtype=torch.int64, device=dev)[None, :]
        i = torch.arange(max_new, dtype=torch.int64, device=dev)[None, :]
        pos = L[:, None] + i
        valid = (i < n_t[:, None]) & (pos < max_ctx) & (pos >= 0)
        ordinal = torch.where(valid, pos, 0) // P
        in_table = valid & (ordinal < M)
        pages = tables.long().gather(1, torch.where(in_table, ordinal, 0)) if M else ordinal
        return PagedLatentPrep(
            read_rows=rb.rows,
            read_lens=read_lens,
            query_pos=query_pos,
            store_pages=torch.where(in_table, pages, -1).to(torch.int32),
            store_offsets=torch.where(valid, pos % P, -1).to(torch.int32),
            new_ctx_len=new_ctx,
            shift=rb.shift,
        )

    def generation_prep(self) -> list[PagedLatentPrep]:
        """This step's preparation; computed with no new tokens if nothing was committed yet."""
        if self._prep is None:
            self.prepare_generation(None)
        assert self._prep is not None
        return self._prep

    @property
    def last_num_new(self) -> list[int] | None:
        return self._last_num_new


__all__ = [
    "ContextStorePlan",
    "DFlashSpecMetadata",
    "NoFreeSlotError",
    "Row",
    "SlotSnapshot",
    "required_extra_kv_tokens",
]
