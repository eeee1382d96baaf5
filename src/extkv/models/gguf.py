"""The weights of a .gguf file, dequantized, under their Hugging Face names.

transformers' GGUF reader does the work (names mapped, the Q/K permutation of
llama.cpp undone, quantized blocks dequantized with the `gguf` package). It maps
names through a Hugging Face model's state dict, which it only enumerates: that
model is built on the meta device, so it costs no memory; the tensors then load
into extkv's model through the same name matching as a safetensors checkpoint.

That reader takes ~13 s for SmolLM2-135M on two CPU cores, most of it parsing the
file's metadata and mapping names, not dequantizing. So the result is kept: a
safetensors file in the cache folder (`$EXTKV_CACHE/gguf`), keyed by the .gguf file
(path, size, modification time), the dtype and the versions of transformers and
gguf, which later loads read in well under a second. `EXTKV_GGUF_CACHE=0` turns it off.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PretrainedConfig

from extkv.models.smollm2 import cache_folder

logger = logging.getLogger(__name__)

CACHE_ENV = "EXTKV_GGUF_CACHE"  # 0: dequantize on every load, keep nothing on disk


def require_gguf() -> None:
    """Fail at once, naming the package, where `gguf` is not installed: transformers needs it
    for a GGUF file's config, tokenizer and weights, and only logs which package is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("loading a .gguf model needs the `gguf` package: pip install gguf")


def gguf_tensors(
    path: str, config: PretrainedConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF file `path` (config: its own) in `dtype`, on the CPU, by its
    Hugging Face name; a tied output weight is absent, as in Hugging Face checkpoints. Read
    from the cache where an earlier load left them (see the module's docstring)."""
    cached = cached_weights_file(path, dtype)
    if cached is not None and cached.is_file():
        logger.info("Reading %s's weights, dequantized before, from %s.", _name(path), cached)
        return load_file(cached)
    tensors = _dequantized(path, config, dtype)
    if cached is not None:
        _keep(tensors, cached)
    return tensors


def cached_weights_file(path: str, dtype: torch.dtype) -> Path | None:
    """Where the dequantized weights of `path` in `dtype` are kept; None with the cache off."""
    wanted = os.environ.get(CACHE_ENV, "1")
    if wanted not in ("0", "1"):
        raise ValueError(
            f"{CACHE_ENV} must be 0 (dequantize every time) or 1 (keep the dequantized "
            f"weights in $EXTKV_CACHE/gguf), got {wanted!r}"
        )
    if wanted == "0":
        return None
    stat = os.stat(path)
    versions = transformers.__version__, importlib.metadata.version("gguf")
    key = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}|{versions}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_folder() / "gguf" / f"{Path(path).stem}-{digest}.safetensors"


def _dequantized(
    path: str, config: PretrainedConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        names_only = AutoModelForCausalLM.from_config(config)
    logger.info("Dequantizing %s to %s.", _name(path), dtype)
    parsed = load_gguf_checkpoint(
        path, return_tensors=True, model_to_load=names_only, torch_dtype=dtype
    )
    return parsed["tensors"]


def _keep(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """Write `tensors` to `file` whole or not at all (a temporary file renamed into place,
    so a load never reads a half-written one); a failure only costs the next load time."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=file.parent, suffix=".tmp", delete=False) as tmp:
            temporary = Path(tmp.name)
        try:
            save_file({name: t.contiguous() for name, t in tensors.items()}, temporary)
            os.replace(temporary, file)
        finally:
            temporary.unlink(missing_ok=True)
    except OSError as e:
        logger.warning("Could not keep the dequantized weights in %s: %s", file, e)
        return
    size = file.stat().st_size / 2**30
    logger.info("Kept the dequantized weights in %s (%.2f GiB) for later loads.", file, size)


def _name(path: str) -> str:
    return os.path.basename(path)
