"""The vision transformers of vision-language models: CLIP's and SigLIP's image encoders.

An image is cut into patches, each patch embedded, a position added (CLIP also prepends
a class token and norms the sequence first), then pre-norm transformer layers with
bidirectional attention over the image's tokens. A vision-language model reads the
hidden states of some layer (LLaVA: the second to last; Gemma 3: the last, after the
tower's final norm), so only the layers up to the deepest one read are built; the
checkpoint's later layers are skipped when loading. Module names mirror the Hugging Face
checkpoints'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

CLIP, SIGLIP = "clip_vision_model", "siglip_vision_model"


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"quick_gelu": _quick_gelu, "gelu": F.gelu, "gelu_pytorch_tanh": _gelu_tanh}


def activation(name: str, what: str):  # -> Callable[[Tensor], Tensor]
    """The activation `name` (as Hugging Face configs spell it); `what` names the field."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{what} {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class VisionEmbeddings(nn.Module):
    """Patch embedding plus learned positions; CLIP's also has the class token first."""

    def __init__(self, config: PretrainedConfig, class_token: bool) -> None:
        super().__init__()
        dim, patch = config.hidden_size, config.patch_size
        self.class_embedding = nn.Parameter(torch.zeros(dim)) if class_token else None
        self.patch_embedding = nn.Conv2d(
            config.num_channels, dim, patch, stride=patch, bias=not class_token
        )
        num_positions = (config.image_size // patch) ** 2 + class_token
        self.position_embedding = nn.Embedding(num_positions, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(n, channels, size, size) -> (n, tokens, hidden)."""
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            first = self.class_embedding.expand(patches.shape[0], 1, -1)
            patches = torch.cat([first, patches], dim=1)
        return patches + self.position_embedding.weight


class VisionAttention(nn.Module):
    """Multi-head self-attention over one image's tokens, every token seeing every other."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        if dim % self.num_heads:
            raise ValueError(
                f"vision hidden_size {dim} is not a multiple of num_attention_heads "
                f"{self.num_heads}"
            )
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(n, tokens, hidden) -> (n, tokens, hidden)."""
        n, tokens, dim = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, tokens, self.num_heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(n, tokens, dim))


class VisionMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.act = activation(config.hidden_act, "vision hidden_act")
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP, each added to the residual stream."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config: PretrainedConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(num_layers))


def hidden_state_index(layer: int, num_layers: int) -> int:
    """Hugging Face's `hidden_states[layer]` as a count of layers run (0: the embeddings,
    -1: after the last layer); a ValueError for one the tower does not have."""
    index = layer if layer >= 0 else num_layers + 1 + layer
    if not 0 <= index <= num_layers:
        raise ValueError(
            f"vision_feature_layer {layer} is outside the vision tower's hidden states "
            f"({-num_layers - 1} to {num_layers})"
        )
    return index


class VisionTransformer(nn.Module):
    """CLIP's or SigLIP's vision tower, built up to the deepest hidden state read.

    `feature_layers` are Hugging Face's `hidden_states` indices (negative from the end);
    `forward` returns those hidden states concatenated along the features. With
    `post_layernorm` it returns the tower's output instead: the last layer's states
    through its final norm (SigLIP's `last_hidden_state`)."""

    def __init__(
        self, config: PretrainedConfig, feature_layers: list[int], post_layernorm: bool = False
    ) -> None:
        super().__init__()
        if config.model_type not in (CLIP, SIGLIP):
            raise ValueError(
                f"vision tower {config.model_type!r} is not supported; supported: {CLIP!r}, "
                f"{SIGLIP!r}"
            )
        layers = config.num_hidden_layers
        self.feature_indices = [hidden_state_index(i, layers) for i in feature_layers]
        clip = config.model_type == CLIP
        self.embeddings = VisionEmbeddings(config, class_token=clip)
        self.pre_layrnorm = (
            nn.LayerNorm(config.hidden_size, config.layer_norm_eps) if clip else None
        )
        self.encoder = VisionEncoder(config, max(self.feature_indices))
        self.post_layernorm = None
        if post_layernorm:
            if self.feature_indices != [layers]:
                raise ValueError(
                    f"the vision tower's final norm follows its last layer; the feature layers "
                    f"{feature_layers} read others"
                )
            self.post_layernorm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps)

    def ignores_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (relative to this tower) is one of what the
        tower leaves out: later layers, the final norm unless read, SigLIP's pooling head."""
        if name.startswith("head.") or (
            name.startswith("post_layernorm.") and self.post_layernorm is None
        ):
            return True
        prefix = "encoder.layers."
        if name.startswith(prefix):
            return int(name[len(prefix) :].split(".", 1)[0]) >= len(self.encoder.layers)
        return False

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(n, channels, size, size) -> (n, tokens, hidden * number of feature layers)."""
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        kept = {0: x} if 0 in self.feature_indices else {}  # only the states read
        for index, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            if index in self.feature_indices:
                kept[index] = x
        features = torch.cat([kept[i] for i in self.feature_indices], dim=-1)
        if self.post_layernorm is not None:
            features = self.post_layernorm(features)
        return features
