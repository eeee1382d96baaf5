"""A tiny random checkpoint extkv builds itself: the demo's model, and the tests'.

The model is a real Hugging Face checkpoint folder (config.json, safetensors,
tokenizer files) written by `transformers`, so it loads through exactly the
same code as a downloaded one; only its weights are random.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CORPUS = """\
The extensible KV cache reserves address space first and commits memory later.
CUDA graphs bake in every address they touch, so the cache must never move.
A paged cache hands out blocks of tokens to sequences as they grow.
Continuous batching lets new requests join while others are still decoding.
The quick brown fox jumps over the lazy dog. Once upon a time there was a model.
Numbers like 1, 2, 3, 42 and 2026 appear in text, as do questions? And answers!
"""
# Tiny multi-head latent attention with dense MLPs only (first_k_dense_replace past any
# tiny layer count): 48 values a token and layer in the KV cache (latent 32 + rope 16).
_MLA_TINY: dict[str, object] = dict(
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    first_k_dense_replace=64,
)
# architecture -> (transformers config class, model class, tiny defaults of its own)
_ARCHITECTURES: dict[str, tuple[str, str, dict[str, object]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=12,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            num_hidden_layers=3,
        ),
    ),
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(
            attn_layer_indices=[1],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_chunk_size=16,
        ),
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        {**_MLA_TINY, "q_lora_rank": None},
    ),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {**_MLA_TINY, "q_lora_rank": 24}),
    "mamba2": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        dict(num_heads=8, head_dim=16, state_size=16, n_groups=2, conv_kernel=4, chunk_size=16),
    ),
}
# A hybrid of roughly Bamba's layer mix at GPU-benchmark size (random weights).
BAMBA_BENCH_SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=16,
    attn_layer_indices=[3, 8, 13],
    num_attention_heads=16,
    num_key_value_heads=8,
    mamba_n_heads=32,
    mamba_d_head=64,
    mamba_d_state=128,
    mamba_n_groups=1,
    mamba_chunk_size=256,
    max_position_embeddings=4096,
    initializer_range=0.02,
)
# The shape of Qwen3-0.6B, for GPU tests and benchmarks (random weights, no download).
QWEN3_0_6B_SHAPE = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    initializer_range=0.02,
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The tiny text model every architecture starts from (its own `_ARCHITECTURES` defaults
# and the caller's overrides on top); LLaVA's language model too.
_TINY_TEXT: dict[str, object] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    eos_token_id=0,
    bos_token_id=0,
    pad_token_id=0,
    # Larger than the usual 0.02, so greedy decoding wanders over the vocabulary
    # instead of repeating one token: tests then notice a wrong step.
    initializer_range=0.3,
)


def train_tokenizer(
    vocab_size: int = 384, extra_texts: tuple[str, ...] = (), **named_tokens: str
):  # -> PreTrainedTokenizerFast
    """A byte-level BPE tokenizer trained on a few sentences (and `extra_texts`, newlines
    kept): small, real, offline. `named_tokens` (e.g. boi_token="<start_of_image>") are
    special tokens the tokenizer also has by name, as a model's processor looks them up."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 4 + list(extra_texts), trainer=trainer)
    tokenizer.add_special_tokens(list(named_tokens.values()))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=named_tokens or None,
    )


def make_random_checkpoint(
    folder: str | os.PathLike,
    architecture: str = "qwen3",
    *,
    tie_word_embeddings: bool = True,
    with_tokenizer: bool = True,
    vocab_size: int = 384,
    num_hidden_layers: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    **config_overrides: object,
) -> Path:
    """Write a random checkpoint of one of `_ARCHITECTURES`: tiny by default (2 layers, or
    the architecture's own default), any shape through `config_overrides` (e.g.
    QWEN3_0_6B_SHAPE); `device` "cuda" builds a large one fast."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    common = {**_TINY_TEXT, "vocab_size": vocab_size, "tie_word_embeddings": tie_word_embeddings}
    if architecture not in _ARCHITECTURES:
        raise ValueError(
            f"architecture must be one of {sorted(_ARCHITECTURES)}; got {architecture!r}"
        )
    config_name, model_name, defaults = _ARCHITECTURES[architecture]
    shape = {**common, **defaults, **config_overrides}
    if num_hidden_layers is not None:  # also over an architecture's own default
        shape["num_hidden_layers"] = num_hidden_layers
    config = getattr(transformers, config_name)(**shape)
    model_class = getattr(transformers, model_name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(config).to(dtype).eval()
    model.save_pretrained(folder)
    if with_tokenizer:
        train_tokenizer(vocab_size).save_pretrained(folder)
    return folder


IMAGE_TOKEN = "<image>"
# A vision-language chat template in the llava-hf style: images first, then the text of a
# message whose content is a list of parts.
LLAVA_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{% for part in m['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ part['text'] }}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
# Tiny vision towers: 28 x 28 images in 7 x 7 patches, 16 image tokens; LLaVA's feature
# layer reads the first of two layers (its -2).
_TINY_VISION: dict[str, object] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=28,
    patch_size=7,
)
_VISION_TOWERS: dict[str, tuple[str, str, dict[str, object]]] = {
    "clip": ("CLIPVisionConfig", "default", {"projection_dim": 32}),
    "siglip": ("SiglipVisionConfig", "full", {}),
}
# The shape of LLaVA-1.5-7B (CLIP ViT-L/14 at 336 pixels, 576 image tokens, Llama-2-7B),
# for GPU benchmarks (random weights, no download).
LLAVA_1_5_7B_SHAPE = dict(
    vision=dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=336,
        patch_size=14,
    ),
    text=dict(
        vocab_size=32064,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        initializer_range=0.02,
    ),
)


def make_random_llava(
    folder: str | os.PathLike,
    text_architecture: str = "llama",
    vision: str = "clip",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    vision_overrides: dict[str, object] | None = None,
    text_overrides: dict[str, object] | None = None,
    device: str = "cpu",
) -> Path:
    """Write a random LLaVA checkpoint (a `vision` tower, the projector, a text model of
    `_ARCHITECTURES`) and its processor: the image processor and a tokenizer that has
    IMAGE_TOKEN, with LLAVA_CHAT_TEMPLATE. Tiny by default (LLAVA_1_5_7B_SHAPE's parts
    through the overrides make it large; `device` "cuda" then builds it fast)."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    vision_name, strategy, vision_defaults = _VISION_TOWERS[vision]
    vision_config = getattr(transformers, vision_name)(
        **{**_TINY_VISION, **vision_defaults, **(vision_overrides or {})}
    )
    config_name, _, text_defaults = _ARCHITECTURES[text_architecture]
    text = {**_TINY_TEXT, "vocab_size": len(tokenizer), **text_defaults, **(text_overrides or {})}
    text_config = getattr(transformers, config_name)(**text)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    config = transformers.LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_id=image_token_id,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=-2,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlavaForConditionalGeneration(config).to(dtype).eval()
    model.save_pretrained(folder)
    size = vision_config.image_size
    if vision == "clip":
        images = transformers.CLIPImageProcessor(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        )
    else:
        images = transformers.SiglipImageProcessor(size={"height": size, "width": size})
    processor = transformers.LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=vision_config.patch_size,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=1 if vision == "clip" else 0,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(folder)
    return folder


