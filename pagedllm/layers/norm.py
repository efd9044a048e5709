"""RMSNorm, with the residual add fused in as vLLM does."""

from __future__ import annotations

import torch
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
