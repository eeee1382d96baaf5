"""Mamba2ForCausalLM: a stack of pre-norm Mamba2 mixers, no attention and no positions.

Module names mirror the HF checkpoint's tensor names (`backbone.layers.N.mixer`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from extkv.models.layers import RMSNorm
from extkv.models.mamba2 import Mamba2Dims, Mamba2Mixer, check_activation
from extkv.models.parallel import ParallelLMHead, VocabParallelEmbedding


def mamba2_dims(config: PretrainedConfig) -> Mamba2Dims:
    """The mixer's shape from a Mamba2 config."""
    return Mamba2Dims(
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        state_size=config.state_size,
        n_groups=config.n_groups,
        conv_kernel=config.conv_kernel,
        chunk_size=config.chunk_size,
        eps=config.layer_norm_epsilon,
        use_bias=config.use_bias,
        use_conv_bias=config.use_conv_bias,
        time_step_limit=tuple(config.time_step_limit),
    )


class Mamba2Block(nn.Module):
    """Pre-norm residual block; with `residual_in_fp32` the residual stream stays fp32
    (as HF), each block's input cast to the model dtype before its norm."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(mamba2_dims(config))
        self.residual_in_fp32 = config.residual_in_fp32

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mixer output, residual stream): the caller's next norm adds the two."""
        hidden, residual = self.mixer(hidden, residual, self.norm)
        if self.residual_in_fp32:
            residual = residual.float()  # a copy in the first block only
        return hidden, residual


class Mamba2Model(nn.Module):
    """Embedding, the Mamba2 blocks and the final norm (HF's `backbone`)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Mamba2Block(config) for _ in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (T,) -> hidden states (T, hidden_size) in the model dtype."""
        hidden, residual = self.embeddings(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        # The fused norm reads an fp32 residual stream rounded to the model dtype (HF
        # norms the fp32 sum, then the logits matmul rounds anyway): the engine gets
        # hidden states in the model dtype, as from every model.
        return self.norm_f(hidden, residual)[0]


class Mamba2ForCausalLM(nn.Module):
    """Pure Mamba2 causal LM: no attention, no positional limit, a cache of per-sequence
    states only."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_activation(config.hidden_act)
        self.backbone = Mamba2Model(config)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.backbone.embeddings.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: (T,) -> hidden states (T, hidden_size); a recurrent
        model needs no positions, its states carry the order."""
        return self.backbone(input_ids)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """(n, hidden_size) -> fp32 logits (n, vocab_size), the matmul in the model dtype
        (`fp32=False`: left in it, as `CausalLM.compute_logits`)."""
        logits = self.lm_head(hidden.to(self.lm_head.weight.dtype))
        return logits.float() if fp32 else logits
