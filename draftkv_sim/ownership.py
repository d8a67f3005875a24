"""OwnershipChecker: did the drafter touch only its own pages, and read back what it stored?

Invariant 1: every block-table entry a drafter reads or writes is a page its
own request holds. The checker does not take the request's row as the truth:
the row is what the block-offset export is built from, so an allocator bug
that put one page into two rows would look owned from either row. Instead it
keeps its own *holders map*, ``holders_of[(group, page)] -> frozenset of
request ids`` (live pages only; page_holders.py keeps it), fed by the events
of every pool of the draft manager (the pools name the owner the cache
passed, the request id):

- ``allocate`` adds the owner as the page's only holder (fresh, or a
  cached-free page revived); ``share`` adds it to the holders already there;
- ``release`` removes the owner, which was the last holder; ``unshare``
  removes it while others stay;
- ``publish`` / ``evict`` change no holder: the checker keeps the set of
  published pages (the prefix table) beside the map, for the write rule.

Without block reuse only ``allocate`` and ``release`` happen, every page has
at most one holder, and everything below is exactly the single-owner check.

An access is *owned* when the page the drafter used is the page the request's
row holds at that ordinal
(``draft_manager.get_cache(rid).block_row(group)[ordinal]``) **and** the map
has the request among the page's holders; anything else — another request's
page, page 0 or the guard page behind an unbacked entry in the ``"cpp"``
export, a ``-1`` entry in the ``"python"`` export, a row entry the map gives
only to others — is a *foreign page access*. Accesses through an ordinal the
request's row does not back are also counted as ``unbacked_accesses`` (the
"read released entries" case). A read of a shared page is fine. An owned
*write* must also land on a writable page: held by the request alone and not
published (published K/V is final; other requests read it). An owned write to
a shared or published page is a ``shared_page_write`` (a violation too). With
no draft manager (a private arena passes ``owned_row``), the given row is the
truth, as before.

The map is checked on its own too. Each event is checked against it: an
allocation of a page the map already has as held (a page handed out twice), a
release by a non-holder or while others still hold the page, an unshare by a
non-holder or by the last holder, a share of a page nobody holds or that is
not published, or by a request already among its holders, a publish of a
published page or by a request that does not hold it, an eviction of a page
that is not published — each is an ``accounting_error``, and so is every
mismatch found by :meth:`check_accounting` (map vs. pool counts),
:meth:`check_rows` (live rows vs. map) and :meth:`check_export` (an exported
block-offset tensor vs. map). :meth:`detach` unsubscribes.

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
``shared_page_writes`` / ``stale_reads`` (and :meth:`assert_clean` in tests).
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from tensorrt_llm_draftkv.runtime.page_pool import BAD_PAGE_INDEX
from .page_holders import NOBODY, PageHolders
from .slot_shadow import REUSED_EPOCH, ShadowRing

# Rows kept as tensors between checks: a step touches a few rows many times, and a
# row of a 2M-token request is 65k entries, so a large cache would cost hundreds of MB.
_ROW_CACHE_ENTRIES = 16


def _row_at(row: torch.Tensor, ordinals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For block ordinals of one row: whether each is inside the row, the index to read it at (0 outside),
    and the page the row holds there (-1 outside or unbacked)."""
    if row.numel():
        inside = (ordinals >= 0) & (ordinals < row.numel())
        at = torch.where(inside, ordinals, 0)
        return inside, at, torch.where(inside, row[at], -1)
    return torch.zeros_like(ordinals, dtype=torch.bool), ordinals, torch.full_like(ordinals, -1)


class OwnershipViolation(AssertionError):
    """The drafter touched a page its request does not hold, or read what it did not store."""


