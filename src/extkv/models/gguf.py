"""The weights of a .gguf file, dequantized, under their Hugging Face names.

transformers' GGUF reader does the work (names mapped, the Q/K permutation of
llama.cpp undone, quantized blocks dequantized with the `gguf` package). It maps
names through a Hugging Face model's state dict, which it only enumerates: that
model is built on the meta device, so it costs no memory; the tensors then load
into extkv's model through the same name matching as a safetensors checkpoint.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

logger = logging.getLogger(__name__)


def require_gguf() -> None:
    """Fail at once, naming the package, where `gguf` is not installed: transformers needs it
    for a GGUF file's config, tokenizer and weights, and only logs which package is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("loading a .gguf model needs the `gguf` package: pip install gguf")


def gguf_tensors(
    path: str, config: PretrainedConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF file `path` (config: its own) in `dtype`, on the CPU, by its
    Hugging Face name; a tied output weight is absent, as in Hugging Face checkpoints."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        names_only = AutoModelForCausalLM.from_config(config)
    logger.info("Dequantizing %s to %s.", os.path.basename(path), dtype)
    parsed = load_gguf_checkpoint(
        path, return_tensors=True, model_to_load=names_only, torch_dtype=dtype
    )
    return parsed["tensors"]
