"""The pooling an embedding model was trained with: vLLM's `pooler_config` when given, else the model folder's
sentence-transformers config (modules.json and its Pooling module's config.json) or a GGUF file's `pooling_type`, else
LAST (`PoolingParams`); and the Dense layers that config puts after the pooling (`sentence_transformers_projector`:
EmbeddingGemma's 768 -> 3072 -> 768, which a GGUF file holds as its dense_2 and dense_3 tensors), which vLLM and
llama.cpp run too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.loader.resolve import ResolvedModel
from pagedllm.logger import init_logger

if TYPE_CHECKING:
    from pagedllm.loader.gguf import GGUFFile

logger = init_logger(__name__)

# sentence-transformers' pooling modes -> the pooling types pagedllm runs
_MODES = {"lasttoken": "LAST", "mean_tokens": "MEAN", "cls_token": "CLS"}


# sentence-transformers' Dense activations (their class's full name) -> the module; Tanh is its default
_ACTIVATIONS = {f"torch.nn.modules.{name}": module for name, module in [
    ("linear.Identity", nn.Identity), ("activation.Tanh", nn.Tanh), ("activation.ReLU", nn.ReLU),
    ("activation.GELU", nn.GELU), ("activation.Sigmoid", nn.Sigmoid), ("activation.SiLU", nn.SiLU)]}


def _modules(folder: Path, kind: str) -> list[Path]:
    """The folders of the sentence-transformers modules of `kind` ("Pooling", "Dense") in the folder's modules.json,
    in order; none for a folder without one."""
    modules = folder / "modules.json"
    if not modules.is_file():
        return []
    return [folder / module.get("path", "") for module in json.loads(modules.read_text())
            if str(module.get("type", "")).split(".")[-1] == kind]


def copy_sentence_transformers_modules(folder: Path, to: Path) -> None:
    """Copy a model folder's sentence-transformers config (modules.json and the folders of its modules after the
    model's own) into `to`, where a converted copy of the model is written; nothing for a folder without one."""
    if not (folder / "modules.json").is_file():
        return
    shutil.copy(folder / "modules.json", to / "modules.json")
    for module in json.loads((folder / "modules.json").read_text()):
        if module.get("path") and (folder / module["path"]).is_dir():     # (a Normalize module has none)
            shutil.copytree(folder / module["path"], to / module["path"], dirs_exist_ok=True)


def sentence_transformers_pooling(folder: Path) -> str | None:
    """The pooling modes a sentence-transformers folder turns on ("lasttoken", "mean_tokens", "cls_token", ...,
    joined by "+"), or None for a folder without such a config."""
    for module in _modules(folder, "Pooling"):
        config = module / "config.json"
        if config.is_file():
            modes = [key.removeprefix("pooling_mode_") for key, on in json.loads(config.read_text()).items()
                     if key.startswith("pooling_mode_") and on is True]
            return "+".join(modes) or None
    return None


# llama.cpp's pooling types (a GGUF's `{arch}.pooling_type`) -> pagedllm's
_GGUF_POOLING = {1: "MEAN", 2: "CLS", 3: "LAST"}


def model_pooling_type(model: ResolvedModel, pooler_config: dict[str, Any] | None = None,
                       gguf_file: GGUFFile | None = None) -> str:
    """LAST, MEAN or CLS: `pooler_config`'s pooling_type (vLLM's), else the sentence-transformers config's (a GGUF
    file's pooling_type; `gguf_file`: the file already opened), else LAST (vLLM's default for a causal LM). A mode
    pagedllm does not run is warned of, and LAST taken."""
    if pooler_config is not None:       # checked by ModelConfig
        return pooler_config["pooling_type"]
    if model.gguf_path is not None:
        return _GGUF_POOLING.get(_opened(model, gguf_file).arch_value("pooling_type"), "LAST")
    modes = sentence_transformers_pooling(model.path)
    if modes is None:
        return "LAST"
    if modes not in _MODES:
        logger.warning("this model's sentence-transformers config pools by %s, which pagedllm does not run; it "
                       "embeds by the last token (LAST pooling), so its embeddings will differ from the model's own",
                       modes)
        return "LAST"
    logger.info("embeddings pool by %s, as the model's sentence-transformers config says", _MODES[modes])
    return _MODES[modes]


def sentence_transformers_projector(model: ResolvedModel, gguf_file: GGUFFile | None = None
                                    ) -> nn.Sequential | None:
    """The Dense modules a sentence-transformers folder runs after its pooling (each `activation(W x + b)`, from its
    config.json and its model.safetensors or pytorch_model.bin), in float32 as the pooled vectors they take; None for
    a folder without any. ValueError for an activation pagedllm does not know: its embeddings would be wrong. A GGUF
    file's are its dense_2 and dense_3 weights, without biases or activations (as llama.cpp runs EmbeddingGemma's);
    `gguf_file`: the file already opened."""
    from safetensors.torch import load_file

    if model.gguf_path is not None:
        return _gguf_projector(_opened(model, gguf_file))
    layers: list[nn.Module] = []
    for module in _modules(model.path, "Dense"):
        config = json.loads((module / "config.json").read_text())
        activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"{module}: the Dense activation {activation} is not supported (only "
                             f"{', '.join(sorted(_ACTIVATIONS))})")
        weights_file = module / "model.safetensors"
        weights = load_file(weights_file) if weights_file.is_file() else \
            torch.load(module / "pytorch_model.bin", map_location="cpu", weights_only=True)
        linear = nn.Linear(config["in_features"], config["out_features"], bias=config.get("bias", True))
        linear.load_state_dict({name.removeprefix("linear."): tensor.float() for name, tensor in weights.items()})
        layers += [linear, _ACTIVATIONS[activation]()]
    return _projector(layers)


def _opened(model: ResolvedModel, gguf_file: GGUFFile | None) -> GGUFFile:
    from pagedllm.loader.gguf import GGUFFile

    assert model.gguf_path is not None
    return gguf_file or GGUFFile(model.gguf_path)


def _gguf_projector(g: GGUFFile) -> nn.Sequential | None:
    from pagedllm.loader.gguf import DENSE_TENSORS

    layers: list[nn.Module] = []
    for name in DENSE_TENSORS:
        if name in g.tensors:
            weight = g.read_tensor(g.tensors[name]).float()
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            linear.weight.data.copy_(weight)
            layers += [linear, nn.Identity()]
    return _projector(layers)


def _projector(layers: list[nn.Module]) -> nn.Sequential | None:
    if not layers:
        return None
    logger.info("embeddings pass through %d Dense layers after pooling, as the model's sentence-transformers config "
                "says", len(layers) // 2)
    return nn.Sequential(*layers).requires_grad_(False)
