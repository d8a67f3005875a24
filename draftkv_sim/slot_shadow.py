"""The value shadow behind the ownership checker's stale-read check (its invariant 2).

A dense per-(request, pool) copy of every K/V a drafter's slot stored, by slot
position (the slot's own coordinates, not absolute token positions), with the
slot *epoch* it was stored in; a read is checked against it. K/V a paired pool
provides through block reuse is stored under `REUSED_EPOCH`, valid in every epoch.
"""
from __future__ import annotations

import torch

NEVER_STORED = -1  # the epoch of a ring slot that holds nothing (or another position)
REUSED_EPOCH = -2  # K/V declared reused (`OwnershipChecker.mark_reused`): valid in every epoch


class ShadowRing:
    """What one request's slot stored in one pool, by slot position, with epochs, in a ring.

    Position `p` lives in ring slot `p % capacity`, which also records `p`
    itself, so a later store that reuses the slot makes `p` read as never
    stored. `keep` is how far below the newest stored position a read can still
    reach (about the pool's window; None for a full-attention pool, which reads
    everything). The ring holds `keep` plus the largest store, whatever the
    prompt length, and is reallocated only when a store needs more room, so a
    long prefill does not churn the allocator chunk after chunk.
    """

    def __init__(self, like: torch.Tensor, keep: int | None) -> None:
        """`like`: a stored K/V batch, `[n, layers, 2, H, D]` (its trailing shape, dtype and device)."""
        self.keep = keep
        self.hi = 0  # one past the newest position ever stored
        self.values = torch.zeros((0, *like.shape[1:]), dtype=like.dtype, device=like.device)
        self.epoch = torch.full((0,), NEVER_STORED, dtype=torch.int64, device=like.device)
        self.position = torch.full((0,), -1, dtype=torch.int64, device=like.device)  # what each slot holds

    @property
    def capacity(self) -> int:
        return self.values.shape[0]

    def _needed(self, first: int, end: int) -> int:
        hi = max(self.hi, end)
        if self.keep is None:
            return hi  # every position stays readable
        # the store itself, what a read may still reach below its top, and re-stores under the top
        return max(end - first + self.keep, hi - first)

    def cover(self, first: int, end: int) -> None:
        """Make room for a store of positions `[first, end)`: grow the ring if it is too small."""
        need = self._needed(first, end)
        if need <= self.capacity:
            return
        size = max(need, 64) if self.keep is not None else max(need, 2 * self.capacity, 64)
        values = torch.zeros((size, *self.values.shape[1:]), dtype=self.values.dtype, device=self.values.device)
        epoch = torch.full((size,), NEVER_STORED, dtype=torch.int64, device=self.epoch.device)
        position = torch.full((size,), -1, dtype=torch.int64, device=self.epoch.device)
        held = (self.position >= 0).nonzero().flatten()
        if held.numel():
            pos = self.position[held]
            slot = pos % size  # the held positions span less than the old capacity: no collisions
            values[slot], epoch[slot], position[slot] = self.values[held], self.epoch[held], pos
        self.values, self.epoch, self.position = values, epoch, position

    def store(self, pos: torch.Tensor, kv: torch.Tensor, epoch: int) -> None:
        """`kv[i]` stored at slot position `pos[i]` in slot epoch `epoch`."""
        first, end = int(pos.min()), int(pos.max()) + 1
        self.cover(first, end)
        slot = pos % self.capacity
        self.values[slot] = kv
        self.epoch[slot] = epoch
        self.position[slot] = pos
        self.hi = max(self.hi, end)

    def lookup(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(epochs, values) at `pos`; a position whose slot holds another one reads as never stored."""
        if self.capacity == 0:
            empty = torch.zeros((pos.numel(), *self.values.shape[1:]), dtype=self.values.dtype, device=self.values.device)
            return torch.full_like(pos, NEVER_STORED), empty
        slot = pos % self.capacity
        here = self.position[slot] == pos
        return torch.where(here, self.epoch[slot], NEVER_STORED), self.values[slot]


    def stale(self, pos: torch.Tensor, kv: torch.Tensor, epoch: int) -> tuple[torch.Tensor, int]:
        """Which (token, layer) values read at slot positions `pos` (`kv`: `[n, layers, 2, H, D]`) are not what
        epoch `epoch` (or a reuse declaration) stored there: a `[n, layers]` mask, and how many positions
        were never stored in that epoch."""
        ep, held = self.lookup(pos)
        stored = (ep == epoch) | (ep == REUSED_EPOCH)
        same = (held == kv.to(self.values.device)).flatten(2).all(dim=2)  # [n, Lg]
        return ~stored[:, None] | ~same, int((~stored).sum())
