"""Compile the decode step's newest Triton kernels for an H100/H200 (sm90) without a GPU.

    python scripts/compile_kernels.py                 # with the installed Triton
    bash scripts/compile-check [TRITON_VERSION]       # with another one (default 3.6.0,
                                                      # the GPU machine's), in /tmp

Front-end and back-end errors (a Triton version's typing rules, PTX assembly) show up
here in seconds, where the device costs minutes: every variant of the GEMV (plain,
SiLU*mul and RMSNorm inputs, with and without residual, split K, PDL with the L2
prefetch), of the paged attention (decode splits, prefill, PDL, image key bounds, MLA's
latent rows; each checked against sm90's shared memory) and its merge, of the prefill
attention over a step's own K/V (TMA descriptors or pointer loads, sliding window, head
dims 64 to 256 at the tiles fit for them; its dots on wgmma, its TMA loads there), the
q/k norm + rotary + KV store kernel (with and without its k output), the RMSNorm and
SiLU*mul kernels whose math the GEMV's inputs share, the fused MoE's kernels, the
Mamba2 prefill's conv and chunked-scan kernels, the batch-1 MLP kernel with its
weights in registers at Qwen3's and SmolLM2's shapes, and the one-kernel decode attention.
"""

from __future__ import annotations

import inspect
import itertools
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from extkv.kernels import (
    activation,
    causal_conv,
    decode_attention,
    fused_moe,
    gated_mlp,
    gemv,
    norm,
    paged_attention,
    prefill_attention,
    rotary,
    ssd_prefill,
)

HOPPER = GPUTarget("cuda", 90, 32)


SHARED_MEMORY = 232448  # an H100's/H200's per-program limit (bytes)


def compile_for_hopper(
    fn: triton.JITFunction, types: dict[str, str], constexprs: dict, **options
) -> dict[str, str]:
    """Compile `fn` with pointer/scalar `types` by argument name (i32 for the rest) and
    return its assembly by stage. Every pointer and integer is marked 16-divisible, as
    the launcher marks aligned tensors and sizes, and innermost strides (`stride_*d`,
    `stride_*k`) are the constant 1 the launcher specializes: without either no load
    is vectorized, so none is pipelined, and neither the code nor its shared memory is
    what the GPU runs. Fails where the program needs more shared memory than sm90 has."""
    names = list(inspect.signature(fn.fn).parameters)
    unit = {n: 1 for n in names if n.startswith("stride_") and n[-1] in "dk"}
    constexprs = {**unit, **constexprs}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if signature[n].startswith("*") or signature[n] in ("i32", "i64")
    }
    source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(source, target=HOPPER, options=options)
    if kernel.metadata.shared > SHARED_MEMORY:
        raise RuntimeError(f"needs {kernel.metadata.shared} bytes of shared memory")
    return kernel.asm


def gemv_variants() -> list[tuple[str, dict[str, str], dict]]:
    variants = []
    for kind, residual, split, pdl in itertools.product(
        (0, 1, 2), ("bf16", "fp32"), (1, 4), (0, 1)
    ):
        types = {
            **dict.fromkeys(("x_ptr", "w_ptr", "bias_ptr", "y_ptr", "norm_weight_ptr"), "*bf16"),
            "partial_ptr": "*fp32",
            "arrivals_ptr": "*i32",
            "residual_ptr": f"*{residual}",
            "residual_out_ptr": f"*{residual}",
            "w_address": "i64",
            "eps": "fp32",
        }
        constexprs = dict(
            num_rows=1,  # Triton specializes a batch of one as a constant
            INPUT=kind,
            HAS_RESIDUAL=kind == 2,
            HAS_BIAS=True,
            BLOCK_N=64,
            BLOCK_K=128,
            BLOCK_M=16,
            SPLIT_K=split,
            K_CHUNKS=8 if kind == 2 else 1,
            DOT_PRECISION="tf32",
            PREFETCH=bool(pdl),
            LINE_ELEMENTS=64,
            USE_PDL=bool(pdl),
        )
        name = f"gemv input={kind} residual={residual} split_k={split} pdl={pdl}"
        variants.append((name, types, constexprs))
    return variants


