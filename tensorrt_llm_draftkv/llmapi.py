"""The LLM-API configs a TensorRT-LLM executor hands its KV cache managers, in upstream's names.

`KvCacheConfig` is the user-facing budget (how many tokens or bytes the cache
may use, block reuse, attention windows), not a pool geometry: the managers turn
it into pools (`manager/upstream_geometry.py`). The decoding configs say which
drafter runs (`spec_dec_mode`) and how many tokens it drafts. Only the fields
the KV cache reads are here; each keeps upstream's name and default.
Plain dataclasses with checks, where upstream uses pydantic models.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .config import SpeculativeDecodingMode


@dataclass
class KvCacheConfig:
    """How much the KV cache may hold, and how (LLM-API fields, upstream's defaults).

    Budget: `max_tokens` tokens of every layer, or `max_gpu_total_bytes`, or (on a GPU)
    `free_gpu_memory_fraction` of the free device memory; the smallest of those given
    wins. `max_attention_window`: per-layer windows in tokens, repeated over the
    layers as upstream does (a window >= max_seq_len is full attention).
    `tokens_per_block` and `dtype` ("auto": the model's) of the pools.
    """

    max_tokens: int | None = None
    free_gpu_memory_fraction: float | None = 0.9
    max_gpu_total_bytes: int = 0
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    max_attention_window: list[int] | None = None
    sink_token_length: int | None = None
    tokens_per_block: int = 32
    dtype: str = "auto"
    host_cache_size: int | None = None
    event_buffer_max_size: int = 0
    max_util_for_resume: float = 0.95

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"KvCacheConfig: max_tokens must be >= 1 (or None), got {self.max_tokens}")
        fraction = self.free_gpu_memory_fraction
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"KvCacheConfig: free_gpu_memory_fraction must be in (0, 1], got {fraction}")
        if self.max_gpu_total_bytes < 0:
            raise ValueError(f"KvCacheConfig: max_gpu_total_bytes must be >= 0, got {self.max_gpu_total_bytes}")
        if self.max_attention_window is not None:
            if len(self.max_attention_window) == 0:
                raise ValueError("KvCacheConfig: max_attention_window needs at least one entry (or None)")
            bad = [w for w in self.max_attention_window if w < 1]
            if bad:
                raise ValueError(f"KvCacheConfig: attention windows must be >= 1 token, got {bad}")
        if self.tokens_per_block < 1:
            raise ValueError(f"KvCacheConfig: tokens_per_block must be >= 1, got {self.tokens_per_block}")
        if not 0.0 < self.max_util_for_resume <= 1.0:
            raise ValueError(f"KvCacheConfig: max_util_for_resume must be in (0, 1], got {self.max_util_for_resume}")


@dataclass
class DecodingBaseConfig:
    """What every speculative decoding config carries that the KV cache reads."""

    max_draft_len: int | None = None
    max_total_draft_tokens: int | None = None
    speculative_model: str | None = None
    max_concurrency: int | None = None
    #: Upstream's private switches (`_allow_separate_draft_kv_cache`, `_use_shared_kv_cache`).
    allow_separate_draft_kv_cache: bool = field(default=True, repr=False)
    use_shared_kv_cache: bool = field(default=False, repr=False)

    decoding_type: ClassVar[str] = "NONE"

    def __post_init__(self) -> None:
        if self.max_draft_len is not None and self.max_draft_len < 0:
            raise ValueError(f"{type(self).__name__}: max_draft_len must be >= 0, got {self.max_draft_len}")
        if self.max_total_draft_tokens is None:
            self.max_total_draft_tokens = self.max_draft_len

    @property
    def spec_dec_mode(self) -> SpeculativeDecodingMode:
        return SpeculativeDecodingMode.from_string(self.decoding_type)

    @property
    def tokens_per_gen_step(self) -> int:
        """Tokens a generation step feeds the target: the new token and the drafts."""
        return 1 + (self.max_total_draft_tokens or 0)

    # upstream spells these with a leading underscore
    @property
    def _allow_separate_draft_kv_cache(self) -> bool:
        return self.allow_separate_draft_kv_cache

    @property
    def _use_shared_kv_cache(self) -> bool:
        return self.use_shared_kv_cache


@dataclass
class DFlashDecodingConfig(DecodingBaseConfig):
    """DFlash: a block drafter that proposes `max_draft_len` tokens in one pass over its own context."""

    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    attention_backend: str = "VANILLA"

    decoding_type: ClassVar[str] = "DFLASH"


@dataclass
class DSparkDecodingConfig(DecodingBaseConfig):
    """DSpark: DFlash's lineage with a Markov head; `draft_is_embedded_in_target` for a checkpoint
    that carries the drafter inside the target (it then keeps no separate draft pool)."""

    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    block_size: int | None = None
    attention_backend: str = "VANILLA"
    draft_is_embedded_in_target: bool = False

    decoding_type: ClassVar[str] = "DSPARK"


@dataclass
class PARDDecodingConfig(DecodingBaseConfig):
    decoding_type: ClassVar[str] = "PARD"


@dataclass
class DraftTargetDecodingConfig(DecodingBaseConfig):
    """A draft model run inside the target's engine (upstream's one-model draft-target)."""

    decoding_type: ClassVar[str] = "DRAFT_TARGET_ONE_MODEL"


@dataclass
class MTPDecodingConfig(DecodingBaseConfig):
    num_nextn_predict_layers: int = 1

    decoding_type: ClassVar[str] = "MTP"


@dataclass
class Eagle3DecodingConfig(DecodingBaseConfig):
    """Eagle3 in the target's engine (`eagle3_one_model=True`, upstream's default) or as a second engine."""

    eagle3_one_model: bool = True

    @property
    def spec_dec_mode(self) -> SpeculativeDecodingMode:
        if self.eagle3_one_model:
            return SpeculativeDecodingMode.EAGLE3_ONE_MODEL
        return SpeculativeDecodingMode.EAGLE3


def should_use_separate_draft_kv_cache(spec_config: DecodingBaseConfig | None) -> bool:
    """Does this drafter keep its K/V in a draft pool of its own (a draft `KVCacheManagerV2`)?

    Only a drafter in the target's engine, not told to share the target's cache; a DSpark
    drafter embedded in the target checkpoint keeps none (as upstream).
    """
    if spec_config is None:
        return False
    mode = spec_config.spec_dec_mode
    if not mode.use_one_engine() or spec_config._use_shared_kv_cache:
        return False
    if mode.is_dspark() and getattr(spec_config, "draft_is_embedded_in_target", False):
        return False
    return spec_config._allow_separate_draft_kv_cache


def get_num_extra_kv_tokens(spec_config: DecodingBaseConfig | None) -> int:
    """Upstream's extra tokens a one-engine drafter's cache keeps above each step: `max_draft_len - 1`
    (0 without a drafter, or with a shared cache)."""
    if spec_config is None or spec_config._use_shared_kv_cache:
        return 0
    if spec_config.spec_dec_mode.use_one_engine():
        return max(0, (spec_config.max_draft_len or 0) - 1)
    return 0
