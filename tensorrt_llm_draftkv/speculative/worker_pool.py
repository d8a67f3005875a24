"""Where the DFlash worker's context store lives: the draft pool's tensors, or a private arena.

`PoolBinding` holds one HND tensor per drafter layer (`[pages, kv_factor, heads,
P, head_dim]`), the pool each layer lives in, and one page table per pool
(int32 `[num_slots, width]`: batch rows by page ordinal on a shared pool, slots
on an arena). It decodes upstream's block offsets into those tables, checks a
store against the request's own mirror, and writes.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from ..kernels import ring_entries
from ..manager.block_table import last_of_each
from ..staging import PinnedStager, scatter_int32
from .draft_pool import DraftPool


class DraftStoreRefused(ValueError):
    """A drafter store would land on a page its request's mirror does not hold; nothing was written."""

    def __init__(self, message: str, *, request_id: int, position: int, pool: int) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.position = position
        self.pool = pool


@dataclass
class PoolBinding:
    """The context store of one worker (see the module docstring)."""

    layers: list[torch.Tensor]
    layer_pool: list[int]
    tables: list[torch.Tensor]
    kv_factor: int
    tokens_per_block: int
    arena: bool
    manager: Optional[DraftPool] = None
    #: per pool, int64 [num_slots]: entries the last decode found non-negative (upstream's block counts)
    counts: list[torch.Tensor] = field(default_factory=list)
    #: per pool, the draft manager's device block table for the rows (see `note_owned`), and for which
    #: rows and step
    owned: list[Any] = field(default_factory=list)
    owned_ids: list[int] = field(default_factory=list)
    refreshed_step: int = -1
    #: the offsets the tables were last decoded from: (tensor, the manager's write number, width, rows)
    decoded: Optional[tuple] = None
    #: rows the last `decode` decoded whole (the rest: only the entries the manager changed)
    rows_decoded_whole: int = 0
    #: the decoded entries' copies (made at the first, on the layers' device)
    stager: Optional[PinnedStager] = None

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def staging(self) -> PinnedStager:
        """The binding's kept pinned arena for its small host-to-device copies."""
        if self.stager is None:
            self.stager = PinnedStager(self.device)
        return self.stager

    # ------------------------------------------------------------------ tables
    def decode(self, src: torch.Tensor, num_seqs: int) -> None:
        """`src[p, :num_seqs, 0]` (`page * kv_factor + k`, negative = unbacked) -> `tables[p][:num_seqs]`.

        When the draft manager wrote `src` (`copy_batch_block_offsets`) and nobody else has since,
        only what its writes changed since the last decode is decoded again: the tables stay what a
        whole decode would give, at the cost of what changed (nothing, on most steps)."""
        if src.dim() != 4 or src.shape[0] < len(self.tables) or src.shape[1] < num_seqs:
            raise ValueError(
                f"DFlashWorker: draft block offsets of shape {tuple(src.shape)} do not cover "
                f"{len(self.tables)} pools x {num_seqs} rows x 2 x width"
            )
        writes = self.manager.offset_destinations if self.manager is not None else None
        last = self.decoded
        since = None
        if writes is not None and last is not None and last[0]() is src and last[2] == src.shape[-1]:
            since = writes.written_since(src, last[1])
        if since is None:
            self.rows_decoded_whole = num_seqs
            for p in range(len(self.tables)):
                self._decode_rows(src, p, torch.arange(num_seqs, device=self.device), num_seqs)
        else:
            full, rows, pools, ordinals, k_values = since
            full = sorted({b for b in full if b < num_seqs} | set(range(last[3], num_seqs)))
            self.rows_decoded_whole = len(full)
            if rows.size:
                keep = rows < num_seqs
                if full:
                    keep &= ~np.isin(rows, full)
                rows, pools, ordinals, k_values = rows[keep], pools[keep], ordinals[keep], k_values[keep]
            if full:
                for p in range(len(self.tables)):
                    self._decode_rows(src, p, torch.tensor(full, device=self.device), num_seqs)
            if rows.size:
                self._decode_entries(rows, pools, ordinals, k_values)
        serial = writes.serial(src) if writes is not None else None
        self.decoded = None if serial is None else (weakref.ref(src), serial, src.shape[-1], num_seqs)

    def _decode_rows(self, src: torch.Tensor, p: int, rows: torch.Tensor, num_seqs: int) -> None:
        """Whole rows of pool p's table (and their counts) from `src`; entries past its width read page 0."""
        encoded = src[p, :num_seqs, 0].index_select(0, rows.to(src.device)).to(device=self.device, dtype=torch.int64)
        width = encoded.shape[-1]
        table = self.tables[p]
        if width > table.shape[1]:  # a wider export than any before: grow once, keep the rows
            grown = torch.zeros(table.shape[0], width, dtype=torch.int32, device=self.device)
            grown[:, : table.shape[1]] = table
            self.tables[p] = table = grown
        self.counts[p][rows] = (encoded >= 0).sum(dim=1)
        decoded = torch.zeros(rows.numel(), table.shape[1], dtype=torch.int32, device=self.device)
        decoded[:, :width] = encoded.clamp(min=0).div(self.kv_factor, rounding_mode="floor").to(torch.int32)
        table[rows] = decoded

    def _decode_entries(self, rows: np.ndarray, pools: np.ndarray, ordinals: np.ndarray, k_values: np.ndarray) -> None:
        """Single entries of the tables from the K offsets the manager wrote (its "cpp" offsets are never
        negative, so the row counts stay): decoded on the host, the last write of each entry kept (where
        one repeats), then per pool one staged copy and one scatter (`scatter_int32`). `src` is not read back."""
        key = (pools << 56) | (rows << 36) | ordinals
        if len(set(key.tolist())) != key.size:  # one write names each entry once: only merged writes repeat
            # (a Python set of a step's few entries costs a few µs; a sort, inside a step, ten times that)
            keep = last_of_each(key)
            rows, pools, ordinals, k_values = rows[keep], pools[keep], ordinals[keep], k_values[keep]
        pages = np.maximum(k_values, 0) // self.kv_factor
        stager = self.staging()
        for p in sorted(set(pools.tolist())):
            table = self.tables[p]
            mine = pools == p
            scatter_int32(table.view(-1), rows[mine] * table.stride(0) + ordinals[mine], pages[mine], stager)

    def pages_for(self, rows: torch.Tensor, positions: torch.Tensor) -> dict[int, torch.Tensor]:
        """Pool -> int64 `[n]` page of each `(row, position)`; -1 past the table's width."""
        out = {}
        ordinal = positions // self.tokens_per_block
        for p in sorted(set(self.layer_pool)):
            table = self.tables[p]
            inside = (ordinal >= 0) & (ordinal < table.shape[1])
            page = table[rows, torch.where(inside, ordinal, 0)].long()
            out[p] = torch.where(inside, page, -1)
        return out

    def note_owned(self, request_ids: list[int], step: int) -> None:
        """The rows' own pages for this step's store checks: the draft manager's device block table,
        synced for these requests (only what changed since the last step), one ring per pool."""
        table = self.manager.sync_block_table(request_ids)
        self.owned = [table.ring(p, request_ids) for p in range(len(self.tables))]
        self.owned_ids = list(request_ids)
        self.refreshed_step = step

    def _held_and_named(self, p: int, rows: torch.Tensor, ordinal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 `[n]` each `(row, ordinal)`'s page in its request's mirror (-1 where it holds none) and the
        page the decoded table names there (-1 past the table's width)."""
        ring, table = self.owned[p], self.tables[p]
        held = ring_entries(ring.pages, ring.extent, ring.rows[rows], ring.first, ordinal[:, None])[:, 0].long()
        inside = (ordinal >= 0) & (ordinal < table.shape[1])
        named = torch.where(inside, table[rows, torch.where(inside, ordinal, 0)].long(), -1)
        return held, named

    def checked_pages(self, step: int, rows: torch.Tensor, positions: torch.Tensor) -> dict[int, torch.Tensor]:
        """Pool -> int64 `[n]` page of each `(row, position)`, each one a page the row's request holds.

        One device-to-host sync for the whole store; DraftStoreRefused (or RuntimeError for a row the
        tables were not refreshed for) before anything is written, the message built only then.
        """
        if self.refreshed_step != step:
            raise RuntimeError(
                "DFlashWorker: the block tables were not refreshed for this step; call "
                "_refresh_ctx_block_tables(attn_metadata, num_seqs) after spec_metadata.prepare()"
            )
        ordinal = positions // self.tokens_per_block
        known = (rows >= 0) & (rows < len(self.owned_ids))
        r = torch.where(known, rows, 0)
        out, bad = {}, ~known
        for p in sorted(set(self.layer_pool)):
            held, named = self._held_and_named(p, r, torch.where(known, ordinal, -1))
            out[p] = torch.where(known & (held >= 0) & (held == named), held, -1)
            bad |= out[p] < 0
        if rows.numel() and bool(bad.any()):
            self._refuse(int(bad.nonzero()[0]), rows, positions)
        return out

    def _refuse(self, i: int, rows: torch.Tensor, positions: torch.Tensor) -> None:
        r, pos = int(rows[i]), int(positions[i])
        if not 0 <= r < len(self.owned_ids):
            raise RuntimeError(
                f"DFlashWorker: a store names batch row {r}, but the block tables were refreshed "
                f"for {len(self.owned_ids)} rows"
            )
        rid, ordinal = self.owned_ids[r], pos // self.tokens_per_block
        for p in sorted(set(self.layer_pool)):
            held_t, named_t = self._held_and_named(p, rows[i : i + 1], positions[i : i + 1] // self.tokens_per_block)
            held, page = int(held_t[0]), int(named_t[0])
            if held < 0 or held != page:
                what = "does not back that ordinal" if held < 0 else f"holds page {held} there"
                raise DraftStoreRefused(
                    f"DFlashWorker: request {rid} (batch row {r}) would store position {pos} (ordinal {ordinal}) "
                    f"of draft pool {p} on page {page}, but its mirror {what}; nothing was written",
                    request_id=rid, position=pos, pool=p,
                )

    # ------------------------------------------------------------------ writes
    def write(self, pages: dict[int, torch.Tensor], offsets: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor | None) -> None:
        """K (and V) `[n, layers, heads, head_dim]` at `(pages[pool of layer], offsets)` of every layer."""
        if k.dim() != 4 or k.shape[1] != len(self.layers):
            raise ValueError(f"DFlashWorker: K must be [n, {len(self.layers)}, heads, head_dim], got {tuple(k.shape)}")
        for layer, buf in enumerate(self.layers):
            pg = pages[self.layer_pool[layer]]
            buf[pg, 0, :, offsets, :] = k[:, layer].to(device=buf.device, dtype=buf.dtype)
            if v is not None:
                buf[pg, 1, :, offsets, :] = v[:, layer].to(device=buf.device, dtype=buf.dtype)

    def write_layers(self, layers: list[int], pages: torch.Tensor, offsets: torch.Tensor, kv: torch.Tensor) -> None:
        """`kv` `[n, len(layers), kv_factor, heads, head_dim]` at `(pages, offsets)`; negative entries skipped."""
        pages, offsets = pages.to(self.device).long(), offsets.to(self.device).long()
        keep = (pages >= 0) & (offsets >= 0)
        if not bool(keep.all()):
            pages, offsets, kv = pages[keep], offsets[keep], kv[keep.to(kv.device)]
        if pages.numel() == 0:
            return
        kv = kv.to(self.device)
        first = self.layers[layers[0]]
        _, kvf, heads, P, D = first.shape
        # one flat row index per (token, K/V, head): index_copy_ over a [*, head_dim] view, no advanced indexing
        plane = torch.arange(kvf, device=self.device)[None, :, None] * (heads * P)
        head = torch.arange(heads, device=self.device)[None, None, :] * P
        rows = (pages[:, None, None] * (kvf * heads * P) + plane + head + offsets[:, None, None]).reshape(-1)
        for j, layer in enumerate(layers):
            buf = self.layers[layer]
            buf.view(-1, D).index_copy_(0, rows, kv[:, j].reshape(-1, D).to(buf.dtype))


def pool_binding(manager: DraftPool, num_slots: int, shape: dict[str, int]) -> PoolBinding:
    """Bind to a draft manager's pools: every local layer's HND buffer, tables per pool."""
    num_layers = manager.num_local_layers
    layers = [manager.get_buffers(i, kv_layout="HND") for i in range(num_layers)]
    pools = [manager.layer_slots[i].group for i in range(num_layers)]
    cfg = manager.config
    want = {"layers": num_layers, "heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "kv_factor": cfg.kv_factor}
    wrong = {k: (shape[k], want[k]) for k in want if k in shape and shape[k] != want[k]}
    if wrong:
        raise ValueError(
            "DFlashWorker: the drafter does not fit its draft pool: "
            + ", ".join(f"{k} {got} (pool {pool})" for k, (got, pool) in wrong.items())
        )
    dev = layers[0].device
    n_pools = manager.num_pools
    return PoolBinding(
        layers=layers, layer_pool=pools, kv_factor=cfg.kv_factor, tokens_per_block=manager.tokens_per_block,
        arena=False, manager=manager,
        tables=[torch.zeros(num_slots, 1, dtype=torch.int32, device=dev) for _ in range(n_pools)],
        counts=[torch.zeros(num_slots, dtype=torch.int64, device=dev) for _ in range(n_pools)],
    )


def arena_binding(draft_slots: Any, shape: dict[str, int], dtype: torch.dtype = torch.float32) -> PoolBinding:
    """A private arena: slot `s` owns pages `[s * pps, (s + 1) * pps)` of every layer."""
    missing = [k for k in ("layers", "heads", "head_dim") if k not in shape]
    if missing:
        raise ValueError(
            f"DFlashWorker: a private arena needs the drafter's {missing} (draft_model._num_attn_layers, "
            "_num_kv_heads, _head_dim)"
        )
    P, pps, slots = draft_slots.tokens_per_block, draft_slots.arena_pages_per_slot, draft_slots.num_slots
    kv_factor = shape.get("kv_factor", 2)
    dev = draft_slots.device
    layers = [
        torch.zeros(slots * pps, kv_factor, shape["heads"], P, shape["head_dim"], dtype=dtype, device=dev)
        for _ in range(shape["layers"])
    ]
    table = torch.arange(slots * pps, dtype=torch.int32, device=dev).view(slots, pps)
    return PoolBinding(
        layers=layers, layer_pool=[0] * shape["layers"], tables=[table], kv_factor=kv_factor,
        tokens_per_block=P, arena=True, counts=[torch.full((slots,), pps, dtype=torch.int64, device=dev)],
    )


__all__ = ["DraftStoreRefused", "PoolBinding", "arena_binding", "pool_binding"]
