"""Gemma 3 (text): local sliding-window layers interleaved with global ones.

The Llama network with Gemma's differences: norms of x * (1 + w) (the checkpoint's
w loaded plus one, so the Llama norm and its fused kernels compute them), sandwich
norms (after attention and after the MLP too), q/k norms, embeddings scaled by
sqrt(hidden_size), a GELU-tanh gated MLP, the attention scaled by
`query_pre_attn_scalar`, and two rotary tables: the local layers' own base and the
global layers' (scaled) one. Local and global layers are different KV cache groups
(extkv.kv_cache.groups), each with its own block table: a sequence's local layers
release the blocks out of their window as it runs, its global layers keep them all.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PretrainedConfig

from extkv.models.hf_config import head_dim, rope_parameters
from extkv.models.layers import GatedMLP, GemmaRMSNorm, RotaryEmbedding
from extkv.models.llama import CausalLM, DecoderAttention, DecoderModel

SLIDING, FULL = "sliding_attention", "full_attention"


def _check_supported(config: PretrainedConfig) -> None:
    """Refuse what this network would silently get wrong."""
    if config.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(
            f"hidden_activation {config.hidden_activation!r} is not supported; "
            "only 'gelu_pytorch_tanh'"
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 2's); use null")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention is not supported; only causal attention")
    unknown = set(config.layer_types) - {SLIDING, FULL}
    if unknown:
        raise ValueError(
            f"layer_types {sorted(unknown)} are not supported; only {SLIDING!r}, {FULL!r}"
        )


class Gemma3DecoderLayer(nn.Module):
    """Norm, attention, norm; norm, MLP, norm: each residual add fused into the next
    layer's first norm, as in the Llama layer."""

    def __init__(self, config: PretrainedConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        window = config.sliding_window if layer_type == SLIDING else None
        scale = config.query_pre_attn_scalar**-0.5
        self.self_attn = DecoderAttention(
            config, qk_norm=True, sliding_window=window, scale=scale, norm=GemmaRMSNorm
        )
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, False, activation="gelu_tanh"
        )
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's normed output, residual stream): the caller's next norm adds the two."""
        hidden, residual = self.self_attn(
            hidden, residual, self.input_layernorm, positions, cos_sin_cache
        )
        hidden = self.post_attention_layernorm(hidden)[0]
        hidden, residual = self.mlp(hidden, residual, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm(hidden)[0], residual


class Gemma3Model(DecoderModel):
    """The decoder stack with Gemma's norms and scaled embedding, each layer rotating by
    its layer type's table."""

    def __init__(self, config: PretrainedConfig) -> None:
        tables = nn.ModuleDict(
            {
                layer_type: RotaryEmbedding(
                    head_dim(config),
                    config.max_position_embeddings,
                    rope_parameters(config, layer_type),
                )
                for layer_type in sorted(set(config.layer_types))
            }
        )
        super().__init__(
            config,
            lambda i: Gemma3DecoderLayer(config, config.layer_types[i]),
            norm=GemmaRMSNorm,
            embed_scale=math.sqrt(config.hidden_size),
            rotary=tables,
        )

    def cos_sin_cache(self, layer: nn.Module) -> torch.Tensor:
        return self.rotary_emb[layer.layer_type].cos_sin_cache


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's text model; final logits soft-capped when the config says so."""

    def __init__(self, config: PretrainedConfig) -> None:
        _check_supported(config)
        super().__init__(config, Gemma3Model(config))
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """(n, hidden_size) -> logits, tanh-capped at +-final_logit_softcapping: in fp32
        where there is a cap whatever `fp32` says, else as `CausalLM.compute_logits`."""
        cap = self.final_logit_softcapping
        logits = super().compute_logits(hidden, fp32 or cap is not None)
        return logits if cap is None else torch.tanh(logits / cap) * cap
