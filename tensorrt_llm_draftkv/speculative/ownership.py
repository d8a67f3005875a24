"""OwnershipChecker: did the drafter touch only its own pages, and read back what it stored?

Invariant 1 (DESIGN.md §3): every block-table entry a drafter reads or writes
is a page its own request holds. An access is *owned* when the entry the
drafter used resolves to the very page the request's mirror holds at that
ordinal (``draft_manager.get_cache(rid).block_row(group)[ordinal]``); anything
else — another request's page, page 0 or the guard page behind an unbacked
entry in the ``"cpp"`` export, a ``-1`` entry in the ``"python"`` export — is a
*foreign page access*. Accesses through an ordinal the request's row does not
back are also counted as ``unbacked_accesses`` (the "read released entries"
case).

Invariant 2: a slot reads exactly what it stored. The checker keeps a dense
per-request shadow copy of every K/V the drafter stored, by slot position and
layer, stamped with the slot's *epoch* (bumped whenever the request loses its
slot or restarts it), and compares every value read, within the attended span,
with the shadow: a read of a position never stored in the current epoch, or of
a value that differs, is a ``stale_read``. K/V that a paired pool provides
through block reuse can be declared with :meth:`mark_reused`.

Counters are per (token position, layer). ``raise_on_violation=True`` raises
:class:`OwnershipViolation` at the first violation (a debug mode of the
drafter); otherwise the executor reads ``foreign_page_accesses`` /
``stale_reads`` (and :meth:`assert_clean` in tests).
"""
from __future__ import annotations

import torch

_NEVER = -1
_REUSED = -2


class OwnershipViolation(AssertionError):
    """The drafter touched a page its request does not hold, or read what it did not store."""


class _Shadow:
    """Dense per-(request, layer) copy of stored K/V by slot position, with epochs."""

    def __init__(self, like: torch.Tensor) -> None:
        self.values = torch.zeros((0, *like.shape[1:]), dtype=like.dtype, device=like.device)
        self.epoch = torch.full((0,), _NEVER, dtype=torch.int64, device=like.device)

    def ensure(self, size: int) -> None:
        if size <= self.values.shape[0]:
            return
        new = max(size, 2 * self.values.shape[0], 64)
        values = torch.zeros((new, *self.values.shape[1:]), dtype=self.values.dtype, device=self.values.device)
        values[: self.values.shape[0]] = self.values
        epoch = torch.full((new,), _NEVER, dtype=torch.int64, device=self.epoch.device)
        epoch[: self.epoch.shape[0]] = self.epoch
        self.values, self.epoch = values, epoch


