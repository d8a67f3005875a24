"""`DraftPool`: everything the speculative layer reads of a draft KV cache manager, typed.

The drafter's slots, addressing and worker depend on the draft manager through
this protocol only, so the dependency is visible and checkable: a
`DraftKVCacheManagerV2` satisfies it (tests/speculative/test_draft_pool.py), and
anything else that does can stand in for it. Coordinates as the manager's:
block rows are per layer group (pool), by page ordinal; -1 marks an unbacked entry.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Protocol, Sequence, runtime_checkable

import torch

from ..config import KVPoolConfig
from ..request import ScheduledRequests


class MirrorCache(Protocol):
    """One request's draft mirror, as the drafter reads it."""

    @property
    def capacity(self) -> int:
        """Tokens the mirror holds room for (absolute positions `[0, capacity)`)."""

    def block_row(self, group: int) -> list[int]:
        """Pages of layer group `group` by ordinal, -1 where unbacked."""


class LayerSlotView(Protocol):
    group: int
    index: int


@runtime_checkable
class DraftPool(Protocol):
    """The draft manager's surface the drafter's side reads (and nothing more)."""

    config: KVPoolConfig
    tokens_per_block: int
    draft_slot_trail_tokens: int
    layer_slots: Sequence[LayerSlotView]
    last_prepared_batch: Optional[ScheduledRequests]

    @property
    def joint_kv_cache_reuse(self) -> bool: ...

    @property
    def num_pools(self) -> int: ...

    @property
    def num_local_layers(self) -> int: ...

    def has_cache(self, request_id: int) -> bool: ...

    def get_cache(self, request_id: int) -> MirrorCache: ...

    def get_caches(self, request_ids: Sequence[int]) -> Sequence[MirrorCache]:
        """The mirrors of a batch, in order (KeyError for an id without one)."""

    def block_tables(self, request_ids: Iterable[int], backend: str = "cpp", *,
                     width: int | str | None = "live") -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def get_block_offsets(self, request_ids: Iterable[int], backend: str = "cpp", *,
                          width: int | str | None = None) -> torch.Tensor: ...

    def get_buffers(self, layer_idx: int, kv_layout: str = "NHD") -> Optional[torch.Tensor]: ...

    def sync_block_table(self, request_ids: Iterable[int]) -> "RingSource":
        """The manager's device block table, brought up to date for these requests."""


class RingSource(Protocol):
    """What the drafter's side reads of a draft manager's device block table (manager/block_table.py)."""

    def ring(self, pool: int, request_ids: Sequence[int]) -> Any:
        """Pool ``pool``'s ring (``pages``, ``first``, ``extent``) and these requests' table ``rows``."""


__all__ = ["DraftPool", "MirrorCache", "RingSource"]
