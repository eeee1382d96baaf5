"""Chat messages with images, as OpenAI's API writes them, for a model's chat template.

A message's content is a string or a list of parts: `{"type": "text", "text": ...}` and
`{"type": "image_url", "image_url": {"url": ...}}` (`LLM.chat` also takes
`{"type": "image_pil", "image_pil": PIL.Image}`). Images come from `data:` URLs (base64),
from `file://` URLs inside the folder the engine allows (`allowed_local_media_path`), and
from `http(s)://` URLs on the hosts it allows (`allowed_media_domains`, redirects
included); with neither set, only `data:` URLs.

Chat templates take content one of two ways, as vLLM tells them apart: templates that
loop over a message's content get the parts as a list (`{"type": "image"}` where an image
goes); the others get one string, each image's placeholder text on a line of its own
before the text.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote, urlparse

ContentFormat = Literal["string", "openai"]
FETCH_TIMEOUT_S = 5.0  # a remote image's whole download (vLLM's default timeout too)
MAX_IMAGE_BYTES = 64 << 20  # a larger download is refused, not read to the end


@dataclass(frozen=True)
class MediaSources:
    """Where images may come from besides `data:` URLs: a local folder (`file://`) and
    the hosts `http(s)://` URLs may name (None: neither)."""

    local_folder: str | None = None
    domains: tuple[str, ...] | None = None

    @classmethod
    def of(cls, config: Any) -> MediaSources:
        """The sources an EngineConfig allows."""
        return cls(config.allowed_local_media_path, config.allowed_media_domains)


def content_format(template: str | None) -> ContentFormat:
    """ "openai" if the chat template loops over a message's content (`for part in
    message['content']`, filters allowed), else "string"."""
    if not template:
        return "string"
    from jinja2 import Environment, TemplateSyntaxError, nodes

    try:
        ast = Environment().parse(template)
    except TemplateSyntaxError:
        return "string"
    for loop in ast.find_all(nodes.For):
        node = loop.iter
        while isinstance(node, nodes.Filter | nodes.Test):
            node = node.node
        if isinstance(node, nodes.Getattr) and node.attr == "content":
            return "openai"
        if (
            isinstance(node, nodes.Getitem)
            and isinstance(node.arg, nodes.Const)
            and node.arg.value == "content"
        ):
            return "openai"
    return "string"


def load_image_url(url: str, sources: MediaSources, where: str) -> Any:
    """The PIL image a `data:`, `file://` or `http(s)://` URL holds, the latter two where
    `sources` allows them; ValueError naming `where` for anything else or for bytes that
    are not an image."""
    from PIL import Image

    if not isinstance(url, str):
        raise ValueError(f"{where}: the image URL must be a string; got {type(url).__name__}")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url_bytes(url, where)
    elif scheme == "file":
        data = _local_file_bytes(url, sources.local_folder, where)
    elif scheme in ("http", "https"):
        data = _remote_bytes(url, sources.domains, where)
    else:
        raise ValueError(
            f"{where}: image URLs must be data: URLs (or file:// URLs inside "
            "--allowed-local-media-path, http(s):// URLs on --allowed-media-domains); got "
            f"{url[:40]!r}"
        )
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as e:  # PIL raises several kinds on bad data
        raise ValueError(f"{where}: the data is not an image PIL can read ({e})") from None
    return image


def _check_host(url: str, domains: tuple[str, ...] | None, where: str) -> None:
    host = urlparse(url).hostname or ""
    if domains is None:
        raise ValueError(
            f"{where}: remote image URLs are fetched only from the hosts the engine allows "
            "(--allowed-media-domains, allowed_media_domains); send the image inline as a "
            "data:image/...;base64 URL instead"
        )
    if host.lower() not in domains:
        raise ValueError(f"{where}: {host!r} is not one of --allowed-media-domains {list(domains)}")


class _AllowedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host."""

    def __init__(self, domains: tuple[str, ...] | None, where: str) -> None:
        self.domains, self.where = domains, where

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urlparse(newurl).scheme.lower() not in ("http", "https"):
            raise ValueError(f"{self.where}: redirected to a URL that is not http(s)")
        _check_host(newurl, self.domains, f"{self.where} (redirected)")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _remote_bytes(url: str, domains: tuple[str, ...] | None, where: str) -> bytes:
    """The body of `url` on an allowed host, at most MAX_IMAGE_BYTES, within
    FETCH_TIMEOUT_S in all: read as it arrives, so a host that trickles bytes cannot
    hold a parsing thread (and the requests queued behind it) for long."""
    _check_host(url, domains, where)
    deadline = time.monotonic() + FETCH_TIMEOUT_S
    opener = urllib.request.build_opener(_AllowedRedirects(domains, where))
    chunks, size = [], 0
    try:
        with opener.open(url, timeout=FETCH_TIMEOUT_S) as response:
            while size <= MAX_IMAGE_BYTES:
                if time.monotonic() > deadline:
                    raise ValueError(
                        f"{where}: fetching {url[:80]!r} took over {FETCH_TIMEOUT_S} s"
                    )
                chunk = response.read1(1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except urllib.error.HTTPError as e:
        raise ValueError(f"{where}: fetching {url[:80]!r} failed: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ValueError(f"{where}: fetching {url[:80]!r} failed: {reason}") from None
    if size > MAX_IMAGE_BYTES:
        raise ValueError(f"{where}: {url[:80]!r} holds more than {MAX_IMAGE_BYTES} bytes")
    return b"".join(chunks)


def _data_url_bytes(url: str, where: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise ValueError(f"{where}: a data: URL must be data:<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: the data: URL's payload is not valid base64") from None


def _local_file_bytes(url: str, folder: str | None, where: str) -> bytes:
    if folder is None:
        raise ValueError(
            f"{where}: file:// URLs need the engine started with --allowed-local-media-path "
            "(allowed_local_media_path), the folder they may read from"
        )
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"{where}: a file:// URL must name a local path; got {url[:60]!r}")
    path = os.path.realpath(unquote(parsed.path))
    if os.path.commonpath([path, folder]) != folder:
        raise ValueError(
            f"{where}: {unquote(parsed.path)!r} is outside --allowed-local-media-path {folder!r}"
        )
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{where}: cannot read {unquote(parsed.path)!r}: {e.strerror}") from None


def chat_inputs(
    messages: Sequence[Mapping[str, Any]],
    fmt: ContentFormat,
    placeholder: str | None,
    sources: MediaSources,
) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the messages as the chat template takes them, their images in order). A message's
    parts become one string or a list (`fmt`); `placeholder` is the model's image token
    text, None for a model without images (then an image part is a ValueError)."""
    out: list[dict[str, Any]] = []
    images: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) or content is None:
            out.append(dict(message))
            continue
        if not isinstance(content, Sequence):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of parts; got "
                f"{type(content).__name__}"
            )
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind in ("image_url", "image_pil"):
                if placeholder is None:
                    raise ValueError(f"{where}: this model takes no images (no vision encoder)")
                images.append(_part_image(part, kind, sources, where))
                parts.append({"type": "image"})
            else:
                raise ValueError(
                    f"{where} must be a text part {{'type': 'text', 'text': ...}} or an image "
                    "part {'type': 'image_url', 'image_url': {'url': ...}}"
                )
        out.append(
            {**message, "content": parts if fmt == "openai" else _joined(parts, placeholder)}
        )
    return out, images


def _part_image(part: Mapping[str, Any], kind: str, sources: MediaSources, where: str) -> Any:
    from PIL import Image

    if kind == "image_pil":
        image = part.get("image_pil")
        if not isinstance(image, Image.Image):
            raise ValueError(f"{where}.image_pil must be a PIL.Image.Image")
        return image
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, Mapping) else ref
    return load_image_url(url, sources, f"{where}.image_url")


def _joined(parts: list[dict[str, Any]], placeholder: str | None) -> str:
    """A list of parts as one string: each image's placeholder on its own line, then the
    text parts."""
    images = "".join(f"{placeholder}\n" for p in parts if p["type"] == "image")
    return images + "".join(p["text"] for p in parts if p["type"] == "text")
