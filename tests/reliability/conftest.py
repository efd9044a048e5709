from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.tiny import save_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    # initializer_range 0.5: the random model's greedy outputs vary from prompt to prompt (0.1 gives one token).
    folder, _ = save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama-gqa", initializer_range=0.5)
    return folder


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """A tiny model runs 10-30x slower with two intra-op threads on a busy two-core box: spinning, not work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
