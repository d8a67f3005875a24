"""One request's paged cache over every layer group of a manager.

Coordinates: capacity, history and committed are token counts from absolute
position 0; block tables map block ordinals to physical pages of each group's
pool, with BAD_PAGE_INDEX where nothing backs the ordinal.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .life_cycle import LifeCycle
from .page_pool import BAD_PAGE_INDEX, PagePool
from .cache_prefix import CachePrefixReuse
from .prefix_cache import PageKey


@dataclass(frozen=True)
class LayerGroup:
    """A life cycle and the pool whose pages back it."""

    life_cycle: LifeCycle
    pool: PagePool


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _GroupPlan(NamedTuple):
    """What one resize does to one group's row (ordinals are block ordinals)."""

    release: list[int]  # pages given back
    clear: list[int]  # ordinals that lose their page (stay inside the row)
    allocate: list[int]  # ordinals that get a fresh page
    new_len: int  # the row's length afterwards (ceil(capacity / P))
    settled: int  # ordinals below this never change again


class _Undo(NamedTuple):
    """One resize, as the journal records it: enough to put the rows and scalars back."""

    scalars: tuple[int, int, int]
    settled: tuple[int, ...]
    held: tuple[int, ...]
    rows: list[tuple[int, list[tuple[int, int]]]]  # per group: (old length, old entries)


