"""RMSNorm, with the residual add fused in as vLLM does."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32 and cast back (as Hugging Face Llama does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H]. With `residual`, returns (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual  # in the model dtype, like HF's `hidden_states = residual + hidden_states`
        return self._norm(x), x
