"""Activations."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import kernels_for


class _GatedAndMul(nn.Module):
    """x: [T, 2 * d] (gate, up) -> activation(gate) * up: [T, d]. One C++ pass on the CPU (the kernel
    `kernel_name`); `forward_native` is torch."""

    kernel_name: str
    activation: Callable[[torch.Tensor], torch.Tensor]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = kernels_for(x)
        if kernels is None or x.dim() != 2:
            return self.forward_native(x)
        out = x.new_empty(x.shape[0], x.shape[1] // 2)
        getattr(kernels, self.kernel_name)(out, x)
        return out

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return type(self).activation(gate) * up


class SiluAndMul(_GatedAndMul):
    """silu(gate) * up."""

    kernel_name = "silu_and_mul"
    activation = F.silu


class GeluAndMul(_GatedAndMul):
    """gelu(gate) * up, GELU's tanh approximation (Gemma's `gelu_pytorch_tanh`); the kernel computes it as
    gate / (1 + exp(-2 y)), torch as gate (1 + tanh(y)) / 2: the same within float rounding."""

    kernel_name = "gelu_and_mul"
    activation = functools.partial(F.gelu, approximate="tanh")


class SwigluOAI(nn.Module):
    """gpt-oss's clamped SwiGLU (vLLM's "swigluoai"): x [T, 2 d] (gate, up) -> (up' + 1) g sigmoid(alpha g) with
    g = min(gate, limit), up' = clamp(up, -limit, limit), in transformers' ops and their order (the C++ mixture of
    experts runs the same ops: kernels/csrc/moe.cpp's swiglu_oai). gpt-oss's checkpoints interleave gate and up;
    the loader puts them in halves (pagedllm.models.llama's `_gpt_oss_experts`)."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
