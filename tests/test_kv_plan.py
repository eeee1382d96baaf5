"""The KV cache plan: groups, block size and layouts decided once from the layers, and
the block counts start-up reports from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from extkv import LLM
from extkv.kv_cache import MambaSpec
from extkv.kv_cache.plan import plan_kv_cache

SMALL = dict(cpu_memory_budget_bytes=64 << 20, max_model_len=128, max_num_seqs=4)


@dataclass
class FakeAttention:
    num_kv_heads: int = 2
    head_dim: int = 16
    latent_cache: bool = False


class FakeMixer:
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return (4, 16, 32), (48, 3)  # 8,768 bytes: more than a 16-token page

    def state_dtypes(self) -> tuple[torch.dtype, ...]:
        return torch.float32, torch.float32


def test_dense_plan_has_one_group_and_the_configured_block_size() -> None:
    layers = {f"layers.{i}.attn": FakeAttention() for i in range(3)}
    plan = plan_kv_cache(layers, {}, torch.float16, 16, "block_major")
    assert [g.layer_names for g in plan.groups] == [list(layers)]
    assert plan.block_size == 16 and plan.needs.num_state_groups == 0
    assert (
        plan.bytes_per_block == 3 * 2 * 16 * 2 * 16 * 2
    )  # layers * K+V * tokens * heads * dim * bytes
    assert {layout.name for layout in plan.layouts.values()} == {"block_major"}


def test_mla_plan_keeps_one_latent_row_per_token_in_the_mla_layout() -> None:
    layers = {f"layers.{i}.attn": FakeAttention(1, 48, latent_cache=True) for i in range(2)}
    plan = plan_kv_cache(layers, {}, torch.float32, 16, "split")  # kv_layout has no say
    assert {type(g.spec).__name__ for g in plan.groups} == {"MLASpec"}
    assert plan.bytes_per_block == 2 * 16 * 48 * 4  # layers * tokens * row * bytes
    assert {layout.name for layout in plan.layouts.values()} == {"mla"}


@pytest.mark.parametrize(("num_attention", "num_mamba"), [(1, 4), (2, 5), (4, 1), (3, 3)])
def test_hybrid_plan_fits_a_state_in_a_page_and_keeps_one_attention_group(
    num_attention: int, num_mamba: int
) -> None:
    attention = {f"attn.{i}": FakeAttention() for i in range(num_attention)}
    mixers = {f"mamba.{i}": FakeMixer() for i in range(num_mamba)}
    plan = plan_kv_cache(attention, mixers, torch.float32, 16, "split")
    kinds = [g.spec.kind for g in plan.groups]
    assert kinds.count("attention") == 1 and kinds[0] == "attention"
    state = MambaSpec(plan.block_size, FakeMixer().state_shapes(), FakeMixer().state_dtypes())
    attention_page = plan.groups[0].spec.page_size_bytes
    assert state.page_size_bytes <= attention_page < 2 * state.page_size_bytes  # smallest fit
    assert plan.block_size > 16 and plan.block_size & (plan.block_size - 1) == 0
    assert {g.spec.page_size_bytes for g in plan.groups} == {attention_page}
    # Every Mamba layer is in exactly one state group, none longer than the attention group.
    names = [n for g in plan.state_groups for n in g.layer_names]
    assert sorted(names) == sorted(mixers)
    assert all(len(g.layer_names) <= num_attention for g in plan.state_groups)
    assert plan.needs.num_state_groups == len(plan.state_groups)
    buffers = plan.buffers(5)
    assert len(buffers.tensors) == max(num_attention, min(num_mamba, num_attention))
    assert all(
        layout.num_segments(5, plan.block_size, 2, 16) == 1 for layout in plan.layouts.values()
    )


def test_a_model_without_cache_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="no layer that keeps a KV cache"):
        plan_kv_cache({}, {}, torch.float32, 16, "split")


@pytest.mark.parametrize("extensible", [False, True])
def test_report_says_committed_and_capacity_blocks(qwen3: Path, extensible: bool) -> None:
    report = LLM(qwen3, enable_extensible_kv_cache=extensible, **SMALL).memory_report()
    committed, capacity = report["num_blocks_committed"], report["num_blocks_capacity"]
    assert report["num_blocks"] == committed >= 1
    if extensible:  # reserved for everything available, committed after the graphs' share
        assert capacity >= committed
        assert report["kv_reserved_bytes"] >= capacity * report["bytes_per_block"]
    else:
        assert capacity == committed
    assert "capacity_blocks" not in report


@pytest.mark.parametrize("family", ["qwen3", "bamba"])
def test_starting_up_writes_nothing_to_the_cache(
    family: str, request: pytest.FixtureRequest
) -> None:
    """The decode graphs' warm-ups (run on the CPU too) stage padding rows of their own
    batch size, which write no KV slot and no state block: the cache is still all zeros
    (reading another size's rows once wrote K/V to block 0 and states to blocks that an
    extensible cache had not committed yet: an illegal address on the GPU)."""
    options = {**SMALL, "max_num_seqs": 20, "enable_extensible_kv_cache": True}
    llm = LLM(request.getfixturevalue(family), **options)
    assert llm.engine.runner.graphs.batch_sizes == [1, 2, 4, 8, 16, 20]
    for buffer in llm.engine.kv_cache._buffers:
        memory = buffer.memory
        for segment in range(memory.num_segments):
            start = segment * memory.segment_capacity_bytes
            assert not memory.full_view()[start : start + memory.bytes_per_segment].any()
