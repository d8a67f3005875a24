"""Draft-KV pool sizing and addressing for speculative decoding drafters.

See README.md for what the package fixes and how an executor uses it; docs/upstream.md
lists every name that carries TensorRT-LLM's signature.
"""
from .bindings import CacheType, DataType
from .config import KVPoolConfig, LayerGroupConfig, SpeculativeDecodingMode
from .llmapi import (
    DecodingBaseConfig,
    DFlashDecodingConfig,
    DSparkDecodingConfig,
    KvCacheConfig,
    get_num_extra_kv_tokens,
    should_use_separate_draft_kv_cache,
)
from .manager import DraftKVCacheManagerV2, KVCacheManagerV2, KVCacheResizeError, MirrorSizing, MissingKVCacheError
from .mapping import Mapping
from .request import LlmRequest, LlmRequestState, ScheduledRequests, request_context
from .runtime import BAD_PAGE_INDEX
from .speculative import CUDA_GRAPH_DUMMY_REQUEST_ID, DFlashDraftSlots, DFlashSpecMetadata, DFlashWorker, DraftStoreRefused, SpecMetadata

__all__ = [
    "BAD_PAGE_INDEX",
    "CacheType",
    "DataType",
    "DecodingBaseConfig",
    "DFlashDecodingConfig",
    "CUDA_GRAPH_DUMMY_REQUEST_ID",
    "DFlashDraftSlots",
    "DFlashSpecMetadata",
    "DFlashWorker",
    "DraftStoreRefused",
    "DSparkDecodingConfig",
    "DraftKVCacheManagerV2",
    "KVCacheManagerV2",
    "KVCacheResizeError",
    "KVPoolConfig",
    "KvCacheConfig",
    "LayerGroupConfig",
    "LlmRequest",
    "LlmRequestState",
    "Mapping",
    "MirrorSizing",
    "MissingKVCacheError",
    "ScheduledRequests",
    "SpeculativeDecodingMode",
    "get_num_extra_kv_tokens",
    "request_context",
    "should_use_separate_draft_kv_cache",
]
