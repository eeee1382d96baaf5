"""Images in prompts: from what a user passes to what the engine schedules.

A prompt holds one placeholder token per image (LLaVA's image token `<image>`, Gemma 3's
`<start_of_image>`), typed in its text or given in its token ids, as vLLM takes them.
`MultiModalProcessor` checks the images against the placeholders and the per-prompt limit,
preprocesses them with the checkpoint's own `transformers` processor, and expands each
placeholder as that processor does: to the run of positions the image's embeddings will
fill, with the markers the model puts around it. Each image is keyed by a hash of its
preprocessed pixels, so identical images share one encoder cache entry whatever request
brings them.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from extkv.models import ImageSpec

logger = logging.getLogger(__name__)

MODALITIES = ("image",)


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt, preprocessed: the encoder cache's key, the pixels the encoder
    takes, and the prompt positions its embeddings fill."""

    hash: str
    pixel_values: torch.Tensor  # (channels, height, width), float32 on the host
    offset: int  # the first position of its placeholder run
    length: int  # positions in the run: the image's embeddings

    @property
    def end(self) -> int:
        """The position after its run."""
        return self.offset + self.length


def check_limit_mm_per_prompt(value: object) -> dict[str, int] | None:
    """`limit_mm_per_prompt` as a dict {"image": N} (N >= 0); the command line's
    `image=N` (comma separated) or a JSON object too. None: no limit."""
    if value is None:
        return None
    if isinstance(value, str):
        value = _parse_limits(value)
    allowed = f"a dict {{'image': N}} with N an int >= 0 (command line: image=N); got {value!r}"
    if not isinstance(value, Mapping):
        raise ValueError(f"limit_mm_per_prompt must be {allowed}")
    unknown = sorted(set(value) - set(MODALITIES))
    if unknown:
        raise ValueError(
            f"limit_mm_per_prompt: modality {unknown[0]!r} is not supported; supported: "
            f"{', '.join(MODALITIES)}"
        )
    for count in value.values():
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"limit_mm_per_prompt must be {allowed}")
    return dict(value)


def _parse_limits(text: str) -> object:
    import json

    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    limits: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, count = item.partition("=")
        limits[name.strip()] = int(count) if count.strip().isdigit() else count
    return limits


def _image_hash(pixels: torch.Tensor) -> str:
    data = np.ascontiguousarray(pixels.numpy())
    digest = hashlib.blake2b(data.tobytes(), digest_size=16)
    digest.update(str(tuple(data.shape)).encode())
    return digest.hexdigest()


def _as_image_list(images: object) -> list[Any]:
    from PIL import Image

    items = list(images) if isinstance(images, list | tuple) else [images]
    for i, image in enumerate(items):
        if not isinstance(image, Image.Image):
            raise ValueError(
                f"multi_modal_data['image'][{i}] must be a PIL.Image.Image; got "
                f"{type(image).__name__}"
            )
    return items


