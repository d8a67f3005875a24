"""Transfer descriptors from page ids, built with numpy (no per-page Python loop).

A request's pages on the two ranks pair up ordinal by ordinal (the context
worker's page for block `b` goes onto the generation worker's page for block
`b`). Where both sides' page ids step by one, the run becomes one descriptor
per layer: `(base + start * stride, count * page_bytes, device)`.
Coordinates: page ids in, byte addresses and lengths out.
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from .regions import PoolRegion


def page_runs(src_pages, dst_pages) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs over which both page lists step by one: `(src_start, dst_start, count)` arrays."""
    s = np.asarray(src_pages, dtype=np.int64).reshape(-1)
    d = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
    if s.shape != d.shape:
        raise ValueError(f"{s.size} source pages for {d.size} destination pages")
    if s.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [s.size]))
    return s[starts], d[starts], ends - starts


@functools.lru_cache(maxsize=256)
def _layers(regions: tuple[PoolRegion, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, bool]:
    """Per layer `[L, 1]` base, stride, device and page bytes, the pages every layer has, and whether
    every page sits right after the previous one: what each request's descriptors are built from
    (worked out once per set of regions)."""
    col = lambda name: np.array([getattr(r, name) for r in regions], dtype=np.int64)[:, None]  # noqa: E731
    packed = all(r.stride == r.page_bytes for r in regions)
    return col("base"), col("stride"), col("device_id"), col("page_bytes"), min(r.num_pages for r in regions), packed


def _check_pages(pages: np.ndarray, limit: int, side: str, what: str) -> None:
    bad = (pages < 0) | (pages >= limit)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{what}: {side} page {int(pages[i])} (entry {i}) outside the pool's {limit} pages")


def page_write_descs(
    src: Sequence[PoolRegion], src_pages, dst: Sequence[PoolRegion], dst_pages, *, what: str = "transfer"
) -> tuple[np.ndarray, np.ndarray]:
    """Paired `[N, 3]` (address, bytes, device) arrays writing `src_pages` of every layer in `src` onto
    `dst_pages` of the same layer in `dst` (layer i onto layer i). Runs of consecutive pages on both
    sides merge into one descriptor per layer where pages sit back to back (`stride == page_bytes`).

    Raises `ValueError` naming `what` and the numbers for mismatched layers, page sizes or page ids.
    """
    if len(src) != len(dst):
        raise ValueError(f"{what}: {len(src)} source layers for {len(dst)} destination layers")
    s = np.asarray(src_pages, dtype=np.int64).reshape(-1)
    d = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
    if s.shape != d.shape:
        raise ValueError(f"{what}: {s.size} source pages for {d.size} destination pages")
    if not src or s.size == 0:
        empty = np.zeros((0, 3), dtype=np.int64)
        return empty, empty
    mine, theirs = _layers(tuple(src)), _layers(tuple(dst))
    page_bytes = mine[3]
    if not np.array_equal(page_bytes, theirs[3]):
        sizes = sorted({(a.page_bytes, b.page_bytes) for a, b in zip(src, dst)})
        raise ValueError(f"{what}: page sizes differ between the ranks ({sizes} bytes)")
    _check_pages(s, mine[4], "source", what)
    _check_pages(d, theirs[4], "destination", what)
    if mine[5] and theirs[5]:
        s0, d0, count = page_runs(s, d)
    else:  # pages with gaps between them: one descriptor per page
        s0, d0, count = s, d, np.ones_like(s)
    length = count[None, :] * page_bytes

    def side(layers: tuple, start: np.ndarray) -> np.ndarray:
        base, stride, dev = layers[:3]
        out = np.empty((base.shape[0], start.size, 3), dtype=np.int64)
        out[..., 0] = base + start[None, :] * stride
        out[..., 1] = length
        out[..., 2] = dev
        return out.reshape(-1, 3)

    return side(mine, s0), side(theirs, d0)


def slot_descs(region: PoolRegion, slot: int, nbytes: int, *, what: str = "transfer") -> np.ndarray:
    """One `[1, 3]` descriptor: the first `nbytes` of slot `slot` of a slotted region (the auxiliary buffer)."""
    if not 0 <= slot < region.num_pages:
        raise ValueError(f"{what}: slot {slot} outside the buffer's {region.num_pages} slots")
    if not 0 < nbytes <= region.page_bytes:
        raise ValueError(f"{what}: {nbytes} bytes do not fit a slot of {region.page_bytes} bytes")
    return np.array([[region.base + slot * region.stride, nbytes, region.device_id]], dtype=np.int64)
