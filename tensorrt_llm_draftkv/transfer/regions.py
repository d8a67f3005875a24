"""Registered memory: each pool layer as a page array, described once per rank.

A `PoolRegion` is one layer tensor of a page pool seen as bytes: `num_pages`
pages of `page_bytes`, `stride` bytes apart from `base`, each page holding
`tokens_per_block` token positions. A rank sends its `RankMemory` (every target
and draft pool layer, and the auxiliary buffer) to its peer once; after that a
transfer names pages only. Coordinates: byte addresses, pages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .agent import MemoryDescs, MemoryType

_FIELDS = 7  # ints per region on the wire


@dataclass(frozen=True)
class PoolRegion:
    """One registered page array (a pool layer, or the auxiliary buffer's slots)."""

    base: int
    num_pages: int
    page_bytes: int
    stride: int
    tokens_per_block: int
    mem_type: str = MemoryType.DRAM
    device_id: int = 0

    def __post_init__(self) -> None:
        if self.num_pages < 0 or self.page_bytes <= 0 or self.stride < self.page_bytes:
            raise ValueError(
                f"a region needs num_pages >= 0 and stride >= page_bytes > 0, got {self.num_pages} pages of "
                f"{self.page_bytes} bytes, stride {self.stride}"
            )
        if self.mem_type not in (MemoryType.DRAM, MemoryType.VRAM):
            raise ValueError(f"memory type {self.mem_type!r}; expected DRAM or VRAM")

    @property
    def nbytes(self) -> int:
        """Bytes from `base` to the end of the last page."""
        return 0 if self.num_pages == 0 else (self.num_pages - 1) * self.stride + self.page_bytes

    def to_wire(self) -> list[int]:
        return [self.base, self.num_pages, self.page_bytes, self.stride, self.tokens_per_block,
                int(self.mem_type == MemoryType.VRAM), self.device_id]

    @classmethod
    def from_wire(cls, ints: Sequence[int]) -> "PoolRegion":
        base, pages, page_bytes, stride, tpb, vram, dev = (int(x) for x in ints)
        return cls(base, pages, page_bytes, stride, tpb, MemoryType.VRAM if vram else MemoryType.DRAM, dev)


def layer_region(layer: Any, tokens_per_block: int) -> PoolRegion:
    """The region of one pool layer tensor `[pages, ...]` (pages along dim 0, each page contiguous).

    A CUDA tensor gives a `VRAM` region on its device; anything else `DRAM`.
    Only tensor attributes are read (`data_ptr`, `shape`, `stride`, `element_size`,
    `is_contiguous`, `device`), so a stand-in object works in tests.
    """
    if len(layer.shape) < 1 or not layer.is_contiguous():
        raise ValueError(f"a pool layer must be a contiguous [pages, ...] tensor, got shape {tuple(layer.shape)}")
    item = layer.element_size()
    page_elems = int(np.prod(layer.shape[1:], dtype=np.int64)) if len(layer.shape) > 1 else 1
    device = layer.device
    vram = getattr(device, "type", str(device)) == "cuda"
    return PoolRegion(
        base=int(layer.data_ptr()),
        num_pages=int(layer.shape[0]),
        page_bytes=page_elems * item,
        stride=int(layer.stride(0)) * item if layer.shape[0] > 1 else page_elems * item,
        tokens_per_block=tokens_per_block,
        mem_type=MemoryType.VRAM if vram else MemoryType.DRAM,
        device_id=(getattr(device, "index", None) or 0) if vram else 0,
    )


def pool_regions(layers: Sequence[Any], tokens_per_block: int) -> tuple[PoolRegion, ...]:
    """Every layer of one pool (a layer group), in layer order."""
    return tuple(layer_region(layer, tokens_per_block) for layer in layers)


@dataclass(frozen=True)
class RankMemory:
    """What a rank registers and sends its peer once: per target group and per draft group its layers'
    regions, and the auxiliary buffer (`aux`: `num_pages` slots of `page_bytes`)."""

    target: tuple[tuple[PoolRegion, ...], ...]
    draft: tuple[tuple[PoolRegion, ...], ...]
    aux: PoolRegion

    def regions(self) -> list[PoolRegion]:
        """Every region, target groups first, then draft groups, then the auxiliary buffer."""
        return [r for group in (*self.target, *self.draft) for r in group] + [self.aux]

    def memory_descs(self) -> list[MemoryDescs]:
        """Registration descriptors (one per region, whole region), one list per memory type present."""
        out = []
        regions = self.regions()
        for kind in (MemoryType.DRAM, MemoryType.VRAM):
            rows = [(r.base, r.nbytes, r.device_id) for r in regions if r.mem_type == kind and r.nbytes > 0]
            if rows:
                out.append(MemoryDescs(kind, np.array(rows, dtype=np.int64)))
        return out

    def to_wire(self) -> list[int]:
        """`[n_target, n_draft, layers per group..., fields per region...]` (ints; sent once)."""
        groups = (*self.target, *self.draft)
        out = [len(self.target), len(self.draft), *(len(g) for g in groups)]
        for r in self.regions():
            out += r.to_wire()
        return out

    @classmethod
    def from_wire(cls, ints: Sequence[int]) -> "RankMemory":
        ints = [int(x) for x in ints]
        nt, nd = ints[0], ints[1]
        counts = ints[2 : 2 + nt + nd]
        pos = 2 + nt + nd
        regions = [PoolRegion.from_wire(ints[pos + i * _FIELDS : pos + (i + 1) * _FIELDS])
                   for i in range(sum(counts) + 1)]
        groups, i = [], 0
        for c in counts:
            groups.append(tuple(regions[i : i + c]))
            i += c
        return cls(tuple(groups[:nt]), tuple(groups[nt:]), regions[-1])
