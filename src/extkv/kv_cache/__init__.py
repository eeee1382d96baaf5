"""The KV cache layer: specs (what a block holds), layouts (how a backend lays it out),
groups (which layers share a block table, and the buffers one pool of blocks needs), the
plan (decided once from the model) and the cache (allocate, view, extend)."""

from extkv.kv_cache.cache import KVCache, layer_segments
from extkv.kv_cache.groups import (
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    bytes_per_block,
    group_layers,
    make_kv_cache_config,
)
from extkv.kv_cache.layouts import LAYOUTS, AttentionLayout, get_layout, hybrid_layout
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
    "group_layers",
    "hybrid_layout",
    "layer_segments",
    "make_kv_cache_config",
]
