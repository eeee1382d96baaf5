"""The weights of a .gguf file, dequantized, under their Hugging Face names.

transformers' GGUF reader does the work (names mapped, the Q/K permutation of
llama.cpp undone, quantized blocks dequantized with the `gguf` package). It maps
names through a Hugging Face model's state dict, which it only enumerates: that
model is built on the meta device, so it costs no memory; the tensors then load
into extkv's model through the same name matching as a safetensors checkpoint.

That reader takes ~13 s for SmolLM2-135M on two CPU cores, most of it parsing the
file's metadata and mapping names, not dequantizing, and the config and the tokenizer
parse the metadata again (~4 s each). So what they give is kept, in a folder of the
cache (`$EXTKV_CACHE/gguf/<name>-<key>`, the key from the .gguf's real path, size
and modification time and the versions of transformers and gguf): the config and the
tokenizer as `save_pretrained` writes them, and the weights as a safetensors file per
dtype. Later loads read those. `EXTKV_GGUF_CACHE=0` turns it off.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from extkv.models.smollm2 import cache_folder

logger = logging.getLogger(__name__)

CACHE_ENV = "EXTKV_GGUF_CACHE"  # 0: dequantize on every load, keep nothing on disk


def require_gguf() -> None:
    """Fail at once, naming the package, where `gguf` is not installed: transformers needs it
    for a GGUF file's config, tokenizer and weights, and only logs which package is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("loading a .gguf model needs the `gguf` package: pip install gguf")


def gguf_config(folder: str, name: str) -> PretrainedConfig:
    """The config of the GGUF file `name` in `folder`: the kept one, else parsed (and kept)."""
    return _kept_or_parsed(AutoConfig, folder, name, "config.json")


def gguf_tokenizer(folder: str, name: str) -> PreTrainedTokenizerBase:
    """The tokenizer of the GGUF file `name` in `folder`: the kept one, else parsed (and kept)."""
    return _kept_or_parsed(AutoTokenizer, folder, name, "tokenizer_config.json")


def _kept_or_parsed(auto: type, folder: str, name: str, marker: str):
    """`auto.from_pretrained` of the GGUF file: from its cache entry where `marker` (the
    file `save_pretrained` writes that a load looks for) is there; else parsed from the
    .gguf, then saved there."""
    entry = cache_entry(os.path.join(folder, name))
    if entry is not None and (entry / marker).is_file():
        kept = auto.from_pretrained(entry)
        kept.name_or_path = folder  # as parsed from the file, not the cache's folder
        return kept
    parsed = auto.from_pretrained(folder, gguf_file=name, local_files_only=True)
    if entry is not None:
        _keep(entry, parsed.save_pretrained, marker)
    return parsed


def gguf_tensors(
    path: str, config: PretrainedConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF file `path` (config: its own) in `dtype`, on the CPU, by its
    Hugging Face name; a tied output weight is absent, as in Hugging Face checkpoints. The
    kept ones where an earlier load left them."""
    entry = cache_entry(path)
    weights = f"weights-{str(dtype).removeprefix('torch.')}.safetensors"
    if entry is not None and (entry / weights).is_file():
        logger.info(
            "Reading %s's weights, dequantized before, from %s.", os.path.basename(path), entry
        )
        return load_file(entry / weights)
    tensors = _dequantized(path, config, dtype)
    if entry is not None:
        contiguous = {name: t.contiguous() for name, t in tensors.items()}
        _keep(entry, lambda folder: save_file(contiguous, Path(folder) / weights), weights)
    return tensors


def cache_entry(path: str) -> Path | None:
    """The cache folder of the GGUF file `path`; None with the cache off."""
    wanted = os.environ.get(CACHE_ENV, "1")
    if wanted not in ("0", "1"):
        raise ValueError(
            f"{CACHE_ENV} must be 0 (parse the .gguf every time) or 1 (keep its config, "
            f"tokenizer and dequantized weights in $EXTKV_CACHE/gguf), got {wanted!r}"
        )
    if wanted == "0":
        return None
    file = os.path.realpath(path)  # a link to the file shares its entry
    stat = os.stat(file)
    versions = transformers.__version__, importlib.metadata.version("gguf")
    key = f"{file}|{stat.st_size}|{stat.st_mtime_ns}|{versions}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_folder() / "gguf" / f"{Path(file).stem}-{digest}"


def _dequantized(
    path: str, config: PretrainedConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        names_only = AutoModelForCausalLM.from_config(config)
    logger.info("Dequantizing %s to %s.", os.path.basename(path), dtype)
    parsed = load_gguf_checkpoint(
        path, return_tensors=True, model_to_load=names_only, torch_dtype=dtype
    )
    return parsed["tensors"]


def _keep(entry: Path, write: Callable[[str], object], last: str) -> None:
    """Put what `write(folder)` writes into `entry`, the file `last` (what a load looks
    for) moved in after the others, so a load never finds it half written; a failure only
    costs the next load time. A new entry replaces the file's older ones (same name,
    another key): one entry per .gguf name, however often the file or the libraries
    change."""
    try:
        if not entry.exists():  # the same file's older entries (changed, or older versions)
            for stale in entry.parent.glob(f"{glob.escape(entry.name.rsplit('-', 1)[0])}-*"):
                if stale.is_dir() and len(stale.name) == len(entry.name):
                    shutil.rmtree(stale, ignore_errors=True)
        entry.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=entry.parent) as scratch:
            write(scratch)
            files = sorted(os.listdir(scratch), key=lambda f: f == last)
            for file in files:
                os.replace(os.path.join(scratch, file), entry / file)
    except OSError as e:
        logger.warning("Could not keep %s in %s: %s", last, entry, e)
        return
    size = sum(f.stat().st_size for f in entry.iterdir()) / 2**30
    logger.info("Kept %s in %s (%.2f GiB in all) for later loads.", last, entry, size)
