"""The engine's device: "auto", "cpu", "cuda" or "cuda:N", resolved once at start-up and described in its log."""

from __future__ import annotations

import dataclasses

import psutil
import torch

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.runner.kv_tensors import GiB


def resolve_device(name: str) -> str:
    """The device `name` asks for: "auto" is "cuda" when torch sees a CUDA device, else "cpu". ValueError, naming
    CUDA, for a CUDA device torch cannot see."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(f"device {name!r} needs CUDA, but torch sees no CUDA device (torch {torch.__version__}, "
                         f"{build}): run on a machine with an NVIDIA GPU and a CUDA build of torch, or use "
                         "device 'cpu' or 'auto'")
    index = int(name.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: torch sees {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return name


def model_device(model: ModelConfig, tp_size: int = 1, dp_size: int = 1) -> str:
    """The device `model.device` resolves to; "auto" stays on the CPU for what runs only there (quantized weights,
    but an FP8 checkpoint's, read dequantised; tensor and data parallelism)."""
    cpu_only = model.quantization not in (None, "fp8") or tp_size > 1 or dp_size > 1
    return "cpu" if model.device == "auto" and cpu_only else resolve_device(model.device)


def resolve_engine_device(config: EngineConfig) -> None:
    """Set `config.model.device` to the device it resolves to (`model_device`); asking for CUDA with what runs
    only on the CPU is a ValueError."""
    parallel = config.parallel
    device = model_device(config.model, parallel.tensor_parallel_size, parallel.data_parallel_size)
    config.model = dataclasses.replace(config.model, device=device)  # re-validated: no quantization on CUDA
    if device != "cpu" and (parallel.tensor_parallel_size > 1 or parallel.data_parallel_size > 1):
        raise ValueError(f"on {device} pagedllm runs one engine on one device: tensor_parallel_size and "
                         "data_parallel_size must be 1 (the tensor-parallel collectives go through host shared "
                         "memory, and data-parallel replicas would share the device's memory budget)")


def describe_device(device: torch.device) -> str:
    """'cuda:0 (NVIDIA H200, 139.8 GiB)' or 'cpu (31.3 GiB RAM)', for the start-up log."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({props.name}, {props.total_memory / GiB:.1f} GiB)"
    return f"cpu ({psutil.virtual_memory().total / GiB:.1f} GiB RAM)"
