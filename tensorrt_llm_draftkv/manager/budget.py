"""Estimators: the most pages one request ever holds, and what a pool budget buys.

Everything is per request and per layer group, in pages of `tokens_per_block`
(P) tokens. A step puts `headroom` tokens above the request's history h: the
cache then holds ordinals `(h + 1 - W) // P` up to `ceil((h + headroom) / P) - 1`.
The count is largest when `h + 1 - W` sits on the last slot of a page, which
gives `ceil((W + headroom - 2) / P) + 1`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import LayerGroupConfig
from . import rules


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def windowed_pages_per_request(window: int, tokens_per_block: int, headroom: int, alignment: int = 1) -> int:
    """Peak pages of one windowed group while a step holds `headroom` tokens above history.

    `alignment` is what every history a step starts from is known to be a multiple of
    (1 when nothing is known: then the result is `ceil((W + headroom - 2) / P) + 1`).
    Chunked prefill in fixed chunks of c tokens starts at multiples of c, so
    `alignment = c` gives the exact peak of such a prefill.
    """
    _check_positive(window=window, tokens_per_block=tokens_per_block, headroom=headroom, alignment=alignment)
    p = tokens_per_block
    g = math.gcd(alignment, p)
    # (h + 1 - W) mod P runs over residues congruent to (1 - W) mod g: take the largest.
    worst_residue = p - g + ((1 - window) % g)
    return _ceil_div(worst_residue + window - 1 + headroom, p)


def full_attention_pages_per_request(max_seq_len: int, tokens_per_block: int) -> int:
    _check_positive(max_seq_len=max_seq_len, tokens_per_block=tokens_per_block)
    return _ceil_div(max_seq_len, tokens_per_block)


def group_pages_per_request(
    window: int | None,
    tokens_per_block: int,
    *,
    max_seq_len: int,
    chunk: int,
    max_draft_len: int = 0,
    num_extra_kv_tokens: int = 0,
    trail_tokens: int = 0,
    sink_blocks: int = 0,
    chunk_alignment: bool = False,
) -> int:
    """Peak pages one request holds in one layer group, over prefill and generation.

    `trail_tokens` widens the window (the DFlash trail page). With
    `chunk_alignment`, context chunks are known to start at multiples of `chunk`.
    Never more than the full-attention charge for `max_seq_len`.
    """
    full = full_attention_pages_per_request(max_seq_len, tokens_per_block)
    if window is None:
        return full
    w = window + trail_tokens
    context = rules.context_headroom(chunk, True, max_draft_len, num_extra_kv_tokens)
    generation = rules.generation_headroom(max_draft_len, num_extra_kv_tokens)
    peak = max(
        windowed_pages_per_request(w, tokens_per_block, context, chunk if chunk_alignment else 1),
        windowed_pages_per_request(w, tokens_per_block, generation, 1),
    )
    return min(full, peak + sink_blocks)


def bytes_per_page(
    group: LayerGroupConfig, *, tokens_per_block: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_factor: int = 2
) -> int:
    """Bytes one page of this group occupies over all its layers (K and V)."""
    return bytes_per_token(group, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, kv_factor=kv_factor) * tokens_per_block


def bytes_per_token(
    group: LayerGroupConfig, *, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_factor: int = 2
) -> int:
    """Bytes one token of this group occupies over all its layers (K and V)."""
    _check_positive(num_kv_heads=num_kv_heads, head_dim=head_dim, kv_factor=kv_factor)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return group.num_layers * kv_factor * num_kv_heads * head_dim * itemsize


def pages_for_quota(quota_bytes: int, page_bytes: int) -> int:
    """Whole pages a byte quota buys."""
    if quota_bytes < 0:
        raise ValueError(f"a byte quota must be >= 0, got {quota_bytes}")
    _check_positive(page_bytes=page_bytes)
    return quota_bytes // page_bytes


def quota_to_max_tokens(quota_bytes: int, page_bytes: int, tokens_per_block: int) -> int:
    """Token slots a byte quota buys in one group's pool (whole pages only)."""
    return pages_for_quota(quota_bytes, page_bytes) * tokens_per_block


def max_tokens_to_quota(max_tokens: int, page_bytes: int, tokens_per_block: int) -> int:
    """Bytes needed for `max_tokens` token slots, rounded up to whole pages."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    _check_positive(tokens_per_block=tokens_per_block)
    return _ceil_div(max_tokens, tokens_per_block) * page_bytes


def max_concurrency(pool_pages: int, pages_per_request: int) -> int:
    if pool_pages < 0:
        raise ValueError(f"pool_pages must be >= 0, got {pool_pages}")
    _check_positive(pages_per_request=pages_per_request)
    return pool_pages // pages_per_request


@dataclass(frozen=True)
class AffineCost:
    """Bytes a pool needs: `per_token` for every token slot plus `per_request` for each request.

    The draft pool of a DFlash/DSpark drafter has a per-request intercept: the
    trail page of every windowed group.
    """

    per_token: int
    per_request: int = 0

    def bytes_for(self, max_tokens: int, max_num_requests: int) -> int:
        if max_tokens < 0 or max_num_requests < 0:
            raise ValueError(f"max_tokens ({max_tokens}) and max_num_requests ({max_num_requests}) must be >= 0")
        return self.per_token * max_tokens + self.per_request * max_num_requests

    def max_tokens_for(self, quota_bytes: int, max_num_requests: int) -> int:
        """Token slots a quota buys once every request's intercept is paid."""
        spare = quota_bytes - self.per_request * max_num_requests
        if spare < 0:
            raise ValueError(
                f"a quota of {quota_bytes} bytes does not cover the per-request cost "
                f"({self.per_request} bytes x {max_num_requests} requests)"
            )
        return spare // self.per_token


def trail_cost(page_bytes_per_windowed_group: list[int]) -> int:
    """Bytes of trail pages per request: one page in every windowed group."""
    return sum(page_bytes_per_windowed_group)


@dataclass(frozen=True)
class BudgetSplit:
    target_bytes: int
    draft_bytes: int
    max_tokens: int


def split_budget(total_bytes: int, target: AffineCost, draft: AffineCost, max_num_requests: int) -> BudgetSplit:
    """Share `total_bytes` so both pools hold the same number of token slots.

    Solves `target(T) + draft(T) <= total` for the largest T; each pool gets
    exactly what T costs it, and the remainder (less than one token's worth)
    stays unassigned.
    """
    intercept = (target.per_request + draft.per_request) * max_num_requests
    slope = target.per_token + draft.per_token
    if slope < 1:
        raise ValueError(f"per-token costs must add to >= 1 byte, got {slope}")
    if total_bytes < intercept:
        raise ValueError(
            f"a budget of {total_bytes} bytes does not cover the per-request costs of "
            f"{max_num_requests} requests ({intercept} bytes)"
        )
    tokens = (total_bytes - intercept) // slope
    return BudgetSplit(
        target_bytes=target.bytes_for(tokens, max_num_requests),
        draft_bytes=draft.bytes_for(tokens, max_num_requests),
        max_tokens=tokens,
    )
