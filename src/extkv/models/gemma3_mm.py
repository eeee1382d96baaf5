"""Gemma 3 with images: a SigLIP vision tower, Gemma 3's projector, the Gemma 3 text model.

The tower's output (its last layer, through its final norm) is a grid of patches; the
projector averages it down to `mm_tokens_per_image` cells, norms them the Gemma way
(x * (1 + w)) and projects them into the text model's hidden size. A prompt holds one
`<start_of_image>` per image, which the processor expands to the image's tokens between
`<start_of_image>` and `<end_of_image>` (newlines around them).

In the prefill an image's tokens attend to each other both ways (`ImageSpec.bidirectional`:
the attention sees up to the image's last token from each of them; the local layers'
window still counts back from each token's own position); everything else is causal,
decode included.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from extkv.models.gemma3 import Gemma3ForCausalLM
from extkv.models.layers import GemmaRMSNorm
from extkv.models.vision import SIGLIP, VisionTransformer
from extkv.models.vision_language import ImageSpec, VisionLanguageModel, config_token_id


class Gemma3MultiModalProjector(nn.Module):
    """Patch grid -> `mm_tokens_per_image` text embeddings: average pool, Gemma RMSNorm,
    one matmul by `mm_input_projection_weight` (vision hidden x text hidden)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        vision = config.vision_config
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = math.isqrt(config.mm_tokens_per_image)
        if (
            tokens_per_side**2 != config.mm_tokens_per_image
            or self.patches_per_side % tokens_per_side
        ):
            raise ValueError(
                f"mm_tokens_per_image {config.mm_tokens_per_image} must be a square whose side "
                f"divides the {self.patches_per_side} patches per side of an image"
            )
        self.pool = self.patches_per_side // tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, config.text_config.hidden_size)
        )
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(n, patches, vision hidden) -> (n, mm_tokens_per_image, text hidden)."""
        n, _, hidden = features.shape
        side = self.patches_per_side
        grid = features.transpose(1, 2).reshape(n, hidden, side, side)
        pooled = F.avg_pool2d(grid, self.pool).flatten(2).transpose(1, 2)
        # One row per cell, its channels contiguous (the CUDA norm reads rows): for one
        # image the reshape alone would be a strided view.
        rows = pooled.reshape(-1, hidden).contiguous()
        normed = self.mm_soft_emb_norm(rows)[0].view(n, -1, hidden)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(features)


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    """Gemma 3 (4B, 12B, 27B) with its vision tower."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        vision_config, text_config = config.vision_config, config.text_config
        if vision_config.model_type != SIGLIP:
            raise ValueError(
                f"Gemma 3's vision tower {vision_config.model_type!r} is not supported; only "
                f"{SIGLIP!r}"
            )
        self.vision_tower = VisionTransformer(vision_config, [-1], post_layernorm=True)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.language_model = Gemma3ForCausalLM(text_config)
        size = vision_config.image_size
        self.image_spec = ImageSpec(
            token_id=config_token_id(config, "image_token_id"),
            num_tokens=config.mm_tokens_per_image,
            pixel_shape=(vision_config.num_channels, size, size),
            hidden_size=text_config.hidden_size,
            placeholder_id=config_token_id(config, "boi_token_id"),
            bidirectional=True,
        )

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(n, channels, height, width) -> (n, mm_tokens_per_image, text hidden size)."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))
