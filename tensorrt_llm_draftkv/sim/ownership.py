"""OwnershipChecker: did the drafter touch only its own pages, and read back what it stored?

Invariant 1: every block-table entry a drafter reads or writes is a page its
own request holds. The checker does not take the request's row as the truth:
the row is what the block-offset export is built from, so an allocator bug
that put one page into two rows would look owned from either row. Instead it
keeps its own *holders map*, ``holders_of[(group, page)] -> frozenset of
request ids`` (live pages only; ``owner_of`` is the same map under its old
name), fed by the events of every pool of the draft manager (the pools name
the owner the cache passed, the request id):

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

import weakref
from typing import Iterable

import numpy as np
import torch

from ..runtime.page_pool import BAD_PAGE_INDEX, PagePool

_NEVER = -1
# Rows kept as tensors between checks: a step touches a few rows many times, and a
# row of a 2M-token request is 65k entries, so a large cache would cost hundreds of MB.
_ROW_CACHE_ENTRIES = 16
_REUSED = -2
_NOBODY: frozenset = frozenset()  # the holders map's answer for a page nobody holds


def _holders_text(holders: frozenset) -> str:
    """One holder as its repr (the single-owner wording); several, sorted by repr, joined by ", "."""
    if len(holders) == 1:
        return repr(next(iter(holders)))
    return ", ".join(sorted(repr(h) for h in holders))


class OwnershipViolation(AssertionError):
    """The drafter touched a page its request does not hold, or read what it did not store."""


class _Shadow:
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
        self.keep = keep
        self.hi = 0  # one past the newest position ever stored
        self.values = torch.zeros((0, *like.shape[1:]), dtype=like.dtype, device=like.device)
        self.epoch = torch.full((0,), _NEVER, dtype=torch.int64, device=like.device)
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
        epoch = torch.full((size,), _NEVER, dtype=torch.int64, device=self.epoch.device)
        position = torch.full((size,), -1, dtype=torch.int64, device=self.epoch.device)
        held = (self.position >= 0).nonzero().flatten()
        if held.numel():
            pos = self.position[held]
            slot = pos % size  # the held positions span less than the old capacity: no collisions
            values[slot], epoch[slot], position[slot] = self.values[held], self.epoch[held], pos
        self.values, self.epoch, self.position = values, epoch, position

    def store(self, pos: torch.Tensor, kv: torch.Tensor, epoch: int) -> None:
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
            return torch.full_like(pos, _NEVER), torch.zeros((pos.numel(), *self.values.shape[1:]), dtype=self.values.dtype, device=self.values.device)
        slot = pos % self.capacity
        here = self.position[slot] == pos
        return torch.where(here, self.epoch[slot], _NEVER), self.values[slot]


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
        self._shadow: dict[tuple[int, int], _Shadow] = {}  # (request, pool) -> [pos, layers, 2, H, D]
        self._epoch: dict[int, int] = {}
        self._row_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # The holders map: (group, page) -> its holders, live pages only (>= 1 holder);
        # `_owned` indexes it by (holder, group). Frozensets: a snapshot of the map stays as it was.
        self.holders_of: dict[tuple[int, int], frozenset] = {}
        self._owned: dict[tuple[object, int], set[int]] = {}
        # (group, page) of every page in its pool's prefix table (held or cached-free), from the events.
        self._published: set[tuple[int, int]] = set()
        self._map_version = 0  # bumped by every pool event (keys the row cache)
        self._pending: str | None = None  # a violation seen inside a pool event, raised at the next hook
        # Group -> the group whose key the map uses for that pool (groups may share one pool).
        self._group_key: list[int] = []
        self._listeners: list[tuple[PagePool, object]] = []
        if draft_manager is not None:
            self._subscribe(draft_manager)

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

    # ------------------------------------------------------------------ the holders map
    def _subscribe(self, dm) -> None:
        """Listen to every pool of `dm` (once per pool) and learn the pages live caches hold now.

        Rows are the only record of holders before the checker listens; a reuse pool's
        prefix table (which pages are published) is read from the pool itself.
        """
        first: dict[int, int] = {}
        for g, group in enumerate(dm.layer_groups):
            pool = group.pool
            key = first.setdefault(id(pool), g)
            self._group_key.append(key)
            if key == g:
                listener = _PoolListener(self, pool, key)
                pool.add_listener(listener)
                self._listeners.append((pool, listener))
                if pool.block_reuse:
                    self._published.update((key, page) for page in range(pool.total) if pool.is_published(page))
        for rid in dm.request_ids():
            cache = dm.get_cache(rid)
            for g in range(len(self._group_key)):
                self._learn(g, dm.layer_groups[g].pool, cache.held_pages(g), rid)

    def _learn(self, group: int, pool: PagePool, pages: list[int], owner: object) -> None:
        """A live cache's row holds `pages` of `group`'s pool: add `owner` as a holder of each.

        A page the map already has is joined only where the pool's refcount says
        it has room for one more holder (a shared prefix page); otherwise it is
        the same "held twice" error as an allocation.
        """
        key = self._key(group)
        for page in pages:
            holders = self.holders_of.get((key, page), _NOBODY)
            if holders and owner not in holders and pool.refcount(page) > len(holders):
                self._add_holder(key, page, owner, holders)
            else:
                self._claim(group, [page], owner, "held when the checker was built")

    def detach(self) -> None:
        """Stop following the pools and drop the holders map (idempotent).

        A detached checker with a draft manager finds no page owned: use it
        only for reporting afterwards.
        """
        for pool, listener in self._listeners:
            pool.remove_listener(listener)
        self._listeners.clear()
        self.holders_of.clear()
        self._owned.clear()
        self._published.clear()
        self._map_version += 1
        self._row_cache.clear()

    @property
    def attached(self) -> bool:
        """Whether the checker follows its draft manager's pools."""
        return bool(self._listeners)

    @property
    def owner_of(self) -> dict[tuple[int, int], frozenset]:
        """The holders map under its old name: ``(group, page) -> frozenset of holders``, live pages only."""
        return self.holders_of

    def holders(self, group: int, page: int) -> frozenset:
        """The requests the map has holding `page` of layer group `group`'s pool (empty: nobody)."""
        return self.holders_of.get((self._key(group), page), _NOBODY)

    def is_published(self, group: int, page: int) -> bool:
        """Whether the events put `page` of layer group `group`'s pool in its prefix table (and kept it)."""
        return (self._key(group), page) in self._published

    def owned_pages(self, request_id: object, group: int) -> list[int]:
        """Pages of layer group `group`'s pool that `request_id` holds per the map (shared or not), ascending."""
        return sorted(self._owned.get((request_id, self._key(group)), ()))

    def _key(self, group: int) -> int:
        return self._group_key[group] if 0 <= group < len(self._group_key) else group

    def _describe(self, key: int, page: int) -> str:
        """How the map has a page: "free", or "held by" its holders (", published" when in the table)."""
        holders = self.holders_of.get((key, page), _NOBODY)
        text = "free" if not holders else "held by " + _holders_text(holders)
        return text + (", published" if (key, page) in self._published else "")

    def _on_pool_event(self, key: int, event: str, pages: list[int], owner: object | None) -> None:
        """A pool of group `key` told its listeners `event` for `pages` and `owner` (see `PagePool`)."""
        self._map_version += 1
        if event == "allocate":
            self._claim(key, pages, owner, "allocated")
        elif event == "release":
            self._drop(key, pages, owner)
        elif event == "share":
            self._join(key, pages, owner)
        elif event == "unshare":
            self._leave(key, pages, owner)
        elif event == "publish":
            self._publish(key, pages, owner)
        elif event == "evict":
            self._evict(key, pages, owner)
        else:
            raise ValueError(f"unknown pool event {event!r}")

    def _add_holder(self, key: int, page: int, owner: object, holders: frozenset) -> None:
        self.holders_of[(key, page)] = holders | {owner}
        self._owned.setdefault((owner, key), set()).add(page)

    def _unindex(self, owner: object, key: int, page: int) -> None:
        """Forget that `owner` holds `page` in the (holder, group) index."""
        mine = self._owned[(owner, key)]
        mine.discard(page)
        if not mine:
            del self._owned[(owner, key)]

    def _claim(self, group: int, pages: list[int], owner: object, how: str) -> None:
        """"allocate": `owner` now holds each page alone; the map must have had it free (or cached-free)."""
        key = self._key(group)
        for page in pages:
            holders = self.holders_of.get((key, page), _NOBODY)
            if holders:
                # Keep the holders the map has: the new holder's accesses are then the foreign ones.
                self._accounting_error(
                    f"group {key}: page {page} {how} for {owner!r} while the owner map has it held by "
                    f"{_holders_text(holders)} (one page held twice)"
                )
                continue
            self._add_holder(key, page, owner, _NOBODY)

    def _drop(self, key: int, pages: list[int], owner: object) -> None:
        """"release": `owner` was each page's last holder; the pool has the page free or cached-free now."""
        for page in pages:
            holders = self.holders_of.pop((key, page), _NOBODY)
            if not holders:
                self._accounting_error(
                    f"group {key}: page {page} released by {owner!r} but the owner map has it free"
                )
                continue
            for holder in holders:  # the pool holds nobody on it now: neither does the map
                self._unindex(holder, key, page)
            if owner not in holders:
                self._accounting_error(
                    f"group {key}: page {page} released by {owner!r} but the owner map has it held by "
                    f"{_holders_text(holders)}"
                )
            elif len(holders) > 1:
                self._accounting_error(
                    f"group {key}: page {page} released by {owner!r} as its last holder, but the owner map "
                    f"also has it held by {_holders_text(holders - {owner})}"
                )

    def _join(self, key: int, pages: list[int], owner: object) -> None:
        """"share": `owner` joins published pages others hold (a page nobody holds is revived by "allocate")."""
        for page in pages:
            holders = self.holders_of.get((key, page), _NOBODY)
            published = (key, page) in self._published
            if owner in holders:
                self._accounting_error(
                    f"group {key}: page {page} shared with {owner!r}, which the owner map already has "
                    f"among its holders ({_holders_text(holders)})"
                )
                continue
            if not holders or not published:
                self._accounting_error(
                    f"group {key}: page {page} shared with {owner!r} but the owner map has it "
                    + ("held by " + _holders_text(holders) if holders else "free")
                    + (", published" if published else ", not published")
                    + " (a share joins published pages others hold)"
                )
            self._add_holder(key, page, owner, holders)  # the pool has `owner` holding it: follow

    def _leave(self, key: int, pages: list[int], owner: object) -> None:
        """"unshare": `owner` leaves pages that other holders keep."""
        for page in pages:
            holders = self.holders_of.get((key, page), _NOBODY)
            if owner not in holders:
                self._accounting_error(
                    f"group {key}: page {page} unshared by {owner!r} but the owner map has it {self._describe(key, page)}"
                )
                continue
            self._unindex(owner, key, page)
            rest = holders - {owner}
            if rest:
                self.holders_of[(key, page)] = rest
                continue
            del self.holders_of[(key, page)]
            self._accounting_error(
                f"group {key}: page {page} unshared by {owner!r}, its last holder in the owner map, but the pool "
                "says others still hold it"
            )

    def _publish(self, key: int, pages: list[int], owner: object | None) -> None:
        """"publish": pages enter the prefix table (by a holder, or put back by a rollback with owner None)."""
        for page in pages:
            if (key, page) in self._published:
                self._accounting_error(
                    f"group {key}: page {page} published by {owner!r} but the owner map has it published already"
                )
                continue
            self._published.add((key, page))
            holders = self.holders_of.get((key, page), _NOBODY)
            if owner is not None and owner not in holders:
                self._accounting_error(
                    f"group {key}: page {page} published by {owner!r}, which the owner map does not have among "
                    f"its holders ({self._describe(key, page)})"
                )

    def _evict(self, key: int, pages: list[int], owner: object | None) -> None:
        """"evict": pages leave the prefix table (a cached-free page reused, or a publish rolled back)."""
        for page in pages:
            if (key, page) not in self._published:
                self._accounting_error(
                    f"group {key}: page {page} evicted (owner {owner!r}) but the owner map has it unpublished"
                )
                continue
            self._published.discard((key, page))

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
        for key, _ in self.holders_of:
            held[key] = held.get(key, 0) + 1
        cached: dict[int, int] = {}  # per group: published pages nobody holds (one pass over the table)
        for key, page in self._published:
            if (key, page) not in self.holders_of:
                cached[key] = cached.get(key, 0) + 1
        found = 0
        for pool, listener in self._listeners:
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
            for g in range(len(self._group_key)):
                key = self._key(g)
                for ordinal, page in enumerate(cache.block_row(g)):
                    if page == BAD_PAGE_INDEX:
                        continue
                    holds = rid in self.holders_of.get((key, page), _NOBODY)
                    first = seen.get((key, page, rid)) if holds else None
                    if holds and first is None:
                        seen[(key, page, rid)] = (g, ordinal)
                        continue
                    found += 1
                    self.foreign_row_entries += 1
                    why = (
                        f"which its row already holds at group {first[0]} ordinal {first[1]}"
                        if first is not None
                        else "which the owner map has " + self._describe(key, page)
                    )
                    self._accounting_error(
                        f"row of request {rid} group {g}: ordinal {ordinal} -> page {page}, {why}", now=True
                    )
        for (key, page), holders in list(self.holders_of.items()):
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
        num_groups = len(self._group_key)
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
            key = self._key(g)
            guard = dm.layer_groups[g].pool.guard_page_index
            base = 0 if guard is None else guard * kv
            fills = (-1, -1) if backend == "python" else (base, base + v_slot)
            for b, rid in enumerate(ids):
                row = np.asarray(dm.get_cache(rid).block_row(g) if dm.has_cache(rid) else [], dtype=np.int64)[:width]
                backed = np.zeros(width, dtype=bool)
                backed[: row.size] = row != BAD_PAGE_INDEX
                owned = np.fromiter(self._owned.get((rid, key), ()), dtype=np.int64)
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
                        + self._describe(key, page)
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
        key = (request_id, group, id(cache), cache.capacity, cache.history_length, self._map_version, str(device))
        hit = self._row_cache.get(key)
        if hit is None:
            if len(self._row_cache) >= _ROW_CACHE_ENTRIES:
                self._row_cache.clear()
            pages = cache.block_row(group)
            k = self._key(group)
            mine = self._owned.get((request_id, k), ())
            row = torch.tensor(pages, dtype=torch.int64).to(device)
            owned = torch.tensor([p in mine for p in pages], dtype=torch.bool).to(device)
            if dm.layer_groups[group].pool.block_reuse:
                holders, published = self.holders_of, self._published
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

    def _shadow_for(self, request_id: int, group: int, like: torch.Tensor) -> _Shadow:
        key = (request_id, group)
        sh = self._shadow.get(key)
        if sh is None:
            sh = self._shadow[key] = _Shadow(like, self._shadow_keep(group))
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
        if row.numel():
            inside = (ordinals >= 0) & (ordinals < row.numel())
            at = torch.where(inside, ordinals, 0)
            expected = torch.where(inside, row[at], -1)
        else:
            inside = torch.zeros_like(ordinals, dtype=torch.bool)
            at = ordinals
            expected = torch.full_like(ordinals, -1)
        unbacked = expected < 0
        bad = unbacked | (pages != expected)
        if row_owned is not None:
            mapped = row_owned[at] & inside if row.numel() else inside
            bad = bad | ~mapped
        n_bad = int(bad.sum())
        per_layer = len(layers)
        if n_bad:
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
            if row_owned is not None:
                held = "; the owner map has that page " + self._describe(self._key(group), page)
            self._note(
                f"request {request_id} layers {layers} (group {group}): {what} of {n_bad} token(s) through "
                f"entries it does not own, e.g. ordinal {int(ordinals[i])} -> page {page} "
                f"(its row has {int(expected[i])} there; {n_unbacked} unbacked{held})"
            )
        if what == "write" and row_writable is not None and row.numel():
            # Owned (not counted above) but shared or published: K/V others read, or will read, changes.
            shared = ~bad & ~row_writable[at]
            n_shared = int(shared.sum())
            if n_shared:
                self.shared_page_writes += n_shared * per_layer
                i = int(shared.nonzero()[0])
                page = int(pages[i])
                self._note(
                    f"request {request_id} layers {layers} (group {group}): write of {n_shared} token(s) to pages "
                    f"it does not hold alone or that are published, e.g. ordinal {int(ordinals[i])} -> page {page} "
                    f"(the owner map has that page {self._describe(self._key(group), page)})"
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
        self._store_shadow(request_id, group, positions, kv, _REUSED)

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
        ep, held = sh.lookup(pos)
        stored = (ep == epoch) | (ep == _REUSED)
        same = (held == kv.to(sh.values.device)).flatten(2).all(dim=2)  # [n, Lg]
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


class _PoolListener:
    """Forwards one pool's events to a checker, holding it weakly (a dropped checker unsubscribes)."""

    def __init__(self, checker: OwnershipChecker, pool: PagePool, key: int) -> None:
        self._checker = weakref.ref(checker)
        self._pool = weakref.ref(pool)
        self.key = key

    def __call__(self, event: str, pages: list[int], owner: object | None) -> None:
        checker = self._checker()
        if checker is None:
            pool = self._pool()
            if pool is not None:
                pool.remove_listener(self)
            return
        checker._on_pool_event(self.key, event, pages, owner)


__all__ = ["OwnershipChecker", "OwnershipViolation"]
