"""Where each row of a DFlash step reads and writes: block tables, context stores, generation prep.

Coordinates. Tables are UNREBASED page tables of the rows' draft mirrors
(ordinal -> page, -1 = unbacked). A token at slot position ``s`` (tokens) is
stored on ordinal ``s // P`` of its row at in-page offset ``s % P``; a read
goes through the row rebased past the slot's base, ``row[b:]`` (pages), with
context length ``L - b*P`` (tokens). Slot positions are absolute positions
minus the slot's host-side ``offset``.

The functions here only compute addresses and move slots' lengths and bases
through the :class:`~.slot_table.SlotTable`; which rows a step has and which
slot each holds is the metadata's business.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from itertools import repeat
from operator import add, gt
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from ..kernels import (
    BlockTables,
    PagedLatentPrep,
    decode_draft_block_table,
    prepare_paged_latent,
    ring_entries,
)
from ..kernels import triton_runs
from ..kernels.reference import window_read_width
from ..request import LlmRequest
from .draft_pool import DraftPool
from .slot_table import SlotTable
from .step_buffers import StepBuffers


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


@dataclasses.dataclass(frozen=True)
class RowFacts:
    """What a step asks of its rows, found once per list of rows (a step's rows are rebuilt when
    they change, never edited): each row's request id and slot, in row order, and whether the
    batch-wide generation path applies (one row per slot, every row a generation row)."""

    request_ids: list[int]
    slots: list[int]
    plain: bool
    #: the rows' slots as an int64 array, and a getter of a per-slot list's values in row order
    #: (`itemgetter(*slots)`: one C call where a comprehension loops in Python), for the staged rows
    slot_array: Any = dataclasses.field(default=None, compare=False, repr=False)
    by_slot: Any = dataclasses.field(default=None, compare=False, repr=False)


def row_facts(rows: Sequence[Row]) -> RowFacts:
    """The :class:`RowFacts` of these rows."""
    row_slots = [row.slot for row in rows]
    plain = len(set(row_slots)) == len(row_slots) and all(row.kind == "generation" for row in rows)
    return RowFacts([row.request_id for row in rows], row_slots, plain, np.array(row_slots, dtype=np.int64),
                    operator.itemgetter(*row_slots) if row_slots else None)


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


@dataclasses.dataclass
class RingStepTables:
    """One pool's tables of a step, read from the draft manager's device block table (no export).

    ``ring`` holds the pool's ring ``pages [R, C]``, ``first`` and ``extent`` ``[R]``
    (block ordinals) and ``rows`` ``[B]`` (the table row of each batch row): ordinal
    ``o`` of batch row ``b`` is ``pages[rows[b], o % C]`` inside ``[first, extent)``
    of its table row, -1 elsewhere. ``tables`` / ``extents`` give the same rows in the
    two-step form's absolute layout (the ``"python"`` decode, built on first use) for
    a consumer that indexes rows by absolute ordinal.
    """

    ring: Any

    def pages_of(self, row: int, ordinals: torch.Tensor) -> torch.Tensor:
        """int32 pages of absolute ``ordinals`` ``[n]`` of batch row ``row``, -1 outside its live span."""
        r = self.ring
        return ring_entries(r.pages, r.extent, r.rows[row : row + 1], r.first, ordinals.to(r.pages.device)[None, :])[0]

    @functools.cached_property
    def extents(self) -> torch.Tensor:
        """int64 ``[B]``: each batch row's extent (one past its last backed ordinal)."""
        r = self.ring
        return r.extent.to(torch.int64)[r.rows]

    @functools.cached_property
    def tables(self) -> torch.Tensor:
        """int32 ``[B, M]`` absolute rows (``M`` the longest extent), -1 where unbacked."""
        r = self.ring
        M = int(self.extents.max()) if self.extents.numel() else 0
        ordinals = torch.arange(M, dtype=torch.int64, device=r.pages.device)[None, :].expand(r.rows.shape[0], M)
        return ring_entries(r.pages, r.extent, r.rows, r.first, ordinals)


StepTables = Union[BlockTables, RingStepTables]

#: ``check_room(row, new_ctx_len)``: raises if the row's block would not fit its mirror.
RoomCheck = Callable[[Row, int], None]


