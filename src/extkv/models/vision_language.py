"""What the vision-language models (LLaVA, Gemma 3) share.

Each is a vision tower and projector (`encode_images`) in front of a text model: an
image becomes `ImageSpec.num_tokens` embeddings in the text model's hidden size, which
take the places of as many image tokens in the prompt. Everything else is the text
model's: the engine runs it on embeddings where a prompt has images (`inputs_embeds`)
and on token ids otherwise, so decode steps and their CUDA graphs are those of the text
model alone.

Checkpoints name tensors two ways (transformers before 5: `language_model.model.*`,
`vision_tower.vision_model.*`; 5: `model.language_model.*`, `model.vision_tower.*`);
`checkpoint_name` maps both onto this module's names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from extkv.models.llama import CausalLM
from extkv.models.vision import VisionTransformer

# Checkpoint prefixes (either transformers layout) -> this module's.
_RENAMES = [
    (re.compile(r"^(model\.)?vision_tower\.(vision_model\.)?"), "vision_tower."),
    (re.compile(r"^(model\.)?multi_modal_projector\."), "multi_modal_projector."),
    (re.compile(r"^model\.language_model\.|^language_model\.model\."), "language_model.model."),
    (re.compile(r"^(language_model\.)?lm_head\."), "language_model.lm_head."),
]


@dataclass(frozen=True)
class ImageSpec:
    """What the engine needs to know of a model's images: the token whose positions take
    an image's embeddings and how many (`num_tokens`), the token a prompt holds per image
    (`placeholder_id`: the image token itself for LLaVA, `<start_of_image>` for Gemma 3,
    whose processor expands it to more than the image's tokens), the pixel shape the
    encoder takes, the embeddings' width, and whether an image's tokens attend to each
    other both ways in the prefill (Gemma 3), which then must compute an image in one
    step."""

    token_id: int
    num_tokens: int
    pixel_shape: tuple[int, int, int]  # (channels, height, width)
    hidden_size: int
    placeholder_id: int
    bidirectional: bool = False


class VisionLanguageModel(nn.Module):
    """The part every vision-language model has alike: the engine calls `encode_images`
    on a prompt's images, puts the rows into `embed_input_ids`'s output at the image
    tokens, and runs `forward` on the result. Subclasses build `vision_tower`,
    `multi_modal_projector`, `language_model` (a CausalLM) and `image_spec`, and define
    `encode_images`: (n, channels, height, width) pixels -> (n, image_spec.num_tokens,
    text hidden size) embeddings."""

    image_spec: ImageSpec
    vision_tower: VisionTransformer
    language_model: CausalLM

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

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """(n, hidden_size) -> fp32 logits (n, vocab_size) (`fp32`: as the language model's)."""
        return self.language_model.compute_logits(hidden, fp32)


def config_token_id(config: object, name: str) -> int:
    """The config's token id `name` (e.g. "image_token_id"), spelled either way
    transformers has saved it (`..._id`, or the older `..._index`)."""
    token = getattr(config, name, None)
    return token if token is not None else getattr(config, name.replace("_id", "_index"))