def attention_variants() -> list[tuple[str, dict[str, str], dict, dict]]:
    """Decode and prefill tiles at Qwen3's head dim 128, with and without splits and PDL,
    and DeepSeek's 576-value latent rows at 16 and 32 query heads, each with the tiles
    `fit_tiles` cuts for it: (name, types, constexprs, launch options)."""
    types = {
        **dict.fromkeys(("out_ptr", "q_ptr", "k_ptr", "v_ptr"), "*bf16"),
        **dict.fromkeys(("part_out_ptr", "part_lse_ptr"), "*fp32"),
        **dict.fromkeys(
            ("block_tables_ptr", "context_lens_ptr", "cu_seqlens_q_ptr", "key_bounds_ptr"), "*i32"
        ),
        "qk_scale": "fp32",
    }
    cases = [
        (name, 2, 128, tiles, splits, pdl, window, False)
        for (name, tiles), splits, pdl, window in itertools.product(
            (("decode", paged_attention.DECODE_TILES), ("prefill", paged_attention.PREFILL_TILES)),
            (1, 4),
            (False, True),
            (False, True),
        )
        if name == "decode" or splits == 1
    ]
    prefill = paged_attention.PREFILL_TILES
    cases += [("prefill", 2, 128, prefill, 1, True, window, True) for window in (False, True)]
    mla = paged_attention.DECODE_TILES
    cases += [("mla", heads, 576, mla, 4, True, False, False) for heads in (16, 32)]
    variants = []
    for name, group, head_dim, tiles, splits, pdl, window, images in cases:
        dim_p2 = triton.next_power_of_2(head_dim)
        block_m = max(tiles.block_m, group)
        tiles = paged_attention.fit_tiles(tiles, block_m, dim_p2, 2, torch.device("cpu"))
        constexprs = dict(
            GROUP=group,
            GROUP_P2=group,
            HEAD_DIM=head_dim,
            HEAD_DIM_P2=dim_p2,
            BLOCK_SIZE=16,
            BLOCK_M=block_m,
            BLOCK_N=tiles.block_n,
            NUM_SPLITS=splits,
            UNMASKED_FIRST=name == "prefill" and not window,
            KEY_BOUNDS=images,
            DOT_PRECISION="tf32",
            USE_PDL=pdl,
        )
        options = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
        label = (
            f"paged attention {name} heads/kv={group} {tiles} splits={splits} pdl={pdl:d} "
            f"window={window:d} images={images:d}"
        )
        variants.append((label, types, constexprs, options))
    return variants


def prefill_attention_variants() -> list[tuple[str, dict[str, str], dict, dict]]:
    """The prefill kernel over a step's own K/V at Qwen3-0.6B's heads (TMA or pointer
    loads, with and without a window), Llama's head dim 64 and Gemma 3's 256 (tiles cut
    by fit_tiles), bf16; a GQA group of 1 and 4: (name, types, constexprs, options)."""
    variants = []
    cases = [(2, 128, tma, window) for tma in (True, False) for window in (False, True)]
    cases += [(4, 64, True, False), (1, 256, True, True), (2, 256, False, False)]
    for group, head_dim, tma, window in cases:
        tiles = prefill_attention.fit_tiles(
            prefill_attention.PREFILL_TILES, head_dim, 2, torch.device("cpu")
        )
        types = {"out_ptr": "*bf16", "cu_seqlens_ptr": "*i32", "qk_scale": "fp32"}
        for name, rows in (
            ("q_src", tiles.block_m),
            ("k_src", tiles.block_n),
            ("v_src", tiles.block_n),
        ):
            types[name] = f"tensordesc<bf16[{rows},{head_dim}]>" if tma else "*bf16"
        constexprs = dict(
            GROUP=group,
            HEAD_DIM=head_dim,
            HEAD_DIM_P2=head_dim,
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            HAS_WINDOW=window,
            USE_TMA=tma,
            DOT_PRECISION="tf32",
            USE_PDL=True,
        )
        options = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
        label = (
            f"prefill attention heads/kv={group} head_dim={head_dim} {tiles} tma={tma:d} "
            f"window={window:d}"
        )
        variants.append((label, types, constexprs, options))
    return variants


