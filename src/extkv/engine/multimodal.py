"""Images in prompts: from what a user passes to what the engine schedules.

A prompt holds one placeholder token per image (the model's image token, e.g. `<image>`),
typed in its text or given in its token ids, as vLLM takes them. `MultiModalProcessor`
checks the images against the placeholders and the per-prompt limit, preprocesses them
with the checkpoint's own `transformers` image processor, and expands each placeholder
to the run of positions its embeddings will fill. Each image is keyed by a hash of its
preprocessed pixels, so identical images share one encoder cache entry whatever request
brings them.
"""

from __future__ import annotations

import hashlib
import logging
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
    with the checkpoint's image processor; thread-safe (it keeps no state per call)."""

    def __init__(
        self,
        spec: ImageSpec,
        image_processor: Any,
        limit_mm_per_prompt: dict[str, int] | None = None,
    ) -> None:
        self.spec = spec
        self.image_processor = image_processor
        self.max_images = (limit_mm_per_prompt or {}).get("image")
        from PIL import Image

        _, height, width = spec.pixel_shape
        probe = self._pixels([Image.new("RGB", (width, height))])
        if tuple(probe.shape[1:]) != spec.pixel_shape:
            raise ValueError(
                f"the checkpoint's image processor makes images of shape {tuple(probe.shape[1:])}"
                f", but its vision tower takes {spec.pixel_shape}"
            )

    @classmethod
    def from_pretrained(
        cls, path: str, spec: ImageSpec, limit_mm_per_prompt: dict[str, int] | None
    ) -> MultiModalProcessor:
        """The processor of the checkpoint folder `path` (its saved image processor)."""
        from transformers import AutoImageProcessor

        try:
            images = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"{path} is a vision-language model, but its image processor could not be "
                f"loaded ({e}); save the model's processor (preprocessor_config.json or "
                "processor_config.json) with it"
            ) from None
        return cls(spec, images, limit_mm_per_prompt)

    def process(
        self, token_ids: Sequence[int], multi_modal_data: Mapping[str, Any] | None
    ) -> tuple[list[int], list[ImageInput]]:
        """The prompt's ids with each placeholder expanded to its image's run, and the
        images in prompt order. ValueError (naming the parameter) for data that is not
        images, a count of images unequal to the placeholders', more than the limit, or an
        image that cannot be read."""
        images = self._images(multi_modal_data)
        token = self.spec.token_id
        ids = list(token_ids)
        num_placeholders = ids.count(token)
        if num_placeholders != len(images):
            raise ValueError(
                f"the prompt has {num_placeholders} image placeholder token(s) (id {token}) and "
                f"multi_modal_data['image'] has {len(images)} image(s): put one placeholder "
                "per image in the prompt"
            )
        if not images:
            return ids, []
        pixels = self._pixels(images)
        expanded: list[int] = []
        inputs: list[ImageInput] = []
        length = self.spec.num_tokens
        for t in ids:
            if t == token:
                offset = len(expanded)
                hash_ = _image_hash(pixels[len(inputs)])
                inputs.append(ImageInput(hash_, pixels[len(inputs)], offset, length))
                expanded += [token] * length
            else:
                expanded.append(t)
        return expanded, inputs

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