def required_extra_kv_tokens(block_size: int) -> int:
    """``num_extra_kv_tokens`` a draft manager needs so the block fits above all accepted tokens."""
    return block_size


def check_block_room(draft_manager: Optional[DraftPool], request_id: int, new_ctx: int, block_size: int) -> None:
    """The block ``[new_ctx, new_ctx + block_size)`` (slot positions) must lie inside the request's mirror."""
    if draft_manager is None:
        return
    cap = draft_manager.get_cache(request_id).capacity
    if new_ctx + block_size > cap:
        raise ValueError(
            f"DFlash drafter: request {request_id}'s block [{new_ctx}, {new_ctx + block_size}) would be "
            f"appended past its draft mirror's capacity of {cap} tokens; build the draft manager with "
            f"max_draft_len={block_size - 1} and num_extra_kv_tokens>="
            f"{required_extra_kv_tokens(block_size)}"
        )


def check_pool(draft_manager: DraftPool, *, tokens_per_block: int, rebased_view: bool) -> None:
    """Refuse a pool a slot cannot address safely (ValueError naming the numbers).

    A worker that reads the unrebased table (``rebased_view=False``) stores a
    tail after a prefix it did not compute at slot position 0; its mirror,
    sized for the tail's absolute position, has released those low pages on a
    windowed pool that does not join the target's block reuse, so the stores
    would land on other requests' pages.
    """
    if draft_manager.tokens_per_block != tokens_per_block:
        raise ValueError(
            f"DFlash drafter: metadata built for {tokens_per_block}-token pages, draft manager uses "
            f"{draft_manager.tokens_per_block}"
        )
    windows = tuple(g.window for g in draft_manager.config.layer_groups)
    paired = bool(getattr(draft_manager, "joint_kv_cache_reuse", False))
    if not rebased_view and not paired and any(w is not None for w in windows):
        raise ValueError(
            "DFlash drafter: a worker that reads the unrebased table (_ctx_reads_rebased_view=False) "
            f"cannot use a windowed draft pool (windows {list(windows)}, {tokens_per_block}-token "
            "pages) without joint_kv_cache_reuse: a context tail after a prefix it did not compute is "
            "stored at slot position 0, on pages the mirror has released. Read the rebased view, join "
            "the target's block reuse, or use a full-attention draft pool."
        )


# --------------------------------------------------------------------------- block tables
def decode_tables(
    draft_manager: Optional[DraftPool],
    ids: list[int],
    slots: list[int],
    *,
    backend: str,
    fused: bool,
    pages_per_slot: int,
    device: torch.device,
    ring: bool = False,
) -> list[StepTables]:
    """Unrebased page tables ``[B, M]`` and extents, one per pool (layer group).

    ``draft_manager=None`` (private arena): slot ``s`` owns pages
    ``[s * pages_per_slot, (s + 1) * pages_per_slot)``, every row counts full.
    ``ring``: read the draft manager's device block table instead (synced for these
    rows, only what changed since the last step), when it lives on ``device``.
    """
    impl = None if fused else "reference"
    if draft_manager is None:
        pps = pages_per_slot
        slot_t = torch.tensor(slots, dtype=torch.int64, device=device)
        tables = (slot_t[:, None] * pps + torch.arange(pps, device=device)[None, :]).to(torch.int32)
        extents = torch.full((len(slots),), pps, dtype=torch.int64, device=device)
        return [BlockTables(tables, extents)]
    dm = draft_manager
    if ring and _same_device(torch.device(dm.config.device), device):
        table = dm.sync_block_table(ids)
        return [RingStepTables(table.ring(g, ids)) for g in range(dm.num_pools)]
    if not triton_runs(impl, device):
        # The torch decode would only invert the export: take the tables from the rows.
        return [BlockTables(t.to(device), e.to(device)) for t, e in dm.block_tables(ids, backend, width="live")]
    # The live width (the batch's longest row), not max_blocks_per_seq: the same tables, less to move.
    offsets = dm.get_block_offsets(ids, backend, width="live").to(device)
    return [
        decode_draft_block_table(offsets, g, len(ids), dm.config.kv_factor, backend, impl=impl)
        for g in range(dm.num_pools)
    ]


