"""Rotary position embedding (neox style, `rotate_half`, as Hugging Face Llama applies it).

Supports rope types "default", "linear" and "llama3". `rope_config(hf_config)` reads transformers 5's
`config.rope_parameters` and falls back to the older `rope_theta` / `rope_scaling` fields.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.kernels import kernels_for


def rope_config(config: Any, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(base, scaling) from a Hugging Face config, for layers of `layer_type` where its `rope_parameters` has a
    rope for each type (Gemma 3's "sliding_attention" and "full_attention" layers); scaling is None for the default
    rope type."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        base = float(params["rope_theta"])
        scaling = dict(params)
    else:
        base = float(getattr(config, "rope_theta", 10000.0))
        scaling = dict(getattr(config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return base, (None if rope_type == "default" else {**scaling, "rope_type": rope_type})


def _default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    # The same expression as transformers' default rope init, so float32 results match bit for bit.
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies."""
    inv_freq = _default_inv_freq(head_dim, base)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]  # type: ignore[index]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q and k at the given positions; cos/sin precomputed for max_position."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(head_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]. Rotates q and k in place and returns them.

        In place because they are views of the step's fresh qkv projection; on the CPU one C++ kernel does it,
        elsewhere `forward_native` (the torch reference, which returns new tensors) and a copy back.
        """
        kernels = kernels_for(q)
        if kernels is None:
            q_rot, k_rot = self.forward_native(positions, q, k)
            q.copy_(q_rot)
            k.copy_(k_rot)
        else:
            kernels.rotary_embedding(positions.long(), q, k, self.cos_cache, self.sin_cache)
        return q, k

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def get_rope(head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None) -> RotaryEmbedding:
    """A rotary embedding for `head_dim`, positions < `max_position`, rope type from `rope_scaling`."""
    return RotaryEmbedding(head_dim, max_position, base, rope_scaling)
