"""Load a model: resolve the argument, read its config, build the model and feed it the checkpoint's weights.

The loaders (`safetensors.py`, `gguf.py`) yield Hugging Face (name, tensor) pairs and know nothing of models;
the registry picks the class; the model maps the names onto its parameters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.attention.selector import attention_backend
from pagedllm.config import ModelConfig
from pagedllm.cpu import cpu_info, onednn_bf16_ok
from pagedllm.loader.resolve import ResolvedModel, resolve_model

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: Any  # transformers.PretrainedConfig
    resolved: ResolvedModel
    dtype: torch.dtype
    tp_rank: int = 0        # this process's slice of the model under tensor parallelism
    tp_size: int = 1


def resolve_dtype(dtype: str, device: str = "cpu") -> torch.dtype:
    """"auto" -> bfloat16 on a GPU, and on a CPU wherever linear layers run bf16 weights at full speed (oneDNN with
    bf16 instructions, or pagedllm's packed kernel: bf16 in memory, float32 arithmetic); float32 only where
    neither can (no bf16 in oneDNN, and pagedllm's kernels disabled or not built). Other names map directly."""
    from pagedllm.layers.linear import linear_packing

    if dtype != "auto":
        return _DTYPES[dtype]
    if device != "cpu" or onednn_bf16_ok() or linear_packing(torch.bfloat16) is not None:
        return torch.bfloat16
    return torch.float32


def _log_precision(requested: str, dtype: torch.dtype, device: str) -> None:
    """One line at start-up: the CPU, the dtype chosen and why, and how its matmuls run."""
    from pagedllm.layers.linear import linear_packing

    chosen = f"{str(dtype).removeprefix('torch.')}{' (auto)' if requested == 'auto' else ''}"
    if device != "cpu":
        logger.info("device %s; dtype %s", device, chosen)
        return
    how = {"onednn": "bf16 weights and KV cache, bf16 matmuls in oneDNN",
           "pagedllm": ("bf16 weights and KV cache (half float32's bytes), float32 arithmetic in pagedllm's kernels"
                        if dtype == torch.bfloat16 else "float32 weights packed for pagedllm's kernels")}
    packing = linear_packing(dtype)
    if packing is not None:
        logger.info("CPU: %s; dtype %s: %s", cpu_info().describe(), chosen, how[packing])
    elif dtype == torch.bfloat16:
        logger.warning("CPU: %s; dtype %s runs through torch's bf16 emulation without pagedllm's kernels: several "
                       "times slower than float32 here", cpu_info().describe(), chosen)
    else:
        logger.info("CPU: %s; dtype %s", cpu_info().describe(), chosen)


def load_hf_config(resolved: ResolvedModel) -> Any:
    """The transformers config of a folder, or one built from a GGUF's metadata."""
    return _config_and_weights(resolved, torch.float32)[0]


def max_model_len_of(hf_config: Any, wanted: int | None) -> int:
    """The model's context length (`max_position_embeddings`, else 2048), capped by `wanted` when given."""
    model_len = getattr(hf_config, "max_position_embeddings", None) or 2048
    if wanted is not None and wanted > model_len:
        raise ValueError(f"max_model_len={wanted} is larger than the model's context length {model_len}")
    return wanted or model_len


def _config_and_weights(resolved: ResolvedModel, dtype: torch.dtype) -> tuple[Any, Iterator[tuple[str, torch.Tensor]]]:
    """(hf_config, lazy (name, tensor) iterator); nothing is read until the iterator is consumed."""
    if resolved.gguf_path is not None:
        from pagedllm.loader.gguf import GGUFFile, gguf_hf_config, iterate_gguf

        gguf_file = GGUFFile(resolved.gguf_path)
        return gguf_hf_config(gguf_file), iterate_gguf(resolved.gguf_path, dtype, gguf_file)
    from transformers import AutoConfig

    from pagedllm.loader.safetensors import iterate_safetensors

    return AutoConfig.from_pretrained(str(resolved.path)), iterate_safetensors(resolved.path, dtype)


def _check_gguf_quantization(resolved: ResolvedModel, tp_size: int) -> None:
    if resolved.gguf_path is None:
        raise ValueError(f"quantization='gguf' keeps a GGUF file's blocks packed, but {resolved.name} is not a .gguf "
                         "file: use 'int8' or None")
    if tp_size > 1:
        raise ValueError("quantization='gguf' runs on one rank (tensor_parallel_size=1): the packed blocks are not "
                         "split across ranks yet")


def _pack(model: nn.Module, quantization: str | None, resolved: ResolvedModel) -> str:
    """Pack the linear weights for `quantization`; returns what was packed, for the start-up line."""
    from pagedllm.layers.gguf import PACKED_GGUF_TYPES
    from pagedllm.layers.linear import pack_gguf_linear_weights, pack_linear_weights

    gguf_counts: dict[str, int] = {}
    if quantization == "gguf":
        from pagedllm.loader.gguf import GGUFFile, gguf_block_rows

        rows = gguf_block_rows(GGUFFile(resolved.gguf_path), PACKED_GGUF_TYPES)  # type: ignore[arg-type]
        gguf_counts = pack_gguf_linear_weights(model, rows)
    packed = pack_linear_weights(model, None if quantization == "gguf" else quantization)
    parts = [f"{count} as GGUF {name}" for name, count in sorted(gguf_counts.items())]
    if packed:
        parts.append(f"{packed}{' as int8' if quantization == 'int8' else ''}")
    return f", weights packed: {', '.join(parts)}" if parts else ""


def load_model(model_config: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> LoadedModel:
    """Resolve, build and load the model of `model_config`, in eval mode on `model_config.device`; under tensor
    parallelism, rank `tp_rank`'s slice of it (each rank reads the checkpoint and keeps its own slice)."""
    from pagedllm.models.registry import model_class_for_config

    start = time.perf_counter()
    resolved = resolve_model(model_config.model)
    if model_config.quantization == "gguf":
        _check_gguf_quantization(resolved, tp_size)
    dtype = resolve_dtype(model_config.dtype, model_config.device)
    if tp_rank == 0:
        _log_precision(model_config.dtype, dtype, model_config.device)
    hf_config, weights = _config_and_weights(resolved, dtype)
    model_cls = model_class_for_config(hf_config)
    # Parameters are allocated with torch.empty (no random init), so building directly is cheap.
    with torch.device(model_config.device):
        model = model_cls(hf_config, dtype=dtype, attn_backend=attention_backend(model_config.device),
                          tp_rank=tp_rank, tp_size=tp_size)
    model.load_weights(weights)
    model.eval()
    how = _pack(model, model_config.quantization, resolved)
    rank = f", tensor-parallel rank {tp_rank} of {tp_size}" if tp_size > 1 else ""
    logger.info("loaded %s (%s%s%s) in %.2f s", resolved.name, dtype, how, rank, time.perf_counter() - start)
    return LoadedModel(model, hf_config, resolved, dtype, tp_rank, tp_size)


__all__ = ["LoadedModel", "ResolvedModel", "load_model", "load_hf_config", "max_model_len_of", "resolve_dtype",
           "resolve_model"]