def _same_device(a: torch.device, b: torch.device) -> bool:
    """`cuda` and `cuda:<current>` are one device."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


# --------------------------------------------------------------------------- context stores
def advance_slot_for_context(
    slots: SlotTable,
    tables: Sequence[StepTables],
    index: int,
    row: Row,
    positions: torch.Tensor | Sequence[int],
    check_room: RoomCheck,
) -> ContextStorePlan:
    """Store targets of row ``index``'s context chunk, and advance its slot past it.

    ``positions`` are absolute target positions, contiguous from where the slot
    continues (``L + offset``). Tokens at slot positions ``>= store_limit`` are
    not stored (a private arena clamps; a shared pool raises the base instead).
    """
    rid, slot = row.request_id, row.slot
    pos = torch.as_tensor(positions, dtype=torch.int64).reshape(-1).cpu()
    n = pos.numel()
    L, offset = slots.host_len(slot)
    expected = L + offset
    if n and (int(pos[0]) != expected or not torch.equal(pos, torch.arange(expected, expected + n))):
        raise ValueError(
            f"DFlash drafter: request {rid}'s context store must continue its slot at absolute position "
            f"{expected} with contiguous positions, got [{int(pos[0])}, ..., {int(pos[-1])}] ({n} tokens)"
        )
    P = slots.tokens_per_block
    limit = slots.store_limit()
    new_L = min(L + n, limit)
    if row.proposing:
        check_room(row, new_L)
    slot_pos = torch.arange(L, L + n, dtype=torch.int64, device=slots.device)
    keep = slot_pos < limit
    pages = []
    ordinal = slot_pos // P
    for bt in tables:
        if isinstance(bt, RingStepTables):
            pg = bt.pages_of(index, torch.where(keep, ordinal, -1)).to(slots.device)
            pages.append(torch.where(keep, pg, -1).to(torch.int32))
            continue
        M = bt.tables.shape[1]
        inside = keep & (ordinal < M)
        pg = bt.tables[index].long().gather(0, torch.where(inside, ordinal, 0)) if M else ordinal
        pages.append(torch.where(inside, pg, -1).to(torch.int32))
    offsets = torch.where(keep, slot_pos % P, -1).to(torch.int32)
    slots.commit_store(slot, new_L, n)
    return ContextStorePlan(index, slot_pos, pages, offsets)


# --------------------------------------------------------------------------- generation step
READ_BOUNDS = ("window", "base")


def read_windows(draft_manager: Optional[DraftPool], read_bound: str) -> list[Optional[int]]:
    """Per pool, the window (tokens) that bounds a generation step's read rows, or ``None``.

    ``read_bound="window"`` (default): a windowed pool's rows start at the
    window's first page and stop at the block's last one, so a consumer that
    reads what the rows say reads only pages the request holds. ``"base"``:
    upstream's layout, rows from the slot base as wide as the export (the
    consumer applies the window). A private arena and full-attention pools
    are never bounded.
    """
    if read_bound not in READ_BOUNDS:
        raise ValueError(f"read_bound must be one of {READ_BOUNDS}, got {read_bound!r}")
    if draft_manager is None:
        return [None]
    groups = draft_manager.config.layer_groups
    return [g.window if read_bound == "window" else None for g in groups]


def generation_counts(num_new: Sequence[int] | Mapping[int, int] | None, request_ids: list[int]) -> list[int]:
    """Accepted tokens per row (row order) from a sequence, a mapping request id -> count, or None."""
    if num_new is None:
        return [0] * len(request_ids)
    if type(num_new) is not list and isinstance(num_new, Mapping):  # a list (the usual step) skips the ABC check
        unknown = [rid for rid in num_new if rid not in set(request_ids)]
        if unknown:
            raise KeyError(
                f"DFlash drafter: requests {unknown} are not rows of this step (rows: {request_ids[:16]})"
            )
        return [int(num_new.get(rid, 0)) for rid in request_ids]
    counts = list(map(int, num_new))
    if len(counts) != len(request_ids):
        raise ValueError(f"DFlash drafter: {len(counts)} counts for {len(request_ids)} rows")
    return counts


def _new_lengths(
    slots: SlotTable, rows: Sequence[Row], counts: list[int], max_new: int, check_room: RoomCheck,
    room: Optional[tuple[Sequence[int], int]] = None, facts: Optional[RowFacts] = None,
) -> dict[int, int]:
    """Slot -> its ``ctx_len`` after the step (checked: only generation rows commit, room for the block).

    ``room``: each row's mirror capacity (tokens) and the block size, when the caller has them: the
    room is then checked over the batch at once, ``check_room`` called (to raise) only for a row
    without it. ``facts``: the rows' :class:`RowFacts`, when the caller keeps them.
    """
    lengths, limit = slots.ctx_len_host, slots.store_limit()  # once, not per row
    facts = facts if facts is not None else row_facts(rows)
    if room is not None and facts.plain and (not counts or (min(counts) >= 0 and max(counts) <= max_new)):
        # The usual generation step, batch-wide: valid counts, one row per slot, generation rows only.
        new = [n if n < limit else limit for n in map(add, map(lengths.__getitem__, facts.slots), counts)]
        capacities, block_size = room
        if any(map(gt, map(add, new, repeat(block_size)), capacities)):  # some block past its mirror's room
            for row, n, cap in zip(rows, new, capacities):
                if n + block_size > cap and row.proposing:
                    check_room(row, n)  # raises, naming the request and the numbers
        return dict(zip(facts.slots, new))
    new_host: dict[int, int] = {}
    for row, n in zip(rows, counts):
        if n and row.kind != "generation":
            raise ValueError(
                f"DFlash drafter: request {row.request_id} is a {row.kind} row; only generation rows "
                f"commit accepted tokens (got {n})"
            )
        if not 0 <= n <= max_new:
            raise ValueError(f"DFlash drafter: request {row.request_id} commits {n} tokens; allowed 0..{max_new}")
        new = min(lengths[row.slot] + n, limit)
        if row.slot in new_host and new_host[row.slot] != new:
            raise ValueError(f"DFlash drafter: rows sharing slot {row.slot} disagree on its new length")
        new_host[row.slot] = new
        if row.proposing:
            check_room(row, new)
    return new_host


def prepare_generation(
    slots: SlotTable,
    rows: Sequence[Row],
    tables: Sequence[StepTables],
    slot_ids: torch.Tensor,
    counts: list[int],
    *,
    block_size: int,
    max_new: int,
    fused: bool,
    check_room: RoomCheck,
    read_windows: Optional[Sequence[Optional[int]]] = None,
    buffers: Optional[StepBuffers] = None,
    capacities: Optional[Sequence[int]] = None,
    facts: Optional[RowFacts] = None,
) -> list[PagedLatentPrep]:
    """One :class:`PagedLatentPrep` per pool; advances every row's slot to ``min(L + n, limit)``.

    Bases are raised before the launch, so the read is clamped with the new
    length. One ``prepare_paged_latent`` per pool: the kernel when ``fused``,
    else its torch reference (``impl="reference"``). ``read_windows[g]``
    (tokens, ``None`` = unbounded) bounds pool ``g``'s read rows to the
    drafter's window (:func:`read_windows`). ``buffers``: the step's inputs and the ring
    form's outputs kept in place, its launches bound to them (a preparation is then valid
    until the next step's). ``capacities``: each row's mirror capacity (tokens), when known, so
    the room for each row's block is checked over the batch at once (else ``check_room`` per row).
    ``facts``: the rows' :class:`RowFacts`, when the caller keeps them with the rows.
    """
    room = None if capacities is None else (capacities, block_size)
    facts = facts if facts is not None else row_facts(rows)
    new_host = _new_lengths(slots, rows, counts, max_new, check_room, room, facts)
    consumed = dict(zip(facts.slots, counts))
    lengths = slots.ctx_len_host  # before the step: the staged form reads them from the host
    slots.raise_bases(new_host)
    kw = dict(block_size=block_size, tokens_per_block=slots.tokens_per_block, max_new=max_new)
    windows = list(read_windows) if read_windows is not None else [None] * len(tables)
    if buffers is not None and rows and _all_staged(tables):
        preps = _staged_steps(slots, tables, windows, facts, lengths, counts, buffers, fused, kw)
        slots.advance_hosts(new_host, consumed)
        return preps
    n_t = buffers.num_new(counts) if buffers is not None else torch.tensor(counts, dtype=torch.int64,
                                                                          device=slots.device)
    preps = []
    for g, (bt, window) in enumerate(zip(tables, windows)):
        impl = None if fused else "reference"
        if isinstance(bt, RingStepTables):
            r = bt.ring
            if buffers is None:
                preps.append(prepare_paged_latent(
                    r.pages, r.extent, slot_ids, slots.ctx_len, slots.base_pages, n_t, table_rows=r.rows,
                    table_first=r.first, max_ctx=slots.store_limit(), impl=impl, read_window=window, **kw,
                ))
                continue
            out = _ring_out(buffers, g, len(counts), window, r.pages, slots.tokens_per_block, kw)
            preps.append(buffers.ring_step(g, r, slot_ids, slots.ctx_len, slots.base_pages, n_t, out, impl=impl,
                                           max_ctx=slots.store_limit(), read_window=window, **kw))
            continue
        preps.append(prepare_paged_latent(
            bt.tables, bt.extents, slot_ids, slots.ctx_len, slots.base_pages, n_t,
            max_ctx=slots.store_limit(), impl=impl, read_window=window, **kw,
        ))
    if rows:
        slots.ctx_len.index_copy_(0, slot_ids, preps[0].new_ctx_len)
    slots.advance_hosts(new_host, consumed)
    return preps


def _ring_out(buffers: StepBuffers, pool: int, B: int, window: Optional[int], pages: torch.Tensor,
              tokens_per_block: int, kw: dict) -> PagedLatentPrep:
    """Pool ``pool``'s kept outputs for a ring-form step: rows as wide as the window bounds them, else the ring."""
    width = window_read_width(window, tokens_per_block) if window is not None else pages.shape[1]
    return buffers.out(pool, B, width, kw["block_size"], kw["max_new"])


