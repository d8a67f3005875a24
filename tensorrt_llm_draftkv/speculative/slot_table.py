"""SlotTable: which request holds which DFlash drafter slot, and each slot's ``(L, b, offset)``.

A slot's state is its context length ``L`` (``ctx_len``, tokens) and its base
``b`` (``base_pages``, pages), both in slot positions: absolute token
positions minus the slot's host-only ``offset`` (0 in the base design, the lag
``< P`` after a page-aligned generation seed, the chunk start under slot-local
numbering, growing as a private arena drops clamped tokens). ``L`` and ``b``
live on the device (what the kernels read), with host mirrors kept in step
from host-known quantities: nothing here synchronises with the device.

This module alone allocates slots (``max_batch_size`` regular ones, then the
dummy slots for warmup dummies), snapshots and rolls back their state, evicts
and frees them (telling every release listener), clamps what a slot stores
and reads against ``max_ctx_len``, and keeps a received drafter context
(disaggregated handoff, absolute ``[lo, end)``) until the request's first slot
is seeded from it. Its value types, a step's :class:`SlotPlan` and the
:class:`SlotSnapshot`, live in :mod:`.slot_snapshot`.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..staging import PinnedStager, to_device
from .slot_snapshot import SlotPlan, SlotSnapshot
from .slot_start import SlotStart, context_seed

#: Stores on a shared pool are never clamped (int32-safe stand-in for "no limit").
NO_STORE_LIMIT = (1 << 31) - 1

#: ``fn(request_id, reason)``; reason is "evict", "free", "departed" or "restart".
ReleaseListener = Callable[[int, str], None]


class NoFreeSlotError(RuntimeError):
    """More requests need a drafter slot than there are free slots."""

    def __init__(self, message: str, *, request_ids: list[int], needed: int, free: int) -> None:
        super().__init__(message)
        self.request_ids = request_ids
        self.needed = needed
        self.free = free


class SlotTable:
    """Slot allocation and the per-slot ``(ctx_len, base_pages, offset)`` state (see the module docstring)."""

    def __init__(
        self,
        max_batch_size: int,
        num_dummy_slots: int,
        *,
        tokens_per_block: int,
        max_ctx_len: int,
        device: torch.device,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.num_dummy_slots = num_dummy_slots
        self.num_slots = max_batch_size + num_dummy_slots
        #: First of the slots reserved for warmup dummies; each dummy row of a step takes its own.
        self.dummy_slot = max_batch_size
        self.tokens_per_block = tokens_per_block
        self.max_ctx_len = max_ctx_len
        self.device = device
        #: True while the drafter owns per-slot storage (no draft pool): stores clamp at max_ctx_len.
        self.private_arena = False
        self.ctx_len = torch.zeros(self.num_slots, dtype=torch.int64, device=device)
        self.base_pages = torch.zeros(self.num_slots, dtype=torch.int64, device=device)
        self._stager = PinnedStager(device)  # the raised bases' copies
        self._ctx_host = [0] * self.num_slots
        self._base_host = [0] * self.num_slots
        self._offset_host = [0] * self.num_slots
        self._free: list[int] = list(range(max_batch_size))
        self._slot_of: dict[int, int] = {}
        self._listeners: list[ReleaseListener] = []
        # request id -> (lo, end): a received drafter context waiting for the request's first slot
        self._context_seeds: dict[int, tuple[int, int]] = {}
        #: requests the last applied plan seeded from a received context
        self.last_context_seeded: tuple[int, ...] = ()
        #: bumped whenever a request gains or loses a slot or a context seed: a step planned at the same
        #: version over the same requests would plan the same slots
        self.version = 0

    # ------------------------------------------------------------------ queries
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
    def offsets_host(self) -> list[int]:
        return list(self._offset_host)

    def live_requests(self) -> dict[int, int]:
        """Request id -> slot, for every request holding a slot."""
        return dict(self._slot_of)

    def has_slot(self, request_id: int) -> bool:
        return request_id in self._slot_of

    def holds(self, request_id: int, slot: int) -> bool:
        return self._slot_of.get(request_id) == slot

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

    def host_len(self, slot: int) -> tuple[int, int]:
        """``(ctx_len, offset)`` of a slot (host mirror)."""
        return self._ctx_host[slot], self._offset_host[slot]

    def check_host_mirror(self) -> None:
        """The device tensors equal their host mirrors (one host sync; tests and debugging)."""
        dev_ctx = self.ctx_len.tolist()
        dev_base = self.base_pages.tolist()
        if dev_ctx != self._ctx_host or dev_base != self._base_host:
            raise AssertionError(
                f"slot state out of sync: ctx_len device={dev_ctx} host={self._ctx_host}, "
                f"base_pages device={dev_base} host={self._base_host}"
            )

    # ------------------------------------------------------------------ release
    def add_release_listener(self, fn: ReleaseListener) -> None:
        """``fn(request_id, reason)`` is called whenever a request loses its slot."""
        self._listeners.append(fn)

    def _notify(self, request_id: int, reason: str) -> None:
        for fn in self._listeners:
            fn(request_id, reason)

    def _release(self, request_id: int, reason: str) -> None:
        # A received context seeds only the request's first slot: after a loss it is gone.
        self._context_seeds.pop(request_id, None)
        slot = self._slot_of.pop(request_id)
        self.version += 1
        self._ctx_host[slot] = self._base_host[slot] = self._offset_host[slot] = 0
        self.ctx_len[slot] = 0
        self.base_pages[slot] = 0
        self._free.append(slot)
        self._free.sort()
        self._notify(request_id, reason)

    def assign(self, request_id: int, *, reset: bool = False) -> int | None:
        """The request's slot, taking the lowest free one (fresh: ``L = b = 0``) if it holds none.

        None when no slot is free. ``reset``: a request id reused by a new request
        gives its slot back first (reason "restart"), so it starts over.
        """
        if reset and request_id in self._slot_of:
            self._release(request_id, "restart")
        if request_id not in self._slot_of:
            if not self._free:
                return None
            self._slot_of[request_id] = self._free.pop(0)
            self.version += 1
        return self._slot_of[request_id]

    def evict(self, request_id: int) -> None:
        """Take the request's slot away (it stays alive; its next row is seeded afresh)."""
        self.slot_of(request_id)  # explicit KeyError
        self._release(request_id, "evict")

    def free(self, request_id: int, *, missing_ok: bool = False) -> bool:
        """Release the slot of a finished request; False if it held none (and ``missing_ok``)."""
        if request_id not in self._slot_of:
            if missing_ok:
                self._context_seeds.pop(request_id, None)  # finished before its seeded slot was made
                self.version += 1
                return False
            self.slot_of(request_id)
        self._release(request_id, "free")
        return True

    # ------------------------------------------------------------------ received contexts
    def seed_context(self, request_id: int, lo: int, end: int) -> SlotStart:
        """Seed the request's next fresh slot with a received context ``[lo, end)`` (absolute tokens).

        The slot the request gets at its next generation row starts at
        :func:`.slot_start.context_seed`: ``L = end``, ``b = lo // P`` (raised by
        :meth:`clamped_base` if the context is longer than ``max_ctx_len``).
        Only that first slot: a later loss (evict) reseeds an empty slot as
        usual. The caller checks the mirror backs ``[lo, end)`` (see
        ``DFlashDraftSlots.seed_context``). Raises ``ValueError`` naming the
        request and the numbers, changing nothing, when ``lo`` is not in
        ``[0, end]``, the request already holds a slot, or this is a private arena.
        Returns the start the slot will get.
        """
        if self.private_arena:
            raise ValueError(f"request {request_id}: a private per-slot arena cannot take a received context")
        if request_id in self._slot_of:
            raise ValueError(
                f"request {request_id}: cannot seed a received context [{lo}, {end}): it already holds slot "
                f"{self._slot_of[request_id]} (L={self._ctx_host[self._slot_of[request_id]]}); a received context "
                "seeds only a fresh slot"
            )
        try:
            start = context_seed(lo, end, tokens_per_block=self.tokens_per_block)
        except ValueError as err:
            raise ValueError(f"request {request_id}: {err}") from None
        self._context_seeds[request_id] = (lo, end)
        self.version += 1
        return start._replace(base_pages=self.clamped_base(start.ctx_len, start.base_pages))

    def pending_context_seed(self, request_id: int) -> tuple[int, int] | None:
        """The received context ``(lo, end)`` waiting for the request's first slot, or None."""
        return self._context_seeds.get(request_id)

    def take_context_seed(self, plan: SlotPlan, request_id: int, position: int) -> SlotStart | None:
        """The start of a fresh generation slot from the request's received context, or None.

        ``position``: the row's absolute position (its history); it must be the
        context's end, else ``ValueError`` (nothing changes: the plan is dropped).
        """
        pending = self._context_seeds.get(request_id)
        if pending is None:
            return None
        lo, end = pending
        if position != end:
            raise ValueError(
                f"request {request_id}: its received drafter context ends at {end}, but its first generation row "
                f"sits at position {position}"
            )
        plan.context_seeded.append(request_id)
        start = context_seed(lo, end, tokens_per_block=self.tokens_per_block)
        return start._replace(base_pages=self.clamped_base(start.ctx_len, start.base_pages))

    # ------------------------------------------------------------------ snapshot / rollback
    def snapshot(self) -> SlotSnapshot:
        """Lengths AND bases (and host offsets) of every slot: the host mirrors only (the device tensors
        equal them between steps), so a snapshot per step costs no device work."""
        return SlotSnapshot(tuple(self._ctx_host), tuple(self._base_host), tuple(self._offset_host))

    def rollback(self, snap: SlotSnapshot) -> None:
        """Restore the lengths and bases of :meth:`snapshot` (the slot map is unchanged), device included."""
        if not isinstance(snap, SlotSnapshot) or len(snap.ctx_len_host) != self.num_slots:
            raise ValueError("rollback needs a snapshot taken from this metadata")
        self.ctx_len.copy_(torch.tensor(snap.ctx_len_host, dtype=torch.int64))
        self.base_pages.copy_(torch.tensor(snap.base_pages_host, dtype=torch.int64))
        self._ctx_host = list(snap.ctx_len_host)
        self._base_host = list(snap.base_pages_host)
        self._offset_host = list(snap.offsets_host)

    # ------------------------------------------------------------------ planning a step
    def plan(self, ids: Sequence[int], dummy_ids: Sequence[int], has_mirror: Callable[[int], bool] | None) -> SlotPlan:
        """Working copies for one step: slots whose mirror is gone freed, room checked.

        ``ids``: every row's request id (dummies included); ``has_mirror=None``
        (a private arena) keeps every slot. Raises :class:`NoFreeSlotError`
        when the dummies or the new requests do not fit; nothing changes.
        """
        plan = SlotPlan(
            dict(self._slot_of), list(self._free), list(self._ctx_host), list(self._base_host),
            list(self._offset_host), self.dummy_slot,
        )
        plan.departed = [rid for rid in plan.slot_of if has_mirror is not None and not has_mirror(rid)]
        plan.dropped_seeds = [rid for rid in self._context_seeds if has_mirror is not None and not has_mirror(rid)]
        for rid in plan.departed:
            plan.free.append(plan.slot_of.pop(rid))
        plan.free.sort()
        dummies = set(dummy_ids)
        new_ids = [rid for rid in ids if rid not in dummies and rid not in plan.slot_of]
        self._check_room(plan, new_ids, list(dummy_ids))
        return plan

    def _check_room(self, plan: SlotPlan, new_ids: list[int], dummy_ids: list[int]) -> None:
        if len(dummy_ids) > self.num_dummy_slots:
            raise NoFreeSlotError(
                f"DFlash drafter: {len(dummy_ids)} warmup dummies {dummy_ids[:16]} in one step, but only "
                f"{self.num_dummy_slots} dummy slots (num_dummy_slots={self.num_dummy_slots})",
                request_ids=dummy_ids,
                needed=len(dummy_ids),
                free=self.num_dummy_slots,
            )
        if len(new_ids) > len(plan.free):
            raise NoFreeSlotError(
                f"DFlash drafter: no free slot for requests {new_ids}: {len(new_ids)} needed, {len(plan.free)} free "
                f"of {self.max_batch_size} slots (max_batch_size={self.max_batch_size}); requests holding "
                f"slots: {sorted(plan.slot_of)[:16]}. Evict a request (meta.evict) or raise max_batch_size.",
                request_ids=new_ids,
                needed=len(new_ids),
                free=len(plan.free),
            )

    def apply(self, plan: SlotPlan) -> None:
        """Make a :meth:`plan` current; listeners hear departed slots, then restarted ones."""
        for rid in plan.departed:
            self._slot_of.pop(rid)
            self._notify(rid, "departed")
        for rid in plan.restarted:
            self._notify(rid, "restart")
        for rid in plan.context_seeded + plan.departed + plan.dropped_seeds:
            self._context_seeds.pop(rid, None)
        self.last_context_seeded = tuple(plan.context_seeded)
        self._slot_of = plan.slot_of
        self._free = plan.free
        # the device holds the host mirrors: copy only what the plan changed (seeds, departures)
        if plan.ctx != self._ctx_host:
            self.ctx_len.copy_(torch.tensor(plan.ctx, dtype=torch.int64))
        if plan.base != self._base_host:
            self.base_pages.copy_(torch.tensor(plan.base, dtype=torch.int64))
        self._ctx_host, self._base_host, self._offset_host = plan.ctx, plan.base, plan.off
        self.version += 1

    # ------------------------------------------------------------------ clamping
    def store_limit(self) -> int:
        """Slot positions at or past this are not stored.

        A private arena holds ``max_ctx_len`` tokens per slot, so stores clamp
        there. On a shared pool slot positions are absolute and the mirror is
        sized in absolute positions, so nothing is clamped: ``max_ctx_len``
        bounds what a slot *reads* instead (see :meth:`clamped_base`).
        """
        return self.max_ctx_len if self.private_arena else NO_STORE_LIMIT

    def clamped_base(self, ctx_len: int, base: int) -> int:
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

    def raise_base(self, slot: int, ctx_len: int) -> None:
        """Raise the slot's base (host and device) to :meth:`clamped_base` for length ``ctx_len``."""
        base = self.clamped_base(ctx_len, self._base_host[slot])
        if base != self._base_host[slot]:
            self._base_host[slot] = base
            self.base_pages[slot] = base

    def raise_bases(self, lengths: dict[int, int]) -> None:
        """`raise_base` for every slot -> length of `lengths`, the device bases written with one copy."""
        if self.private_arena:  # an arena's base never rises (`clamped_base`)
            return
        raised_slots, raised = [], []
        limit, P, bases = self.max_ctx_len, self.tokens_per_block, self._base_host
        for slot, ctx_len in lengths.items():
            over = ctx_len - limit
            if over > 0:  # `clamped_base` inlined: this runs for every row of every step
                base = min(-(-over // P), ctx_len // P)
                if base > bases[slot]:
                    bases[slot] = base
                    raised_slots.append(slot)
                    raised.append(base)
        if raised:
            values = to_device(raised_slots + raised, self.base_pages.device, self._stager).view(2, -1)
            self.base_pages.index_copy_(0, values[0], values[1].to(self.base_pages.dtype))

    def advance_host(self, slot: int, new_len: int, consumed: int) -> None:
        """The slot took ``consumed`` tokens and now holds ``new_len`` (host mirror only).

        ``L + offset`` stays the absolute position the slot continues at: in a
        private arena a clamped slot drops tokens, and its offset takes them.
        """
        self._offset_host[slot] += consumed - (new_len - self._ctx_host[slot])
        self._ctx_host[slot] = new_len

    def advance_hosts(self, lengths: dict[int, int], consumed: dict[int, int]) -> None:
        """`advance_host` for every slot -> new length of `lengths`, taking `consumed[slot]` tokens."""
        ctx, offset = self._ctx_host, self._offset_host
        for slot, new_len in lengths.items():
            offset[slot] += consumed[slot] - (new_len - ctx[slot])
            ctx[slot] = new_len

    def commit_store(self, slot: int, new_len: int, consumed: int) -> None:
        """A context store took ``consumed`` tokens: length (host, device) and clamped base."""
        self.advance_host(slot, new_len, consumed)
        self.ctx_len[slot] = new_len
        self.raise_base(slot, new_len)


__all__ = [
    "NO_STORE_LIMIT",
    "NoFreeSlotError",
    "ReleaseListener",
    "SlotTable",
]
