"""LLaVA: a CLIP or SigLIP vision tower, a two-layer projector, and a decoder LM.

An image becomes `ImageSpec.num_tokens` embeddings in the text model's hidden size
(the vision tower's feature layer, its class token dropped under the "default" feature
strategy, projected); they take the places of as many image placeholder tokens in the
prompt. Everything else is the text model's: the engine runs it on embeddings where a
prompt has images (`inputs_embeds`) and on token ids otherwise, so decode steps and
their CUDA graphs are those of the text model alone.

Checkpoints name tensors two ways (transformers before 5: `language_model.model.*`,
`vision_tower.vision_model.*`; 5: `model.language_model.*`, `model.vision_tower.*`);
`checkpoint_name` maps both onto this module's names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from extkv.models.llama import CausalLM, LlamaForCausalLM, MistralForCausalLM
from extkv.models.qwen3 import Qwen2ForCausalLM, Qwen3ForCausalLM
from extkv.models.vision import CLIP, VisionTransformer, activation

# The text models a LLaVA checkpoint may carry, by the text config's model_type.
TEXT_MODELS: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}
FEATURE_STRATEGIES = ("default", "full")
# Checkpoint prefixes (either transformers layout) -> this module's.
_RENAMES = [
    (re.compile(r"^(model\.)?vision_tower\.(vision_model\.)?"), "vision_tower."),
    (re.compile(r"^(model\.)?multi_modal_projector\."), "multi_modal_projector."),
    (re.compile(r"^model\.language_model\.|^language_model\.model\."), "language_model.model."),
    (re.compile(r"^(language_model\.)?lm_head\."), "language_model.lm_head."),
]


@dataclass(frozen=True)
class ImageSpec:
    """What the engine needs to know of a model's images: the placeholder token, how many
    embeddings (prompt positions) one image takes, the pixel shape its encoder takes, and
    the embeddings' width."""

    token_id: int
    num_tokens: int
    pixel_shape: tuple[int, int, int]  # (channels, height, width)
    hidden_size: int


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


def _image_token_id(config: PretrainedConfig) -> int:
    token = getattr(config, "image_token_id", None)
    return token if token is not None else config.image_token_index


class LlavaForConditionalGeneration(nn.Module):
    """LLaVA (1.5 and its kin with one image size): the engine calls `encode_images` on a
    prompt's images, puts the rows into `embed_input_ids`'s output at the placeholders,
    and runs `forward` on the result."""

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
        self.image_spec = ImageSpec(
            token_id=_image_token_id(config),
            num_tokens=num_tokens,
            pixel_shape=(vision_config.num_channels, size, size),
            hidden_size=text_config.hidden_size,
        )

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """The parameter a checkpoint tensor fills, whichever transformers layout wrote it."""
        for pattern, prefix in _RENAMES:
            renamed, found = pattern.subn(prefix, name, count=1)
            if found:
                return renamed
        return name

    def ignores_tensor(self, name: str) -> bool:
        """The vision tower's tensors it leaves out (layers past the feature layer, ...)."""
        prefix = "vision_tower."
        return name.startswith(prefix) and self.vision_tower.ignores_tensor(name[len(prefix) :])

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(n, channels, height, width) -> (n, image_spec.num_tokens, text hidden size)."""
        features = self.vision_tower(pixel_values)
        if self.drop_first:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) -> the tokens' input embeddings (T, hidden_size)."""
        return self.language_model.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> hidden states (T, hidden_size); `inputs_embeds` in
        place of the ids' embeddings where the step has images."""
        return self.language_model.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden_size) -> fp32 logits (n, vocab_size)."""
        return self.language_model.compute_logits(hidden)
