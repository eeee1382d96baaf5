"""The fused mixture-of-experts kernels (extkv.kernels.fused_moe) against the reference loop
(extkv.models.reference.moe_experts): the sort by expert, the grouped GEMMs and the weighted
sum, under uneven routing (experts with no token, one expert taking every token), several
token counts, top_k and tilings; their batch invariance, CUDA-graph capture and the
`ops.moe_experts` dispatch.

As in test_gemv, the CPU checks run this file as a script under the Triton interpreter
(`TRITON_INTERPRET=1`, in a subprocess); the GPU tests run the compiled kernels on
Qwen3-30B-A3B's layer shape.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch

from extkv.kernels.fused_moe import (
    DECODE_TILES,
    PREFILL_TILES,
    ExpertTiles,
    _sort_in_one_program,
    _sort_in_torch,
    expert_tiles,
    fused_experts,
)
from extkv.models import ops, reference
from helpers import (
    interpreter_dots_bf16_as_numbers,
    interpreter_rounds_bf16_to_nearest,
    run_interpreted,
)

# Against the reference: fp32 differs by the order of sums; bf16 rounds every row as the
# reference does, but sums a token's rows once in fp32 where the reference adds each into
# a bf16 output (a few roundings of the sum).
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-6, atol=2**-6),
}
ROUTINGS = ("random", "one_expert_takes_all", "few_experts")


def routing(tokens: int, top_k: int, experts: int, kind: str, seed: int) -> torch.Tensor:
    """Expert indices (T, top_k), each token's distinct: random; every token's first expert
    the same one (it takes all T tokens); or every token to experts 0..top_k-1 (the others
    get none)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    if kind == "one_expert_takes_all":
        scores[:, experts // 2] = 2.0
    elif kind == "few_experts":
        scores[:, :top_k] += 2.0
    return scores.topk(top_k, dim=-1, sorted=False).indices


def moe_inputs(
    tokens: int,
    top_k: int,
    dtype: torch.dtype,
    kind: str,
    device: str,
    seed: int = 0,
    experts: int = 8,
    hidden: int = 48,
    inner: int = 40,
) -> dict[str, torch.Tensor]:
    """x as rows of a wider tensor (a row stride other than H), outputs of about unit size,
    routing weights as a softmax router's (fp32)."""
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)

    return dict(
        x=randn(tokens, hidden + 3)[:, :hidden],
        gate_up=randn(experts, 2 * inner, hidden, scale=hidden**-0.5),
        down=randn(experts, hidden, inner, scale=inner**-0.5),
        weights=torch.rand(tokens, top_k, generator=gen, device=device).softmax(-1),
        indices=routing(tokens, top_k, experts, kind, seed).to(device),
    )


