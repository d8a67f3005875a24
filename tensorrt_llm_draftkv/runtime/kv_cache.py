"""One request's paged cache over every layer group of a manager.

Coordinates: capacity, history and committed are token counts from absolute
position 0; block tables map block ordinals to physical pages of each group's
pool, with BAD_PAGE_INDEX where nothing backs the ordinal.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .change_log import ChangeLog
from .layer_group import LayerGroup
from .page_pool import BAD_PAGE_INDEX
from .prefix_cache import PageKey
from .prefix_keys import PrefixKeys, adoption_settled
from .resize_plan import CursorRange, GroupPlan, ResizePlan, ceil_div, cursor_range, one_page_crossing, plan_group_resize


class _Undo(NamedTuple):
    """One resize, as the journal records it: enough to put the rows and scalars back."""

    scalars: tuple[int, int, int]
    settled: tuple[int, ...]
    held: tuple[int, ...]
    rows: list[tuple[int, list[tuple[int, int]]]]  # per group: (old length, old entries)


class KVCache:
    """capacity / history / committed with real pages, resized all-or-nothing.

    With block reuse, `keys` (a `PrefixKeys`) holds the page keys of each group;
    `commit` publishes full pages under them and `adopt_prefix` starts a fresh
    cache on pages others published.
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
        #: Block reuse: each group's page-key chain (computed once, extended by commit).
        self.keys = PrefixKeys(groups, tokens_per_block)
        self._journal: list[_Undo] | None = None
        self.closed = False
        #: Bumped by every change of a row: a consumer's derived copy of the rows
        #: (see `export_memo`) is current while its version matches.
        self.version = 0
        #: Derived data a consumer keeps per cache (the block-offset export keeps its
        #: numpy rows here), dropped with the cache. The cache never reads it.
        self.export_memo: dict = {}
        #: What a mirror of the rows kept elsewhere follows (the manager's device block table
        #: starts it): every changed entry, recorded only once a consumer started it.
        self.changes = ChangeLog(self)
        #: Groups whose settled mark follows history at every cursor move (full attention).
        self._full_groups = tuple(g for g, group in enumerate(groups) if group.life_cycle.window is None)
        self._life_cycles = tuple(group.life_cycle for group in groups)
        self._cursor_range: CursorRange | None = None

    # -- queries ----------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Logical blocks covering `capacity` tokens (backed or not)."""
        return ceil_div(self.capacity, self.tokens_per_block)

    def block_row(self, group: int) -> list[int]:
        """Ordinal -> page for one layer group, BAD_PAGE_INDEX where unbacked (a copy)."""
        return list(self._rows[group])

    def row_length(self, group: int) -> int:
        """Block ordinals one group's row spans (backed or not): `ceil(capacity / P)` after a resize."""
        return len(self._rows[group])

    def backed_extent(self, group: int) -> int:
        """1 + the last backed block ordinal of one group's row (0 when none is backed)."""
        row = self._rows[group]
        for i in range(len(row) - 1, -1, -1):  # rows almost always end backed: O(1)
            if row[i] != BAD_PAGE_INDEX:
                return i + 1
        return 0

    def block_row_slice(self, group: int, lo: int, hi: int) -> list[int]:
        """Pages of ordinals [lo, hi) (BAD_PAGE_INDEX where unbacked or past the row)."""
        row = self._rows[group][lo:hi]
        return row + [BAD_PAGE_INDEX] * (hi - lo - len(row))

    def block_entries(self, group: int, ordinals: Sequence[int]) -> list[int]:
        """Pages of these ordinals (BAD_PAGE_INDEX where unbacked or past the row), in order."""
        row = self._rows[group]
        n = len(row)
        return [row[o] if 0 <= o < n else BAD_PAGE_INDEX for o in ordinals]

    def block_entry(self, group: int, ordinal: int) -> int:
        """The page of one ordinal (BAD_PAGE_INDEX where unbacked or past the row)."""
        row = self._rows[group]
        return row[ordinal] if 0 <= ordinal < len(row) else BAD_PAGE_INDEX

    def settled_blocks(self, group: int) -> int:
        """Block ordinals below this keep their entry in every later state of the row (a
        rollback may lower it again: it describes the state the cache is in now)."""
        return self._settled[group]

    def first_backed(self, group: int, start: int = 0) -> int:
        """The lowest backed block ordinal at or above `start` (the row's length when none is)."""
        row = self._rows[group]
        n = len(row)
        o = start
        while o < n and row[o] == BAD_PAGE_INDEX:
            o += 1
        return o

    def backed_span(self, group: int, start: int) -> tuple[int, int]:
        """`(first_backed(group, start), backed_extent(group))` in one call: block ordinals, O(1) when
        ordinal `start` and the row's last ordinal are backed (a mirror following a sliding window)."""
        row = self._rows[group]
        n = len(row)
        first = start
        while first < n and row[first] == BAD_PAGE_INDEX:  # `first_backed`, inlined: a slide moves it a page
            first += 1
        return first, (n if n and row[-1] != BAD_PAGE_INDEX else self.backed_extent(group))

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
        if self._moves_only_cursors(new_capacity, new_history):
            self.move_cursors(new_capacity, new_history)
            return True
        plans = self._plans(new_capacity, new_history)
        if not self._fits(plans):
            return False
        self._carry_out(new_capacity, new_history, plans)
        return True

    def plan_resize(self, capacity: int | None, history_length: int | None = None) -> ResizePlan | None:
        """What `resize(capacity, history_length)` would do, changing nothing (a batch's first pass).

        None when resize would raise ValueError (the caller lets resize raise it). `plans`
        is None when no row changes (only the cursors move); otherwise one `GroupPlan` per
        layer group, whose pages (released, allocated) the caller must check its pools can
        give before `apply_plan`.
        """
        if self.closed:
            return None
        new_capacity = self.capacity if capacity is None else capacity
        new_history = self.history_length if history_length is None else history_length
        if new_capacity < new_history or new_history < self.history_length or new_capacity < 0:
            return None  # the messages are resize's (`_validated`)
        # tuple.__new__: a NamedTuple's own constructor is a third of a cursor-only step
        if self._moves_only_cursors(new_capacity, new_history):
            return tuple.__new__(ResizePlan, (new_capacity, new_history, None))
        rows, settled, P = self._rows, self._settled, self.tokens_per_block
        plans = [plan_group_resize(rows[g], settled[g], group.life_cycle, P, new_capacity, new_history)
                 for g, group in enumerate(self.groups)]  # `_plans`, a call less: every page crossing runs it
        return tuple.__new__(ResizePlan, (new_capacity, new_history, plans))

    def apply_plan(self, plan: ResizePlan) -> None:
        """Carry out a `plan_resize` answer of this cache's current state whose pages the caller made
        sure the pools have: exactly what `resize` would have done (journaled alike)."""
        if plan.plans is None:
            self.move_cursors(plan.capacity, plan.history)
        else:
            self._carry_out(plan.capacity, plan.history, plan.plans)

    def one_page_step(self, capacity: int, history: int) -> int:
        """Is this resize a page crossing of a one-group windowed cache (the shape of nearly every
        generation step that changes a row)? `resize_plan.one_page_crossing`'s answer: 1, one page taken
        at the row's end; -1, the window's oldest page given back; 0, take `plan_resize` (also for sizes
        `resize` would refuse, and for a cache with an open journal, whose undo record needs the plan).
        Tokens, as `resize`; changes nothing."""
        if len(self._rows) != 1 or self._journal is not None or self.closed:
            return 0
        if not self.history_length <= history <= capacity:
            return 0
        row, settled = self._rows[0], self._settled[0]
        backed = settled < len(row) and row[settled] != BAD_PAGE_INDEX
        return one_page_crossing(len(row), settled, backed, self._life_cycles[0], self.tokens_per_block,
                                 capacity, history)

    def take_one_page_step(self, step: int, capacity: int, history: int) -> None:
        """Carry out a `one_page_step` answer (1 or -1) of this cache's current state, its pool able to
        give the page: exactly what `resize(capacity, history)` would do (same page, same log chunk)."""
        row = self._rows[0]
        pool = self.groups[0].pool
        if step > 0:
            o = len(row)
            pages = pool.allocate(1, owner=self.owner)
            row.append(pages[0])
            self._held[0] += 1  # the settled mark stays (it never passes the row's length)
            self.changes.record((0, [o], pages))
        else:
            o = self._settled[0]
            pool.release([row[o]], owner=self.owner)
            row[o] = BAD_PAGE_INDEX
            self._held[0] -= 1
            self._settled[0] = o + 1
            self.changes.record((0, [o], None))
        self.version += 1
        self.capacity = capacity
        self.history_length = history

    def cursor_range(self) -> CursorRange:
        """Which sizes only move the cursors from the current rows (`resize_plan.cursor_range`),
        kept until the version changes. A closed cache admits no size."""
        cached = self._cursor_range
        if cached is None or cached.version != self.version:
            above, top, history_max = (0, -1, -1) if self.closed else cursor_range(
                [len(row) for row in self._rows], self._settled, self._life_cycles, self.tokens_per_block)
            # tuple.__new__: the NamedTuple's own constructor is a third of this, run after every page crossing
            cached = self._cursor_range = tuple.__new__(CursorRange, (above, top, history_max, self.version))
        return cached

    def _moves_only_cursors(self, capacity: int, history: int) -> bool:
        """No row changes for these valid sizes (most generation steps move inside one page)."""
        span = self.cursor_range()
        return span.capacity_above < capacity <= span.capacity_max and history <= span.history_max

    def _plans(self, capacity: int, history: int) -> list[GroupPlan]:
        return [self._plan_group(g, capacity, history) for g in range(len(self.groups))]

    def _carry_out(self, capacity: int, history: int, plans: list[GroupPlan]) -> None:
        """Release, then allocate, then edit the rows: the pools must have the pages."""
        journal = self._journal
        if journal is not None:  # no undo record to build when nobody keeps it
            journal.append(_Undo((self.capacity, self.history_length, self.committed), tuple(self._settled),
                                 tuple(self._held), []))
        # Release everything first: groups may share one pool, and one group's
        # growth may then need the pages another group gives back.
        # (An empty release or allocation changes nothing, tells nobody and logs nothing: skipped.)
        for g, plan in enumerate(plans):
            if plan.release:
                self.groups[g].pool.release(plan.release, owner=self.owner)
        for g, plan in enumerate(plans):
            pages = self.groups[g].pool.allocate(len(plan.allocate), owner=self.owner) if plan.allocate else []
            row_undo = self._apply(g, plan, pages)
            if journal is not None:
                journal[-1].rows.append(row_undo)
        self.version += 1
        self.capacity = capacity
        self.history_length = history

    def move_cursors(self, capacity: int, history: int) -> None:
        """Take sizes inside `cursor_range()` (the caller checked them, and that history does not
        decrease and stays within capacity): only the cursors move, as `resize` would."""
        if self._journal is None and not self._full_groups:  # nothing to record or settle
            self.capacity = capacity
            self.history_length = history
        else:
            self._move_cursors(capacity, history)

    def _move_cursors(self, capacity: int, history: int) -> None:
        """The fast path of `resize`: only capacity, history and full-attention settled marks move."""
        if self._journal is not None:
            scalars = (self.capacity, self.history_length, self.committed)
            self._journal.append(_Undo(scalars, tuple(self._settled), tuple(self._held), [(len(r), []) for r in self._rows]))
        P, settled = self.tokens_per_block, self._settled
        for g in self._full_groups:
            # Full attention never releases: every block wholly below history is final.
            settled[g] = max(settled[g], min(history // P, len(self._rows[g])))
        self.capacity = capacity
        self.history_length = history

    def _apply(self, g: int, plan: GroupPlan, pages: list[int]) -> tuple[int, list[tuple[int, int]]]:
        """Edit the row in place (only the ordinals that change); return what undoes it."""
        row = self._rows[g]
        old_len = len(row)
        saved = [(o, row[o]) for o in plan.clear]
        # the row's new or cut-off tail first (unbacked: an ordinal that grows in unbacked, a window's
        # stale range, must read so in a mirror that last saw another row in that place), then what
        # loses its page, then what gets one; whole chunks, not pairs: this runs at every page crossing
        # (Only the non-empty chunks; a grown tail that this very plan backs whole is left out, since its
        # pages supersede it: a generation step's page crossing then logs one chunk.)
        grown = plan.new_len - old_len
        allocate = plan.allocate
        covered = 0 < grown <= len(allocate) and allocate[-grown] == old_len and allocate[-1] == plan.new_len - 1
        chunks = [] if grown == 0 or covered else [(g, range(min(plan.new_len, old_len), max(plan.new_len, old_len)), None)]
        if plan.clear:
            chunks.append((g, plan.clear, None))
        if allocate:
            chunks.append((g, allocate, pages))
        if chunks:
            self.changes.record(*chunks)
        if plan.new_len < old_len:
            saved += [(o, row[o]) for o in range(plan.new_len, old_len)]
            del row[plan.new_len :]
        elif plan.new_len - old_len > old_len >> 3:
            # A big growth (a prompt's first resize) would leave the list exactly full, and its next
            # one-page growth would copy it whole into fresh memory (~0.3 ms at 65k ordinals): grow it
            # with room to spare, then trim (a trim keeps the room).
            row.extend([BAD_PAGE_INDEX] * (plan.new_len - old_len + (plan.new_len >> 3) + 8))
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

    def page_demand(self, capacity: int | None, history_length: int | None = None) -> list[int]:
        """Pages per layer group a `resize(capacity, history_length)` would take from its pool, net of
        the pages it gives back (negative: it returns more). Changes nothing; raises as resize would."""
        new_capacity, new_history = self._validated(capacity, history_length)
        plans = [self._plan_group(g, new_capacity, new_history) for g in range(len(self.groups))]
        return [len(p.allocate) - self.groups[g].pool.pages_returned_by(p.release) for g, p in enumerate(plans)]

    def _fits(self, plans) -> bool:
        # Summed per pool: layer groups that share one pool draw on one free list.
        balance: dict[int, int] = {}
        for g, plan in enumerate(plans):
            pool = self.groups[g].pool
            returned = pool.pages_returned_by(plan.release)  # a page others share stays held
            balance[id(pool)] = balance.get(id(pool), pool.num_free) + returned - len(plan.allocate)
        return all(left >= 0 for left in balance.values())

    def _plan_group(self, g: int, capacity: int, history: int) -> GroupPlan:
        return plan_group_resize(
            self._rows[g], self._settled[g], self.groups[g].life_cycle, self.tokens_per_block, capacity, history
        )

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

    def _publish(self, tokens: int, token_ids: Sequence[int], first_ordinals: Sequence[int] | None) -> None:
        """Publish every backed full page of ordinals `[committed // P, tokens // P)` (from
        `first_ordinals[g]` at least) in each group whose pool has block reuse."""
        P = self.tokens_per_block
        end = tokens // P
        for g, group in enumerate(self.groups):
            pool = group.pool
            if not pool.block_reuse:
                continue
            keys = self.keys.extend(g, token_ids, end)
            row = self._rows[g]
            first = self.committed // P if first_ordinals is None else max(self.committed // P, first_ordinals[g])
            for ordinal in range(first, min(end, len(row))):
                page = row[ordinal]
                if page != BAD_PAGE_INDEX and not pool.is_published(page):
                    pool.publish(page, keys[ordinal], owner=self.owner)

    def adopt_prefix(
        self,
        tokens: int,
        rows: Sequence[Sequence[int]],
        keys: Sequence[Sequence[PageKey]],
        *,
        stale_at: int | None = None,
    ) -> None:
        """Start this fresh cache at `tokens` tokens of history held on published pages.

        `tokens` is a whole number of pages `n * P`. `rows[g]` has `n` entries, by
        block ordinal: the published page for each ordinal group g still reads at
        history `tokens` (every ordinal outside the life cycle's stale range, sinks
        included), `BAD_PAGE_INDEX` for the stale ones. `keys[g]` holds at least the
        `n` keys of the group's chain; each page must be the one published under its
        key. Every page gains this cache's owner as a holder (`PagePool.share`).
        Afterwards capacity = history = committed = `tokens`. ValueError, changing
        nothing, on a cache that is not fresh or rows that break any of this.

        `stale_at` (>= `tokens`; a generation worker's init: the prompt end `m`):
        the stale range is taken at that history instead, so a window's rows need
        only the ordinals it still reads there. The caller's next resize must raise
        history to `stale_at` (ordinals stale there stay unbacked and settled).
        """
        if self.closed or self.capacity or self.history_length or any(self._rows):
            raise ValueError(f"cache {self.name!r}: a prefix can only be adopted by a fresh cache")
        at = tokens if stale_at is None else stale_at
        settled = adoption_settled(self.name, self.groups, self.tokens_per_block, tokens, rows, keys, at)
        n = tokens // self.tokens_per_block
        for g, group in enumerate(self.groups):
            group.pool.share([p for p in rows[g] if p != BAD_PAGE_INDEX], owner=self.owner)
            self._rows[g] = list(rows[g])
            self.changes.record((g, range(len(rows[g])), list(rows[g])))
            self._held[g] = sum(1 for p in rows[g] if p != BAD_PAGE_INDEX)
            self.keys.adopt(g, keys[g][:n])
        self._settled = settled
        self.capacity = self.history_length = self.committed = tokens
        self.version += 1

    def free(self) -> None:
        """Return every page; the cache cannot be used afterwards."""
        if self.closed:
            raise ValueError(f"cache {self.name!r} was already freed")
        for g, row in enumerate(self._rows):
            self.groups[g].pool.release([p for p in row if p != BAD_PAGE_INDEX], owner=self.owner)
            self._rows[g] = []
            self._settled[g] = 0
            self._held[g] = 0
        self.keys.forget_from(0)
        self.capacity = self.history_length = self.committed = 0
        self._journal = None
        self.closed = True
        self.version += 1
        self.export_memo = {}
        self.changes.stop()

    def checkpoint(self) -> tuple:
        """Everything that defines this cache, immutable: what a test compares for bit-identity
        (after a rollback, say)."""
        return (
            self.capacity,
            self.history_length,
            self.committed,
            tuple(tuple(r) for r in self._rows),
            tuple(self._settled),
        )

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
        log = self.changes
        for undo in reversed(records):
            for g, (row, (old_len, saved)) in enumerate(zip(self._rows, undo.rows)):
                if log.started:  # in the order of the edits below: grown tail, restored entries, cut tail
                    tail = (g, range(min(old_len, len(row)), max(old_len, len(row))), None)
                    restored = (g, [o for o, _ in reversed(saved)], [page for _, page in reversed(saved)])
                    log.record(*((tail, restored) if len(row) < old_len else (restored, tail)))
                if len(row) < old_len:
                    row.extend([BAD_PAGE_INDEX] * (old_len - len(row)))
                for o, page in reversed(saved):
                    row[o] = page
                del row[old_len:]
            self.capacity, self.history_length, self.committed = undo.scalars
            self._settled = list(undo.settled)
            self._held = list(undo.held)
        self.keys.forget_from(self.committed // self.tokens_per_block)  # recomputed when needed