class OwnershipChecker:
    """Counts foreign page accesses and stale reads of a drafter against its draft manager."""

    def __init__(
        self,
        draft_manager=None,
        *,
        raise_on_violation: bool = False,
        check_values: bool = True,
        max_messages: int = 64,
    ) -> None:
        self.draft_manager = draft_manager
        self.raise_on_violation = raise_on_violation
        self.check_values = check_values
        self.max_messages = max_messages
        self.reset_counters()
        self._shadow: dict[tuple[int, int], _Shadow] = {}  # (request, pool) -> [pos, layers, 2, H, D]
        self._epoch: dict[int, int] = {}
        self._row_cache: dict[tuple, torch.Tensor] = {}

    def reset_counters(self) -> None:
        self.reads = 0
        self.writes = 0
        self.foreign_page_accesses = 0
        self.foreign_page_reads = 0
        self.foreign_page_writes = 0
        self.unbacked_accesses = 0
        self.stale_reads = 0
        self.messages: list[str] = []

    @property
    def violations(self) -> int:
        return self.foreign_page_accesses + self.stale_reads

    def attach(self, metadata) -> "OwnershipChecker":
        """Follow a :class:`DFlashSpecMetadata`: slot losses and restarts open a new epoch."""
        metadata.add_release_listener(self.on_release)
        return self

    def on_release(self, request_id: int, reason: str) -> None:
        self._epoch[request_id] = self._epoch.get(request_id, 0) + 1
        self._row_cache.clear()
        if reason in ("free", "departed"):
            for key in [k for k in self._shadow if k[0] == request_id]:
                del self._shadow[key]

    def forget(self, request_id: int) -> None:
        """Drop everything known about a request (a finished dummy, say)."""
        self.on_release(request_id, "free")

    # ------------------------------------------------------------------ internals
    def _owned_row(self, request_id: int, group: int, device) -> torch.Tensor:
        """The request's mirror row right now (cached while the cache is not resized)."""
        dm = self.draft_manager
        if dm is None or not dm.has_cache(request_id):
            return torch.zeros(0, dtype=torch.int64, device=device)
        cache = dm.get_cache(request_id)
        key = (request_id, group, id(cache), cache.capacity, cache.history_length, str(device))
        row = self._row_cache.get(key)
        if row is None:
            if len(self._row_cache) > 256:
                self._row_cache.clear()
            row = torch.tensor(cache.block_row(group), dtype=torch.int64).to(device)
            self._row_cache[key] = row
        return row

    def _note(self, text: str) -> None:
        if len(self.messages) < self.max_messages:
            self.messages.append(text)
        if self.raise_on_violation:
            raise OwnershipViolation(text)

    def _shadow_for(self, request_id: int, group: int, like: torch.Tensor) -> _Shadow:
        key = (request_id, group)
        sh = self._shadow.get(key)
        if sh is None:
            sh = self._shadow[key] = _Shadow(like)
        return sh

    def _check_owner(
        self,
        what: str,
        request_id: int,
        group: int,
        layers: list[int],
        ordinals: torch.Tensor,
        pages: torch.Tensor,
        owned_row: torch.Tensor | None,
    ) -> int:
        ordinals = ordinals.to(torch.int64)
        pages = pages.to(torch.int64)
        row = (
            owned_row.to(device=pages.device, dtype=torch.int64)
            if owned_row is not None
            else self._owned_row(request_id, group, pages.device)
        )
        if row.numel():
            inside = (ordinals >= 0) & (ordinals < row.numel())
            expected = torch.where(inside, row[torch.where(inside, ordinals, 0)], -1)
        else:
            expected = torch.full_like(ordinals, -1)
        unbacked = expected < 0
        bad = unbacked | (pages != expected)
        n_bad = int(bad.sum())
        if n_bad:
            n_unbacked = int(unbacked.sum())
            per_layer = len(layers)
            self.foreign_page_accesses += n_bad * per_layer
            if what == "read":
                self.foreign_page_reads += n_bad * per_layer
            else:
                self.foreign_page_writes += n_bad * per_layer
            self.unbacked_accesses += n_unbacked * per_layer
            i = int(bad.nonzero()[0])
            self._note(
                f"request {request_id} layers {layers} (group {group}): {what} of {n_bad} token(s) through "
                f"entries it does not own, e.g. ordinal {int(ordinals[i])} -> page {int(pages[i])} "
                f"(its row has {int(expected[i])} there; {n_unbacked} unbacked)"
            )
        return n_bad

    # ------------------------------------------------------------------ hooks
    def record_write(
        self,
        request_id: int,
        group: int,
        layers: list[int],
        positions: torch.Tensor,
        ordinals: torch.Tensor,
        pages: torch.Tensor,
        kv: torch.Tensor,
        *,
        owned_row: torch.Tensor | None = None,
    ) -> None:
        """The drafter stored ``kv[i]`` (``[n, len(layers), 2, H, D]``) for slot position
        ``positions[i]`` in every layer of pool ``group``, through the entry at
        ``ordinals[i]`` that resolved to ``pages[i]``."""
        if positions.numel() == 0:
            return
        self.writes += positions.numel() * len(layers)
        self._check_owner("write", request_id, group, layers, ordinals, pages, owned_row)
        if not self.check_values:
            return
        self._store_shadow(request_id, group, positions, kv, self._epoch.get(request_id, 0))

    def mark_reused(
        self, request_id: int, group: int, layers: list[int], positions: torch.Tensor, kv: torch.Tensor
    ) -> None:
        """K/V a paired pool holds through block reuse: valid in every epoch."""
        if positions.numel() == 0:
            return
        self._store_shadow(request_id, group, positions, kv, _REUSED)

    def _store_shadow(self, request_id: int, group: int, positions: torch.Tensor, kv: torch.Tensor, epoch: int) -> None:
        sh = self._shadow_for(request_id, group, kv)
        pos = positions.to(device=sh.values.device, dtype=torch.int64)
        sh.ensure(int(pos.max()) + 1)
        sh.values[pos] = kv.to(sh.values.device)
        sh.epoch[pos] = epoch

    def record_read(
        self,
        request_id: int,
        group: int,
        layers: list[int],
        positions: torch.Tensor,
        ordinals: torch.Tensor,
        pages: torch.Tensor,
        kv: torch.Tensor,
        *,
        owned_row: torch.Tensor | None = None,
    ) -> None:
        """The drafter read ``kv[i]`` for slot position ``positions[i]`` (within its attended span)."""
        if positions.numel() == 0:
            return
        self.reads += positions.numel() * len(layers)
        self._check_owner("read", request_id, group, layers, ordinals, pages, owned_row)
        if not self.check_values:
            return
        sh = self._shadow_for(request_id, group, kv)
        pos = positions.to(device=sh.values.device, dtype=torch.int64)
        sh.ensure(int(pos.max()) + 1)
        epoch = self._epoch.get(request_id, 0)
        ep = sh.epoch[pos]
        stored = (ep == epoch) | (ep == _REUSED)
        same = (sh.values[pos] == kv.to(sh.values.device)).flatten(2).all(dim=2)  # [n, Lg]
        bad = ~stored[:, None] | ~same
        n_bad = int(bad.sum())
        if n_bad:
            self.stale_reads += n_bad
            i = int(bad.any(dim=1).nonzero()[0])
            never = int((~stored).sum())
            self._note(
                f"request {request_id} layers {layers}: read {n_bad} (token, layer) value(s) that differ from "
                f"what its slot stored, e.g. slot position {int(pos[i])} ({never} token(s) never stored in "
                f"this slot epoch)"
            )

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict:
        return {
            "reads": self.reads,
            "writes": self.writes,
            "foreign_page_accesses": self.foreign_page_accesses,
            "foreign_page_reads": self.foreign_page_reads,
            "foreign_page_writes": self.foreign_page_writes,
            "unbacked_accesses": self.unbacked_accesses,
            "stale_reads": self.stale_reads,
        }

    def assert_clean(self) -> None:
        if self.violations:
            raise OwnershipViolation(
                f"ownership violations: {self.summary()}\n" + "\n".join(self.messages[:10])
            )


__all__ = ["OwnershipChecker", "OwnershipViolation"]
