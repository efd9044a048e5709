"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import kernels_for


class SiluAndMul(nn.Module):
    """x: [T, 2 * d] (gate, up) -> silu(gate) * up: [T, d]. One C++ pass on the CPU; `forward_native` is torch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = kernels_for(x)
        if kernels is None or x.dim() != 2:
            return self.forward_native(x)
        out = x.new_empty(x.shape[0], x.shape[1] // 2)
        kernels.silu_and_mul(out, x)
        return out

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """x: [T, 2 * d] (gate, up) -> gelu(gate) * up: [T, d], GELU's tanh approximation (Gemma's
    `gelu_pytorch_tanh`). Two torch ops: no C++ pass of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
