"""KV cache groups: which layers share a block table, and how one pool of blocks serves them.

Layers keep their cache in different ways: full attention (and MLA's latent) holds one
block per `block_size` tokens; a sliding window holds the same, but frees the blocks no
later query sees; a Mamba layer holds one block of state whatever the length. Layers with
one spec form a *group*: each sequence has one block table per group, and each group
counts its own blocks (`KVCacheGroup.blocks_for`, `num_out_of_window`). Every group
draws block ids from one pool.

One pool for groups that keep different numbers of blocks (as vLLM's hybrid KV cache
manager does it): every group has the same number of layers `g`, the fewest layers that
any one spec has (so the rarest kind is never padded; the last group of a commoner spec
may have fewer layers, the missing ones are padding). There are `g` buffers, and buffer
`j` is shared by the `j`-th layer of every group. A block id is then one page in every
buffer and belongs to one group at a time, so layers sharing a buffer never touch the
same page, and a block costs the same whichever group holds it. That needs one page size
for every layer: Mamba pages are padded up to the attention page (the plan raises the
block size so that an attention page holds a state), and attention specs of different
page sizes are refused.

A model whose layers all have one spec has one group of them all and one buffer per
layer.

    Gemma 3, layers local, global, local: g = 1, one buffer shared by the three layers
    groups:  local [layer 0] | local [layer 2] | global [layer 1]   (attention first)
    block b: page b of the buffer, in one table of one group at a time
    40 tokens in blocks of 8, window 12: 2 or 3 blocks held in each local group, 5 in
    the global one
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from extkv.kv_cache.specs import KVCacheSpec, MambaSpec, MLASpec, SlidingWindowSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers with one spec that share block ids: one block table per sequence."""

    layer_names: list[str]
    spec: KVCacheSpec

    @property
    def kind(self) -> str:
        """What the group keeps: "full_attention", "sliding_window", "mla" or "mamba"."""
        spec = self.spec
        if isinstance(spec, MambaSpec):
            return "mamba"
        if isinstance(spec, MLASpec):
            return "mla"
        return "sliding_window" if isinstance(spec, SlidingWindowSpec) else "full_attention"

    @property
    def per_token(self) -> bool:
        """Whether the group's blocks hold tokens (attention), so a table grows with the
        sequence; else (Mamba) a sequence holds one block of state."""
        return self.spec.kind == "attention"

    @property
    def sliding_window(self) -> int | None:
        """Tokens each query sees (its own included), or None: all of them."""
        return self.spec.sliding_window if isinstance(self.spec, SlidingWindowSpec) else None

    def blocks_for(self, num_tokens: int) -> int:
        """Table entries a sequence of `num_tokens` tokens has: a block per `block_size`
        tokens (those out of the window among them, released), or one state block."""
        if not self.per_token:
            return 1
        return -(-num_tokens // self.spec.block_size)

    def num_out_of_window(self, num_computed_tokens: int) -> int:
        """Leading blocks that no query from position `num_computed_tokens` on sees: a
        sliding-window group releases them; other groups keep every block (0)."""
        window = self.sliding_window
        if window is None:
            return 0
        return max(num_computed_tokens - window + 1, 0) // self.spec.block_size

    def max_blocks_per_seq(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a sequence holds at once while it grows to `num_tokens` tokens,
        `max_step_tokens` at most computed per step: with a window, the window's tokens
        before a step, the step's own, and one block the window starts inside."""
        held = self.blocks_for(num_tokens)
        window = self.sliding_window
        if window is None:
            return held
        steps = min(max_step_tokens, num_tokens)
        return min(held, -(-(window - 1 + steps) // self.spec.block_size) + 1)


def group_layers(specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroup]:
    """The groups of these layers (by name, in model order): one per spec, cut into
    groups of the fewest layers any spec has, Mamba pages padded to the shared page size
    (see the module docstring). Attention groups come first, then the state groups."""
    if not specs:
        raise ValueError("specs must name at least one layer")
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(spec, []).append(name)
    if len(by_spec) == 1:
        ((spec, names),) = by_spec.items()
        return [KVCacheGroup(names, spec)]
    page = _shared_page_size(list(by_spec))
    size = min(len(names) for names in by_spec.values())
    ordered = sorted(by_spec.items(), key=lambda item: item[0].kind != "attention")
    return [
        KVCacheGroup(names[i : i + size], _padded(spec, page))
        for spec, names in ordered
        for i in range(0, len(names), size)
    ]


def _shared_page_size(specs: Sequence[KVCacheSpec]) -> int:
    """The one page size of layers that share buffers: the attention page, which every
    attention spec must have and every Mamba state must fit (the largest state without
    attention)."""
    attention = {spec.page_size_bytes for spec in specs if spec.kind == "attention"}
    if len(attention) > 1:
        raise ValueError(
            "layers with different KV cache specs share buffers page by page and need one "
            f"page size, but their attention pages are {sorted(attention)} bytes: "
            f"{', '.join(f'{s!r}' for s in specs if s.kind == 'attention')}"
        )
    if not attention:
        return max(spec.page_size_bytes for spec in specs)
    page = attention.pop()
    per_token = page // next(s for s in specs if s.kind == "attention").block_size
    for spec in specs:
        if isinstance(spec, MambaSpec) and spec.state_bytes > page:
            raise ValueError(
                f"the {spec.state_bytes}-byte Mamba state page does not fit the {page}-byte "
                f"attention page; block_size must be >= "
                f"{math.ceil(spec.state_bytes / per_token)} for this model"
            )
    return page


def _padded(spec: KVCacheSpec, page: int) -> KVCacheSpec:
    return replace(spec, page_size_padded=page) if isinstance(spec, MambaSpec) else spec


@dataclass(frozen=True)
class KVCacheTensor:
    """One buffer of `size` bytes; every layer in `shared_by` views all of it."""

    size: int
    shared_by: list[str]


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
    """The buffers of `groups` (as `group_layers` made them) at `num_blocks` blocks: one
    group, a buffer per layer; several, buffer `j` shared by the `j`-th layer of each."""
    _check_num_blocks(num_blocks)
    if not groups or any(not group.layer_names for group in groups):
        raise ValueError("groups must be a non-empty list of groups, each with >= 1 layer")
    if len(groups) == 1:
        ((group),) = groups
        page = group.spec.page_size_bytes
        tensors = [KVCacheTensor(num_blocks * page, [name]) for name in group.layer_names]
        return KVCacheConfig(num_blocks, tensors, list(groups))
    pages = {group.spec.page_size_bytes for group in groups}
    if len(pages) != 1:
        raise ValueError(
            f"groups share buffers page by page and need one page size, got {sorted(pages)} "
            "bytes; group_layers pads Mamba pages to the attention page"
        )
    page = pages.pop()
    width = max(len(group.layer_names) for group in groups)
    tensors = [
        KVCacheTensor(
            num_blocks * page, [g.layer_names[j] for g in groups if j < len(g.layer_names)]
        )
        for j in range(width)
    ]
    return KVCacheConfig(num_blocks, tensors, list(groups))


def bytes_per_block(groups: Sequence[KVCacheGroup]) -> int:
    """What one more block costs across all buffers: size the cache as `available // this`."""
    return sum(tensor.size for tensor in make_kv_cache_config(groups, 1).tensors)
