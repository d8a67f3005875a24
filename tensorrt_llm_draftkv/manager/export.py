"""Block-offset export: a manager's per-request rows as the int32 tables kernels and executors read.

Entry `[pool, row, k, i]` is `page * kv_factor + k` for the page backing block
ordinal i (absolute positions `[i*P, (i+1)*P)`); K at k = 0, V at k = 1.
The public functions are `KVCacheManagerV2` methods (hence `self`), kept here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import numpy as np
import torch

from ..runtime import BAD_PAGE_INDEX, KVCache

if TYPE_CHECKING:
    from .kv_cache_manager import KVCacheManagerV2


def get_block_offsets(self: KVCacheManagerV2, request_ids: Iterable[int], backend: str = "cpp") -> torch.Tensor:
    """int32 `[num_pools, B, 2, max_blocks_per_seq]` block offsets, by block ordinal.

    Entry `[p, b, k, i]` is `page * kv_factor + k` for the page backing ordinal i
    of request b in pool p (K at k=0, V at k=1, in the pool's storage viewed as
    `[pages * kv_factor, ...]`). Unbacked ordinals: `"python"` keeps -1; `"cpp"`
    writes page 0's offset (a page some other request may own) or, when the
    pool has a guard page, the guard page's.
    """
    if backend not in ("cpp", "python"):
        raise ValueError(f"unknown block-offset backend {backend!r}; use 'cpp' or 'python'")
    ids = list(request_ids)
    caches = [self.get_cache(rid) for rid in ids]
    width = self.config.max_blocks_per_seq
    out = block_offset_array(self, ids, caches, backend, width, f"max_blocks_per_seq={width}")
    return torch.from_numpy(out.astype(np.int32))


def block_offset_array(
    manager: KVCacheManagerV2, ids: list[int], caches: list[KVCache], backend: str, width: int, width_label: str
) -> np.ndarray:
    """int64 `[num_pools, len(ids), 2, width]` offsets (see `get_block_offsets`); changes nothing."""
    kv = manager.config.kv_factor
    v_slot = 1 if kv > 1 else 0  # a K-only pool (kv_factor 1) has no separate V slot
    out = np.full((manager.num_pools, len(ids), 2, width), BAD_PAGE_INDEX, dtype=np.int64)
    for b, cache in enumerate(caches):
        for p in range(manager.num_pools):
            row = np.asarray(cache._rows[p], dtype=np.int64)
            if row.size > width:
                raise ValueError(f"request {ids[b]} spans {row.size} blocks, more than {width_label}")
            out[p, b, 0, : row.size] = np.where(row >= 0, row * kv, BAD_PAGE_INDEX)
            out[p, b, 1, : row.size] = np.where(row >= 0, row * kv + v_slot, BAD_PAGE_INDEX)
    if backend == "cpp":
        for p, group in enumerate(manager.layer_groups):
            guard = group.pool.guard_page_index
            fill = 0 if guard is None else guard * kv
            sub = out[p]
            sub[:, 0][sub[:, 0] < 0] = fill
            sub[:, 1][sub[:, 1] < 0] = fill + v_slot
    return out


def copy_batch_block_offsets(
    self: KVCacheManagerV2,
    dst_tensor: torch.Tensor,
    request_ids: Iterable[int],
    beam_width: int,
    num_contexts: int,
    num_seqs: int,
    max_blocks: int | None = None,
) -> None:
    """Upstream's call: write the batch's block offsets into `dst_tensor`, in place.

    `dst_tensor` is the caller's int32 `[num_pools, >= num_seqs, 2, >= width]`
    tensor on this self's device, `width` being `max_blocks` or else
    `config.max_blocks_per_seq`. Row i of every pool gets `request_ids[i]`'s
    entries, exactly `get_block_offsets(request_ids, "cpp")[:, i, :, :width]`
    (unbacked blocks as page 0's offset, or the guard page's when the pool has
    one); rows from `num_seqs` on and columns from `width` on are left as they
    are. As upstream, the first `num_contexts` ids are the context requests and
    the rest generation requests, `num_seqs == len(request_ids) * beam_width`,
    and only `beam_width` 1 is supported. Every check runs before the write: on
    any error `dst_tensor` is unchanged.
    """
    ids = list(request_ids)
    width, width_label = _check_copy_args(self, dst_tensor, ids, beam_width, num_contexts, num_seqs, max_blocks)
    self._require_caches(ids, "copy_batch_block_offsets")
    caches = [self._caches[rid] for rid in ids]
    out = block_offset_array(self, ids, caches, "cpp", width, width_label)
    if num_seqs:
        dst_tensor[:, :num_seqs, :, :width].copy_(torch.from_numpy(out.astype(np.int32)))


def _check_copy_args(
    manager: KVCacheManagerV2,
    dst_tensor: torch.Tensor,
    ids: list[int],
    beam_width: int,
    num_contexts: int,
    num_seqs: int,
    max_blocks: int | None,
) -> tuple[int, str]:
    """Every argument error of `copy_batch_block_offsets`, before the write; returns the width written."""
    label = f"{manager.error_label}: copy_batch_block_offsets"
    for name, value in (("beam_width", beam_width), ("num_contexts", num_contexts), ("num_seqs", num_seqs)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{label}: {name} must be an int, got {value!r}")
    if beam_width != 1:
        raise ValueError(f"{label} supports beam_width 1 only (no beam search here), got beam_width={beam_width}")
    if num_seqs != len(ids) * beam_width:
        raise ValueError(
            f"{label}: num_seqs={num_seqs} but {len(ids)} request ids with beam_width={beam_width} "
            f"make {len(ids) * beam_width} rows"
        )
    if not 0 <= num_contexts <= num_seqs:
        raise ValueError(f"{label}: num_contexts={num_contexts} must be between 0 and num_seqs={num_seqs}")
    if max_blocks is None:
        width, width_label = manager.config.max_blocks_per_seq, f"max_blocks_per_seq={manager.config.max_blocks_per_seq}"
    elif isinstance(max_blocks, bool) or not isinstance(max_blocks, (int, np.integer)) or max_blocks < 0:
        raise ValueError(f"{label}: max_blocks must be an int >= 0 or None, got {max_blocks!r}")
    else:
        width, width_label = int(max_blocks), f"max_blocks={max_blocks}"
    if not isinstance(dst_tensor, torch.Tensor):
        raise TypeError(f"{label}: dst_tensor must be a torch.Tensor, got {type(dst_tensor).__name__}")
    if dst_tensor.dtype != torch.int32:
        raise ValueError(f"{label}: dst_tensor must be torch.int32, got {dst_tensor.dtype}")
    shape = tuple(dst_tensor.shape)
    want = f"[num_pools={manager.num_pools}, >= num_seqs={num_seqs}, 2, >= {width}]"
    if (
        len(shape) != 4
        or shape[0] != manager.num_pools
        or shape[1] < num_seqs
        or shape[2] != 2
        or shape[3] < width
    ):
        raise ValueError(f"{label}: dst_tensor has shape {list(shape)}, needs {want} ({width_label})")
    pool_device = torch.device(manager.config.device)
    if dst_tensor.device.type != pool_device.type or (
        pool_device.index is not None and dst_tensor.device.index != pool_device.index
    ):
        raise ValueError(
            f"{label}: dst_tensor is on {dst_tensor.device}, this manager's pools on {manager.config.device}"
        )
    return width, width_label
