"""Bamba: a hybrid decoder, each layer Mamba2 or attention (`attn_layer_indices`), then an MLP.

The attention layers are the Llama-style ones (with Bamba's partial rotary,
half of each head), so they are `extkv.attention.Attention` modules over the
paged KV cache; the Mamba2 layers keep per-sequence states in cache blocks.
Module names mirror the HF checkpoint's tensor names.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from extkv.models.hf_config import head_dim, rope_parameters
from extkv.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from extkv.models.llama import CausalLM, DecoderAttention
from extkv.models.mamba2 import Mamba2Dims, Mamba2Mixer, check_activation
from extkv.models.parallel import VocabParallelEmbedding


def bamba_dims(config: PretrainedConfig) -> Mamba2Dims:
    """The mixer's shape from Bamba's `mamba_*` config fields."""
    return Mamba2Dims(
        hidden_size=config.hidden_size,
        num_heads=config.mamba_n_heads,
        head_dim=config.mamba_d_head,
        state_size=config.mamba_d_state,
        n_groups=config.mamba_n_groups,
        conv_kernel=config.mamba_d_conv,
        chunk_size=config.mamba_chunk_size,
        eps=config.rms_norm_eps,
        use_bias=config.mamba_proj_bias,
        use_conv_bias=config.mamba_conv_bias,
        time_step_limit=tuple(config.time_step_limit),
    )


class BambaDecoderLayer(nn.Module):
    """Token mixer (Mamba2 or attention) and MLP, each pre-norm with a residual."""

    def __init__(self, config: PretrainedConfig, is_attention: bool) -> None:
        super().__init__()
        self.is_attention = is_attention
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = GatedMLP(
            config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False)
        )
        if is_attention:
            self.self_attn = DecoderAttention(config, qk_norm=False)
        else:
            self.mamba = Mamba2Mixer(bamba_dims(config))

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream): the caller's next norm adds the two. Each
        sublayer applies its norm itself, fused into its first projection."""
        norm = self.input_layernorm
        if self.is_attention:  # the output projection runs in the MLP's kernel
            out, residual = self.self_attn.attend(hidden, residual, norm, positions, cos_sin_cache)
            out_proj = self.self_attn.o_proj
            return self.feed_forward.after_projection(
                out, out_proj, residual, self.pre_ff_layernorm
            )
        hidden, residual = self.mamba(hidden, residual, norm)
        return self.feed_forward(hidden, residual, self.pre_ff_layernorm)


class BambaModel(nn.Module):
    """Embedding, the hybrid layer stack and the final norm, one rotary table shared by the
    attention layers."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        attention = set(getattr(config, "attn_layer_indices", None) or ())
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            BambaDecoderLayer(config, i in attention) for i in range(config.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            head_dim(config), config.max_position_embeddings, rope_parameters(config)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (T,) -> hidden states (T, hidden_size); only attention layers
        read the positions."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, self.rotary_emb.cos_sin_cache)
        return self.final_layernorm(hidden, residual)[0]


class BambaForCausalLM(CausalLM):
    """Bamba causal LM; refuses any activation but SiLU, which its mixers and MLPs assume."""

    def __init__(self, config: PretrainedConfig) -> None:
        check_activation(config.hidden_act)  # the MLP's too: GatedMLP is SiLU-gated
        super().__init__(config, BambaModel(config))
