"""Rotary position embedding (neox style, `rotate_half`, as Hugging Face Llama applies it), over a head's first
`rotary_dim` values (all of them, or a part: Phi-4-mini's 3/4), the rest passed through.

Supports rope types "default", "linear", "llama3" and "longrope" (Phi-3's), and M-RoPE (Qwen2-VL's and Qwen3-VL's:
`mrope_axes`), whose image tokens sit at three positions. `rope_config(hf_config)` reads transformers 5's
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
    if rope_type == "mrope":    # older Qwen2-VL configs' name for M-RoPE, whose frequencies are the default ones
        rope_type = "default"
    if rope_type == "dynamic" and scaling.get("alpha"):     # Hunyuan's: a fixed alpha, whatever the length
        rope_type = "ntk_alpha"
    if rope_type == "yarn":     # the context it was trained on (the model's own where the config names none)
        scaling.setdefault("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None)
                           or config.max_position_embeddings)
    if rope_type == "longrope":     # the context it was trained on, and how far past it the model reaches
        original = scaling.get("original_max_position_embeddings") or config.original_max_position_embeddings
        scaling["original_max_position_embeddings"] = original
        if scaling.get("factor") is None:
            scaling["factor"] = config.max_position_embeddings / original
    return base, (None if rope_type == "default" else {**scaling, "rope_type": rope_type})


def mrope_axes(config: Any) -> list[int] | None:
    """M-RoPE: the position, of a token's (frame, row, column), that turns each of a head's rotary frequencies (0, 1
    or 2, one per frequency): Qwen2-VL's sections ([16, 24, 24] of half a head of 128: the first 16 by the frame,
    ...), or Qwen3-VL's interleaving of them (`mrope_interleaved`: frame, row, column, frame, ..., the frame's after
    the others run out); None for any other rope."""
    for params in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if isinstance(params, dict) and params.get("mrope_section"):
            section = list(params["mrope_section"])
            if not params.get("mrope_interleaved"):
                return [axis for axis, count in enumerate(section) for _ in range(count)]
            axes = [0] * sum(section)
            for axis in (1, 2):     # every third from its own, as far as its count reaches (or the head ends)
                for index in range(axis, min(3 * section[axis], len(axes)), 3):
                    axes[index] = axis
            return axes
    return None


def rotary_dim(config: Any, head_dim: int) -> int:
    """How many of a head's values the rotary embedding turns: head_dim x `partial_rotary_factor` (Phi-4-mini's
    0.75), GPT-J's `rotary_dim`, all of them without either."""
    if getattr(config, "model_type", None) == "gptj" and config.rotary_dim:
        return int(config.rotary_dim)
    params = getattr(config, "rope_parameters", None)
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    return int(head_dim * (factor or getattr(config, "partial_rotary_factor", None) or 1.0))


