"""A batch of resizes known to succeed before any is made: the managers' per-step fast path.

Coordinates are the caches' own: (capacity, history) in tokens from absolute
position 0, pages of each layer group's pool.

A batch transaction (`RequestCaches.transaction`) journals every cache and pool so
that a failure part-way can be undone. Most generation steps cannot fail: every
size is valid and the pools have the pages. `resize_in_order` checks that first,
changing nothing, and then resizes without journals; when it cannot be sure it
answers False and the caller takes the journaled per-request path, which raises
or rolls back exactly as before.
"""
from __future__ import annotations

from collections.abc import Sequence

from .kv_cache import KVCache
from .resize_plan import ResizePlan
from .layer_group import LayerGroup
from .page_pool import PagePool


_ONE_SLOT = (0,)  # one group, one pool: its balance is slot 0


def plain_pools(groups: Sequence[LayerGroup]) -> bool:
    """Can a resize over these groups only fail by a short pool? True when no pool has block reuse
    (releases would park, allocations evict) or listeners (which might raise mid-batch)."""
    return all(_plain(g.pool) for g in groups)


def _plain(pool: PagePool) -> bool:
    """No block reuse and no listeners: `plain_pools` for one pool."""
    return pool.prefix is None and not pool.listeners


def plan_in_order(
    groups: Sequence[LayerGroup], caches: Sequence[KVCache], sizes: Sequence[tuple[int | None, int | None]]
) -> list[ResizePlan] | None:
    """Each cache's `plan_resize(capacity, history)`, checked as consecutive resizes would run:
    every size valid and, request after request, every pool able to give the pages still
    free after the requests before it. None, changing nothing, when any check fails, a cache
    is named twice or a pool is not plain (`plain_pools`)."""
    checked = _check_in_order(groups, caches, sizes)
    if checked is None:
        return None
    return [plan if plan is not None else tuple.__new__(ResizePlan, (capacity, history, None))
            for capacity, history, plan in checked]


def resize_in_order(
    groups: Sequence[LayerGroup], caches: Sequence[KVCache], sizes: Sequence[tuple[int | None, int | None]]
) -> bool:
    """Resize `caches[i]` to `sizes[i]` in order, exactly as consecutive `resize` calls would (same
    pages, same free-list order, same journal entries where one is open), when `plan_in_order`
    shows every one succeeds. False, changing nothing, otherwise."""
    checked = _check_in_order(groups, caches, sizes, one_page=True)
    if checked is None:
        return False
    for cache, (capacity, history, plan) in zip(caches, checked):
        if plan is None:
            cache.move_cursors(capacity, history)
        elif plan.__class__ is int:
            cache.take_one_page_step(plan, capacity, history)
        else:
            cache.apply_plan(plan)
    return True


def _check_in_order(
    groups: Sequence[LayerGroup], caches: Sequence[KVCache], sizes: Sequence[tuple[int | None, int | None]],
    one_page: bool = False,
) -> list[tuple[int, int, ResizePlan | int | None]] | None:
    """`plan_in_order`'s answer as (capacity, history, plan) per cache, plan None where only the cursors
    move: the usual step, answered from `KVCache.cursor_range` without building a plan. `one_page`:
    a one-group cache's page crossing is answered as `KVCache.one_page_step`'s 1 or -1 instead of a
    plan (the step where every request crosses a page then builds no plan at all)."""
    if len(set(map(id, caches))) != len(caches):
        return None
    if len(groups) == 1:  # the usual draft pool: `plain_pools` and the balances below, for one pool
        pool = groups[0].pool
        if not _plain(pool):
            return None
        slot_of, balance = _ONE_SLOT, [pool.num_free]
    else:
        if not plain_pools(groups):
            return None
        # Groups may share one pool: one balance (free pages left) per distinct pool, by slot.
        slots: dict[int, int] = {}
        slot_of = [slots.setdefault(id(g.pool), len(slots)) for g in groups]
        balance = [0] * len(slots)
        for slot, group in zip(slot_of, groups):
            balance[slot] = group.pool.num_free
    checked: list[tuple[int, int, ResizePlan | None]] = []
    append = checked.append
    for cache, (capacity, history) in zip(caches, sizes):
        span = cache.cursor_range()
        if capacity is None:
            capacity = cache.capacity
        if history is None:
            history = cache.history_length
        if (span.capacity_above < capacity <= span.capacity_max and history <= capacity
                and cache.history_length <= history <= span.history_max):
            append((capacity, history, None))
            continue
        if one_page and len(slot_of) == 1:
            step = cache.one_page_step(capacity, history)
            if step:
                balance[0] -= step  # a page taken (1) or given back (-1)
                if balance[0] < 0:
                    return None
                append((capacity, history, step))
                continue
        plan = cache.plan_resize(capacity, history)
        if plan is None:
            return None
        if plan.plans is not None:
            # As `KVCache._fits`: a request's releases come before its allocations.
            for slot, group_plan in zip(slot_of, plan.plans):
                balance[slot] += len(group_plan.release) - len(group_plan.allocate)
            if min(balance) < 0:
                return None
        append((capacity, history, plan))
    return checked


__all__ = ["plain_pools", "plan_in_order", "resize_in_order"]
