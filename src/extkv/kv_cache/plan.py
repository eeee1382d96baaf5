"""The KV cache plan: decided once, from the model's layers, before anything is allocated.

`plan_kv_cache` turns the layers that keep a cache (attention layers, Mamba
mixers) into the KV cache groups, the block size, the page size of each group
and each attention layer's layout; the runner, the block manager and the
start-up flow all read that plan, and nothing changes it afterwards.
`KVCachePlan.buffers(num_blocks)` then says which buffers exist at a block
count, which layers share each, and what a block costs.

Non-hybrid models get one buffer per layer. Hybrid attention + Mamba models
share buffers across kinds: the Mamba layers are cut into groups of as many
layers as there are attention layers (`n`; fewer in the last one), there are
`n` buffers, and buffer `j` is shared by the `j`-th layer of every group. All
specs then have one page size (Mamba pages are padded up to the attention
page), and a block id belongs to one group at a time, so layers sharing a
buffer never touch the same page. Attention layers stay one group (one block
table per sequence) whatever the ratio of the two kinds.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

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


@dataclass(frozen=True)
class KVCacheTensor:
    """One buffer of `size` bytes; every layer in `shared_by` views all of it."""

    size: int
    shared_by: list[str]


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers with one spec that share block ids (one block table per sequence)."""

    layer_names: list[str]
    spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """The buffers at one block count and the groups viewing them, checked to agree on sizes."""

    num_blocks: int
    tensors: list[KVCacheTensor]
    groups: list[KVCacheGroup]

    def __post_init__(self) -> None:
        _check_num_blocks(self.num_blocks)
        specs = self.layer_specs()
        names = [name for group in self.groups for name in group.layer_names]
        repeated = sorted(name for name, n in Counter(names).items() if n > 1)
        if repeated:
            raise ValueError(f"layers {repeated} appear in more than one group")
        shared = Counter(name for tensor in self.tensors for name in tensor.shared_by)
        wrong = sorted(n for n in specs.keys() | shared.keys() if n not in specs or shared[n] != 1)
        if wrong:
            raise ValueError(
                f"tensors' shared_by must name every layer of groups exactly once, and no "
                f"other layer; not so for {wrong}"
            )
        for tensor in self.tensors:
            for name in tensor.shared_by:
                page = specs[name].page_size_bytes
                if tensor.size != self.num_blocks * page:
                    raise ValueError(
                        f"tensor of {tensor.size} bytes shared by {tensor.shared_by} must be "
                        f"num_blocks ({self.num_blocks}) * the {page}-byte page of {name!r}"
                    )

    def layer_specs(self) -> dict[str, KVCacheSpec]:
        """Each layer's spec by name, as the groups assign them."""
        return {name: group.spec for group in self.groups for name in group.layer_names}


def _check_num_blocks(num_blocks: object) -> None:
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")


def make_kv_cache_config(groups: Sequence[KVCacheGroup], num_blocks: int) -> KVCacheConfig:
    """The buffers for `groups` at `num_blocks` blocks; hybrid groups are re-cut (see module)."""
    _check_num_blocks(num_blocks)
    if not groups or any(not group.layer_names for group in groups):
        raise ValueError("groups must be a non-empty list of groups, each with >= 1 layer")
    if {group.spec.kind for group in groups} == {"attention", "mamba"}:
        groups = _hybrid_groups(groups)
        width = max(len(group.layer_names) for group in groups)
        page = groups[0].spec.page_size_bytes
        tensors = [
            KVCacheTensor(
                num_blocks * page,
                [g.layer_names[j] for g in groups if j < len(g.layer_names)],
            )
            for j in range(width)
        ]
    else:
        tensors = [
            KVCacheTensor(num_blocks * group.spec.page_size_bytes, [name])
            for group in groups
            for name in group.layer_names
        ]
    return KVCacheConfig(num_blocks, tensors, list(groups))


def bytes_per_block(groups: Sequence[KVCacheGroup]) -> int:
    """What one more block costs across all buffers: size the cache as `available // this`."""
    return sum(tensor.size for tensor in make_kv_cache_config(groups, 1).tensors)