class KVCache(CachePrefixReuse):
    """capacity / history / committed with real pages, resized all-or-nothing.

    Block reuse (the prefix keys, publishing, adopting a cached prefix) is the
    `CachePrefixReuse` part (`cache_prefix.py`).
    """

    def __init__(
        self,
        groups: list[LayerGroup],
        tokens_per_block: int,
        name: str = "",
        *,
        owner: object | None = None,
    ) -> None:
        """`owner` (a request id, say) is named in every pool call, so pool listeners know whose pages move."""
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        self.groups = groups
        self.tokens_per_block = tokens_per_block
        self.name = name
        self.owner = owner
        self.capacity = 0
        self.history_length = 0
        self.committed = 0
        self._rows: list[list[int]] = [[] for _ in groups]
        # Per group: ordinals below this never change again (released or sinks),
        # so a resize only walks the rest of the row.
        self._settled: list[int] = [0 for _ in groups]
        self._held: list[int] = [0 for _ in groups]  # backed entries per row, kept by every change
        # Block reuse: per group, the keys of ordinals [0, len) (computed once, extended by commit).
        self._keys: list[list[PageKey]] = [[] for _ in groups]
        self._journal: list[_Undo] | None = None
        self.closed = False
        #: Bumped by every change of a row: a consumer's derived copy of the rows
        #: (see `export_memo`) is current while its version matches.
        self.version = 0
        #: Derived data a consumer keeps per cache (the block-offset export keeps its
        #: numpy rows here), dropped with the cache. The cache never reads it.
        self.export_memo: dict = {}

    # -- queries ----------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Logical blocks covering `capacity` tokens (backed or not)."""
        return _ceil_div(self.capacity, self.tokens_per_block)

    def block_row(self, group: int) -> list[int]:
        """Ordinal -> page for one layer group, BAD_PAGE_INDEX where unbacked (a copy)."""
        return list(self._rows[group])

    def block_row_slice(self, group: int, lo: int, hi: int) -> list[int]:
        """Pages of ordinals [lo, hi) (BAD_PAGE_INDEX where unbacked or past the row)."""
        row = self._rows[group][lo:hi]
        return row + [BAD_PAGE_INDEX] * (hi - lo - len(row))

    def settled_blocks(self, group: int) -> int:
        """Block ordinals below this keep their entry in every later state of the row (a
        rollback or restore may lower it again: it describes the state the cache is in now)."""
        return self._settled[group]

    def held_pages(self, group: int) -> list[int]:
        return [p for p in self._rows[group] if p != BAD_PAGE_INDEX]

    def num_held_pages(self, group: int | None = None) -> int:
        """Pages the cache holds (in one group, or all): a counter, not a scan."""
        return self._held[group] if group is not None else sum(self._held)

    # -- the one mutator ----------------------------------------------------------
    def resize(self, capacity: int | None, history_length: int | None = None) -> bool:
        """Make the cache hold `capacity` tokens with `history_length` of them history.

        Either argument may be None (unchanged). History never decreases and never
        exceeds capacity (ValueError). Raising history releases the blocks that
        enter a group's stale range; growth backs only ordinals outside it. If a
        pool lacks the pages, returns False and nothing changes.
        """
        new_capacity, new_history = self._validated(capacity, history_length)
        if self._rows_stay(new_capacity, new_history):
            self._move_cursors(new_capacity, new_history)
            return True
        plans = [self._plan_group(g, new_capacity, new_history) for g in range(len(self.groups))]
        if not self._fits(plans):
            return False
        undo = _Undo((self.capacity, self.history_length, self.committed), tuple(self._settled), tuple(self._held), [])
        # Release everything first: groups may share one pool, and one group's
        # growth may then need the pages another group gives back.
        for g, plan in enumerate(plans):
            self.groups[g].pool.release(plan.release, owner=self.owner)
        for g, plan in enumerate(plans):
            pages = self.groups[g].pool.allocate(len(plan.allocate), owner=self.owner)
            undo.rows.append(self._apply(g, plan, pages))
        self.version += 1
        self.capacity = new_capacity
        self.history_length = new_history
        if self._journal is not None:
            self._journal.append(undo)
        return True

    def _rows_stay(self, capacity: int, history: int) -> bool:
        """True when no row changes: same block count everywhere and no window releases
        a block above its settled mark. Most generation steps move inside one page."""
        P = self.tokens_per_block
        num_blocks = _ceil_div(capacity, P)
        for g, row in enumerate(self._rows):
            if len(row) != num_blocks:
                return False
            life_cycle = self.groups[g].life_cycle
            if life_cycle.window is not None:
                lo, hi = life_cycle.stale_range(history, P)
                if hi > lo and hi > self._settled[g]:
                    return False
        return True

    def _move_cursors(self, capacity: int, history: int) -> None:
        """The fast path of `resize`: only capacity, history and full-attention settled marks move."""
        if self._journal is not None:
            scalars = (self.capacity, self.history_length, self.committed)
            self._journal.append(_Undo(scalars, tuple(self._settled), tuple(self._held), [(len(r), []) for r in self._rows]))
        P = self.tokens_per_block
        for g, row in enumerate(self._rows):
            if self.groups[g].life_cycle.window is None:
                # Full attention never releases: every block wholly below history is final.
                self._settled[g] = max(self._settled[g], min(history // P, len(row)))
        self.capacity = capacity
        self.history_length = history

    def _apply(self, g: int, plan: _GroupPlan, pages: list[int]) -> tuple[int, list[tuple[int, int]]]:
        """Edit the row in place (only the ordinals that change); return what undoes it."""
        row = self._rows[g]
        old_len = len(row)
        saved = [(o, row[o]) for o in plan.clear]
        if plan.new_len < old_len:
            saved += [(o, row[o]) for o in range(plan.new_len, old_len)]
            del row[plan.new_len :]
        else:
            row.extend([BAD_PAGE_INDEX] * (plan.new_len - old_len))
        for o in plan.clear:
            row[o] = BAD_PAGE_INDEX
        for o, page in zip(plan.allocate, pages):
            saved.append((o, BAD_PAGE_INDEX))
            row[o] = page
        self._held[g] += len(pages) - len(plan.release)
        self._settled[g] = plan.settled
        return old_len, saved

    def _validated(self, capacity: int | None, history_length: int | None) -> tuple[int, int]:
        if self.closed:
            raise ValueError(f"cache {self.name!r} was freed; it cannot be resized")
        new_capacity = self.capacity if capacity is None else capacity
        new_history = self.history_length if history_length is None else history_length
        if new_capacity < 0:
            raise ValueError(f"cache {self.name!r}: capacity must be >= 0 tokens, got {new_capacity}")
        if new_history < self.history_length:
            raise ValueError(
                f"cache {self.name!r}: history length never decreases "
                f"(is {self.history_length}, asked {new_history})"
            )
        if new_capacity < new_history:
            raise ValueError(
                f"cache {self.name!r}: capacity {new_capacity} is below history length {new_history}"
            )
        return new_capacity, new_history

    def can_resize(self, capacity: int | None, history_length: int | None = None) -> bool:
        """Would `resize(capacity, history_length)` succeed? Changes nothing; raises as resize would."""
        new_capacity, new_history = self._validated(capacity, history_length)
        return self._fits([self._plan_group(g, new_capacity, new_history) for g in range(len(self.groups))])

    def _fits(self, plans) -> bool:
        # Summed per pool: layer groups that share one pool draw on one free list.
        balance: dict[int, int] = {}
        for g, plan in enumerate(plans):
            pool = self.groups[g].pool
            returned = pool.pages_returned_by(plan.release)  # a page others share stays held
            balance[id(pool)] = balance.get(id(pool), pool.num_free) + returned - len(plan.allocate)
        return all(left >= 0 for left in balance.values())

    def _plan_group(self, g: int, capacity: int, history: int) -> _GroupPlan:
        """What a resize to (capacity, history) does to group g, walking only ordinals that can change."""
        old = self._rows[g]
        P = self.tokens_per_block
        num_blocks = _ceil_div(capacity, P)
        life_cycle = self.groups[g].life_cycle
        lo, hi = life_cycle.stale_range(history, P)
        # Stale ranges only grow with history and capacity never drops below
        # history, so everything below the previous settled mark is final.
        start = min(self._settled[g], len(old), num_blocks)
        release: list[int] = []
        clear: list[int] = []
        allocate: list[int] = []
        # Every ordinal in [settled, len) outside the stale range is backed (each resize
        # leaves it so), and stale ranges only grow. So only three spans can change: the
        # newly stale ordinals [start, hi), the growth [len, num_blocks) and the shrink
        # [num_blocks, len): O(blocks that change), not O(row).
        kept = min(len(old), num_blocks)
        walk = [range(start, min(max(hi, start), kept)), range(kept, max(num_blocks, len(old)))]
        for ordinal in (o for span in walk for o in span):
            page = old[ordinal] if ordinal < len(old) else BAD_PAGE_INDEX
            keep = ordinal < num_blocks and not (lo <= ordinal < hi)
            if not keep:
                if page != BAD_PAGE_INDEX:
                    release.append(page)
                    if ordinal < num_blocks:
                        clear.append(ordinal)
            elif page == BAD_PAGE_INDEX:
                allocate.append(ordinal)
        if life_cycle.window is None:
            # Full attention never releases: every block wholly below history is final.
            settled = max(start, min(history // P, num_blocks))
        else:
            settled = max(hi, start) if hi > lo else start
        return _GroupPlan(release, clear, allocate, num_blocks, settled)

    def commit(
        self, tokens: int, token_ids: Sequence[int] | None = None, *, first_ordinals: Sequence[int] | None = None
    ) -> None:
        """Publish `tokens` for prefix reuse; committed <= history.

        With `token_ids` (the request's token ids from absolute position 0, at
        least `tokens` of them), every group whose pool has block reuse puts each
        full page of ordinals `[committed // P, tokens // P)` that this cache still
        backs into its pool's prefix table (a page a window already released is not
        published; a key another page already has is left to that page). Without
        `token_ids` only the counter moves. `first_ordinals[g]`: group g publishes
        no ordinal below this one (pages this cache does not hold whole, e.g. a
        generation worker's first received page, which starts mid-page); committed
        still moves to `tokens`. Journaled like a resize.
        """
        if first_ordinals is not None and len(first_ordinals) != len(self.groups):
            raise ValueError(
                f"cache {self.name!r}: first_ordinals needs one entry per group ({len(self.groups)}), "
                f"got {len(first_ordinals)}"
            )
        if not self.committed <= tokens <= self.history_length:
            raise ValueError(
                f"cache {self.name!r}: committed must stay in [{self.committed}, {self.history_length}], "
                f"got {tokens}"
            )
        if token_ids is not None and len(token_ids) < tokens:
            raise ValueError(f"cache {self.name!r}: committing {tokens} tokens needs as many token ids, got {len(token_ids)}")
        if self._journal is not None and tokens != self.committed:
            scalars = (self.capacity, self.history_length, self.committed)
            self._journal.append(_Undo(scalars, tuple(self._settled), tuple(self._held), [(len(r), []) for r in self._rows]))
        if token_ids is not None:
            self._publish(tokens, token_ids, first_ordinals)
        self.committed = tokens

    def free(self) -> None:
        """Return every page; the cache cannot be used afterwards."""
        if self.closed:
            raise ValueError(f"cache {self.name!r} was already freed")
        for g, row in enumerate(self._rows):
            self.groups[g].pool.release([p for p in row if p != BAD_PAGE_INDEX], owner=self.owner)
            self._rows[g] = []
            self._settled[g] = 0
            self._held[g] = 0
            self._keys[g] = []
        self.capacity = self.history_length = self.committed = 0
        self._journal = None
        self.closed = True
        self.version += 1
        self.export_memo = {}

    def checkpoint(self) -> tuple:
        """Everything that defines this cache, immutable: what `restore` returns to, and what
        a test compares for bit-identity."""
        return (
            self.capacity,
            self.history_length,
            self.committed,
            tuple(tuple(r) for r in self._rows),
            tuple(self._settled),
        )

    def restore(self, state: tuple) -> None:
        """Return to a checkpoint: give back pages gained since, take back pages released since.

        Undo in the reverse order of the changes (latest resize first), so the
        pages released since the checkpoint are still free to take back.
        """
        capacity, history, committed, rows, settled = state
        for g, (now, then) in enumerate(zip(self._rows, rows)):
            held_now = {p for p in now if p != BAD_PAGE_INDEX}
            held_then = {p for p in then if p != BAD_PAGE_INDEX}
            self.groups[g].pool.release(sorted(held_now - held_then), owner=self.owner)
            self.groups[g].pool.take(sorted(held_then - held_now), owner=self.owner)
        self._rows = [list(r) for r in rows]
        self._settled = list(settled)
        self._held = [sum(1 for p in r if p != BAD_PAGE_INDEX) for r in self._rows]
        self.capacity, self.history_length, self.committed = capacity, history, committed
        self.version += 1
        self.export_memo = {}  # the settled marks went back: derived rows start over

    # -- the undo journal (what a batch transaction rolls back) ----------------------------
    def begin_journal(self) -> None:
        """Record every resize from now on, so `rollback_journal` can undo them; O(changes), not O(row)."""
        if self._journal is not None:
            raise ValueError(f"cache {self.name!r}: a journal is already open")
        self._journal = []

    def end_journal(self) -> None:
        """Keep the changes; stop recording."""
        self._journal = None

    def rollback_journal(self) -> None:
        """Put rows, counters and scalars back as they were at `begin_journal`, latest resize first.

        The pages themselves go back through the pools' own journals
        (`PagePool.rollback_journal`), which a batch transaction rolls back with it.
        """
        records, self._journal = self._journal or [], None
        if records:
            self.version += 1
            self.export_memo = {}  # the settled marks go back: derived rows start over
        for undo in reversed(records):
            for row, (old_len, saved) in zip(self._rows, undo.rows):
                if len(row) < old_len:
                    row.extend([BAD_PAGE_INDEX] * (old_len - len(row)))
                for o, page in reversed(saved):
                    row[o] = page
                del row[old_len:]
            self.capacity, self.history_length, self.committed = undo.scalars
            self._settled = list(undo.settled)
            self._held = list(undo.held)
        for keys in self._keys:  # keys past what is committed are recomputed when needed
            del keys[self.committed // self.tokens_per_block :]

