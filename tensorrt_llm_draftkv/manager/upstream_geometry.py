"""From upstream's constructor arguments to pools: which layers, which windows, how many pages.

TensorRT-LLM builds a KV cache manager from the model's shape (layers, KV heads,
head size), a `Mapping`, and a user budget (`KvCacheConfig`). This module turns
those into the pool geometry the runtime allocates (`KVPoolConfig`) and the
model-layer -> pool map, as one pure function. The rules:

- Layers: the model's `num_layers`, those `layer_mask` keeps (a draft manager's
  drafter layers), numbered 0.. in model order.
- Windows: `max_attention_window` repeated over the model's layers (as upstream);
  a window of `max_seq_len` or more is full attention. Layers sharing a window
  share one layer group, hence one pool.
- Heads: `num_kv_heads` (one, or one per model layer) split across TP ranks; every
  kept layer must have the same heads and head size (one geometry per manager).
- Budget: the smallest of `max_tokens` tokens of every kept layer,
  `max_gpu_total_bytes`, and `free_gpu_memory_fraction` of the free device memory
  (a GPU only). Every group gets the same token slots; a windowed group never
  more than `max_batch_size` requests can hold at once, and what it does not take
  goes to the full-attention groups.

Bad input raises ValueError naming the argument and the numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..bindings import CacheType, DataType
from ..config import KVPoolConfig, LayerGroupConfig, parse_dtype
from ..llmapi import KvCacheConfig
from ..mapping import Mapping
from . import budget
from .buffers import LayerSlot, slots_by_group_key


@dataclass(frozen=True)
class UpstreamGeometry:
    """The pools one manager allocates, and where its budget came from."""

    config: KVPoolConfig
    layer_slots: tuple[LayerSlot, ...]
    budget_bytes: int
    budget_source: str


def _local_layers(num_layers: int, layer_mask: Sequence[bool] | None, label: str) -> list[int]:
    if num_layers < 1:
        raise ValueError(f"{label}: num_layers must be >= 1, got {num_layers}")
    if layer_mask is None:
        return list(range(num_layers))
    if len(layer_mask) != num_layers:
        raise ValueError(f"{label}: layer_mask has {len(layer_mask)} entries for {num_layers} layers")
    kept = [i for i, keep in enumerate(layer_mask) if keep]
    if not kept:
        raise ValueError(f"{label}: layer_mask keeps none of the {num_layers} layers")
    return kept


def _per_layer(value: int | Sequence[int | None], num_layers: int, name: str, label: str) -> list[int | None]:
    if isinstance(value, int):
        return [value] * num_layers
    values = list(value)
    if len(values) != num_layers:
        raise ValueError(f"{label}: {name} has {len(values)} entries for {num_layers} layers")
    return values


def _uniform(values: list[int | None], layers: list[int], name: str, label: str) -> int:
    kept = {values[i] for i in layers}
    if None in kept:
        raise ValueError(f"{label}: {name} is None for a layer this manager keeps (layers {layers})")
    if len(kept) != 1:
        raise ValueError(
            f"{label}: the layers this manager keeps have different {name} ({sorted(kept)}); one manager "
            "holds one geometry here (build one manager per geometry)"
        )
    (only,) = kept
    if only < 1:
        raise ValueError(f"{label}: {name} must be >= 1, got {only}")
    return only


def layer_windows(
    max_attention_window: Sequence[int] | None, num_layers: int, max_seq_len: int
) -> list[int | None]:
    """Each model layer's window in tokens (None: full attention), the config's list repeated over the layers."""
    if not max_attention_window:
        return [None] * num_layers
    pattern = list(max_attention_window)
    return [None if (w := pattern[i % len(pattern)]) >= max_seq_len else w for i in range(num_layers)]


def _pool_dtype(kv_cache_config: KvCacheConfig, dtype: DataType | torch.dtype) -> torch.dtype:
    if kv_cache_config.dtype != "auto":
        return parse_dtype(kv_cache_config.dtype)
    return dtype.to_torch() if isinstance(dtype, DataType) else parse_dtype(dtype)


def _budget(
    kv_cache_config: KvCacheConfig, bytes_per_token: int, device: str, label: str
) -> tuple[int, str]:
    """(bytes, which field set them): the smallest of the budgets the config gives."""
    options: list[tuple[int, str]] = []
    if kv_cache_config.max_tokens is not None:
        options.append((kv_cache_config.max_tokens * bytes_per_token, "max_tokens"))
    if kv_cache_config.max_gpu_total_bytes > 0:
        options.append((kv_cache_config.max_gpu_total_bytes, "max_gpu_total_bytes"))
    fraction = kv_cache_config.free_gpu_memory_fraction
    if fraction is not None and torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        options.append((int(free * fraction), "free_gpu_memory_fraction"))
    if not options:
        raise ValueError(
            f"{label}: no KV cache budget: on {device} there is no free GPU memory to take "
            f"free_gpu_memory_fraction={fraction} of; set KvCacheConfig.max_tokens or max_gpu_total_bytes"
        )
    return min(options)


def pool_geometry(
    kv_cache_config: KvCacheConfig,
    kv_cache_type: CacheType,
    *,
    num_layers: int,
    num_kv_heads: int | Sequence[int | None],
    head_dim: int | Sequence[int],
    tokens_per_block: int,
    max_seq_len: int,
    max_batch_size: int,
    mapping: Mapping,
    dtype: DataType | torch.dtype,
    layer_mask: Sequence[bool] | None,
    max_num_tokens: int,
    max_draft_len: int,
    num_extra_kv_tokens: int,
    trail_tokens: int,
    device: str,
    label: str,
) -> UpstreamGeometry:
    """The pools for these upstream arguments (see the module docstring for the rules)."""
    if kv_cache_type is CacheType.CROSS:
        raise ValueError(f"{label}: cross-attention caches are not supported (kv_cache_type=CacheType.CROSS)")
    if mapping.has_pp() or mapping.has_cp():
        raise ValueError(
            f"{label}: pipeline and context parallelism are not supported (pp_size={mapping.pp_size}, "
            f"cp_size={mapping.cp_size}); tensor parallelism is"
        )
    for name, value in (("tokens_per_block", tokens_per_block), ("max_seq_len", max_seq_len),
                        ("max_batch_size", max_batch_size), ("max_num_tokens", max_num_tokens)):
        if value < 1:
            raise ValueError(f"{label}: {name} must be >= 1, got {value}")
    layers = _local_layers(num_layers, layer_mask, label)
    heads = mapping.local_kv_heads(_uniform(_per_layer(num_kv_heads, num_layers, "num_kv_heads", label), layers,
                                            "num_kv_heads", label))
    dim = _uniform(_per_layer(head_dim, num_layers, "head_dim", label), layers, "head_dim", label)
    windows = layer_windows(kv_cache_config.max_attention_window, num_layers, max_seq_len)
    slots, group_windows = slots_by_group_key([windows[i] for i in layers])
    groups = tuple(
        LayerGroupConfig(sum(1 for s in slots if s.group == g), window=w) for g, w in enumerate(group_windows)
    )
    pool_dtype = _pool_dtype(kv_cache_config, dtype)
    page_bytes = [
        budget.bytes_per_page(g, tokens_per_block=tokens_per_block, num_kv_heads=heads, head_dim=dim,
                              dtype=pool_dtype, kv_factor=kv_cache_type.kv_factor)
        for g in groups
    ]
    total_bytes, source = _budget(kv_cache_config, sum(page_bytes) // tokens_per_block, device, label)
    pages = _split_pages(
        total_bytes, groups, page_bytes, tokens_per_block=tokens_per_block, max_seq_len=max_seq_len,
        max_batch_size=max_batch_size, chunk=min(max_num_tokens, max_seq_len), max_draft_len=max_draft_len,
        num_extra_kv_tokens=num_extra_kv_tokens, trail_tokens=trail_tokens,
    )
    for g, n in enumerate(pages):
        if n < 1:
            raise ValueError(
                f"{label}: a budget of {total_bytes} bytes ({source}) buys no page of layer group {g} "
                f"({page_bytes[g]} bytes a page); raise KvCacheConfig.{source}"
            )
    config = KVPoolConfig(
        layer_groups=groups,
        pages_per_group=tuple(pages),
        tokens_per_block=tokens_per_block,
        num_kv_heads=heads,
        head_dim=dim,
        dtype=pool_dtype,
        kv_factor=kv_cache_type.kv_factor,
        device=device,
        max_seq_len=max_seq_len,
        enable_block_reuse=kv_cache_config.enable_block_reuse,
    )
    return UpstreamGeometry(config, slots, total_bytes, source)


def _split_pages(
    total_bytes: int,
    groups: tuple[LayerGroupConfig, ...],
    page_bytes: list[int],
    *,
    tokens_per_block: int,
    max_seq_len: int,
    max_batch_size: int,
    chunk: int,
    max_draft_len: int,
    num_extra_kv_tokens: int,
    trail_tokens: int,
) -> list[int]:
    """Pages per group: the same token slots for every group, windowed groups capped at what
    `max_batch_size` requests hold at their peak, the rest to the full-attention groups."""
    even = total_bytes // sum(page_bytes)  # pages per group if every group got the same
    pages = []
    saved = 0
    for group, nbytes in zip(groups, page_bytes):
        if group.window is None:
            pages.append(even)
            continue
        cap = max_batch_size * budget.group_pages_per_request(
            group.window, tokens_per_block, max_seq_len=max_seq_len, chunk=chunk, max_draft_len=max_draft_len,
            num_extra_kv_tokens=num_extra_kv_tokens, trail_tokens=trail_tokens,
        )
        pages.append(min(even, cap))
        saved += (even - pages[-1]) * nbytes
    full = [g for g, group in enumerate(groups) if group.window is None]
    if full and saved:
        more = saved // sum(page_bytes[g] for g in full)
        for g in full:
            pages[g] += more
    return pages