def rotary_variants() -> list[tuple[str, dict[str, str], dict]]:
    """The q/k norm + rotary + KV store kernel at Qwen3-0.6B's heads, with and without its
    k output (a prefill attending over its own K/V) and PDL."""
    types = {
        **dict.fromkeys(("qkv_ptr", "q_weight_ptr", "k_weight_ptr", "q_out_ptr"), "*bf16"),
        **dict.fromkeys(("k_out_ptr", "k_cache_ptr", "v_cache_ptr"), "*bf16"),
        "positions_ptr": "*i64",
        "cos_sin_ptr": "*fp32",
        "slot_ptr": "*i64",
        "eps": "fp32",
    }
    variants = []
    for keys, pdl in itertools.product((False, True), (False, True)):
        constexprs = dict(
            NUM_Q_HEADS=16,
            NUM_KV_HEADS=8,
            HEAD_DIM=128,
            DIM_P2=128,
            ROTARY_DIM=128,
            HEADS=4,
            Q_TILES=4,
            BLOCK_SIZE=16,
            HAS_NORM=True,
            K_OUT=keys,
            USE_PDL=pdl,
        )
        variants.append((f"qk_norm_rope_store keys={keys:d} pdl={pdl:d}", types, constexprs))
    return variants


GEMV_OPTIONS = dict(num_warps=4, num_stages=6)  # gemv_config's


