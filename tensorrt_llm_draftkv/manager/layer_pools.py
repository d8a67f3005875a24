"""A manager's pools: one `PagePool` per layer group built from a pool geometry, and their accounting checked.

Coordinates: pages (a pool's page indices) and the block rows of the caches that
hold them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import KVPoolConfig
from ..runtime import LayerGroup, LifeCycle, PagePool

if TYPE_CHECKING:
    from .request_caches import RequestCaches


def build_layer_groups(config: KVPoolConfig, label: str, trail_tokens: int, block_reuse: bool) -> list[LayerGroup]:
    """One `PagePool` per layer group of `config`, each window widened by `trail_tokens` (the trail page).

    Every pool's prefix keys are salted by the geometry (`label`, page size, K/V
    layout, dtype, trail), so pools of different geometry never share a chain.
    """
    salt = (label, config.tokens_per_block, config.kv_factor, config.num_kv_heads, config.head_dim,
            str(config.dtype), trail_tokens)
    return [
        LayerGroup(
            LifeCycle(g.window, g.sink_blocks).widened(trail_tokens),
            PagePool(
                pages,
                tokens_per_block=config.tokens_per_block,
                num_layers=g.num_layers,
                kv_factor=config.kv_factor,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                dtype=config.dtype,
                device=config.device,
                guard_page=config.guard_page,
                block_reuse=block_reuse,
                reuse_salt=salt,
            ),
        )
        for g, pages in zip(config.layer_groups, config.pages_per_group)
    ]


def check_accounting(layer_groups: list[LayerGroup], caches: RequestCaches) -> None:
    """Every pool balances (held + cached-free + free = total), and every held page is in exactly
    as many rows as the pool counts holders: a page held alone is in one row only."""
    for p, group in enumerate(layer_groups):
        pool = group.pool
        pool.check_accounting()
        holders: dict[int, list[int]] = {}
        for rid, cache in caches.items():
            for page in cache.held_pages(p):
                holders.setdefault(page, []).append(rid)
        for page, rids in holders.items():
            if len(rids) != pool.refcount(page):
                if len(rids) > 1 and pool.refcount(page) <= 1:
                    raise AssertionError(f"pool {p}: page {page} held by requests {rids[0]} and {rids[1]}")
                raise AssertionError(
                    f"pool {p}: page {page} is in the rows of requests {rids} but the pool counts "
                    f"{pool.refcount(page)} holder(s)"
                )
        if len(holders) != pool.num_held:
            raise AssertionError(
                f"pool {p}: caches hold {len(holders)} pages but the pool counts {pool.num_held} held"
            )
