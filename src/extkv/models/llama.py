"""Llama-style dense decoder; Qwen3 is the same network plus per-head q/k RMSNorm.

Models take flat token batches: every sequence's tokens concatenated, no
padding; the attention layer finds the sequence boundaries (and the paged KV
cache) in the forward context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from extkv.attention import Attention
from extkv.attention.layer import QKNorm
from extkv.models.hf_config import head_dim, num_kv_heads, rope_parameters
from extkv.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from extkv.models.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    split_evenly,
    split_heads,
)


def _check_supported(config: PretrainedConfig) -> None:
    """Refuse configs this network would silently get wrong."""
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError("sliding-window attention layers are not supported")


class DecoderAttention(nn.Module):
    """A Llama-style layer's self-attention: fused qkv projection, optional per-head q/k norm
    (Qwen3), rotary and paged attention in `Attention`, output projection."""

    def __init__(
        self,
        config: PretrainedConfig,
        qk_norm: bool,
        sliding_window: int | None = None,
        scale: float | None = None,
        norm: type[RMSNorm] = RMSNorm,
        qkv_bias: bool | None = None,
    ) -> None:
        """`scale`: of the scores (None: 1 / sqrt(head_dim)); `norm`: the q/k norms' kind;
        `qkv_bias`: biases on q, k and v only (Qwen2); None: the config's `attention_bias`
        on all four projections."""
        super().__init__()
        self.head_dim = head_dim(config)
        # Tensor parallel: each rank holds whole heads, KV heads replicated when the
        # ranks outnumber them.
        q = split_evenly(config.num_attention_heads, "num_attention_heads", self.head_dim)
        kv = split_heads(num_kv_heads(config), "num_key_value_heads", self.head_dim)
        self.num_heads, self.num_kv_heads = q.size // self.head_dim, kv.size // self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = MergedColumnParallelLinear(
            config.hidden_size,
            {"q_proj": [q], "k_proj": [kv], "v_proj": [kv]},
            bias if qkv_bias is None else qkv_bias,
        )
        self.o_proj = RowParallelLinear(q, config.hidden_size, bias and qkv_bias is None)
        # Weights only: the attention kernel norms each q and k head itself.
        self.q_norm = norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        scale = self.head_dim**-0.5 if scale is None else scale
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale, sliding_window
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
        residual)`, summed over the ranks; the residual stream): the norm runs fused
        into the qkv projection where a decode step's GEMV runs."""
        out, residual = self.attend(hidden, residual, norm, positions, cos_sin_cache)
        return self.o_proj(out), residual

    def attend(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` up to the output projection: (the heads' outputs (T, heads * head_dim),
        the residual stream), for a layer that runs `o_proj` in its MLP's kernel."""
        qk_norm = None
        if self.q_norm is not None:
            qk_norm = QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        qkv, residual = self.qkv_proj.normed(hidden, residual, norm, one_row=True)
        return self.attn(qkv, positions, cos_sin_cache, qk_norm), residual


class DecoderLayer(nn.Module):
    """Pre-norm attention then MLP, each residual add fused into the next norm.

    `self_attn` is any attention sublayer called as `DecoderAttention` is (Llama's, MLA's),
    `mlp` any called as `GatedMLP` is (None: the config's GatedMLP; DeepSeek's experts)."""

    def __init__(
        self, config: PretrainedConfig, self_attn: nn.Module, mlp: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        bias = getattr(config, "mlp_bias", False)
        self.mlp = (
            GatedMLP(config.hidden_size, config.intermediate_size, bias) if mlp is None else mlp
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def fuses_out_proj(self) -> bool:
        """Whether the attention's output projection runs in the MLP's kernel (a Llama-style
        attention and a gated MLP)."""
        return isinstance(self.self_attn, DecoderAttention) and isinstance(self.mlp, GatedMLP)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream): the caller's next norm adds the two. Each
        sublayer applies its norm itself, fused into its first projection; a Llama-style
        attention's output projection runs in a gated MLP's kernel."""
        args = (hidden, residual, self.input_layernorm, positions, cos_sin_cache)
        norm = self.post_attention_layernorm
        if self.fuses_out_proj():
            out_proj = self.self_attn.o_proj
            out, residual = self.self_attn.attend(*args)
            return self.mlp.after_projection(out, out_proj, residual, norm)
        hidden, residual = self.self_attn(*args)
        return self.mlp(hidden, residual, norm)


class DecoderModel(nn.Module):
    """Embedding, the decoder layers and the final norm; `make_layer(i)` builds layer i.

    One rotary table is shared by all layers (`cos_sin_cache` says which table a layer
    rotates by; Gemma 3 has one per layer type); it rotates `head_dim` channels (DeepSeek
    configs set it to their rotary part, qk_rope_head_dim). `norm` is the norms' kind and
    `embed_scale` multiplies the embeddings (both Gemma's). The one place that takes a
    step's embeddings in place of its token ids' (`inputs_embeds`: images)."""

    def __init__(
        self,
        config: PretrainedConfig,
        make_layer: Callable[[int], nn.Module],
        norm: type[RMSNorm] = RMSNorm,
        embed_scale: float | None = None,
        rotary: nn.Module | None = None,
    ) -> None:
        """`rotary`: the tables `cos_sin_cache` picks from (None: one of the config's)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = embed_scale
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = norm(config.hidden_size, config.rms_norm_eps)
        if rotary is None:
            rotary = RotaryEmbedding(
                head_dim(config), config.max_position_embeddings, rope_parameters(config)
            )
        self.rotary_emb = rotary

    def cos_sin_cache(self, layer: nn.Module) -> torch.Tensor:
        """The rotary table `layer` rotates by."""
        return self.rotary_emb.cos_sin_cache

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) -> the tokens' input embeddings (T, hidden_size)."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is None:
            return hidden
        # As HF: the scale rounded to the weights' dtype, then one multiply; a Python number,
        # as a device tensor made here would be a host-to-device copy inside a graph capture.
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype).item()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> final-normed hidden states (T, hidden_size);
        `inputs_embeds` (T, hidden_size) in place of the ids' embeddings (images in them)."""
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, self.cos_sin_cache(layer))
        return self.norm(hidden, residual)[0]


class CausalLM(nn.Module):
    """A decoder stack (`model`, mapping token ids and positions to hidden states)
    under an LM head, tied to the stack's embedding when the config says so."""

    def __init__(self, config: PretrainedConfig, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: (T,) -> hidden states (T, hidden_size)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """(n, hidden_size) -> fp32 logits (n, vocab_size), the matmul in the model dtype as
        HF. `fp32=False` may leave them in that dtype, where fp32 holds the same numbers
        (the decode graph's argmax kernel casts them as it stores them: a kernel fewer)."""
        logits = self.lm_head(hidden)
        return logits.float() if fp32 else logits


class LlamaForCausalLM(CausalLM):
    """Llama-style causal LM; module names mirror the HF checkpoint's tensor names."""

    qk_norm: ClassVar[bool] = False
    sliding: ClassVar[bool] = False  # every layer attends over `config.sliding_window`
    qkv_bias: ClassVar[bool | None] = None  # None: the config's attention_bias

    def __init__(self, config: PretrainedConfig) -> None:
        _check_supported(config)
        window = getattr(config, "sliding_window", None) if self.sliding else None
        if window is not None and window < 1:  # transformers' config checks it is an int
            raise ValueError(f"sliding_window must be a positive int or null, got {window!r}")

        def layer(i: int) -> DecoderLayer:
            attention = DecoderAttention(config, self.qk_norm, window, qkv_bias=self.qkv_bias)
            return DecoderLayer(config, attention, self.make_mlp(config, i))

        super().__init__(config, DecoderModel(config, layer))

    def make_mlp(self, config: PretrainedConfig, layer: int) -> nn.Module | None:
        """Layer `layer`'s MLP; None: the config's dense GatedMLP (mixture-of-experts
        models say which layers route instead)."""
        return None


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama network, each query attending over its last `sliding_window`
    tokens in every layer (all of them when the config has none)."""

    sliding: ClassVar[bool] = True
