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
    sliding_window: int | None = None


class FakeMixer:
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return (4, 16, 32), (48, 3)  # 8,768 bytes: more than a 16-token page

    def state_dtypes(self) -> tuple[torch.dtype, ...]:
        return torch.float32, torch.float32


def test_dense_plan_has_one_group_and_the_configured_block_size() -> None:
    layers = {f"layers.{i}.attn": FakeAttention() for i in range(3)}
    plan = plan_kv_cache(layers, {}, torch.float16, 16, "block_major")
    assert [g.layer_names for g in plan.groups] == [list(layers)]
    assert plan.block_size == 16 and plan.state_groups == []
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


@pytest.mark.parametrize(("num_attention", "num_mamba"), [(1, 4), (2, 5), (4, 1), (5, 1), (3, 3)])
def test_hybrid_plan_fits_a_state_in_a_page_and_groups_by_the_rarer_kind(
    num_attention: int, num_mamba: int
) -> None:
    """Groups of as many layers as the rarer kind has: the commoner kind is cut into
    several groups (the last one short), and that many buffers are shared by position."""
    attention = {f"attn.{i}": FakeAttention() for i in range(num_attention)}
    mixers = {f"mamba.{i}": FakeMixer() for i in range(num_mamba)}
    plan = plan_kv_cache(attention, mixers, torch.float32, 16, "split")
    size = min(num_attention, num_mamba)
    kinds = [g.kind for g in plan.groups]
    assert kinds == ["full_attention"] * -(-num_attention // size) + ["mamba"] * -(
        -num_mamba // size
    )
    assert [len(g.layer_names) for g in plan.attention_groups] == [
        min(size, num_attention - i) for i in range(0, num_attention, size)
    ]
    state = MambaSpec(plan.block_size, FakeMixer().state_shapes(), FakeMixer().state_dtypes())
    attention_page = plan.groups[0].spec.page_size_bytes
    assert state.page_size_bytes <= attention_page < 2 * state.page_size_bytes  # smallest fit
    assert plan.block_size > 16 and plan.block_size & (plan.block_size - 1) == 0
    assert {g.spec.page_size_bytes for g in plan.groups} == {attention_page}
    # Every layer is in exactly one group, in model order within its kind.
    names = [n for g in plan.groups for n in g.layer_names]
    assert names == [*attention, *mixers]
    buffers = plan.buffers(5)
    assert len(buffers.tensors) == size
    assert buffers.tensors[0].shared_by == [g.layer_names[0] for g in plan.groups]
    assert plan.bytes_per_block == size * attention_page
    # One sequence holds a block per 16 tokens in each attention group, one per state group.
    groups = len(plan.groups) - len(plan.state_groups)
    assert plan.blocks_per_seq(plan.block_size + 1) == 2 * groups + len(plan.state_groups)
    assert all(
        layout.num_segments(5, plan.block_size, 2, 16) == 1 for layout in plan.layouts.values()
    )


def test_local_and_global_layers_form_groups_that_share_buffers() -> None:
    """Gemma-like: 11 local layers and 2 global ones. The rarer global kind sets the group
    size (2 layers): 6 local groups, the last one short, and 2 buffers; no re-striding,
    since no Mamba state shares a page."""
    layers = {
        f"layers.{i}": FakeAttention(sliding_window=None if i % 6 == 5 else 64) for i in range(13)
    }
    plan = plan_kv_cache(layers, {}, torch.float16, 16, "split")
    assert [g.kind for g in plan.groups] == ["sliding_window"] * 6 + ["full_attention"]
    assert [g.layer_names for g in plan.groups][-2:] == [["layers.12"], ["layers.5", "layers.11"]]
    assert plan.groups[0].layer_names == ["layers.0", "layers.1"]
    assert plan.block_size == 16 and {layout.name for layout in plan.layouts.values()} == {"split"}
    buffers = plan.buffers(3)
    assert [len(t.shared_by) for t in buffers.tensors] == [7, 6]
    page = 2 * 16 * 2 * 16 * 2
    assert plan.bytes_per_block == 2 * page
    # A sequence of 1000 tokens computed 100 a step holds its whole length in the global
    # group and the window's (64 + 100 tokens, and the block the window starts in) locally.
    assert plan.blocks_per_seq(1000, 100) == 63 + 6 * (-(-(63 + 100) // 16) + 1)
    assert plan.blocks_per_seq(10) == 7  # short: one block in each group
    sizing = plan.group_sizing(1000, 100)
    assert [s["max_blocks_per_seq"] for s in sizing] == [12] * 6 + [63]
    assert sizing[-1]["bytes_per_block"] == 2 * page and sizing[-2]["bytes_per_block"] == page
    assert sizing[-1]["max_bytes_per_seq"] == 63 * 2 * page
    assert sizing[0]["spec"].startswith("SlidingWindowSpec(block_size=16")


def test_attention_layers_of_different_page_sizes_are_refused() -> None:
    local, full = FakeAttention(head_dim=16, sliding_window=8), FakeAttention(head_dim=32)
    layers = {"local": local, "global": full}
    with pytest.raises(ValueError, match=r"need one page size.*\[2048, 4096\] bytes"):
        plan_kv_cache(layers, {}, torch.float16, 16, "split")


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
