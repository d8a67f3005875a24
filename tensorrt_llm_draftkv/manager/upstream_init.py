"""The small decisions upstream's constructor arguments imply, each a pure function.

Which arguments are refused or ignored, how many drafts and extra tokens a
manager sizes for, and whether it is a draft mirror (with which policy and trail
page). `KVCacheManagerV2.__init__` calls these, then builds its pools from
`upstream_geometry.pool_geometry`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..config import SpeculativeDecodingMode
from ..llmapi import get_num_extra_kv_tokens
from . import rules

#: Keywords of ours the constructor takes beside upstream's arguments.
OUR_KEYWORDS = ("device", "sizing", "trail_page")


@dataclass(frozen=True)
class Options:
    """Our keywords, resolved."""

    device: str
    sizing: rules.MirrorSizing
    trail_page: bool


@dataclass(frozen=True)
class DraftNumbers:
    """Draft tokens a step may carry and extra tokens kept above every step."""

    max_draft_len: int
    num_extra_kv_tokens: int


@dataclass(frozen=True)
class UpstreamArgs:
    """What the constructor was given that the pools do not hold (read by the accessors)."""

    kv_cache_config: Any
    kv_cache_type: Any
    mapping: Any
    spec_config: Any
    max_batch_size: int
    max_num_tokens: int
    is_disagg: bool
    enable_stats: bool
    budget_bytes: int
    budget_source: str


def check_options(
    label: str,
    kwargs: dict[str, Any],
    *,
    is_draft: bool,
    max_beam_width: int,
    kv_connector_manager: object,
    cold_page_codec_provider: object,
) -> Options:
    """Refuse what this package does not implement; warn about keywords it does not know (upstream
    swallows them silently)."""
    if max_beam_width != 1:
        raise ValueError(f"{label}: beam search is not supported (max_beam_width={max_beam_width}, must be 1)")
    if kv_connector_manager is not None:
        raise ValueError(f"{label}: KV cache connectors are not supported (kv_connector_manager must be None)")
    if cold_page_codec_provider is not None:
        raise ValueError(f"{label}: there is no host tier here to compress pages into (cold_page_codec_provider)")
    unknown = sorted(set(kwargs) - set(OUR_KEYWORDS))
    if unknown:
        warnings.warn(f"{label}: ignoring keyword arguments {unknown}", stacklevel=3)
    if not is_draft and ("sizing" in kwargs or "trail_page" in kwargs):
        raise ValueError(f"{label}: sizing and trail_page are draft-manager options (is_draft=False here)")
    device = kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    return Options(
        device=str(device),
        sizing=rules.MirrorSizing.parse(kwargs.get("sizing", rules.MirrorSizing.HISTORY)),
        trail_page=bool(kwargs.get("trail_page", True)),
    )


def draft_numbers(spec_config: Any, *, is_draft: bool) -> DraftNumbers:
    """Upstream's draft length and extra tokens; a block drafter's mirror (DFlash, DSpark, PARD) also
    keeps room for its whole block (`max_draft_len + 1` tokens) above the accepted ones."""
    if spec_config is None:
        return DraftNumbers(0, 0)
    k = spec_config.max_draft_len or 0
    extra = get_num_extra_kv_tokens(spec_config)
    if is_draft and spec_config.spec_dec_mode.is_parallel_draft():
        extra = max(extra, k + 1)
    return DraftNumbers(k, extra)


def mirror_policy(
    spec_config: Any,
    *,
    is_draft: bool,
    joint_kv_cache_reuse: bool,
    options: Options,
    tokens_per_block: int,
    windowed: bool,
) -> tuple[rules.DraftPoolTraits | None, int]:
    """(the mirror policy, trail tokens) of a draft manager; (None, 0) for a target manager.

    ValueError for a draft manager without a drafter: it would have nothing to mirror.
    """
    if not is_draft:
        return None, 0
    mode = None if spec_config is None else spec_config.spec_dec_mode
    if mode is None or mode in (SpeculativeDecodingMode.NONE, SpeculativeDecodingMode.AUTO):
        raise ValueError(
            f"Draft KV cache: is_draft=True needs the drafter's spec_config (got {spec_config!r}): the draft "
            "manager sizes its mirrors by the drafter's mode"
        )
    policy = rules.DraftPoolTraits(mode, options.sizing, joint_kv_cache_reuse)
    trail = rules.draft_slot_trail_tokens(
        policy, tokens_per_block=tokens_per_block, any_windowed_group=windowed, trail_page=options.trail_page
    )
    return policy, trail
