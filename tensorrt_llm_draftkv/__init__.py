"""Draft-KV pool sizing and addressing for speculative decoding drafters.

See README.md for what the package fixes and how an executor uses it; docs/upstream.md
lists every name that carries TensorRT-LLM's signature.
"""
from __future__ import annotations

import importlib
from typing import Any

# Each public name and the module it lives in, loaded on first use (PEP 562): `import tensorrt_llm_draftkv`
# stays cheap until a name is read, so the command line's `--version` never loads torch.
_EXPORTS: dict[str, str] = {
    "BAD_PAGE_INDEX": ".runtime",
    "CacheType": ".bindings",
    "DataType": ".bindings",
    "DecodingBaseConfig": ".llmapi",
    "DFlashDecodingConfig": ".llmapi",
    "CUDA_GRAPH_DUMMY_REQUEST_ID": ".speculative",
    "DFlashDraftSlots": ".speculative",
    "DFlashSpecMetadata": ".speculative",
    "DFlashWorker": ".speculative",
    "DraftStoreRefused": ".speculative",
    "DSparkDecodingConfig": ".llmapi",
    "DraftKVCacheManagerV2": ".manager",
    "KVCacheManagerV2": ".manager",
    "KVCacheResizeError": ".manager",
    "KVPoolConfig": ".config",
    "KvCacheConfig": ".llmapi",
    "LayerGroupConfig": ".config",
    "LlmRequest": ".request",
    "LlmRequestState": ".request",
    "Mapping": ".mapping",
    "MirrorSizing": ".manager",
    "MissingKVCacheError": ".manager",
    "ScheduledRequests": ".request",
    "SpeculativeDecodingMode": ".config",
    "get_num_extra_kv_tokens": ".llmapi",
    "request_context": ".request",
    "should_use_separate_draft_kv_cache": ".llmapi",
    "SpecMetadata": ".speculative",
}

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


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later reads skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
