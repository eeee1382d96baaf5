"""A batch-1 decode step's own kernels against those they replace, on Qwen3-0.6B's shapes
(the MLP kernel with its weights in registers, the one-kernel decode attention, the LM
head by the GEMV), and what one grid barrier costs.

    python benchmarks/bench_persistent.py [--context 512] [--json OUT]

- `barrier`: microseconds per `grid_barrier` on every SM (a kernel of 256 of them).
- `mlp`: the rest of a layer after attention, `gated_mlp_one_row` with the output
  projection (one kernel) against the three GEMVs (o_proj, norm + gate_up, SiLU + down).
- `layer`: the attention sublayer's four kernels (norm + qkv GEMV, q/k norm + rotary + KV
  store, split attention and its merge over `--context` tokens) then the MLP either way.
- `attention`: the norm + qkv GEMV and the decode attention kernel (q/k norm, rotary, KV
  store, attention and merge in one) against the GEMV and the three kernels it replaces.
- `layer one attn`: the decode attention kernel, then the MLP kernel (3 kernels a layer).
- `layer one row`: the same with the norm + qkv by the one-row kernel
  (extkv.kernels.norm_linear) against the GEMV ("apart" here is `layer one attn`).
- `lm head N gemv/cublas`: Qwen3's LM head (151936 x 1024) at N rows, the GEMV against
  cuBLAS.

Each runs as a CUDA graph over 28 layers' own weights and caches (none served from L2
by the layer before), as in the decode step; `us` is per layer. Run it with EXTKV_PDL=0
as well to see the kernels without programmatic dependent launch.
"""

from __future__ import annotations

import argparse
import logging
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

from _common import write_json
from bench_gemv import graph_time_us
from extkv.attention import AttentionMetadata
from extkv.kernels.decode_attention import rope_store_decode_attention
from extkv.kernels.gated_mlp import gated_mlp_one_row
from extkv.kernels.gemv import (
    linear_small_batch,
    num_sms,
    rms_norm_linear_small_batch,
    silu_and_mul_linear_small_batch,
)
from extkv.kernels.grid_barrier import barrier_counter, grid_barrier
from extkv.kernels.norm_linear import rms_norm_linear_one_row
from extkv.kernels.paged_attention import paged_attention
from extkv.kernels.rotary import qk_norm_rope_store

logger = logging.getLogger("bench_persistent")

LAYERS = 28
HIDDEN, INNER, Q_HEADS, KV_HEADS, HEAD_DIM = 1024, 3072, 16, 8, 128
BLOCK_SIZE = 16
VOCAB = 151_936
BARRIERS = 256


@triton.jit
def _barriers_kernel(state_ptr, COUNT: tl.constexpr):
    for _ in range(COUNT):
        grid_barrier(state_ptr, tl.num_programs(0))


def barrier_us() -> float:
    """Microseconds per barrier of a kernel with one program per SM."""
    programs = num_sms(torch.device("cuda"))
    state = barrier_counter("bench_persistent", torch.device("cuda"), programs)

    def run(_: int) -> None:
        _barriers_kernel[(programs,)](state, COUNT=BARRIERS)

    return graph_time_us(run, 4) / BARRIERS


def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*size, device="cuda") * scale).to(torch.bfloat16)


