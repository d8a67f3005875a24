"""Block reuse in the planner: what one more request sharing a prefix saves in one pool.

A request whose prompt starts with an already-computed prefix shares that
prefix's whole pages instead of allocating them, and skips their prefill. This
module counts those pages and bytes per layer group for a `PoolGeometry` (see
docs/block_reuse.md); it is kept apart from the capacity planning in `planner`.
The text form is `plan_format.format_savings`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .budget import bytes_per_page

if TYPE_CHECKING:
    from .planner import PoolGeometry


@dataclass(frozen=True)
class ReuseSavings:
    """What one more request sharing a prefix does not compute or hold alone, in one pool.

    `reused_tokens` is the prefix rounded down to whole pages (the prefill tokens
    skipped; the request's prompt must be longer, since one token is always
    computed). `pages_per_group[g]` counts the prefix pages group g still holds at
    history = `reused_tokens` (all of them under full attention; the window, trail
    and sinks under a window): the pages the request shares instead of allocating.
    """

    name: str
    shared_prefix: int
    reused_tokens: int
    pages_per_group: tuple[int, ...]
    bytes_per_group: tuple[int, ...]
    bytes_per_group_per_rank: tuple[int, ...]

    @property
    def pages(self) -> int:
        return sum(self.pages_per_group)

    @property
    def bytes(self) -> int:
        return sum(self.bytes_per_group)

    @property
    def bytes_per_rank(self) -> int:
        return sum(self.bytes_per_group_per_rank)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "shared_prefix": self.shared_prefix,
            "reused_tokens": self.reused_tokens,
            "pages_per_group": list(self.pages_per_group),
            "bytes_per_group": list(self.bytes_per_group),
            "bytes": self.bytes,
            "bytes_per_rank": self.bytes_per_rank,
        }


def prefix_reuse_savings(name: str, geometry: PoolGeometry, shared_prefix: int, *, trail_tokens: int = 0) -> ReuseSavings:
    """Pages and bytes per request that sharing a `shared_prefix`-token prefix saves in one pool.

    The prefix covers absolute positions `[0, shared_prefix)`; only its whole
    pages `[0, shared_prefix // P)` are shared. `trail_tokens` widens every window
    as the pool's life cycles do (the trail page of a DFlash/DSpark draft pool).
    """
    from ..runtime.life_cycle import LifeCycle
    from .admission import held_pages

    if shared_prefix < 0:
        raise ValueError(f"a shared prefix must be >= 0 tokens, got {shared_prefix}")
    p = geometry.tokens_per_block
    tokens = shared_prefix // p * p
    pages, full, per_rank = [], [], []
    for g in geometry.layer_groups:
        lc = LifeCycle(g.window, g.sink_blocks).widened(trail_tokens)
        count = held_pages(lc, p, tokens, tokens)
        pages.append(count)
        for heads, out in ((geometry.num_kv_heads, full), (geometry.kv_heads_per_rank, per_rank)):
            out.append(count * bytes_per_page(g, tokens_per_block=p, num_kv_heads=heads, head_dim=geometry.head_dim,
                                              dtype=geometry.dtype, kv_factor=geometry.kv_factor))
    return ReuseSavings(name, shared_prefix, tokens, tuple(pages), tuple(full), tuple(per_rank))
