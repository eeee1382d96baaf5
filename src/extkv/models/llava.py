"""LLaVA: a CLIP or SigLIP vision tower, a two-layer projector, and a decoder LM.

An image becomes `ImageSpec.num_tokens` embeddings (the vision tower's feature layer,
its class token dropped under the "default" feature strategy, projected); a prompt holds
that many image tokens for it, one placeholder expanded by the engine. What it shares
with the other vision-language models is extkv.models.vision_language's.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from extkv.models.llama import CausalLM, LlamaForCausalLM, MistralForCausalLM
from extkv.models.qwen3 import Qwen2ForCausalLM, Qwen3ForCausalLM
from extkv.models.vision import CLIP, VisionTransformer, activation
from extkv.models.vision_language import ImageSpec, VisionLanguageModel, config_token_id

# The text models a LLaVA checkpoint may carry, by the text config's model_type.
TEXT_MODELS: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}
FEATURE_STRATEGIES = ("default", "full")


class LlavaMultiModalProjector(nn.Module):
    """Vision features -> text embeddings: linear, activation, linear."""

    def __init__(self, config: PretrainedConfig, num_feature_layers: int) -> None:
        super().__init__()
        vision, text = config.vision_config.hidden_size, config.text_config.hidden_size
        bias = getattr(config, "multimodal_projector_bias", True)
        self.linear_1 = nn.Linear(vision * num_feature_layers, text, bias=bias)
        self.act = activation(config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = nn.Linear(text, text, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    """LLaVA (1.5 and its kin with one image size)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        text_config, vision_config = config.text_config, config.vision_config
        if text_config.model_type not in TEXT_MODELS:
            raise ValueError(
                f"LLaVA text model {text_config.model_type!r} is not supported; supported: "
                f"{sorted(TEXT_MODELS)}"
            )
        strategy = config.vision_feature_select_strategy
        if strategy not in FEATURE_STRATEGIES:
            raise ValueError(
                f"vision_feature_select_strategy {strategy!r} is not supported; supported: "
                f"{FEATURE_STRATEGIES}"
            )
        layers = config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        self.vision_tower = VisionTransformer(vision_config, layers)
        self.multi_modal_projector = LlavaMultiModalProjector(config, len(layers))
        self.language_model = TEXT_MODELS[text_config.model_type](text_config)
        # "default" drops CLIP's class token; SigLIP has none to drop.
        self.drop_first = strategy == "default" and vision_config.model_type == CLIP
        size, patch = vision_config.image_size, vision_config.patch_size
        num_tokens = (size // patch) ** 2 + (vision_config.model_type == CLIP) - self.drop_first
        token = config_token_id(config, "image_token_id")
        self.image_spec = ImageSpec(
            token_id=token,
            num_tokens=num_tokens,
            pixel_shape=(vision_config.num_channels, size, size),
            hidden_size=text_config.hidden_size,
            placeholder_id=token,
        )

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(n, channels, height, width) -> (n, image_spec.num_tokens, text hidden size)."""
        features = self.vision_tower(pixel_values)
        if self.drop_first:
            features = features[:, 1:]
        return self.multi_modal_projector(features)
