"""The KV cache layer: specs (what a block holds), layouts (how a backend lays it out),
config (which buffers exist and who shares them) and the cache (allocate, view, extend)."""

from extkv.kv_cache.cache import KVCache, layer_segments
from extkv.kv_cache.layouts import LAYOUTS, AttentionLayout, get_layout, hybrid_layout
from extkv.kv_cache.plan import (
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    bytes_per_block,
    make_kv_cache_config,
)
from extkv.kv_cache.specs import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
)

__all__ = [
    "LAYOUTS",
    "AttentionLayout",
    "AttentionSpec",
    "FullAttentionSpec",
    "KVCache",
    "KVCacheConfig",
    "KVCacheGroup",
    "KVCacheSpec",
    "KVCacheTensor",
    "MLASpec",
    "MambaSpec",
    "SlidingWindowSpec",
    "bytes_per_block",
    "get_layout",
    "hybrid_layout",
    "layer_segments",
    "make_kv_cache_config",
]