class Layers:
    """28 layers' own weights and KV caches, and a batch-1 decode step's inputs to them."""

    def __init__(self, context: int) -> None:
        rows = 1
        width = triton.cdiv(context, BLOCK_SIZE)
        tables = torch.arange(rows * width, dtype=torch.int32, device="cuda").view(rows, width)
        last = context - 1
        self.slots = tables[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE
        self.metadata = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slots,
            cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32, device="cuda"),
            context_lens=torch.full((rows,), context, dtype=torch.int32, device="cuda"),
            block_tables=tables,
            max_seqlen_q=1,
            max_context_len=context,
        )
        self.x, self.residual = randn(rows, HIDDEN), randn(rows, HIDDEN)
        self.attn = randn(rows, Q_HEADS * HEAD_DIM)
        self.positions = torch.full((rows,), last, device="cuda")
        self.cos_sin = torch.randn(context, HEAD_DIM, device="cuda")
        self.norm, self.q_norm, self.k_norm = (
            1 + randn(n, scale=0.1) for n in (HIDDEN, HEAD_DIM, HEAD_DIM)
        )
        qkv_rows, attn_width = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, Q_HEADS * HEAD_DIM
        page = (rows * width, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.weights = [
            {
                "qkv": randn(qkv_rows, HIDDEN, scale=HIDDEN**-0.5),
                "cache": randn(*page),
                "out": randn(HIDDEN, attn_width, scale=attn_width**-0.5),
                "gate_up": randn(2 * INNER, HIDDEN, scale=HIDDEN**-0.5),
                "down": randn(HIDDEN, INNER, scale=INNER**-0.5),
            }
            for _ in range(LAYERS)
        ]

    def attention(self, i: int, fused: bool = True, one_row_qkv: bool = False) -> torch.Tensor:
        """Layer i's attention sublayer, from the norm + qkv GEMV (`one_row_qkv`: the one-row
        kernel): `fused`, the decode attention kernel; else q/k norm + rotary + KV store,
        the split attention, its merge."""
        w = self.weights[i]
        norm_qkv = rms_norm_linear_one_row if one_row_qkv else rms_norm_linear_small_batch
        qkv, _ = norm_qkv(self.x, self.residual, self.norm, 1e-6, w["qkv"])
        prepare = (qkv, self.positions, self.cos_sin, Q_HEADS, KV_HEADS, self.q_norm, self.k_norm)
        k_cache, v_cache = w["cache"][:, 0], w["cache"][:, 1]
        if fused:
            out = rope_store_decode_attention(
                *prepare, 1e-6, k_cache, v_cache, self.metadata, HEAD_DIM**-0.5
            )
        else:
            q = qk_norm_rope_store(*prepare, 1e-6, k_cache, v_cache, self.slots)
            out = paged_attention(q, k_cache, v_cache, self.metadata, HEAD_DIM**-0.5)
        return out.view(out.shape[0], -1)

    def attention_apart(self, i: int) -> torch.Tensor:
        return self.attention(i, fused=False)

    def mlp(self, i: int, attn: torch.Tensor) -> None:
        w = self.weights[i]
        gated_mlp_one_row(attn, self.residual, self.norm, 1e-6, w["gate_up"], w["down"], w["out"])

    def mlp_apart(self, i: int, attn: torch.Tensor) -> None:
        w = self.weights[i]
        x = linear_small_batch(attn, w["out"])
        hidden, _ = rms_norm_linear_small_batch(x, self.residual, self.norm, 1e-6, w["gate_up"])
        silu_and_mul_linear_small_batch(hidden, w["down"])

    def layer(self, i: int, fused_attention: bool = False, one_row_qkv: bool = False) -> None:
        self.mlp(i, self.attention(i, fused=fused_attention, one_row_qkv=one_row_qkv))

    def layer_apart(self, i: int) -> None:
        self.mlp_apart(i, self.attention_apart(i))


def measure(context: int) -> dict[str, dict[str, float]]:
    """Per layer at batch 1, the MLP and the whole layer: {"fused": us, "apart": us}."""
    layers = Layers(context)
    cases = {
        "attention": (layers.attention, layers.attention_apart),
        "mlp": (lambda i: layers.mlp(i, layers.attn), lambda i: layers.mlp_apart(i, layers.attn)),
        "layer": (layers.layer, layers.layer_apart),
        "layer one attn": (partial(layers.layer, fused_attention=True), layers.layer_apart),
        "layer one row": (
            partial(layers.layer, fused_attention=True, one_row_qkv=True),
            partial(layers.layer, fused_attention=True),
        ),
    }
    head = randn(VOCAB, HIDDEN, scale=HIDDEN**-0.5)
    for rows in (1, 16):
        hidden = randn(rows, HIDDEN)
        cases[f"lm head {rows} gemv/cublas"] = (
            partial(lambda x, _: linear_small_batch(x, head), hidden),
            partial(lambda x, _: torch.nn.functional.linear(x, head), hidden),
        )
    return {
        name: {"fused": graph_time_us(fused, LAYERS), "apart": graph_time_us(apart, LAYERS)}
        for name, (fused, apart) in cases.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    results: dict[str, object] = {"barrier_us": barrier_us()}
    logger.info(
        "grid barrier on %d SMs: %.2f us", num_sms(torch.device("cuda")), results["barrier_us"]
    )
    logger.info("%-15s %10s %10s %7s", "batch 1", "fused us", "apart us", "ratio")
    for name, us in measure(args.context).items():
        results[name] = us
        ratio = us["fused"] / us["apart"]
        logger.info("%-15s %10.2f %10.2f %7.3f", name, us["fused"], us["apart"], ratio)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
