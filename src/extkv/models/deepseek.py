"""DeepSeek V2 / V3: the Llama-style decoder with multi-head latent attention (MLA,
extkv.attention.mla) in place of grouped-query attention, and mixture-of-experts MLPs past
the first `first_k_dense_replace` layers.

Module names mirror the Hugging Face checkpoints' tensor names; the experts are stacked per
layer (extkv.models.moe), filled from the checkpoints' per-expert tensors.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from extkv.attention import MLAAttention
from extkv.models.hf_config import rope_parameters
from extkv.models.layers import RMSNorm, mla_softmax_scale
from extkv.models.llama import CausalLM, DecoderLayer, DecoderModel, _check_supported
from extkv.models.moe import MixtureOfExperts, Router
from extkv.models.parallel import ColumnParallelLinear, RowParallelLinear, Shard, split_evenly
from extkv.models.reference import apply_rotary

# transformers builds its latent norms with this eps, whatever rms_norm_eps says.
_LATENT_NORM_EPS = 1e-6
_TOPK_METHODS = ("greedy", "group_limited_greedy")  # V2's routers transformers has


def _is_moe(config: PretrainedConfig, layer: int) -> bool:
    """As in transformers: a layer past the first `first_k_dense_replace` routes to experts."""
    return bool(config.n_routed_experts) and layer >= (config.first_k_dense_replace or 0)


def _router(config: PretrainedConfig, sigmoid: bool) -> Router:
    """V2's softmax router (`topk_method` greedy or group_limited_greedy) or V3's sigmoid
    one (normalised when `norm_topk_prob`), both scaled by `routed_scaling_factor`, with
    the router weight and the routing weights in fp32 whatever the model dtype, as
    transformers keeps them."""
    method = "sigmoid" if sigmoid else config.topk_method
    if method not in ("sigmoid", *_TOPK_METHODS):
        raise ValueError(
            f"topk_method {config.topk_method!r} is not supported; extkv supports "
            f"{', '.join(map(repr, _TOPK_METHODS))}"
        )
    return Router(
        config.hidden_size,
        config.n_routed_experts,
        config.num_experts_per_tok,
        method,
        n_group=config.n_group,
        topk_group=config.topk_group,
        norm_topk_prob=sigmoid and config.norm_topk_prob,
        scale=config.routed_scaling_factor,
        weight_dtype=torch.float32,
    )


def _experts(config: PretrainedConfig, sigmoid: bool) -> MixtureOfExperts:
    """A DeepSeek MoE layer: routed experts of `moe_intermediate_size` plus
    `n_shared_experts` shared ones fused into one MLP every token takes."""
    return MixtureOfExperts(
        _router(config, sigmoid),
        config.hidden_size,
        config.moe_intermediate_size,
        config.n_shared_experts or 0,
        getattr(config, "mlp_bias", False),
    )


def _replicated(in_features: int, out_features: int, bias: bool) -> ColumnParallelLinear:
    """A projection every tensor-parallel rank holds whole: the latent ones, small, whose
    output every rank's heads (and its copy of the latent cache) need."""
    return ColumnParallelLinear(in_features, {None: [Shard(0, out_features, out_features)]}, bias)


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotary of x (T, heads, qk_rope_head_dim). Interleaved checkpoints (DeepSeek's own)
    pair channels (0, 1), (2, 3), ...: de-interleaved first, then rotated in halves, as
    transformers' V3 does (its V2 keeps the output interleaved: a permutation of the
    channels that q and k share, which leaves every score as it is)."""
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return apply_rotary(x, cos, sin)


class LatentAttention(nn.Module):
    """A DeepSeek layer's self-attention: query (through a low-rank q_a/q_b pair when
    `q_lora_rank` is set), the compressed KV latent and the shared rotary key from
    kv_a_proj_with_mqa, paged MLA over the latents, output projection.

    Tensor parallel: each rank holds whole heads (their rows of q_proj / q_b_proj and
    kv_b_proj, their columns of o_proj); the latent projections are replicated, so every
    rank caches the whole latent."""

    def __init__(self, config: PretrainedConfig, rope_interleave: bool) -> None:
        super().__init__()
        heads, hidden = config.num_attention_heads, config.hidden_size

        def by_heads(rows_per_head: int) -> Shard:
            return split_evenly(heads, "num_attention_heads", rows_per_head)

        self.num_heads = by_heads(1).size
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_interleave = rope_interleave
        qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        bias = config.attention_bias
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        q_heads = {None: [by_heads(qk_head_dim)]}
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_heads, False)
        else:
            self.q_a_proj = _replicated(hidden, config.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, q_heads, False)
        self.kv_a_proj_with_mqa = _replicated(
            hidden, config.kv_lora_rank + config.qk_rope_head_dim, bias
        )
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, _LATENT_NORM_EPS)
        kv_b = {None: [by_heads(config.qk_nope_head_dim + config.v_head_dim)]}
        self.kv_b_proj = ColumnParallelLinear(config.kv_lora_rank, kv_b, False)
        self.o_proj = RowParallelLinear(by_heads(config.v_head_dim), hidden, bias)
        scale = mla_softmax_scale(
            qk_head_dim, rope_parameters(config), config.max_position_embeddings
        )
        self.attn = MLAAttention(
            self.num_heads,
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.kv_lora_rank,
            config.v_head_dim,
            scale,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (T, hidden_size), positions (T,) -> (attention of `norm(hidden,
        residual)`, the residual stream), as `DecoderAttention`."""
        x, residual = norm(hidden, residual)
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))[0])
        q_nope, q_rot = q.unflatten(-1, (self.num_heads, -1)).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1
        )
        compressed, k_rot = self.kv_a_proj_with_mqa(x).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        cos, sin = cos_sin_cache[positions].to(x.dtype).unsqueeze(1).chunk(2, dim=-1)
        q_rot = _rotate(q_rot, cos, sin, self.rope_interleave)
        k_rot = _rotate(k_rot[:, None], cos, sin, self.rope_interleave)[:, 0]
        query = torch.cat((q_nope, q_rot), dim=-1)
        latent = torch.cat((self.kv_a_layernorm(compressed)[0], k_rot), dim=-1)
        out = self.attn(query, latent, self.kv_b_proj.weight)
        return self.o_proj(out), residual


