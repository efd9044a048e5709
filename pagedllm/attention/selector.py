"""Which paged-attention backend a device runs: pagedllm's CPU backend on a CPU, the Triton kernel on CUDA."""

from __future__ import annotations

import torch

from pagedllm.attention import cpu
from pagedllm.attention.metadata import AttentionBackend
from pagedllm.logger import init_logger

logger = init_logger(__name__)


def attention_backend(device: str) -> AttentionBackend:
    """The backend for `device` ("cpu", "cuda" or "cuda:N"). Without triton, CUDA falls back to the CPU backend's
    torch path (SDPA over gathered blocks), which runs on any device."""
    if torch.device(device).type != "cuda":
        return cpu.paged_attention
    try:
        from pagedllm.attention.triton_attention import paged_attention
    except ImportError as exc:
        logger.warning("attention on %s runs through the torch path, without the Triton kernel (%s): install "
                       "triton for it", device, exc)
        return cpu.paged_attention
    return paged_attention


def runs_in_cuda_graphs(backend: AttentionBackend) -> bool:
    """Whether a decode step through `backend` can be captured in a CUDA graph (pagedllm.runner.cuda_graphs): the
    Triton kernel reads each sequence's length and blocks on the device, the torch path loops over them on the
    host, where a graph would fix the values its capture saw."""
    return backend is not cpu.paged_attention
