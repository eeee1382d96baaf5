"""Qwen3-MoE: Qwen3's network (per-head q/k RMSNorm, a sliding window on every layer when
the config sets one) with mixture-of-experts MLPs: a softmax router picks each token's
`num_experts_per_tok` of `num_experts` experts, no shared experts. Every
`decoder_sparse_step`-th layer routes, except the `mlp_only_layers`, which keep a dense
MLP of `intermediate_size`."""

from __future__ import annotations

from typing import ClassVar

from transformers import PretrainedConfig

from extkv.models.moe import MixtureOfExperts, Router
from extkv.models.qwen3 import Qwen3ForCausalLM


def _is_moe(config: PretrainedConfig, layer: int) -> bool:
    """As in transformers: layer `layer` routes to experts."""
    if not config.num_experts or layer in (config.mlp_only_layers or ()):
        return False
    step = config.decoder_sparse_step
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step must be a positive int, got {step!r}")
    return (layer + 1) % step == 0


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: the Qwen3 network, its routing layers' MLPs mixtures of experts."""

    sliding: ClassVar[bool] = True  # transformers nulls sliding_window unless use_sliding_window

    def make_mlp(self, config: PretrainedConfig, layer: int) -> MixtureOfExperts | None:
        """The experts of a routing layer (weights normalised when `norm_topk_prob`, in the
        model's dtype as transformers casts them); None for a dense one."""
        if not _is_moe(config, layer):
            return None
        gate = Router(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            norm_topk_prob=config.norm_topk_prob,
        )
        return MixtureOfExperts(gate, config.hidden_size, config.moe_intermediate_size)
