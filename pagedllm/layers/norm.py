"""RMSNorm, with the residual add fused in as vLLM does; LayerNorm with biases, the add fused in, for BERT's
post-norm layers; PreLayerNorm, a LayerNorm called as RMSNorm is, for the pre-norm decoders that norm with one."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import kernels_for


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32 and cast back (as Hugging Face Llama does).

    On the CPU one C++ pass per row does it (`kernels/csrc/layers.cpp`); `forward_native` is the torch
    reference.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H]. With `residual`, returns (norm(x + residual), x + residual)."""
        kernels = kernels_for(x)
        if kernels is None or x.dim() != 2:
            return self.forward_native(x, residual)
        out = torch.empty_like(x)
        if residual is None:
            kernels.rms_norm(out, x, self.weight, self.eps)
            return out
        residual_out = torch.empty_like(x)
        kernels.fused_add_rms_norm(out, residual_out, x, residual, self.weight, self.eps)
        return out, residual_out

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual  # in the model dtype, like HF's `hidden_states = residual + hidden_states`
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LayerNorm(nn.Module):
    """y = LayerNorm(x + residual) * weight + bias (BERT's post-norm: the residual is the sublayer's input), the
    sum in the model dtype as torch adds it, normalised in float32. `residual` may be a row broadcast to x's shape
    (an embedding's token type row). One C++ pass per row on the CPU (`kernels/csrc/layers.cpp`); `forward_native`
    is torch's."""

    def __init__(self, hidden_size: int, eps: float = 1e-12, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return _layer_norm(self, x, residual)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return _layer_norm_native(self, x, residual)


class PreLayerNorm(nn.Module):
    """LayerNorm with RMSNorm's calling convention, for the decoders that norm each branch's input with a LayerNorm
    (StableLM, Phi, GPT-NeoX, StarCoder2, Cohere): with `residual`, returns (norm(x + residual), x + residual), the sum
    in the model dtype as transformers adds it; normalised as `LayerNorm` does. `bias=False` (Cohere's): no bias
    parameter, a zero buffer in its place for the kernel; `weight=False` too (OLMo's, which learns neither): a buffer
    of ones."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32,
                 bias: bool = True, weight: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight: torch.Tensor
        self.bias: torch.Tensor
        for name, learned, fill in (("weight", weight, torch.ones), ("bias", bias, torch.zeros)):
            if learned:
                setattr(self, name, nn.Parameter(fill(hidden_size, dtype=dtype), requires_grad=False))
            else:
                self.register_buffer(name, fill(hidden_size, dtype=dtype), persistent=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H]. With `residual`, returns (norm(x + residual), x + residual)."""
        return self._add_and_norm(_layer_norm, x, residual)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._add_and_norm(_layer_norm_native, x, residual)

    def _add_and_norm(self, norm: Callable[[PreLayerNorm, torch.Tensor, None], torch.Tensor], x: torch.Tensor,
                      residual: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return norm(self, x, None)
        x = x + residual
        return norm(self, x, None), x


def _layer_norm(norm: LayerNorm | PreLayerNorm, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """LayerNorm(x + residual) with `norm`'s weight, bias and eps: the kernel's one pass per row where it runs."""
    kernels = kernels_for(x)
    if kernels is None or x.dim() != 2:
        return _layer_norm_native(norm, x, residual)
    out = torch.empty_like(x)
    kernels.add_layer_norm(out, x, None if residual is None else residual.expand_as(x), norm.weight, norm.bias,
                           norm.eps)
    return out


def _layer_norm_native(norm: LayerNorm | PreLayerNorm, x: torch.Tensor, residual: torch.Tensor | None
                       ) -> torch.Tensor:
    return F.layer_norm(x if residual is None else x + residual, norm.weight.shape, norm.weight, norm.bias, norm.eps)
