"""Which buffers the KV cache has, which layers share each, and what a block costs.

Non-hybrid models get one buffer per layer. Hybrid attention + Mamba models
share buffers across kinds: all groups are cut to the same number of layers
`n`, there are `n` buffers, and buffer `j` is shared by the `j`-th layer of
every group. All specs then have one page size (Mamba pages are padded up to
the attention page), and a block id belongs to one group at a time, so layers
sharing a buffer never touch the same page. This wastes no memory whichever
kind a block is handed to.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from extkv.kv_cache.specs import KVCacheSpec, MambaSpec


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
    """Give every group the attention page size and cut all groups to the smallest's length."""
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
    width = min(len(group.layer_names) for group in padded)
    return [
        KVCacheGroup(group.layer_names[i : i + width], group.spec)
        for group in padded
        for i in range(0, len(group.layer_names), width)
    ]
