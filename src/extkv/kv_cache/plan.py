"""The KV cache plan: decided once, from the model's layers, before anything is allocated.

`plan_kv_cache` gives every layer that keeps a cache (attention layers, Mamba mixers)
its spec, fixes the block size and each attention layer's layout, and groups the layers
(see groups.py: one block table per group, one pool of blocks for all); the runner, the
block manager and the start-up flow all read that plan, and nothing changes it
afterwards. `KVCachePlan.buffers(num_blocks)` then says which buffers exist at a block
count, which layers share each, and what a block costs.

Each attention layer has its own spec: a sliding window (Mistral, Gemma's local layers),
full attention (Gemma's global layers), or MLA's latent row. In a hybrid attention + Mamba
model the block size is raised until one attention page holds a Mamba state, since the
groups share pages.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from extkv.kv_cache.groups import (
    KVCacheConfig,
    KVCacheGroup,
    bytes_per_block,
    group_layers,
    make_kv_cache_config,
)
from extkv.kv_cache.layouts import AttentionLayout, get_layout, hybrid_layout
from extkv.kv_cache.specs import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
)

logger = logging.getLogger(__name__)


class AttentionLayer(Protocol):
    """What the plan reads of an attention layer: K and V of its heads per token, or with
    `latent_cache` (MLA) one row of `head_dim` values."""

    num_kv_heads: int
    head_dim: int
    latent_cache: bool
    sliding_window: int | None  # optional: None when absent


class StateLayer(Protocol):
    """What the plan reads of a recurrent (Mamba) layer: its per-sequence state."""

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of the per-sequence states, in page order."""
        ...

    def state_dtypes(self) -> tuple[torch.dtype, ...]:
        """One dtype per state in `state_shapes`."""
        ...


@dataclass(frozen=True)
class KVCachePlan:
    """The KV cache of one model, decided before anything is allocated: its groups (the
    attention groups first, then the recurrent-state groups), block size, and the layout
    of every attention layer."""

    groups: tuple[KVCacheGroup, ...]
    layouts: dict[str, AttentionLayout]
    block_size: int  # tokens per block, raised in a hybrid so that one page holds a state

    @property
    def attention_groups(self) -> list[KVCacheGroup]:
        """The groups whose blocks hold tokens: a block table each, in the step's inputs."""
        return [group for group in self.groups if group.per_token]

    @property
    def state_groups(self) -> list[KVCacheGroup]:
        """The recurrent-state groups, each holding one block per sequence."""
        return [group for group in self.groups if not group.per_token]

    @property
    def bytes_per_block(self) -> int:
        """What one more block costs across all buffers: size the cache as `available // this`."""
        return bytes_per_block(self.groups)

    def blocks_per_seq(self, num_tokens: int, max_step_tokens: int | None = None) -> int:
        """The most blocks one sequence holds at once, over all groups, while it grows to
        `num_tokens` tokens computed at most `max_step_tokens` a step (None: all at once):
        what the pool must have for a sequence of max_model_len tokens to run."""
        step = num_tokens if max_step_tokens is None else max_step_tokens
        return sum(group.max_blocks_per_seq(num_tokens, step) for group in self.groups)

    def buffers(self, num_blocks: int) -> KVCacheConfig:
        """The buffers at `num_blocks` blocks, and which layers share each."""
        return make_kv_cache_config(self.groups, num_blocks)

    def group_sizing(self, max_model_len: int, max_step_tokens: int) -> list[dict[str, object]]:
        """Per group, for the start-up report: its kind, layers and spec, the bytes its
        layers take of one block, and the most blocks (and pool bytes) one sequence of
        `max_model_len` tokens holds in it."""
        per_block = self.bytes_per_block
        sizing = []
        for group in self.groups:
            blocks = group.max_blocks_per_seq(max_model_len, max_step_tokens)
            sizing.append(
                {
                    "kind": group.kind,
                    "layers": list(group.layer_names),
                    "spec": repr(group.spec),
                    "page_size_bytes": group.spec.page_size_bytes,
                    "bytes_per_block": len(group.layer_names) * group.spec.page_size_bytes,
                    "max_blocks_per_seq": blocks,
                    "max_bytes_per_seq": blocks * per_block,
                }
            )
        return sizing


def plan_kv_cache(
    attention: Mapping[str, AttentionLayer],
    state: Mapping[str, StateLayer],
    dtype: torch.dtype,
    block_size: int,
    kv_layout: str,
) -> KVCachePlan:
    """Give each layer that keeps a cache its spec, group them, fix the block size and
    the layouts.

    A hybrid model shares pages between attention and Mamba state, so an attention
    page must hold a whole state: the block size is raised to the next power of two
    that does, and the attention layers are re-strided so that K and V of a block lie
    in one page (one segment; see layouts.hybrid_layout).

    MLA layers keep one latent row per token, in the `mla` layout whatever `kv_layout`
    says (that option places K and V, which an MLA cache does not have)."""
    if not attention and not state:
        raise ValueError("the model has no layer that keeps a KV cache or a recurrent state")
    if attention and state:
        largest = max(state.values(), key=lambda layer: _state_spec(layer, 1).state_bytes)
        first = next(iter(attention.values()))
        block_size = _block_size_holding(
            _attention_spec(first, block_size, dtype), _state_spec(largest, block_size)
        )
    specs: dict[str, KVCacheSpec] = {
        name: _attention_spec(layer, block_size, dtype) for name, layer in attention.items()
    }
    specs |= {name: _state_spec(layer, block_size) for name, layer in state.items()}

    def layout_of(layer: AttentionLayer) -> AttentionLayout:
        layout = get_layout("mla" if layer.latent_cache else kv_layout)
        return hybrid_layout(layout) if state else layout

    layouts = {name: layout_of(layer) for name, layer in attention.items()}
    return KVCachePlan(tuple(group_layers(specs)), layouts, block_size)


def _attention_spec(layer: AttentionLayer, block_size: int, dtype: torch.dtype) -> AttentionSpec:
    if layer.latent_cache:
        return MLASpec(block_size, layer.head_dim, dtype)
    window = getattr(layer, "sliding_window", None)
    if window is None:
        return FullAttentionSpec(block_size, layer.num_kv_heads, layer.head_dim, dtype)
    return SlidingWindowSpec(block_size, layer.num_kv_heads, layer.head_dim, dtype, window)


def _state_spec(layer: StateLayer, block_size: int) -> MambaSpec:
    return MambaSpec(block_size, layer.state_shapes(), layer.state_dtypes())


def _block_size_holding(attention: AttentionSpec, state: MambaSpec) -> int:
    """The block size whose attention page holds one whole state: the configured one, or
    the next power of two above it that does."""
    if state.page_size_bytes <= attention.page_size_bytes:
        return attention.block_size
    per_token = attention.page_size_bytes // attention.block_size
    block_size = 1 << (-(-state.page_size_bytes // per_token) - 1).bit_length()
    logger.info(
        "Raised block_size from %d to %d so that one attention page holds a %d-byte Mamba state.",
        attention.block_size,
        block_size,
        state.page_size_bytes,
    )
    return block_size