class MultiModalProcessor:
    """Turns (prompt token ids, multi_modal_data) into the expanded ids and their images,
    with the checkpoint's processor; thread-safe (per call it keeps no state; the token
    joins it learns are cached under a lock).

    Each placeholder becomes `expansion`: the image's tokens alone (LLaVA), or what the
    checkpoint's own processor puts in place of the placeholder's text, learnt from it
    once (Gemma 3: newlines, `<start_of_image>`, the image's tokens, `<end_of_image>`,
    newlines). Where the processor tokenizes the expanded text, a token at either end of
    an expansion may merge with its neighbour (Gemma's "\n" before "\n\n" is one "\n\n\n"
    token): each such pair is retokenized as the tokenizer reads their text."""

    def __init__(
        self,
        spec: ImageSpec,
        image_processor: Any,
        limit_mm_per_prompt: dict[str, int] | None = None,
        processor: Any | None = None,
    ) -> None:
        """`processor`: the checkpoint's whole processor (tokenizer and image processor),
        for a model whose placeholder is not the image token itself."""
        self.spec = spec
        self.image_processor = image_processor
        self.max_images = (limit_mm_per_prompt or {}).get("image")
        if getattr(image_processor, "do_pan_and_scan", None):
            raise ValueError(
                "the checkpoint's image processor has do_pan_and_scan on (crops that add "
                "images to a prompt); it is not supported: set it to false or null"
            )
        from PIL import Image

        _, height, width = spec.pixel_shape
        blank = Image.new("RGB", (width, height))
        probe = self._pixels([blank])
        if tuple(probe.shape[1:]) != spec.pixel_shape:
            raise ValueError(
                f"the checkpoint's image processor makes images of shape {tuple(probe.shape[1:])}"
                f", but its vision tower takes {spec.pixel_shape}"
            )
        self.expansion: tuple[int, ...] = (spec.token_id,) * spec.num_tokens
        self._tokenizer = None if processor is None else processor.tokenizer
        if processor is not None:
            self.expansion = self._learn_expansion(processor, blank)
        self._run_offset = self.expansion.index(spec.token_id)  # where the image's tokens start
        self._joins: dict[tuple[int, int], tuple[int, ...]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls, path: str, spec: ImageSpec, limit_mm_per_prompt: dict[str, int] | None
    ) -> MultiModalProcessor:
        """The processor of the checkpoint folder `path`: its saved image processor, or its
        whole processor where the placeholder is not the image token."""
        from transformers import AutoImageProcessor, AutoProcessor

        whole = spec.placeholder_id != spec.token_id
        try:
            if whole:
                processor = AutoProcessor.from_pretrained(path, local_files_only=True)
                return cls(spec, processor.image_processor, limit_mm_per_prompt, processor)
            images = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(
                f"{path} is a vision-language model, but its "
                f"{'processor' if whole else 'image processor'} could not be loaded ({e}); "
                "save the model's processor (processor_config.json, preprocessor_config.json "
                "and its tokenizer) with it"
            ) from None
        return cls(spec, images, limit_mm_per_prompt)

    def _learn_expansion(self, processor: Any, blank: Any) -> tuple[int, ...]:
        """The ids `processor` makes of the placeholder's text with one image: one run of
        the image's tokens, markers around it, or a ValueError saying what it made."""
        spec = self.spec
        text = self._tokenizer.convert_ids_to_tokens(spec.placeholder_id)
        made = processor(text=text, images=[blank], add_special_tokens=False)["input_ids"][0]
        made = tuple(int(t) for t in made)
        start = made.index(spec.token_id) if spec.token_id in made else -1
        run = (spec.token_id,) * spec.num_tokens
        if (
            start < 0
            or made[start : start + spec.num_tokens] != run
            or made.count(spec.token_id) != spec.num_tokens
        ):
            raise ValueError(
                f"the checkpoint's processor expands the image placeholder {text!r} to {made}, "
                f"not to one run of the model's {spec.num_tokens} image tokens "
                f"(id {spec.token_id})"
            )
        return made

    def process(
        self, token_ids: Sequence[int], multi_modal_data: Mapping[str, Any] | None
    ) -> tuple[list[int], list[ImageInput]]:
        """The prompt's ids with each placeholder expanded to its image's run, and the
        images in prompt order. ValueError (naming the parameter) for data that is not
        images, a count of images unequal to the placeholders', more than the limit, an
        image that cannot be read, or image tokens written in the prompt itself."""
        images = self._images(multi_modal_data)
        spec = self.spec
        ids = list(token_ids)
        num_placeholders = ids.count(spec.placeholder_id)
        if num_placeholders != len(images):
            raise ValueError(
                f"the prompt has {num_placeholders} image placeholder token(s) (id "
                f"{spec.placeholder_id}) and multi_modal_data['image'] has {len(images)} "
                "image(s): put one placeholder per image in the prompt"
            )
        if spec.placeholder_id != spec.token_id and spec.token_id in ids:
            raise ValueError(
                f"the prompt holds the image token (id {spec.token_id}) itself: put one image "
                f"placeholder (id {spec.placeholder_id}) per image in it, which the engine "
                "expands"
            )
        if not images:
            return ids, []
        pixels = self._pixels(images)
        expanded, offsets = self._expand(ids)
        inputs = [
            ImageInput(_image_hash(pixels[i]), pixels[i], offset, spec.num_tokens)
            for i, offset in enumerate(offsets)
        ]
        return expanded, inputs

    def _expand(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """`ids` with each placeholder replaced by `expansion` (each end retokenized with
        its neighbour), and where each image's tokens start."""
        placeholder = self.spec.placeholder_id
        out: list[int] = []
        offsets: list[int] = []
        after_image = False
        for token in ids:
            piece = self.expansion if token == placeholder else (token,)
            joined = 0  # tokens of the piece taken into the join
            if out and (token == placeholder or after_image):
                out[-1:] = self._retokenized(out[-1], piece[0])
                piece, joined = piece[1:], 1
            if token == placeholder:
                offsets.append(len(out) + self._run_offset - joined)
            out += piece
            after_image = token == placeholder
        return out, offsets

    def _retokenized(self, left: int, right: int) -> tuple[int, ...]:
        """The tokens the tokenizer makes of the text of `left` and `right` side by side
        (themselves where one is special, or without a tokenizer)."""
        tokenizer = self._tokenizer
        key = (left, right)
        if tokenizer is None:
            return key
        with self._lock:
            if key not in self._joins:
                joined = key
                if not set(key) & set(tokenizer.all_special_ids):
                    text = tokenizer.decode(list(key), clean_up_tokenization_spaces=False)
                    joined = tuple(tokenizer.encode(text, add_special_tokens=False))
                self._joins[key] = joined
            return self._joins[key]

    def _images(self, data: Mapping[str, Any] | None) -> list[Any]:
        if data is None:
            return []
        if not isinstance(data, Mapping):
            raise ValueError(
                f"multi_modal_data must be a dict {{'image': image or list of images}}; got "
                f"{type(data).__name__}"
            )
        unknown = sorted(set(data) - set(MODALITIES))
        if unknown:
            raise ValueError(
                f"multi_modal_data: modality {unknown[0]!r} is not supported; supported: "
                f"{', '.join(MODALITIES)}"
            )
        images = _as_image_list(data.get("image", []))
        if self.max_images is not None and len(images) > self.max_images:
            raise ValueError(
                f"multi_modal_data['image'] has {len(images)} images, more than "
                f"limit_mm_per_prompt={{'image': {self.max_images}}} allows in one prompt"
            )
        return images

    def _pixels(self, images: list[Any]) -> torch.Tensor:
        """(n, channels, height, width) float32 from the image processor; an image that
        cannot be read is a ValueError naming its index."""
        rgb = []
        for i, image in enumerate(images):
            try:  # a lazily opened file is decoded here: PIL raises OSError, SyntaxError, ...
                rgb.append(image if image.mode == "RGB" else image.convert("RGB"))
                rgb[-1].load()
            except Exception as e:
                raise ValueError(
                    f"multi_modal_data['image'][{i}] cannot be read as an image: {e}"
                ) from None
        try:
            out = self.image_processor(images=rgb, return_tensors="pt")["pixel_values"]
        except Exception as e:
            raise ValueError(
                f"multi_modal_data['image']: the image processor refused the images: {e}"
            ) from None
        return out.float()