# Gemma 3's tokens around an image, and its chat template (turn markers; a message's
# content either a string or a list of parts, an image part written `<start_of_image>`).
GEMMA3_IMAGE_TOKENS = dict(
    boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>"
)
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
# Newline runs in the tiny tokenizer's corpus, so that it has "\n\n"-style tokens as
# Gemma's has: an image's newlines then merge with a prompt's, as in Gemma's processor.
_NEWLINES = "one\ntwo\n\nthree\n\n\nfour\n\n\n\nfive"
# The shape of Gemma 3 4B (SigLIP at 896 pixels in 14-pixel patches, pooled to 256 image
# tokens; 34 text layers, five local (window 1024) to one global), for GPU benchmarks
# (random weights, no download).
GEMMA3_4B_SHAPE = dict(
    vision=dict(
        hidden_size=1152,
        intermediate_size=4304,
        num_hidden_layers=27,
        num_attention_heads=16,
        image_size=896,
        patch_size=14,
    ),
    text=dict(
        vocab_size=262208,
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=34,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=1024,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        max_position_embeddings=131072,
        initializer_range=0.02,
    ),
    mm_tokens_per_image=256,
)


def make_random_gemma3(
    folder: str | os.PathLike,
    *,
    mm_tokens_per_image: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    vision_overrides: dict[str, object] | None = None,
    text_overrides: dict[str, object] | None = None,
    device: str = "cpu",
) -> Path:
    """Write a random Gemma3ForConditionalGeneration checkpoint (a SigLIP tower, Gemma 3's
    projector, a Gemma 3 text model of local and global layers) and its processor: the
    Gemma 3 image processor and a tokenizer with Gemma's image and turn tokens and
    GEMMA3_CHAT_TEMPLATE. Tiny by default (28-pixel images in 7-pixel patches pooled to
    `mm_tokens_per_image` tokens; a window of 12); GEMMA3_4B_SHAPE's parts through the
    overrides make it large (a text model's `layer_types` pattern is repeated over its
    layers; `device` "cuda" then builds it fast)."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(
        extra_texts=(_NEWLINES,) * 50,
        start_of_turn="<start_of_turn>",
        end_of_turn="<end_of_turn>",
        **GEMMA3_IMAGE_TOKENS,
    )
    tokenizer.add_special_tokens({"bos_token": "<bos>"})
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    vision_config = transformers.SiglipVisionConfig(
        **{**_TINY_VISION, "vision_use_head": False, **(vision_overrides or {})}
    )
    _, _, text_defaults = _ARCHITECTURES["gemma3"]
    text = {
        **_TINY_TEXT,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "tie_word_embeddings": False,  # a head of its own: tokens wander more
        **text_defaults,
        **(text_overrides or {}),
    }
    pattern = text["layer_types"]
    text["layer_types"] = [pattern[i % len(pattern)] for i in range(text["num_hidden_layers"])]
    ids = {name: tokenizer.convert_tokens_to_ids(t) for name, t in GEMMA3_IMAGE_TOKENS.items()}
    config = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**text),
        vision_config=vision_config,
        mm_tokens_per_image=mm_tokens_per_image,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        initializer_range=text["initializer_range"],  # the whole model's
        tie_word_embeddings=text["tie_word_embeddings"],
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Gemma3ForConditionalGeneration(config).to(dtype).eval()
        # transformers starts the projection at zero, which would make every image alike.
        projection = model.model.multi_modal_projector.mm_input_projection_weight
        torch.nn.init.normal_(projection, std=config.initializer_range)
    model.save_pretrained(folder)
    size = vision_config.image_size
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessor(size={"height": size, "width": size}),
        tokenizer=tokenizer,
        image_seq_length=mm_tokens_per_image,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )
    processor.save_pretrained(folder)
    return folder


def demo_checkpoint() -> Path:
    """The demo's fallback checkpoint, built once into the user's cache folder."""
    from extkv.models.smollm2 import cache_folder

    folder = cache_folder() / "tiny-qwen3"
    if not (folder / "config.json").exists():
        logger.info("Building a tiny random Qwen3 checkpoint in %s", folder)
        make_random_checkpoint(folder)
    return folder
