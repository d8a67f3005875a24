"""Where a received drafter context may seed a slot: the generation worker's checks before seeding.

A disaggregated generation worker writes the drafter context it received
(:mod:`.handoff`) onto the request's draft mirror and then seeds the request's
first slot from it. Before that, these checks say which pages the mirror backs
and refuse a context that lies outside them, naming the request and the
numbers; they change nothing.

Coordinates: absolute token positions of the request (position 0 is the first
prompt token), a received context being ``[lo, end)`` with ``end`` the prompt
length; pages of ``tokens_per_block`` (``P``) tokens, block ordinal ``i``
covering ``[i*P, (i+1)*P)``; ``backed_from`` is always a multiple of ``P``.
Split from :mod:`.handoff` (which still exports both functions): that module
describes what is sent, this one only what the receiver's mirror holds.
"""
from __future__ import annotations

from .draft_pool import DraftPool


def check_seed_range(
    request_id: int, lo: int, end: int, *, backed_from: int, tokens_per_block: int
) -> None:
    """Refuse a context seed ``[lo, end)`` (absolute tokens) the mirror cannot hold.

    ``backed_from``: the first absolute position whose page the mirror backs in
    every draft layer group (a multiple of ``tokens_per_block``). Raises
    ``ValueError`` naming the request and the numbers.
    """
    if lo < 0 or lo > end:
        raise ValueError(
            f"request {request_id}: cannot seed a drafter context [{lo}, {end}): it must start at or after 0 "
            f"and not above its end"
        )
    if lo < end and lo < backed_from:  # an empty context needs no page
        raise ValueError(
            f"request {request_id}: cannot seed a drafter context [{lo}, {end}): position {lo} is on page "
            f"{lo // tokens_per_block}, but the draft mirror backs pages only from {backed_from // tokens_per_block} "
            f"(position {backed_from}) on"
        )


def mirror_backed_from(draft_manager: DraftPool, request_id: int, end: int) -> int:
    """First absolute position from which the request's draft mirror backs every page below ``end``, in every group.

    A multiple of the page size (``ceil(end / P) * P`` when a window keeps not
    even the page holding ``end - 1``). Raises ``ValueError`` naming the
    request and the numbers when the mirror's row does not reach ``end``, and
    the manager's own error when the request has no mirror.
    """
    if end < 1:
        raise ValueError(f"request {request_id}: a received drafter context must end past position 0, got {end}")
    cache = draft_manager.get_cache(request_id)
    P = draft_manager.config.tokens_per_block
    top = -(-end // P)  # ordinals [.., top) hold positions below `end`
    first = 0
    for g in range(draft_manager.num_pools):
        row = cache.block_row(g)
        i = top
        if len(row) < top:
            raise ValueError(
                f"request {request_id}: its draft mirror does not back page {top - 1} (positions up to {end}) in "
                f"layer group {g}: its row has {len(row)} entries"
            )
        while i > 0 and row[i - 1] >= 0:
            i -= 1
        first = max(first, i)
    return first * P


__all__ = [
    "check_seed_range",
    "mirror_backed_from",
]
