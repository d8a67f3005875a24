"""Policy over the runtime: the target manager, the draft manager, sizing rules, estimators."""
from .diagnostics import KVCacheResizeError, MissingKVCacheError
from .draft_kv_cache_manager import DraftKVCacheManagerV2
from .kv_cache_manager import KVCacheManagerV2
from .rules import DraftPoolTraits, MirrorSizing

__all__ = ["DraftKVCacheManagerV2", "KVCacheManagerV2", "KVCacheResizeError", "MissingKVCacheError", "DraftPoolTraits", "MirrorSizing"]