def interleaved_to_halves(weight: torch.Tensor, num_heads: int, rotary_dim: int | None = None) -> torch.Tensor:
    """q or k projection rows (weight or bias) of `num_heads` heads, each head's rows from interleaved pairs
    [x0, y0, x1, y1, ...] (the GPT-J rotary layout: ERNIE 4.5's, Helium's and GLM's checkpoints, llama.cpp's files) to
    halves [x0, x1, ..., y0, y1, ...] (the NeoX layout pagedllm's rotary embedding turns): a permutation of each head's
    values, which leaves q . k as it was. The inverse of convert_hf_to_gguf's `permute`: reshape(H, d/2, 2, ...)
    swapped to (H, 2, d/2, ...). Only a head's first `rotary_dim` rows (all by default) are turned, and reordered;
    the rest stay where they are (GLM's half)."""
    rest = weight.shape[1:]
    heads = weight.reshape(num_heads, weight.shape[0] // num_heads, *rest)
    dim = rotary_dim or heads.shape[1]
    turned = heads[:, :dim].reshape(num_heads, dim // 2, 2, *rest).transpose(1, 2).reshape(num_heads, dim, *rest)
    return torch.cat([turned, heads[:, dim:]], dim=1).reshape(weight.shape)


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


def _longrope_inv_freq(head_dim: int, base: float, factors: list[float]) -> torch.Tensor:
    """Phi-3's: each frequency slowed by its own factor (transformers' expression, for its bits)."""
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** shape)


def _longrope_attention_factor(scaling: dict) -> float:
    """The scale of longrope's cos and sin tables: the config's `attention_factor`, else sqrt(1 + ln(factor) /
    ln(original context)) for a model reaching past its original context (1 otherwise)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0


def _yarn_inv_freq(head_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN's (Qwen2.5's and Qwen3's long contexts, DeepSeek's): each frequency between its own (extrapolated) and
    slowed by `factor` (interpolated), by a linear ramp over the dimensions whose wavelengths fit within
    `beta_fast`..`beta_slow` rotations of the original context (transformers' expressions, for its bits)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001   # (as transformers widens a ramp of no width)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def _yarn_attention_factor(scaling: dict) -> float:
    """The scale of YaRN's cos and sin tables: the config's `attention_factor`, else 0.1 ln(factor) + 1 (DeepSeek's:
    its ratio at `mscale` and `mscale_all_dim`)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
    return mscale(factor)


def compute_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies (longrope's short ones: `RotaryEmbedding` takes both)."""
    inv_freq = _default_inv_freq(head_dim, base)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]  # type: ignore[index]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
    if rope_type == "longrope":
        return _longrope_inv_freq(head_dim, base, scaling["short_factor"])  # type: ignore[index]
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, scaling)  # type: ignore[arg-type]
    if rope_type == "ntk_alpha":    # Hunyuan's fixed NTK: the base stretched by alpha ** (D / (D - 2))
        return _default_inv_freq(head_dim, base * scaling["alpha"] ** (head_dim / (head_dim - 2)))  # type: ignore
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3, "
                              "longrope, yarn, dynamic with a fixed alpha)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to the first `rotary_dim` values of each head of q and k at the given positions;
    cos/sin precomputed for max_position.

    Longrope has two tables, rows [0, P) with its short factors and [P, 2P) with its long ones, both scaled by its
    attention factor: a step reaching its original context's end takes the long rows for all its tokens
    (`table_rows`), as transformers picks them for a whole forward pass and vLLM for a whole step. A prompt within
    the original context runs as transformers runs it; one past it, prefilled in one step, too; a context that
    grows past it keeps the short factors in the keys cached before (so does transformers' generate).

    M-RoPE (`mrope_axes`) turns each of a head's frequencies by one of a token's three positions. A text token's
    three are equal: its table row is its position, as for any rope. An image token's rows are written for its step
    past the tables' own (`spatial_rows`), so that the kernels take them as any other.
    """

    def __init__(self, rotary_dim: int, max_position: int, base: float, scaling: dict | None = None,
                 mrope_axes: list[int] | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.mrope_axes = mrope_axes
        positions = torch.arange(max_position, dtype=torch.float32)
        inv_freqs = [compute_inv_freq(rotary_dim, base, scaling)]
        self.long_from, scale = 0, 1.0     # longrope's: the first position of the long rows, its tables' scale
        if scaling is not None and scaling["rope_type"] == "longrope":
            inv_freqs.append(_longrope_inv_freq(rotary_dim, base, scaling["long_factor"]))
            self.long_from, scale = scaling["original_max_position_embeddings"], _longrope_attention_factor(scaling)
        if scaling is not None and scaling["rope_type"] == "yarn":     # YaRN's tables scaled too
            scale = _yarn_attention_factor(scaling)
        freqs = torch.cat([torch.outer(positions, inv_freq) for inv_freq in inv_freqs])  # [P or 2P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P or 2P, D]
        self.max_position = max_position
        self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)    # x 1.0 leaves the bits as they are
        self.register_buffer("sin_cache", emb.sin() * scale, persistent=False)
        self.spare_rows = 0     # M-RoPE's rows past the tables' own, for a step's image tokens

    def spatial_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """M-RoPE: table rows for tokens at (frame, row, column) positions [3, R]: each of a row's values taken from
        the row of its axis's position, written past the tables' own rows (more room made where R is more than
        there is: then the tables are new tensors). Returns the rows [R] and whether the tables are new."""
        assert self.mrope_axes is not None, "spatial rows are M-RoPE's"
        count, grown = positions.shape[1], positions.shape[1] > self.spare_rows
        if grown:
            self.spare_rows = max(count, 2 * self.spare_rows, 256)
            for name in ("cos_cache", "sin_cache"):
                table = getattr(self, name)
                bigger = table.new_empty(self.max_position + self.spare_rows, table.shape[1])
                bigger[:self.max_position] = table[:self.max_position]
                setattr(self, name, bigger)
        axis = torch.tensor(self.mrope_axes * 2, device=positions.device)     # [D]: the axis of each value
        rows = torch.arange(self.max_position, self.max_position + count, device=positions.device)
        for table in (self.cos_cache, self.sin_cache):
            table[rows] = table[positions].gather(0, axis.expand(1, count, -1))[0]   # [3, R, D] -> [R, D]
        return rows, grown

    def table_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The tables' rows for a step's positions: the positions, but under longrope, where a step that reaches
        its original context's end takes the long rows for all its tokens (in tensor ops: no host sync)."""
        if not self.long_from or positions.numel() == 0:
            return positions
        return positions + (positions.max() >= self.long_from) * self.max_position

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T], the tables' rows (`table_rows`); q: [T, Hq, D]; k: [T, Hkv, D]. Rotates q and k in
        place and returns them.

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
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)  # [T, 1, rotary_dim]
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        d = self.rotary_dim

        def rotate(x: torch.Tensor) -> torch.Tensor:
            turned = x[..., :d] * cos + rotate_half(x[..., :d]) * sin
            return turned if d == x.shape[-1] else torch.cat([turned, x[..., d:]], dim=-1)

        return rotate(q), rotate(k)


def get_rope(rotary_dim: int, max_position: int, base: float, rope_scaling: dict | None = None,
             mrope_axes: list[int] | None = None) -> RotaryEmbedding:
    """A rotary embedding over a head's first `rotary_dim` values, positions < `max_position`, rope type from
    `rope_scaling`; M-RoPE's with its `mrope_axes`."""
    return RotaryEmbedding(rotary_dim, max_position, base, rope_scaling, mrope_axes)