def _hybrid_groups(groups: Sequence[KVCacheGroup]) -> list[KVCacheGroup]:
    """Give every group the attention page size and cut the groups into pieces of at most
    as many layers as the attention group has (cutting twice changes nothing)."""
    pages = {g.spec.page_size_bytes for g in groups if g.spec.kind == "attention"}
    if len(pages) != 1:
        raise ValueError(
            f"a hybrid attention + Mamba model needs one attention page size, got {sorted(pages)}"
        )
    page = pages.pop()
    attention = next(g.spec for g in groups if g.spec.kind == "attention")
    bytes_per_token = page // attention.block_size
    padded = []
    for group in groups:
        spec = group.spec
        if isinstance(spec, MambaSpec):
            if spec.page_size_bytes > page:
                raise ValueError(
                    f"the {spec.page_size_bytes}-byte Mamba state page does not fit the "
                    f"{page}-byte attention page; block_size must be >= "
                    f"{math.ceil(spec.page_size_bytes / bytes_per_token)} for this model"
                )
            spec = replace(spec, page_size_padded=page)
        padded.append(KVCacheGroup(group.layer_names, spec))
    width = sum(len(g.layer_names) for g in padded if g.spec.kind == "attention")
    return [
        KVCacheGroup(group.layer_names[i : i + width], group.spec)
        for group in padded
        for i in range(0, len(group.layer_names), width)
    ]


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
class BlockNeeds:
    """What a sequence holds: attention blocks for its tokens (if the model has
    attention) plus one state block per recurrent group."""

    block_size: int
    has_attention: bool = True
    num_state_groups: int = 0
    sliding_window: int | None = None  # every attention layer's: older blocks are released

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` tokens holds; what the scheduler must find free."""
        attention = -(-num_tokens // self.block_size) if self.has_attention else 0
        return attention + self.num_state_groups


@dataclass(frozen=True)
class KVCachePlan:
    """The KV cache of one model, decided before anything is allocated: its groups (the
    attention group first, then the recurrent-state groups), block size, page size and
    the layout of every attention layer."""

    groups: tuple[KVCacheGroup, ...]
    layouts: dict[str, AttentionLayout]
    needs: BlockNeeds

    @property
    def block_size(self) -> int:
        """Tokens per block, raised in a hybrid so that one attention page holds a state."""
        return self.needs.block_size

    @property
    def state_groups(self) -> list[KVCacheGroup]:
        """The recurrent-state groups, each needing one block per sequence."""
        return [group for group in self.groups if group.spec.kind == "mamba"]

    @property
    def bytes_per_block(self) -> int:
        """What one more block costs across all buffers: size the cache as `available // this`."""
        return bytes_per_block(self.groups)

    def buffers(self, num_blocks: int) -> KVCacheConfig:
        """The buffers at `num_blocks` blocks, and which layers share each."""
        return make_kv_cache_config(self.groups, num_blocks)


def plan_kv_cache(
    attention: Mapping[str, AttentionLayer],
    state: Mapping[str, StateLayer],
    dtype: torch.dtype,
    block_size: int,
    kv_layout: str,
) -> KVCachePlan:
    """Group the layers that keep a cache and fix the block size and layouts.

    A hybrid model shares pages between attention and Mamba state, so an attention
    page must hold a whole state: the block size is raised to the next power of two
    that does, and the attention layers are re-strided so that K and V of a block lie
    in one page (one segment; see layouts.hybrid_layout).

    MLA layers keep one latent row per token, in the `mla` layout whatever `kv_layout`
    says (that option places K and V, which an MLA cache does not have)."""
    if not attention and not state:
        raise ValueError("the model has no layer that keeps a KV cache or a recurrent state")
    latent = bool(attention) and next(iter(attention.values())).latent_cache

    # One block table serves every attention layer: a block is released once it is out
    # of every layer's window (never beside a global layer, whose window is everything).
    windows = {getattr(layer, "sliding_window", None) for layer in attention.values()}
    window = None if None in windows or not windows else max(windows)

    def attention_spec(size: int) -> AttentionSpec:
        first = next(iter(attention.values()))
        if latent:
            return MLASpec(size, first.head_dim, dtype)
        if window is None:
            return FullAttentionSpec(size, first.num_kv_heads, first.head_dim, dtype)
        return SlidingWindowSpec(size, first.num_kv_heads, first.head_dim, dtype, window)

    def state_spec(size: int) -> MambaSpec:
        first = next(iter(state.values()))
        return MambaSpec(size, first.state_shapes(), first.state_dtypes())

    groups: list[KVCacheGroup] = []
    layout = get_layout("mla" if latent else kv_layout)
    if attention and state:
        block_size = _block_size_holding(attention_spec(block_size), state_spec(block_size))
        layout = hybrid_layout(layout)
    if attention:
        groups.append(KVCacheGroup(list(attention), attention_spec(block_size)))
    if state:
        groups.append(KVCacheGroup(list(state), state_spec(block_size)))
    groups = make_kv_cache_config(groups, 1).groups  # hybrids: cut into page-sharing groups
    needs = BlockNeeds(
        block_size,
        has_attention=bool(attention),
        num_state_groups=sum(group.spec.kind == "mamba" for group in groups),
        sliding_window=window,
    )
    return KVCachePlan(tuple(groups), dict.fromkeys(attention, layout), needs)


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
