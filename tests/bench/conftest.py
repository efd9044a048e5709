"""A tiny random Llama folder (byte tokenizer, ChatML template) shared by the bench tests, and a `python` for the
peers' stand-in packages."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

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


def python_with_packages(folder: Path, files: dict[str, str]) -> Path:
    """A `python` in `folder` that runs this interpreter with `folder/pkgs` first on its path, after writing `files`
    (paths relative to it, e.g. "vllm/__init__.py") there: a peer's stand-in package, run as the peer's child is."""
    for name, text in files.items():
        (folder / "pkgs" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "pkgs" / name).write_text(text)
    python = folder / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{folder / "pkgs"}" exec "{sys.executable}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python