def moe_variants() -> list[tuple[triton.JITFunction, tuple[str, dict, dict], dict]]:
    """The fused MoE's one-program sort by expert, its grouped GEMM (gate_up with SiLU*mul,
    down) at decode's and prefill's tiles (bf16, and fp32 as the GPU tests run it), and its
    weighted sum (DeepSeek's fp32 routing weights and shared experts, Qwen3-MoE's bf16
    ones), with and without PDL: (kernel, (name, types, constexprs), launch options)."""
    jobs = []
    for dtype, pairs, gated, pdl in itertools.product(
        ("bf16", "fp32"), (8, 1 << 16), (True, False), (False, True)
    ):
        if dtype == "fp32" and pdl:
            continue
        tiles = fused_moe.expert_tiles(pairs, 128, 2 if dtype == "bf16" else 4)
        gemm_types = {
            **dict.fromkeys(("a_ptr", "w_ptr", "out_ptr"), f"*{dtype}"),
            **dict.fromkeys(("sorted_pairs_ptr", "block_experts_ptr"), "*i32"),
        }
        constexprs = dict(
            GATED=gated,
            GATHER=gated,
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k,
            DOT_PRECISION="tf32" if dtype == "bf16" else "ieee",
            USE_PDL=pdl,
        )
        options = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
        name = f"moe {'gate_up' if gated else 'down'} {dtype} {tiles} pdl={pdl:d}"
        jobs.append((fused_moe._expert_gemm_kernel, (name, gemm_types, constexprs), options))
    sort_types = {"indices_ptr": "*i64", "sorted_pairs_ptr": "*i32", "block_experts_ptr": "*i32"}
    for block_m, experts, pdl in ((16, 128, True), (16, 256, True), (64, 64, False)):
        chunk = min(256, max(16, fused_moe._SORT_CHUNK_CELLS // experts))
        constexprs = dict(BLOCK_M=block_m, EXPERTS_P2=experts, CHUNK=chunk, USE_PDL=pdl)
        name = f"moe sort block_m={block_m} experts={experts} pdl={pdl:d}"
        jobs.append((fused_moe._sort_kernel, (name, sort_types, constexprs), {"num_warps": 8}))
    for weights, top_k, shared, pdl in (
        ("fp32", 6, True, False),
        ("fp32", 6, True, True),
        ("bf16", 8, False, True),
    ):
        types = dict.fromkeys(("rows_ptr", "shared_ptr", "out_ptr"), "*bf16")
        types["weights_ptr"] = f"*{weights}"
        constexprs = dict(TOP_K=top_k, HAS_SHARED=shared, BLOCK=1024, USE_PDL=pdl)
        name = f"moe weighted sum weights={weights} top_k={top_k} shared={shared:d} pdl={pdl:d}"
        jobs.append((fused_moe._weighted_sum_kernel, (name, types, constexprs), {}))
    return jobs


def mamba_prefill_variants() -> list[tuple[triton.JITFunction, tuple[str, dict, dict], dict]]:
    """The Mamba2 prefill's kernels at Bamba's shape (64 x 128 heads' state, 256-token
    chunks) in bf16, with and without cached states; the scan's fp32 dots as tf32x3.
    Pointers not named are the chunk layout's and the state rows' (int32)."""

    def job(fn: triton.JITFunction, name: str, types: dict[str, str], constexprs: dict):
        names = inspect.signature(fn.fn).parameters
        pointers = {n: "*i32" for n in names if n.endswith("_ptr")}
        return fn, (name, {**pointers, "carry_ptr": "*i1", **types}, constexprs), {}

    shape = dict(HEAD_DIM=64, STATE_SIZE=128, BLOCK_P=64, BLOCK_N=128)
    scan = dict(HEADS_PER_GROUP=32, CHUNK=256, BLOCK_L=64, DOT_PRECISION="tf32x3", **shape)
    fp32 = ("dt_ptr", "a_ptr", "a_cum_ptr", "state_ptr", "decay_ptr", "out_ptr", "d_ptr")
    types = {**dict.fromkeys(fp32, "*fp32"), "start_state_ptr": "*fp32"}
    types.update(dict.fromkeys(("x_ptr", "b_ptr", "c_ptr"), "*bf16"))
    jobs = [
        job(ssd_prefill._chunk_state_kernel, "ssd chunk_state", types, scan),
        job(
            ssd_prefill._chunk_scan_kernel,
            "ssd chunk_scan",
            types,
            dict(scan, P_TILES=1, EXACT_PRECISION="tf32"),
        ),
    ]
    conv_types = dict.fromkeys(("x_ptr", "weight_ptr", "bias_ptr", "state_ptr", "out_ptr"), "*bf16")
    for cache in (False, True):
        passing = dict.fromkeys(("state_ptr", "decay_ptr", "cache_ptr"), "*fp32")
        name = f"ssd state_passing cache={cache:d}"
        jobs.append(
            job(ssd_prefill._state_passing_kernel, name, passing, dict(shape, HAS_CACHE=cache))
        )
        conv = dict(WIDTH=4, HAS_BIAS=True, HAS_STATE=cache, CHUNK=256, BLOCK_T=32, BLOCK_C=128)
        name = f"causal_conv_prefill state={cache:d}"
        jobs.append(job(causal_conv._causal_conv_prefill_kernel, name, conv_types, conv))
    store = dict(WIDTH=4, BLOCK_C=128)
    jobs.append(job(causal_conv._conv_state_store_kernel, "conv_state_store", conv_types, store))
    return jobs


def persistent_variants() -> list[tuple[triton.JITFunction, tuple[str, dict, dict], dict]]:
    """The batch-1 MLP kernel with all its stages (one launch, grid barriers) at the plans
    of Qwen3-0.6B and SmolLM2-135M, with and without the output projection, bf16 and fp32
    residual streams."""
    jobs = []
    names = inspect.signature(gated_mlp._gated_mlp_kernel.fn).parameters
    shapes = {"qwen3": (1024, 3072, 2048), "smollm2": (576, 1536, 576)}
    for (shape, (hidden, inner, width)), out_proj, residual in itertools.product(
        shapes.items(), (True, False), ("bf16", "fp32")
    ):
        width = width if out_proj else 0
        plan = gated_mlp.RegisterPlan.of(hidden, inner, width, 2, 132)
        types = {n: "*bf16" for n in names if n.endswith("_ptr")}
        types.update(barrier_ptr="*i64", residual_ptr=f"*{residual}", stream_ptr=f"*{residual}")
        types.update(eps="fp32")
        constexprs = dict(
            HAS_OUT_PROJ=out_proj, HAS_RESIDUAL=True, RO1=plan.hidden_rows[0],
            RO2=plan.hidden_rows[1], RI1=plan.inner_rows[0], RI2=plan.inner_rows[1],
            KA1=max(plan.attn_k[0], 1), KA2=plan.attn_k[1], KH1=plan.hidden_k[0],
            KH2=plan.hidden_k[1], KI1=plan.inner_k[0], KI2=plan.inner_k[1],
            FIRST=0 if out_proj else 1, LAST=2, USE_PDL=True,
        )  # fmt: skip
        name = f"gated_mlp {shape} out_proj={out_proj:d} residual={residual}"
        options = {"num_warps": gated_mlp.NUM_WARPS}
        jobs.append((gated_mlp._gated_mlp_kernel, (name, types, constexprs), options))
    return jobs


def decode_attention_variants() -> list[tuple[triton.JITFunction, tuple[str, dict, dict], dict]]:
    """The one-kernel decode attention at Qwen3's heads (q/k norm, split or not), Bamba's
    half rotary without norm, Llama's head dim 64 and Gemma 3's 256, bf16."""
    jobs = []
    names = inspect.signature(decode_attention._decode_attention_kernel.fn).parameters
    cases = [(2, 128, 128, True, splits) for splits in (1, 8, 16)]
    cases += [(4, 128, 64, False, 4), (4, 64, 64, False, 8), (2, 256, 256, True, 4)]
    for group, head_dim, rotary_dim, has_norm, splits in cases:
        types = {n: "*bf16" for n in names if n.endswith("_ptr")}
        types.update(dict.fromkeys(("part_out_ptr", "part_lse_ptr", "cos_sin_ptr"), "*fp32"))
        types.update(
            dict.fromkeys(("block_tables_ptr", "context_lens_ptr", "arrivals_ptr"), "*i32")
        )
        types.update(positions_ptr="*i64", slot_ptr="*i64", eps="fp32", qk_scale="fp32")
        constexprs = dict(
            NUM_Q_HEADS=8 * group, NUM_KV_HEADS=8, GROUP=group, BLOCK_M=16, HEAD_DIM=head_dim,
            HEAD_DIM_P2=head_dim, ROTARY_DIM=rotary_dim, BLOCK_SIZE=16,
            BLOCK_N=decode_attention.block_n(head_dim), NUM_SPLITS=splits, HAS_NORM=has_norm,
            DOT_PRECISION="tf32", USE_PDL=True,
        )  # fmt: skip
        name = (
            f"decode attention heads/kv={group} dim={head_dim} rotary={rotary_dim} splits={splits}"
        )
        options = {"num_warps": decode_attention.NUM_WARPS}
        jobs.append((decode_attention._decode_attention_kernel, (name, types, constexprs), options))
    return jobs


def main() -> int:
    print(f"Triton {triton.__version__}, target sm90")
    jobs = [(gemv._gemv_kernel, v, GEMV_OPTIONS) for v in gemv_variants()]
    jobs += [
        (paged_attention._paged_attention_kernel, (name, types, constexprs), options)
        for name, types, constexprs, options in attention_variants()
    ]
    jobs += [
        (prefill_attention._prefill_attention_kernel, (name, types, constexprs), options)
        for name, types, constexprs, options in prefill_attention_variants()
    ]
    jobs += [(rotary._qk_norm_rope_store_kernel, v, {"num_warps": 4}) for v in rotary_variants()]
    merge_types = {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
    for pdl in (False, True):
        merge = dict(HEAD_DIM=128, HEAD_DIM_P2=128, NUM_SPLITS=4, USE_PDL=pdl)
        jobs.append(
            (paged_attention._merge_splits_kernel, (f"merge pdl={pdl:d}", merge_types, merge), {})
        )
    for pdl in (False, True):
        for residual in (False, True):
            constexprs = dict(HAS_RESIDUAL=residual, BLOCK=1024, USE_PDL=pdl)
            types = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16"}
            types.update(out_ptr="*bf16", eps="fp32")
            name = f"rms_norm residual={residual:d} pdl={pdl:d}"
            jobs.append((norm._rms_norm_kernel, (name, types, constexprs), {}))
        types = {"gate_up_ptr": "*bf16", "out_ptr": "*bf16"}
        constexprs = dict(BLOCK=1024, USE_PDL=pdl)
        jobs.append(
            (activation._silu_and_mul_kernel, (f"silu_and_mul pdl={pdl:d}", types, constexprs), {})
        )
    jobs += moe_variants()
    jobs += mamba_prefill_variants()
    jobs += persistent_variants()
    jobs += decode_attention_variants()
    failed = 0
    for fn, (name, types, constexprs), options in jobs:
        try:
            asm = compile_for_hopper(fn, types, constexprs, **options)
            if fn is gemv._gemv_kernel and "async_copy_global_to_local" not in asm["ttgir"]:
                raise RuntimeError("the GEMV's loads are not pipelined (no async copy)")
            if fn is prefill_attention._prefill_attention_kernel:
                if "wgmma.mma_async" not in asm["ptx"]:
                    raise RuntimeError("the prefill attention's dots are not on wgmma")
                if constexprs["USE_TMA"] and "cp.async.bulk.tensor" not in asm["ptx"]:
                    raise RuntimeError("the prefill attention's TMA loads are not TMA copies")
            print(f"ok    {name}")
        except Exception as e:  # a compile error of any kind: report it and go on
            failed += 1
            print(f"FAIL  {name}\n{str(e)[-2000:]}")
    print(f"{len(jobs) - failed} of {len(jobs)} compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