def _all_staged(tables: Sequence[StepTables]) -> bool:
    """Whether every pool's tables are a ring whose host mirror the step can stage from."""
    return all(isinstance(bt, RingStepTables) and bt.ring.host_first is not None for bt in tables)


def _staged_steps(
    slots: SlotTable, tables: Sequence[StepTables], windows: list[Optional[int]], facts: RowFacts,
    lengths: Sequence[int], counts: list[int], buffers: StepBuffers, fused: bool, kw: dict,
) -> list[PagedLatentPrep]:
    """Every pool's preparation in the staged ring form (``kernels.staged_ring``): each row's table row,
    live span, slot base, slot length (before the step), count and slot staged from the host mirrors in
    one copy, one launch per pool; pool 0's launch also writes the slots' new lengths. Rows sharing a
    slot agree on its new length (``_new_lengths`` checked it), so their stores to it are one value."""
    B, G = len(facts.slots), len(tables)
    host = buffers.stage_rows(G, B)
    shared = host[0]
    shared[:, 3] = facts.by_slot(slots.base_pages_host)  # raised for this step already
    shared[:, 4] = facts.by_slot(lengths)
    shared[:, 5] = counts
    shared[:, 6] = facts.slot_array
    shared[:, 7] = 0
    for g, bt in enumerate(tables):
        r = bt.ring
        rows = r.host_rows
        if g:
            host[g] = shared
        host[g, :, 0] = rows
        host[g, :, 1] = r.host_first[rows]
        host[g, :, 2] = r.host_extent[rows]
    scalars = buffers.push_rows()
    impl = None if fused else "reference"
    preps = []
    for g, (bt, window) in enumerate(zip(tables, windows)):
        pages = bt.ring.pages
        out = _ring_out(buffers, g, B, window, pages, slots.tokens_per_block, kw)
        preps.append(buffers.staged_step(g, pages, scalars[g], slots.ctx_len if g == 0 else None, out, impl=impl,
                                         max_ctx=slots.store_limit(), read_window=window, **kw))
    return preps


__all__ = [
    "ContextStorePlan",
    "RingStepTables",
    "Row",
    "RowFacts",
    "StepTables",
    "check_block_room",
    "check_pool",
    "decode_tables",
    "generation_counts",
    "advance_slot_for_context",
    "prepare_generation",
    "read_windows",
    "required_extra_kv_tokens",
    "row_facts",
]
