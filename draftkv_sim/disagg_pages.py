"""The page handshake: which pages of the generation worker a request's one transfer writes.

Coordinates: absolute token positions of the request; block ordinal = position // P; pages are each
worker's own page ids. Per request, after the offer:

- the context worker's facts (`ContextFacts`): its prefix hit, where its drafter context starts, how
  many drafts it proposed, the drafter context's geometry (or none);
- the generation worker's reply (`PageHandshake`), sent once both generation-init caches exist: per
  target group the pages backing ordinals `[lo_g // P, (m - 1) // P]` (what its window reads), per draft
  group the pages backing the drafter window the handoff covers (kv form; none in hidden form or
  without a drafter), and the auxiliary slot for the drafts and the `hidden`-form context;
- the context worker's one WRITE: its own pages of the same ordinals onto those pages, runs merged
  (`tensorrt_llm_draftkv.transfer.page_write_descs`), plus its auxiliary bytes onto the slot.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from tensorrt_llm_draftkv.runtime import BAD_PAGE_INDEX
from tensorrt_llm_draftkv.speculative.handoff import DrafterContextGeometry, HandoffForm
from tensorrt_llm_draftkv.transfer import RankMemory, page_write_descs, pool_regions, slot_descs
from tensorrt_llm_draftkv.transfer.regions import PoolRegion
from .disagg_wire import Transfer, clipped_hidden_range, clipped_ranges

_AUX_HEADER = 3  # int64: [drafts, hidden rows, hidden columns]


@dataclass(frozen=True)
class ContextFacts:
    """What the generation worker needs from the context worker before it allocates (sent after the offer)."""

    reused_tokens: int = 0  # the context worker's own prefix hit
    drafter_lo: int = 0  # its drafter context starts here (its hit without joint reuse)
    geometry: DrafterContextGeometry | None = None  # the drafter context's, or None: none is sent


@dataclass(frozen=True)
class PageHandshake:
    """The generation worker's reply: where the one transfer of request `request_id` goes (see module doc).

    `accepted` False: it will not take the request (refused, or its executor is dead); nothing is sent.
    `drafter_context` False: it drops the drafter context (another geometry, with fallback on): no drafter
    pages or hidden states are sent.
    """

    request_id: int
    accepted: bool
    drafter_context: bool = False
    gen_reused_tokens: int = 0
    gen_drafter_reused: int = 0
    aux_slot: int = 0
    target_lo: tuple[int, ...] = ()
    target_pages: tuple[np.ndarray, ...] = ()
    draft_lo: tuple[int, ...] = ()
    draft_pages: tuple[np.ndarray, ...] = ()

    def to_wire(self) -> np.ndarray:
        head = [self.request_id, int(self.accepted), int(self.drafter_context), self.gen_reused_tokens,
                self.gen_drafter_reused, self.aux_slot, len(self.target_lo), len(self.draft_lo), *self.target_lo,
                *self.draft_lo, *(len(p) for p in (*self.target_pages, *self.draft_pages))]
        return np.concatenate([np.array(head, dtype=np.int64), *self.target_pages, *self.draft_pages])

    @classmethod
    def from_wire(cls, ints: np.ndarray) -> "PageHandshake":
        rid, accepted, context, reused, drafter_reused, slot, nt, nd = (int(x) for x in ints[:8])
        pos = 8
        target_lo = tuple(int(x) for x in ints[pos : pos + nt])
        draft_lo = tuple(int(x) for x in ints[pos + nt : pos + nt + nd])
        pos += nt + nd
        counts = [int(x) for x in ints[pos : pos + nt + nd]]
        pos += nt + nd
        pages = []
        for c in counts:
            pages.append(np.asarray(ints[pos : pos + c], dtype=np.int64))
            pos += c
        return cls(rid, bool(accepted), bool(context), reused, drafter_reused, slot, target_lo, tuple(pages[:nt]),
                   draft_lo, tuple(pages[nt:]))


def _row_pages(manager, request_id: int, group: int, lo: int, hi: int, what: str) -> np.ndarray:
    """Page ids backing ordinals `[lo // P, (hi - 1) // P]` of one group's row (empty when `hi <= lo`)."""
    if hi <= lo:
        return np.zeros(0, dtype=np.int64)
    P = manager.tokens_per_block
    row = np.asarray(manager.get_cache(request_id).block_row_slice(group, lo // P, (hi - 1) // P + 1),
                     dtype=np.int64)
    if row.size != (hi - 1) // P - lo // P + 1 or (row == BAD_PAGE_INDEX).any():
        raise ValueError(f"request {request_id}: {what} of positions [{lo}, {hi}) in layer group {group}: "
                         f"ordinals {lo // P}..{(hi - 1) // P} are not all backed ({row.tolist()[:8]}...)")
    return row


def draft_ranges(item: Transfer) -> list[tuple[int, int]]:
    """Per draft group, the positions `[lo, m)` whose pages the transfer writes (kv form; else none)."""
    g = item.drafter_geometry
    if g is None or g.form is not HandoffForm.KV:
        return []
    return clipped_ranges(g, item.prompt_len, item.drafter_floor)


def hidden_rows(item: Transfer) -> int:
    """Rows of the `hidden`-form drafter context the auxiliary slot carries (0 in kv form or without one)."""
    g = item.drafter_geometry
    if g is None or g.form is not HandoffForm.HIDDEN:
        return 0
    lo, hi = clipped_hidden_range(g, item.prompt_len, item.drafter_floor)
    return hi - lo


def request_pages(executor, item: Transfer, what: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """This worker's pages of the request's transfer: per target group, per draft group (numpy, no page loop
    in Python beyond the groups)."""
    rid, m = item.request_id, item.prompt_len
    target = [_row_pages(executor.target_manager, rid, g, lo, m, what) for g, lo in enumerate(item.group_lo)]
    draft = [_row_pages(executor.draft_manager, rid, g, lo, hi, what) for g, (lo, hi) in enumerate(draft_ranges(item))]
    return target, draft


def handshake_for(executor, item: Transfer, aux_slot: int, take_context: bool) -> PageHandshake:
    """Generation worker, both generation-init caches built: the reply that tells the context worker where to
    write (`take_context` False: without the drafter context)."""
    if not take_context:
        item = replace(item, drafter_geometry=None)
    target, draft = request_pages(executor, item, "receiving")
    return PageHandshake(item.request_id, True, take_context, item.gen_reused_tokens, item.gen_drafter_reused, aux_slot,
                         tuple(item.group_lo), tuple(target), tuple(lo for lo, _ in draft_ranges(item)), tuple(draft))


def check_handshake(item: Transfer, hs: PageHandshake) -> None:
    """Context worker: the reply must describe the ranges this worker computed for the same hits."""
    want = (tuple(item.group_lo), tuple(lo for lo, _ in draft_ranges(item)))
    if (hs.target_lo, hs.draft_lo) != want:
        raise ValueError(f"request {item.request_id}: the generation worker asks for target positions from "
                         f"{hs.target_lo} and drafter positions from {hs.draft_lo}; this worker sends {want}")


# -- registered memory ----------------------------------------------------------------------------------------
def aux_slot_bytes(executor, max_draft_len: int) -> int:
    """One auxiliary slot: the header, the drafts, and the largest `hidden`-form context this worker's drafter
    geometry can hand over (its hidden range at the longest sequence)."""
    size = 8 * (_AUX_HEADER + max_draft_len)
    speculator = executor.speculator
    if executor.draft_manager is not None and hasattr(speculator, "handoff_geometry"):
        g = speculator.handoff_geometry(HandoffForm.HIDDEN)
        lo, hi = g.hidden_range(executor.target_manager.config.max_seq_len)
        size += (hi - lo) * g.hidden_size * (g.hidden_dtype or g.dtype).itemsize
    return size


def rank_memory(executor, aux: torch.Tensor) -> RankMemory:
    """Every target and draft pool layer of this worker, and its auxiliary buffer `aux` (`[slots, bytes]` uint8)."""
    def groups(manager) -> tuple:
        if manager is None:
            return ()
        return tuple(pool_regions(g.pool.layers, manager.tokens_per_block) for g in manager.layer_groups)

    aux_region = PoolRegion(aux.data_ptr(), aux.shape[0], aux.shape[1], aux.stride(0), 1)
    return RankMemory(groups(executor.target_manager), groups(executor.draft_manager), aux_region)


def pack_aux(item: Transfer, hidden: torch.Tensor | None) -> torch.Tensor:
    """The auxiliary bytes of a request: `[drafts, rows, cols]`, the drafts, the hidden states' raw bytes."""
    rows, cols = (0, 0) if hidden is None else (hidden.shape[0], hidden.shape[1])
    ints = torch.tensor([len(item.drafts), rows, cols, *item.drafts], dtype=torch.long).view(torch.uint8)
    if hidden is None:
        return ints
    return torch.cat([ints, hidden.contiguous().view(-1).view(torch.uint8)])


def unpack_aux(slot: torch.Tensor, item: Transfer, with_context: bool = True) -> None:
    """Fill `item.drafts` (and, in hidden form, `item.drafter_payload`) from a landed auxiliary slot
    (`with_context` False: the handshake declined the drafter context, so no hidden rows came)."""
    n, rows, cols = (int(x) for x in slot[: 8 * _AUX_HEADER].view(torch.long).tolist())
    end = 8 * (_AUX_HEADER + n)
    item.drafts = [int(x) for x in slot[8 * _AUX_HEADER : end].view(torch.long).tolist()]
    want = hidden_rows(item) if with_context else 0
    if rows != want:
        raise ValueError(f"request {item.request_id}: the auxiliary slot holds {rows} hidden rows, expected {want}")
    if rows:
        g = item.drafter_geometry
        dtype = g.hidden_dtype or g.dtype
        nbytes = rows * cols * dtype.itemsize
        item.drafter_payload = [slot[end : end + nbytes].clone().view(dtype).view(rows, cols)]


def write_descs(local: RankMemory, remote: RankMemory, mine: tuple[list[np.ndarray], list[np.ndarray]],
                hs: PageHandshake, aux_slot: int, aux_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The request's one WRITE as paired `[N, 3]` descriptors: every target and draft group's pages, then the
    auxiliary bytes (this worker's slot `aux_slot` onto the peer's `hs.aux_slot`)."""
    what = f"request {hs.request_id}"
    src, dst = [], []
    pairs = [*zip(local.target, remote.target, mine[0], hs.target_pages),
             *zip(local.draft, remote.draft, mine[1], hs.draft_pages)]
    for ours, theirs, our_pages, their_pages in pairs:
        s, d = page_write_descs(ours, our_pages, theirs, their_pages, what=what)
        src.append(s)
        dst.append(d)
    src.append(slot_descs(local.aux, aux_slot, aux_bytes, what=what))
    dst.append(slot_descs(remote.aux, hs.aux_slot, aux_bytes, what=what))
    return np.concatenate(src), np.concatenate(dst)
