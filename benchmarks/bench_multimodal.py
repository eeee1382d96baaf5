"""Vision-language models on the engine: start-up with the encoder cache, images/s, tokens/s.

    python benchmarks/bench_multimodal.py [--model llava gemma3] [--images 64]
        [--output-len 128] [--json OUT]
    python benchmarks/bench_multimodal.py --smoke   # tiny models on the CPU: proves it runs

Random bf16 weights, each checkpoint built once: LLaVA-1.5-7B's shape (CLIP ViT-L/14 at
336 pixels, 576 image tokens, a Llama-2-7B) and Gemma 3 4B's (SigLIP at 896 pixels pooled
to 256 image tokens whose prefill attention is bidirectional, 34 text layers of local and
global attention). For each, three runs over `--images` prompts of one image and a short
question each, greedy: prefill only (one output token: images/s and prompt tokens/s,
every image new, so every one is encoded), the last of them again, as many as the
encoder cache holds (every image a hit), and a full generation (output tokens/s).
Each model's memory report comes first.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from _common import engine_options, timed, write_json
from extkv import LLM, SamplingParams

QUESTION = "What is shown in this picture?"


def llava_checkpoint(smoke: bool) -> Path:
    from extkv.demo import LLAVA_1_5_7B_SHAPE, make_random_llava

    path = Path("/tmp/extkv-bench/" + ("tiny-llava" if smoke else "llava-1.5-7b"))
    if not (path / "config.json").exists():
        if smoke:
            make_random_llava(path)
        else:
            make_random_llava(
                path,
                dtype=torch.bfloat16,
                vision_overrides=LLAVA_1_5_7B_SHAPE["vision"],
                text_overrides=LLAVA_1_5_7B_SHAPE["text"],
                device="cuda",
            )
    return path


def gemma3_checkpoint(smoke: bool) -> Path:
    from extkv.demo import GEMMA3_4B_SHAPE, make_random_gemma3

    path = Path("/tmp/extkv-bench/" + ("tiny-gemma3" if smoke else "gemma3-4b"))
    if not (path / "config.json").exists():
        if smoke:
            make_random_gemma3(path)
        else:
            make_random_gemma3(
                path,
                mm_tokens_per_image=GEMMA3_4B_SHAPE["mm_tokens_per_image"],
                dtype=torch.bfloat16,
                vision_overrides=GEMMA3_4B_SHAPE["vision"],
                text_overrides=GEMMA3_4B_SHAPE["text"],
                device="cuda",
            )
    return path


# name -> (checkpoint builder, prompt with its one image placeholder)
MODELS: dict[str, tuple[Callable[[bool], Path], str]] = {
    "llava": (llava_checkpoint, f"USER: <image>\n{QUESTION} ASSISTANT:"),
    "gemma3": (
        gemma3_checkpoint,
        f"<start_of_turn>user\n<start_of_image>{QUESTION}<end_of_turn>\n<start_of_turn>model\n",
    ),
}


def images(count: int, seed: int) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)) for _ in range(count)
    ]


def run(llm: LLM, prompt: str, pictures: list, max_tokens: int) -> tuple[float, list]:
    prompts = [{"prompt": prompt, "multi_modal_data": {"image": p}} for p in pictures]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return timed(lambda: llm.generate(prompts, params, use_tqdm=False))


def bench(name: str, smoke: bool, count: int, output_len: int) -> dict[str, object]:
    """One model's memory report and figures (its engine closed afterwards)."""
    checkpoint, prompt = MODELS[name]
    llm = LLM(
        str(checkpoint(smoke)),
        enable_extensible_kv_cache=True,
        max_model_len=1024,
        max_num_seqs=count,
        **engine_options(smoke),
    )
    report = llm.memory_report()
    print(json.dumps(report, indent=1))
    run(llm, prompt, images(2, seed=99), 2)  # warm-up, images not used below
    pictures = images(count, seed=0)
    t_prefill, outputs = run(llm, prompt, pictures, 1)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    # Again the last images the encoder cache still holds (it keeps the most recent:
    # all of them again, in order, would evict each just before its turn).
    fits = report["encoder_cache_tokens"] // llm.engine.runner.image_spec.num_tokens
    repeated = pictures[-min(fits, count) :]
    t_cached, _ = run(llm, prompt, repeated, 1)
    fresh = images(count, seed=1)
    t_full, _ = run(llm, prompt, fresh, output_len)
    stats = llm.engine.stats()
    figures = {
        "images": count,
        "prefill_images_s": count / t_prefill,
        "prefill_prompt_tok_s": prompt_tokens / t_prefill,
        "cached_images": len(repeated),
        "cached_images_s": len(repeated) / t_cached,
        "generate_output_tok_s": count * output_len / t_full,
        "encoder_cache_hits": stats.encoder_cache_hits,
        "encoder_cache_misses": stats.encoder_cache_misses,
        "encoder_cache_bytes": report["encoder_cache_bytes"],
        "encoder_activation_peak_bytes": report["encoder_activation_peak_bytes"],
        "kv_cache_bytes": report["kv_cache_bytes"],
    }
    print(f"== {name}")
    for key, value in figures.items():
        print(f"{key:32s} {value:,.1f}")
    llm.close()
    return {"report": report, "figures": figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", nargs="+", choices=sorted(MODELS), default=list(MODELS), help="which models"
    )
    parser.add_argument("--images", type=int, default=64, help="prompts, one image each")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    count = 4 if args.smoke else args.images
    output_len = 4 if args.smoke else args.output_len
    results = {name: bench(name, args.smoke, count, output_len) for name in args.model}
    write_json(args.json, results)


if __name__ == "__main__":
    main()
