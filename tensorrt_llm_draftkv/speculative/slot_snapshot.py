"""The value types of a :class:`~.slot_table.SlotTable`: a step's working copies and a snapshot.

:class:`SlotPlan` holds the working copies one ``prepare_step()`` edits (the slot
map, the free list, and each slot's ``ctx_len L`` in tokens, ``base_pages b``
in pages and host-only ``offset``, the absolute token position of slot
position 0); the table applies it all at once, so a step that fails changes
nothing. :class:`SlotSnapshot` is what :meth:`.SlotTable.snapshot` takes and
:meth:`.SlotTable.rollback` restores: the lengths and bases of every slot on
the device and their host mirrors. Slot positions are absolute token
positions minus the offset. Split from :mod:`.slot_table`, which still
exports both; neither touches the table itself.
"""
from __future__ import annotations

import dataclasses

from .slot_start import SlotStart


@dataclasses.dataclass(frozen=True)
class SlotSnapshot:
    """Context lengths and bases of every slot (host mirrors of the device state), for
    :meth:`SlotTable.rollback`."""

    ctx_len_host: tuple[int, ...]
    base_pages_host: tuple[int, ...]
    offsets_host: tuple[int, ...]


@dataclasses.dataclass
class SlotPlan:
    """Working copies of the slot map and host state for one ``prepare_step()``; applied all at once."""

    slot_of: dict[int, int]
    free: list[int]
    ctx: list[int]
    base: list[int]
    off: list[int]
    next_dummy: int
    departed: list[int] = dataclasses.field(default_factory=list)
    restarted: list[int] = dataclasses.field(default_factory=list)
    #: requests whose received context (``SlotTable.seed_context``) seeded their fresh slot in this plan
    context_seeded: list[int] = dataclasses.field(default_factory=list)
    #: pending context seeds dropped in this plan (their mirror is gone)
    dropped_seeds: list[int] = dataclasses.field(default_factory=list)

    def take_dummy_slot(self) -> int:
        """The next dummy slot: every dummy row of a step gets one of its own."""
        slot, self.next_dummy = self.next_dummy, self.next_dummy + 1
        return slot

    def slot_for(self, request_id: int) -> tuple[int, bool]:
        """``(slot, fresh)``: the request's slot, taking the lowest free one if it holds none."""
        if request_id in self.slot_of:
            return self.slot_of[request_id], False
        slot = self.free.pop(0)
        self.slot_of[request_id] = slot
        self.ctx[slot] = self.base[slot] = self.off[slot] = 0  # a reused slot starts from base 0
        return slot, True

    def continues_at(self, slot: int) -> int:
        """Absolute position the slot continues at (``L + offset``), clamped or not."""
        return self.ctx[slot] + self.off[slot]

    def place(self, slot: int, start: SlotStart) -> None:
        self.ctx[slot], self.base[slot], self.off[slot] = start


__all__ = [
    "SlotPlan",
    "SlotSnapshot",
]
