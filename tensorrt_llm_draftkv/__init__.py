"""Draft-KV pool sizing and addressing for speculative decoding drafters.

See README.md for what the package fixes and how an executor uses it.
"""
from .config import KVPoolConfig, LayerGroupConfig, SpeculativeDecodingMode
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
    "KVPoolConfig",
    "LayerGroupConfig",
    "LlmRequest",
    "LlmRequestState",
    "ScheduledRequests",
    "SpeculativeDecodingMode",
    "request_context",
]


def __getattr__(name: str):
    """`KvCacheConfig`: a deprecated alias of `KVPoolConfig` (warns DeprecationWarning)."""
    from . import config as _config

    if name in _config._DEPRECATED_ALIASES:
        return _config._deprecated_alias(__name__, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
