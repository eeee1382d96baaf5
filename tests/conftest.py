from pathlib import Path

import pytest
import torch

from extkv.demo import make_random_checkpoint
from helpers import make_mamba_checkpoint


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests skip cleanly where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Tiny random Mamba2 and Bamba checkpoints (fp32), shared by the engine-level tests.
# The Bamba has one attention layer among four Mamba layers: the KV config cuts the
# Mamba layers into four state groups, each with its own state block per sequence.
@pytest.fixture(scope="session")
def mamba2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mamba2")
    make_mamba_checkpoint(path, "mamba2")
    return path


@pytest.fixture(scope="session")
def bamba(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bamba")
    make_mamba_checkpoint(path, "bamba", num_hidden_layers=5, attn_layer_indices=[2])
    return path


# The tiny random Qwen3 (fp32, with a tokenizer) most engine tests run.
@pytest.fixture(scope="session")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")