def check_sort(
    tokens: int,
    top_k: int,
    experts: int,
    kind: str,
    block_m: int,
    sort: Callable = _sort_in_torch,
    device: str = "cpu",
) -> None:
    """Every pair once, each block one expert's, each expert's pairs ascending and padded
    with T * top_k, unused blocks -1, the length within the bound."""
    indices = routing(tokens, top_k, experts, kind, seed=tokens)
    num_pairs = tokens * top_k
    sorted_pairs, block_experts = (t.cpu() for t in sort(indices.to(device), experts, block_m))
    bound = num_pairs + min(experts, num_pairs) * (block_m - 1)
    assert sorted_pairs.numel() == block_experts.numel() * block_m
    assert bound <= sorted_pairs.numel() < bound + block_m
    blocks = sorted_pairs.view(-1, block_m)
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    assert (sorted_pairs[sorted_pairs >= num_pairs] == num_pairs).all()
    flat = indices.flatten()
    used = block_experts >= 0
    for block, expert in zip(blocks, block_experts.tolist(), strict=True):
        pairs = block[block < num_pairs]
        if expert < 0:
            assert pairs.numel() == 0
            continue
        assert pairs.numel() > 0 and (flat[pairs.long()] == expert).all()
    # Used blocks come first, in expert order, each expert's pairs ascending.
    assert used.long().diff().le(0).all()
    experts_in_order = block_experts[used]
    assert experts_in_order.diff().ge(0).all()
    for expert in experts_in_order.unique().tolist():
        run = blocks[block_experts == expert].flatten()
        run = run[run < num_pairs]
        assert run.tolist() == (flat == expert).nonzero()[:, 0].tolist()
    counts = torch.bincount(flat, minlength=experts)
    assert used.sum() == ((counts + block_m - 1) // block_m).sum()


def check_one_program_sort(
    tokens: int, top_k: int, experts: int, kind: str, device: str = "cpu"
) -> None:
    """The one-program sort's layout, and the torch sort's to the element."""
    for block_m in (16, 64):
        check_sort(tokens, top_k, experts, kind, block_m, _sort_in_one_program, device)
        indices = routing(tokens, top_k, experts, kind, seed=tokens).to(device)
        ours, want = (s(indices, experts, block_m) for s in (_sort_in_one_program, _sort_in_torch))
        assert all(map(torch.equal, ours, want))


SORT_CASES = [(1, 1), (1, 8), (5, 2), (33, 3), (64, 8)]


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize(("tokens", "top_k"), SORT_CASES)
@pytest.mark.parametrize("block_m", [16, 64])
def test_sort_by_expert_in_torch(tokens: int, top_k: int, kind: str, block_m: int) -> None:
    check_sort(tokens, top_k, 16, kind, block_m)


def test_tiles_follow_the_rows_per_expert() -> None:
    """Up to 16 pairs an expert on average: decode's blocks of 16; more: prefill's; fp32
    halves BLOCK_K (its stages' shared memory)."""
    assert expert_tiles(8, 128, 2) == DECODE_TILES  # batch 1, top-8 of 128
    assert expert_tiles(64 * 8, 128, 2) == DECODE_TILES
    assert expert_tiles(8192 * 8, 128, 2) == PREFILL_TILES
    assert expert_tiles(8, 128, 4).block_k == DECODE_TILES.block_k // 2


def test_bad_inputs_are_refused() -> None:
    args = moe_inputs(3, 2, torch.float32, "random", "cpu", experts=4, hidden=16, inner=8)
    x, gate_up, down, weights, indices = args.values()
    with pytest.raises(ValueError, match=r"x must be \(T, H\) with contiguous rows"):
        fused_experts(x.t(), gate_up, down, weights, indices)
    with pytest.raises(ValueError, match=r"gate_up must be \(E, 2I, H=16\), got \(4, 16, 15\)"):
        fused_experts(x, gate_up[..., :15], down, weights, indices)
    with pytest.raises(ValueError, match=r"down must be \(E, H, I\) = \(4, 16, 8\)"):
        fused_experts(x, gate_up, down[:3], weights, indices)
    with pytest.raises(ValueError, match=r"must have x's dtype torch.float32"):
        fused_experts(x, gate_up.bfloat16(), down, weights, indices)
    with pytest.raises(ValueError, match=r"indices and weights must both be \(T=3, top_k\)"):
        fused_experts(x, gate_up, down, weights[:, :1], indices)
    with pytest.raises(ValueError, match=r"shared must be x's shape \(3, 16\)"):
        fused_experts(x, gate_up, down, weights, indices, torch.zeros(3, 15))


def test_cpu_dispatch_is_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off CUDA, ops.moe_experts is the reference loop bit for bit, EXTKV_FUSED_MOE 0 or 1;
    another value is refused."""
    args = moe_inputs(5, 2, torch.float32, "random", "cpu", experts=4)
    shared = torch.randn(5, 48)
    want = reference.moe_experts(*args.values(), shared)
    for value in ("0", "1"):
        monkeypatch.setenv("EXTKV_FUSED_MOE", value)
        assert torch.equal(ops.moe_experts(*args.values(), shared), want)
    monkeypatch.setenv("EXTKV_FUSED_MOE", "yes")
    with pytest.raises(ValueError, match=r"EXTKV_FUSED_MOE must be 0 \(the reference loop\)"):
        ops.moe_experts(*args.values())


# ---------------------------------------------------------------- the checks, on any device


def check_fused(
    tokens: int,
    top_k: int,
    dtype: torch.dtype,
    kind: str,
    device: str,
    tiles: ExpertTiles | None = None,
    with_shared: bool = False,
    **shape: int,
) -> None:
    """The fused kernels against the reference loop on the same inputs (`shape`: experts,
    hidden, inner, as `moe_inputs` takes them)."""
    args = moe_inputs(tokens, top_k, dtype, kind, device, tokens, **shape)
    hidden = args["x"].shape[1]
    shared = torch.randn(tokens, hidden, device=device).to(dtype) if with_shared else None
    out = fused_experts(*args.values(), shared, tiles=tiles)
    want = reference.moe_experts(*args.values(), shared)
    assert out.dtype == dtype and out.shape == want.shape
    torch.testing.assert_close(out.float(), want.float(), **TOLERANCES[dtype])


def check_batch_invariant(dtype: torch.dtype, device: str, tiles: ExpertTiles) -> None:
    """A token's output is the same bits alone as among others (same tiling)."""
    args = moe_inputs(9, 2, dtype, "random", device, experts=4)
    everything = fused_experts(*args.values(), tiles=tiles)
    for token in (0, 8):
        alone = {k: v[token : token + 1] if v.shape[0] == 9 else v for k, v in args.items()}
        assert torch.equal(fused_experts(*alone.values(), tiles=tiles)[0], everything[token])


# Tilings the interpreter's small shapes would not pick: several K steps and N tiles, the
# last partial; blocks of 32.
SMALL_TILES = (ExpertTiles(16, 32, 16), ExpertTiles(32, 16, 32))


# ---------------------------------------------------------------- CPU: Triton interpreter


def interpreter_checks() -> list[Callable[[], None]]:
    return [
        *(
            partial(check_one_program_sort, tokens, top_k, experts, kind)
            for tokens, top_k in SORT_CASES
            for experts in (16, 6, 128)  # a power of 2, not one, Qwen3-30B's
            for kind in ROUTINGS
            if top_k <= experts
        ),
        partial(check_one_program_sort, 256, 8, 128, "random"),  # a decode batch of 256
        *(
            partial(check_fused, tokens, top_k, dtype, kind, "cpu", tiles)
            for tokens, top_k in ((1, 1), (1, 3), (7, 2), (20, 3))
            for kind in ROUTINGS
            for dtype in (torch.float32, torch.bfloat16)
            for tiles in (None, SMALL_TILES[0])
        ),
        *(
            partial(check_fused, 12, 2, dtype, kind, "cpu", SMALL_TILES[1], True, experts=4)
            for kind in ROUTINGS
            for dtype in (torch.float32, torch.bfloat16)
        ),
        partial(check_fused, 3, 4, torch.float32, "random", "cpu", experts=4),  # top_k == E
        *(partial(check_batch_invariant, dtype, "cpu", SMALL_TILES[0]) for dtype in TOLERANCES),
    ]


def test_interpreted() -> None:
    run_interpreted(__file__, timeout=900)


# ---------------------------------------------------------------- GPU

# Qwen3-30B-A3B's layer: 128 experts, 8 a token, hidden 2048, experts' intermediate 768.
QWEN3_MOE_LAYER = dict(experts=128, hidden=2048, inner=768)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
def test_cuda_matches_the_reference(tokens: int, kind: str) -> None:
    """bf16 on Qwen3-30B-A3B's layer shape, decode's and prefill's tilings both."""
    check_fused(tokens, 8, torch.bfloat16, kind, "cuda", **QWEN3_MOE_LAYER)
    check_fused(tokens, 8, torch.float32, kind, "cuda", None, True, **QWEN3_MOE_LAYER)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize(("tokens", "experts"), [(1, 128), (64, 128), (256, 128), (33, 256)])
def test_cuda_sorts(tokens: int, experts: int, kind: str) -> None:
    """The one-program sort (decode batches up to 256 at top-8; DeepSeek-V3's 256 experts)
    and the torch one on the device."""
    check_one_program_sort(tokens, 8, experts, kind, "cuda")
    check_sort(tokens * 16, 8, experts, kind, 64, device="cuda")  # prefill: the torch sort


@pytest.mark.gpu
def test_cuda_batch_invariant() -> None:
    for tiles in (DECODE_TILES, PREFILL_TILES):
        check_batch_invariant(torch.bfloat16, "cuda", tiles)


@pytest.mark.gpu
def test_cuda_graph_replays_new_routing() -> None:
    """Captured once, replayed on other tokens routed elsewhere (one expert taking all):
    the eager call's bits. The routing's shapes never reach the host."""
    args = moe_inputs(16, 8, torch.bfloat16, "random", "cuda", **QWEN3_MOE_LAYER)
    fused_experts(*args.values())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(*args.values())
    graph.replay()
    first = out.clone()
    assert torch.equal(first, fused_experts(*args.values()))
    other = moe_inputs(16, 8, torch.bfloat16, "one_expert_takes_all", "cuda", 1, **QWEN3_MOE_LAYER)
    for name in ("x", "weights", "indices"):  # the weights stay the captured ones
        args[name].copy_(other[name])
    graph.replay()
    assert torch.equal(out, fused_experts(*args.values()))
    assert not torch.equal(out, first)


@pytest.mark.gpu
def test_cuda_reference_loop_refuses_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXTKV_FUSED_MOE", "0")
    args = moe_inputs(4, 2, torch.bfloat16, "random", "cuda")
    want = reference.moe_experts(*args.values())
    assert torch.equal(ops.moe_experts(*args.values()), want)  # eager: the loop
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="use enforce_eager=True"), torch.cuda.graph(graph):
        ops.moe_experts(*args.values())


if __name__ == "__main__":  # run by test_interpreted under TRITON_INTERPRET=1
    interpreter_rounds_bf16_to_nearest()
    interpreter_dots_bf16_as_numbers()
    for check in interpreter_checks():
        check()
