"""A layer group: the life cycle its layers share and the pool whose pages back them."""
from __future__ import annotations

from dataclasses import dataclass

from .life_cycle import LifeCycle
from .page_pool import PagePool


@dataclass(frozen=True)
class LayerGroup:
    """A life cycle and the pool whose pages back it."""

    life_cycle: LifeCycle
    pool: PagePool


__all__ = ["LayerGroup"]
