"""Where a model comes from, and what the engine and the model code read from its Hugging
Face config, in one place.

A model is a checkpoint folder, a .gguf file or a hub id; `resolve_model` settles which
once, for the loader, the facts and the tokenizer alike. Hugging Face configs spell the
same fact several ways across versions and families (`rope_theta` on the config or in
`rope_parameters`, `rope_scaling` in older files, `head_dim` absent or null); these
helpers settle it once.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Literal

from transformers import AutoConfig, PretrainedConfig

from extkv.models.gguf import require_gguf

logger = logging.getLogger(__name__)

_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")
_TRUE = {"1", "on", "yes", "true"}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: its folder and, for a GGUF model, the file's name in it (config,
    tokenizer and weights all come from that one file then)."""

    kind: Literal["folder", "gguf", "hub"]
    path: str  # the checkpoint folder, the one holding the .gguf, or the hub snapshot
    gguf_file: str | None = None

    def config(self) -> PretrainedConfig:
        """The model's Hugging Face config, read from the folder or the GGUF file."""
        if self.gguf_file is not None:
            from extkv.models.gguf import gguf_config

            return gguf_config(self.path, self.gguf_file)
        return AutoConfig.from_pretrained(self.path, local_files_only=True)


def _snapshot(repo_id: str) -> str:
    """The hub snapshot of `repo_id`: the local cache first, a download only when allowed."""
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except Exception as e:  # not cached (LocalEntryNotFoundError) or a malformed id
        cached = e
    tried = f"not in the local Hugging Face cache {constants.HF_HUB_CACHE} ({cached})"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE:
        raise FileNotFoundError(
            f"model {repo_id!r}: no such folder or .gguf file, and {tried}; "
            "HF_HUB_OFFLINE is set, so no download was tried"
        ) from None
    logger.info("Downloading %s from the Hugging Face hub.", repo_id)
    try:
        return snapshot_download(repo_id)
    except Exception as e:
        raise FileNotFoundError(
            f"model {repo_id!r}: no such folder or .gguf file, {tried}, "
            f"and the download failed ({e})"
        ) from None


def resolve_model(model: str | os.PathLike) -> ModelSource:
    """What `model` names: a checkpoint folder holding config.json, a .gguf file, or a
    Hugging Face hub id (org/name), looked up in the local cache before any download."""
    path = os.fspath(model)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(
                f"model must be a checkpoint folder holding config.json; {path!r} has none"
            )
        return ModelSource("folder", path)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model must be a checkpoint folder or a .gguf file; got {path!r}")
        require_gguf()
        folder, name = os.path.split(os.path.abspath(path))
        return ModelSource("gguf", folder, name)
    if path.endswith(".gguf") or not _REPO_ID.fullmatch(path):
        raise FileNotFoundError(
            "model must be a checkpoint folder, a .gguf file or a Hugging Face hub id "
            f"(org/name); got {path!r}, none of them (no folder holding config.json)"
        )
    snapshot = _snapshot(path)
    if not os.path.isfile(os.path.join(snapshot, "config.json")):
        raise FileNotFoundError(f"model {path!r}: its hub snapshot {snapshot} has no config.json")
    return ModelSource("hub", snapshot)


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


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict[str, Any]:
    """RoPE settings as one dict with `rope_type` and `rope_theta` always present.

    transformers 5 keeps them in `rope_parameters` (per layer type in models with local
    and global layers: `layer_type`'s); older configs use `rope_theta` plus an optional
    `rope_scaling` whose type key may be `type`.
    """
    params = dict(
        getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    )
    if layer_type is not None and layer_type in params:
        params = dict(params[layer_type])
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
    config: PretrainedConfig, model: str | os.PathLike | None = None
) -> tuple[int, ...]:
    """EOS ids of config.json together with generation_config.json's (a GGUF file has
    only its own).

    Chat checkpoints (Qwen3, Llama 3) list the end-of-turn token only in the
    generation config, which is what `generate` stops on.
    """
    ids = _as_ids(getattr(config, "eos_token_id", None))
    source = resolve_model(model) if model is not None else None
    generation_config = (
        os.path.join(source.path, "generation_config.json")
        if source is not None and source.gguf_file is None
        else None
    )
    if generation_config and os.path.isfile(generation_config):
        with open(generation_config) as f:
            ids += _as_ids(json.load(f).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def model_facts(config: PretrainedConfig, model: str | os.PathLike | None = None) -> ModelFacts:
    """The facts of `config` (a vision-language model's: of its text model); `model` (what
    `resolve_model` takes) adds generation-config EOS ids."""
    text = config.get_text_config()
    ids = eos_token_ids(config, model)
    if text is not config:  # a text config's EOS after the checkpoint's own
        ids = tuple(dict.fromkeys((*ids, *_as_ids(getattr(text, "eos_token_id", None)))))
    return ModelFacts(
        max_position_embeddings=getattr(text, "max_position_embeddings", None),
        vocab_size=text.vocab_size,
        eos_token_ids=ids,
    )
