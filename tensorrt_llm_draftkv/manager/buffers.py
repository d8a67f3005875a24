"""Which pool holds a model layer, and the views of a pool's storage upstream's accessors return.

A manager's layers are numbered 0.. in model order over the layers it keeps
(upstream's local layers: those its `layer_mask` selects). Each belongs to one
layer group (one pool); `LayerSlot` says which group and which of that pool's
layer tensors. A pool's storage is one tensor per layer, `[pages, kv_factor,
heads, P, head_dim]` (HND); `kv_layout="NHD"` is a zero-copy permuted view, so
writes through either land in the pool the kernels read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

_LAYOUTS = ("NHD", "HND")


@dataclass(frozen=True)
class LayerSlot:
    """Model layer -> (layer group, index among that group's layer tensors)."""

    group: int
    index: int


def sequential_layer_slots(layers_per_group: Sequence[int]) -> tuple[LayerSlot, ...]:
    """Group 0's layers first, then group 1's, ...: the numbering of a pool geometry built by hand."""
    return tuple(LayerSlot(g, i) for g, n in enumerate(layers_per_group) for i in range(n))


def slots_by_group_key(keys: Sequence[object]) -> tuple[tuple[LayerSlot, ...], list[object]]:
    """Layers in model order with a group key each (their window): layers sharing a key share a group,
    groups numbered by the first layer of each. Returns the slots and the keys of the groups."""
    groups: list[object] = []
    counts: list[int] = []
    slots = []
    for key in keys:
        if key not in groups:
            groups.append(key)
            counts.append(0)
        g = groups.index(key)
        slots.append(LayerSlot(g, counts[g]))
        counts[g] += 1
    return tuple(slots), groups


def layer_buffer(storage: torch.Tensor, kv_layout: str = "NHD") -> torch.Tensor:
    """One layer's pool storage, `[pages, kv_factor, P, heads, head_dim]` for NHD (a view) or
    `[pages, kv_factor, heads, P, head_dim]` for HND (the tensor itself)."""
    if kv_layout not in _LAYOUTS:
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    return storage.transpose(2, 3) if kv_layout == "NHD" else storage


def check_layer(layer_idx: int, slots: Sequence[LayerSlot], label: str) -> LayerSlot:
    """The slot of `layer_idx`, or IndexError naming the manager and how many layers it keeps."""
    if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(slots):
        raise IndexError(f"{label}: layer {layer_idx!r} is not one of this manager's {len(slots)} layers [0, {len(slots)})")
    return slots[layer_idx]
