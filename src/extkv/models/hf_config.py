"""What the engine and the model code read from a Hugging Face config, in one place.

Hugging Face configs spell the same fact several ways across versions and
families (`rope_theta` on the config or in `rope_parameters`, `rope_scaling`
in older files, `head_dim` absent or null); these helpers settle it once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig


@dataclass(frozen=True)
class ModelFacts:
    """What the engine needs to know of a model beyond its layers."""

    max_position_embeddings: int | None  # None: no positional limit (pure Mamba)
    vocab_size: int
    eos_token_ids: tuple[int, ...]


def head_dim(config: PretrainedConfig) -> int:
    """Explicit `head_dim` (Qwen3 sets one unequal to hidden/heads), else hidden/heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads(config: PretrainedConfig) -> int:
    """Explicit `num_key_value_heads` (grouped-query attention), else one per query head."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def rope_parameters(config: PretrainedConfig) -> dict[str, Any]:
    """RoPE settings as one dict with `rope_type` and `rope_theta` always present.

    transformers 5 keeps them in `rope_parameters`; older configs use
    `rope_theta` plus an optional `rope_scaling` whose type key may be `type`.
    """
    params = dict(
        getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    )
    params.setdefault("rope_type", params.pop("type", "default"))
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None)
    if theta is None:
        raise ValueError(f"{type(config).__name__} has no rope_theta")
    params["rope_theta"] = float(theta)
    return params


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def eos_token_ids(
    config: PretrainedConfig, path: str | os.PathLike | None = None
) -> tuple[int, ...]:
    """EOS ids of config.json together with generation_config.json's.

    Chat checkpoints (Qwen3, Llama 3) list the end-of-turn token only in the
    generation config, which is what `generate` stops on.
    """
    ids = _as_ids(getattr(config, "eos_token_id", None))
    generation_config = os.path.join(path, "generation_config.json") if path else None
    if generation_config and os.path.isfile(generation_config):
        with open(generation_config) as f:
            ids += _as_ids(json.load(f).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def model_facts(config: PretrainedConfig, path: str | os.PathLike | None = None) -> ModelFacts:
    """The facts of `config`; `path` (the checkpoint folder) adds generation-config EOS ids."""
    return ModelFacts(
        max_position_embeddings=getattr(config, "max_position_embeddings", None),
        vocab_size=config.vocab_size,
        eos_token_ids=eos_token_ids(config, path),
    )
