"""Draft-KV pool sizing and addressing for speculative decoding drafters.

See README.md for what the package fixes and how an executor uses it.
"""
from .config import KvCacheConfig, LayerGroupConfig, SpeculativeDecodingMode
from .manager import DraftKVCacheManagerV2, KVCacheManagerV2, KVCacheResizeError, MirrorSizing, MissingKVCacheError
from .request import LlmRequest, LlmRequestState, ScheduledRequests, request_context
from .runtime import BAD_PAGE_INDEX
from .speculative import DFlashSpecMetadata

__all__ = [
    "BAD_PAGE_INDEX",
    "DFlashSpecMetadata",
    "DraftKVCacheManagerV2",
    "KVCacheManagerV2",
    "MirrorSizing",
    "KVCacheResizeError",
    "MissingKVCacheError",
    "KvCacheConfig",
    "LayerGroupConfig",
    "LlmRequest",
    "LlmRequestState",
    "ScheduledRequests",
    "SpeculativeDecodingMode",
    "request_context",
]
