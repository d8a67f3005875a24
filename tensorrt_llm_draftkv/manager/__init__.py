"""Policy over the runtime: the target manager, the draft manager, sizing rules, estimators."""
from .diagnostics import KVCacheResizeError
from .kv_cache_manager import KVCacheManagerV2

__all__ = ["KVCacheManagerV2", "KVCacheResizeError"]
