"""The paged KV cache itself: life cycles, page pools, per-request caches. No drafter policy."""
from .kv_cache import KVCache
from .layer_group import LayerGroup
from .life_cycle import LifeCycle
from .page_pool import BAD_PAGE_INDEX, OutOfPagesError, PagePool
from .prefix_cache import PrefixCache

__all__ = ["BAD_PAGE_INDEX", "KVCache", "LayerGroup", "LifeCycle", "OutOfPagesError", "PagePool", "PrefixCache"]