class OwnershipChecker:
    """Counts foreign page accesses, stale reads and accounting errors of a drafter against its draft manager.

    Built with a draft manager, it subscribes to the pool of every layer group
    (``draft_manager.layer_groups[g].pool``) and learns the pages live caches
    already hold from their rows (the only record there is before it listens).
    Group indices below are the manager's layer-group indices; pages are page
    indices of that group's pool.
    """

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
        self._shadow: dict[tuple[int, int], ShadowRing] = {}  # (request, pool) -> [pos, layers, 2, H, D]
        self._epoch: dict[int, int] = {}
        self._row_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending: str | None = None  # a violation seen inside a pool event, raised at the next hook
        self.page_holders = PageHolders(self._accounting_error)
        if draft_manager is not None:
            self.page_holders.subscribe(draft_manager)

    def reset_counters(self) -> None:
        self.peak_shadow_tokens = 0
        self.reads = 0
        self.writes = 0
        self.foreign_page_accesses = 0
        self.foreign_page_reads = 0
        self.foreign_page_writes = 0
        self.shared_page_writes = 0
        self.unbacked_accesses = 0
        self.stale_reads = 0
        self.accounting_errors = 0
        self.foreign_row_entries = 0
        self.foreign_export_entries = 0
        self.messages: list[str] = []

    @property
    def violations(self) -> int:
        return self.foreign_page_accesses + self.shared_page_writes + self.stale_reads + self.accounting_errors

    def detach(self) -> None:
        """Stop following the pools and drop the holders map (idempotent): see `PageHolders.detach`."""
        self.page_holders.detach()
        self._row_cache.clear()

    def attach(self, metadata) -> "OwnershipChecker":
        """Follow a :class:`DFlashDraftSlots`: slot losses and restarts open a new epoch."""
        metadata.slots.add_release_listener(self.on_release)
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

    def _accounting_error(self, text: str, count: int = 1, *, now: bool = False) -> None:
        """Count `count` accounting errors; inside a pool event (`now` False) a raise waits for the next hook."""
        self.accounting_errors += count
        if now:
            self._note(text)
            return
        if len(self.messages) < self.max_messages:
            self.messages.append(text)
        if self.raise_on_violation and self._pending is None:
            self._pending = text

    def _raise_pending(self) -> None:
        if self._pending is not None:
            text, self._pending = self._pending, None
            raise OwnershipViolation(text)

    def check_accounting(self) -> int:
        """Per pool: pages with >= 1 holder in the map == ``pool.total - pool.num_free``.

        ``num_free`` counts plain free and cached-free pages, so the difference is
        the distinct held pages (a shared page once). For a reuse pool also: pages
        the map has published and held by nobody == ``pool.num_cached_free``.
        Returns the mismatches found.
        """
        self._raise_pending()
        held: dict[int, int] = {}
        for key, _ in self.page_holders.holders_of:
            held[key] = held.get(key, 0) + 1
        cached: dict[int, int] = {}  # per group: published pages nobody holds (one pass over the table)
        for key, page in self.page_holders.published:
            if (key, page) not in self.page_holders.holders_of:
                cached[key] = cached.get(key, 0) + 1
        found = 0
        for pool, listener in self.page_holders.listeners:
            key = listener.key
            in_use = pool.total - pool.num_free
            if held.get(key, 0) != in_use:
                found += 1
                self._accounting_error(
                    f"pool of group {key}: the owner map holds {held.get(key, 0)} page(s) but the pool has "
                    f"{in_use} in use (total {pool.total} - free {pool.num_free})",
                    now=True,
                )
            if not pool.block_reuse:
                continue
            if cached.get(key, 0) != pool.num_cached_free:
                found += 1
                self._accounting_error(
                    f"pool of group {key}: the owner map has {cached.get(key, 0)} published page(s) nobody holds "
                    f"but the pool has {pool.num_cached_free} cached-free",
                    now=True,
                )
        return found

    def check_rows(self) -> int:
        """Every backed entry of every live cache's row is a page the holders map has that request holding,
        no page is in two entries of one request, and every page the map has a request holding is in its row.

        With block reuse a page may sit in the rows of all its holders (a shared
        prefix page); it must not sit in the row of a request that is not among them.
        Row entries that fail count as ``foreign_row_entries``; every failure is an
        accounting error. Returns the failures found.
        """
        self._raise_pending()
        dm = self.draft_manager
        if dm is None:
            return 0
        found = 0
        seen: dict[tuple[int, int, object], tuple[int, int]] = {}  # (group, page, holder) -> (group, ordinal)
        for rid in dm.request_ids():
            cache = dm.get_cache(rid)
            for g in range(len(self.page_holders.group_key)):
                key = self.page_holders.key(g)
                for ordinal, page in enumerate(cache.block_row(g)):
                    if page == BAD_PAGE_INDEX:
                        continue
                    holds = rid in self.page_holders.holders_of.get((key, page), NOBODY)
                    first = seen.get((key, page, rid)) if holds else None
                    if holds and first is None:
                        seen[(key, page, rid)] = (g, ordinal)
                        continue
                    found += 1
                    self.foreign_row_entries += 1
                    why = (
                        f"which its row already holds at group {first[0]} ordinal {first[1]}"
                        if first is not None
                        else "which the owner map has " + self.page_holders.describe(key, page)
                    )
                    self._accounting_error(
                        f"row of request {rid} group {g}: ordinal {ordinal} -> page {page}, {why}", now=True
                    )
        for (key, page), holders in list(self.page_holders.holders_of.items()):
            for owner in sorted(holders, key=repr) if len(holders) > 1 else holders:
                if (key, page, owner) in seen:
                    continue
                found += 1
                self._accounting_error(
                    f"group {key}: the owner map has page {page} held by {owner!r}, but "
                    + (
                        "no row of it holds the page (a leaked page)"
                        if dm.has_cache(owner)
                        else "that owner has no live cache (a leaked page)"
                    ),
                    now=True,
                )
        return found

    def check_export(self, request_ids: Iterable[int], offsets: torch.Tensor, backend: str = "cpp") -> int:
        """Every entry of an exported block-offset tensor that is not an unbacked placeholder is a page
        the holders map has that entry's request holding (shared or not).

        ``offsets`` is ``[num_pools, B, 2, M]`` as ``get_block_offsets(request_ids, backend)`` returns:
        entry ``[p, b, k, i]`` is ``page * kv_factor + k`` (k = 0 for K, the V slot for V) for block
        ordinal i of request b in pool p. An entry is a placeholder where the request's row does not back
        ordinal i and the entry holds the backend's fill: -1 (``"python"``) or page 0's / the guard
        page's offset (``"cpp"``). Failing entries count as ``foreign_export_entries`` and as
        accounting errors. Returns the failures found.
        """
        self._raise_pending()
        if backend not in ("cpp", "python"):
            raise ValueError(f"unknown block-offset backend {backend!r}; use 'cpp' or 'python'")
        dm = self.draft_manager
        if dm is None:
            raise ValueError("check_export needs the checker's draft manager")
        ids = list(request_ids)
        num_groups = len(self.page_holders.group_key)
        if offsets.dim() != 4 or offsets.shape[0] != num_groups or offsets.shape[1] != len(ids) or offsets.shape[2] != 2:
            raise ValueError(
                f"block offsets must be [num_pools={num_groups}, B={len(ids)}, 2, M], got {tuple(offsets.shape)}"
            )
        kv = dm.config.kv_factor
        v_slot = 1 if kv > 1 else 0
        table = offsets.detach().to("cpu", torch.int64).numpy()
        width = table.shape[-1]
        found = 0
        for g in range(num_groups):
            key = self.page_holders.key(g)
            guard = dm.layer_groups[g].pool.guard_page_index
            base = 0 if guard is None else guard * kv
            fills = (-1, -1) if backend == "python" else (base, base + v_slot)
            for b, rid in enumerate(ids):
                row = np.asarray(dm.get_cache(rid).block_row(g) if dm.has_cache(rid) else [], dtype=np.int64)[:width]
                backed = np.zeros(width, dtype=bool)
                backed[: row.size] = row != BAD_PAGE_INDEX
                owned = np.fromiter(self.page_holders.owned.get((rid, key), ()), dtype=np.int64)
                for k in (0, 1):
                    entries = table[g, b, k]
                    check = backed | (entries != fills[k])
                    pages = np.floor_divide(entries, kv)
                    bad = check & ((entries < 0) | ~np.isin(pages, owned))
                    n_bad = int(bad.sum())
                    if not n_bad:
                        continue
                    found += n_bad
                    self.foreign_export_entries += n_bad
                    i = int(np.flatnonzero(bad)[0])
                    page = int(pages[i])
                    self._accounting_error(
                        f"export of request {rid} pool {g} ({'KV'[k]}): {n_bad} entr(ies) on pages it does not own, "
                        f"e.g. ordinal {i} -> offset {int(entries[i])} (page {page}, which the owner map has "
                        + self.page_holders.describe(key, page)
                        + f"; its row {'backs' if backed[i] else 'does not back'} that ordinal)",
                        n_bad,
                        now=True,
                    )
        return found

    # ------------------------------------------------------------------ internals
    def _owned_row(
        self, request_id: int, group: int, device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The request's mirror row right now (page per block ordinal), per ordinal whether the holders map
        has the request holding that page, and per ordinal whether that page is writable by it (held by it
        alone and not published).

        Cached while neither the cache's size nor the map (any pool event) changes.
        """
        dm = self.draft_manager
        if dm is None or not dm.has_cache(request_id):
            empty = torch.zeros(0, dtype=torch.int64, device=device)
            return empty, empty.bool(), empty.bool()
        cache = dm.get_cache(request_id)
        key = (request_id, group, id(cache), cache.capacity, cache.history_length, self.page_holders.version, str(device))
        hit = self._row_cache.get(key)
        if hit is None:
            if len(self._row_cache) >= _ROW_CACHE_ENTRIES:
                self._row_cache.clear()
            pages = cache.block_row(group)
            k = self.page_holders.key(group)
            mine = self.page_holders.owned.get((request_id, k), ())
            row = torch.tensor(pages, dtype=torch.int64).to(device)
            owned = torch.tensor([p in mine for p in pages], dtype=torch.bool).to(device)
            if dm.layer_groups[group].pool.block_reuse:
                holders, published = self.page_holders.holders_of, self.page_holders.published
                alone = [p in mine and len(holders[(k, p)]) == 1 and (k, p) not in published for p in pages]
                writable = torch.tensor(alone, dtype=torch.bool).to(device)
            else:  # nothing is shared or published without reuse: every owned page is writable
                writable = owned
            hit = self._row_cache[key] = (row, owned, writable)
        return hit

    def _note(self, text: str) -> None:
        if len(self.messages) < self.max_messages:
            self.messages.append(text)
        if self.raise_on_violation:
            raise OwnershipViolation(text)

    def _shadow_keep(self, group: int) -> int | None:
        """Tokens below the newest stored position a slot can still read in this pool (None: all).

        The pool's window (trail page included) plus a page of seed lag and room for
        a block; twice that, to stay well clear of the edge.
        """
        dm = self.draft_manager
        if dm is None:
            return None
        window = dm.layer_groups[group].life_cycle.window
        return None if window is None else 2 * (window + 2 * dm.tokens_per_block)

    @property
    def shadow_tokens(self) -> int:
        """Token positions the value shadow holds now, over every request and pool."""
        return sum(sh.capacity for sh in self._shadow.values())

    def _note_shadow_size(self) -> None:
        self.peak_shadow_tokens = max(self.peak_shadow_tokens, self.shadow_tokens)

    def _shadow_for(self, request_id: int, group: int, like: torch.Tensor) -> ShadowRing:
        key = (request_id, group)
        sh = self._shadow.get(key)
        if sh is None:
            sh = self._shadow[key] = ShadowRing(like, self._shadow_keep(group))
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
        """Count the accesses of ``pages[i]`` through block ordinal ``ordinals[i]`` of pool ``group`` that
        are not owned, and the owned writes to pages that are not writable.

        With ``owned_row`` (a private arena) an access is owned iff the page is what that row holds at the
        ordinal; otherwise also the holders map must have ``request_id`` among the page's holders, and a
        write must land on a page it holds alone that is not published (else a ``shared_page_write``).
        Returns the foreign accesses found.
        """
        self._raise_pending()
        ordinals = ordinals.to(torch.int64)
        pages = pages.to(torch.int64)
        if owned_row is not None:
            row = owned_row.to(device=pages.device, dtype=torch.int64)
            row_owned = row_writable = None
        else:
            row, row_owned, row_writable = self._owned_row(request_id, group, pages.device)
        inside, at, expected = _row_at(row, ordinals)
        unbacked = expected < 0
        bad = unbacked | (pages != expected)
        if row_owned is not None:
            mapped = row_owned[at] & inside if row.numel() else inside
            bad = bad | ~mapped
        n_bad = int(bad.sum())
        if n_bad:
            self._count_foreign(what, request_id, group, layers, ordinals, pages, bad, unbacked, expected,
                                mapped_by_holders=row_owned is not None)
        if what == "write" and row_writable is not None and row.numel():
            # Owned (not counted above) but shared or published: K/V others read, or will read, changes.
            self._count_shared_writes(request_id, group, layers, ordinals, pages, ~bad & ~row_writable[at])
        return n_bad

    def _count_foreign(
        self, what: str, request_id: int, group: int, layers: list[int], ordinals: torch.Tensor, pages: torch.Tensor,
        bad: torch.Tensor, unbacked: torch.Tensor, expected: torch.Tensor, *, mapped_by_holders: bool,
    ) -> None:
        """Count the accesses `bad` marks (per token, times its layers) as foreign and note the first one."""
        n_bad, per_layer = int(bad.sum()), len(layers)
        n_unbacked = int(unbacked.sum())
        self.foreign_page_accesses += n_bad * per_layer
        if what == "read":
            self.foreign_page_reads += n_bad * per_layer
        else:
            self.foreign_page_writes += n_bad * per_layer
        self.unbacked_accesses += n_unbacked * per_layer
        i = int(bad.nonzero()[0])
        page = int(pages[i])
        held = ""
        if mapped_by_holders:
            held = "; the owner map has that page " + self.page_holders.describe(self.page_holders.key(group), page)
        self._note(
            f"request {request_id} layers {layers} (group {group}): {what} of {n_bad} token(s) through "
            f"entries it does not own, e.g. ordinal {int(ordinals[i])} -> page {page} "
            f"(its row has {int(expected[i])} there; {n_unbacked} unbacked{held})"
        )

    def _count_shared_writes(
        self, request_id: int, group: int, layers: list[int], ordinals: torch.Tensor, pages: torch.Tensor,
        shared: torch.Tensor,
    ) -> None:
        """Count owned writes that `shared` marks (pages not held alone, or published) and note the first."""
        n_shared = int(shared.sum())
        if not n_shared:
            return
        self.shared_page_writes += n_shared * len(layers)
        i = int(shared.nonzero()[0])
        page = int(pages[i])
        self._note(
            f"request {request_id} layers {layers} (group {group}): write of {n_shared} token(s) to pages "
            f"it does not hold alone or that are published, e.g. ordinal {int(ordinals[i])} -> page {page} "
            f"(the owner map has that page {self.page_holders.describe(self.page_holders.key(group), page)})"
        )

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
        ``positions[i]`` in every layer of pool ``group``, through the entry at block
        ordinal ``ordinals[i]`` that resolved to ``pages[i]``.

        Counted as foreign when the request does not hold the page there, as a
        ``shared_page_write`` when it holds it but not alone, or it is published.
        """
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
        self._store_shadow(request_id, group, positions, kv, REUSED_EPOCH)

    def _store_shadow(self, request_id: int, group: int, positions: torch.Tensor, kv: torch.Tensor, epoch: int) -> None:
        sh = self._shadow_for(request_id, group, kv)
        pos = positions.to(device=sh.values.device, dtype=torch.int64)
        sh.store(pos, kv.to(sh.values.device), epoch)
        self._note_shadow_size()

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
        epoch = self._epoch.get(request_id, 0)
        bad, never = sh.stale(pos, kv, epoch)
        n_bad = int(bad.sum())
        if n_bad:
            self.stale_reads += n_bad
            i = int(bad.any(dim=1).nonzero()[0])
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
            "shared_page_writes": self.shared_page_writes,
            "unbacked_accesses": self.unbacked_accesses,
            "stale_reads": self.stale_reads,
            "accounting_errors": self.accounting_errors,
            "foreign_row_entries": self.foreign_row_entries,
            "foreign_export_entries": self.foreign_export_entries,
        }

    def assert_clean(self) -> None:
        if self.violations:
            raise OwnershipViolation(
                f"ownership violations: {self.summary()}\n" + "\n".join(self.messages[:10])
            )


__all__ = ["OwnershipChecker", "OwnershipViolation"]