class DeepseekV2ForCausalLM(CausalLM):
    """DeepSeek-V2 (and V2-Lite): softmax expert routing; the rotary pairs are interleaved."""

    sigmoid_router: ClassVar[bool] = False

    def rope_interleave(self, config: PretrainedConfig) -> bool:
        """Whether the checkpoint's rotary channels come in adjacent pairs."""
        return True

    def __init__(self, config: PretrainedConfig) -> None:
        _check_supported(config)
        interleave = self.rope_interleave(config)
        sigmoid = self.sigmoid_router

        def layer(i: int) -> DecoderLayer:
            moe = _experts(config, sigmoid) if _is_moe(config, i) else None
            return DecoderLayer(config, LatentAttention(config, interleave), moe)

        super().__init__(config, DecoderModel(config, layer))
        self.num_layers = config.num_hidden_layers

    def ignores_tensor(self, name: str) -> bool:
        """Whether the loader skips checkpoint tensor `name`: V3 checkpoints carry their
        multi-token-prediction layers after the decoder's (model.layers.61.* in V3), which
        generation does not run (transformers skips them too)."""
        prefix, _, rest = name.partition("model.layers.")
        index = rest.partition(".")[0]
        return not prefix and index.isdigit() and int(index) >= self.num_layers


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: V2's network with sigmoid expert routing, the rotary layout per
    `rope_interleave`."""

    sigmoid_router: ClassVar[bool] = True

    def rope_interleave(self, config: PretrainedConfig) -> bool:
        """As the config says (transformers' default: interleaved)."""
        return getattr(config, "rope_interleave", True)
