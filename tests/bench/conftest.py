"""A tiny random Llama folder (byte tokenizer, ChatML template) shared by the bench tests."""

from __future__ import annotations

import pytest

from tests.models.tiny import save_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    # Long enough for the mixed dataset's byte-tokenized prompts (<= 600) plus outputs (<= 256).
    folder, _ = save_tiny_model(tmp_path_factory.mktemp("bench") / "tiny", "llama-gqa", max_position_embeddings=1024)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from pagedllm.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)
