"""Multi-head latent attention (MLA: DeepSeek-V2's and V3's, DeepSeek-V2-Lite's, Moonlight's).

Each token's keys and values come from one small latent, shared by every head, and one rotary key, shared too:

    latent, k_rot = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope_head_dim])
    k_nope_h, v_h = split(kv_b_proj(kv_a_layernorm(latent)), per head [qk_nope_head_dim, v_head_dim])
    q_nope_h, q_rot_h = split(q_proj(x), per head [...])       (V2's and V3's: q_b_proj(q_a_layernorm(q_a_proj(x))))
    k_h = [k_nope_h, rope(k_rot)]   q_h = [q_nope_h, rope(q_rot_h)]
    o = o_proj(concat_h softmax(q_h . k_h * scale) v_h)

as transformers runs it (which caches the latent and expands it every step). Here the expanded keys and values go
into the paged cache as a multi-head attention's, each head's value zero-padded to the key's width (qk_head_dim)
so that one pool of rows of one width holds both, and the kernels attend as they attend any layer's; the output's
padding is dropped before o_proj. That is ~9x the latent's bytes a token (DeepSeek-V2-Lite: 27 layers x 16 heads x
192 x 2: ~330 KB a bf16 token), the price of running through the kernels unchanged; the latent cache with the
projections absorbed into the queries (vLLM's) would keep 576 values a token a layer.

The rope turns interleaved pairs of the rotary values (V2's complex multiplication; V3's `rope_interleave`): their
rows of q's and kv_a_proj_with_mqa's weights are reordered into halves at load (`rope_rows_to_halves`), as for
ERNIE's, which leaves q . k as it was. YaRN's `mscale_all_dim` scales the scores too (`mla_scale`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.cpu import write_kv
from pagedllm.attention.metadata import AttentionBackend, AttentionMetadata, KVCache
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding

MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
_LATENT_NORM_EPS = 1e-6     # the latents' RMSNorms' (transformers builds them with their default eps)


def is_mla(config: Any) -> bool:
    return config.model_type in MLA_MODEL_TYPES


def mla_scale(config: Any) -> float:
    """The scores' scale: qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared where the rope is
    scaled (transformers' yarn_apply_mscale)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    factor, all_dim = params.get("factor"), params.get("mscale_all_dim")
    if params.get("rope_type", "default") != "default" and all_dim and factor and factor > 1:
        mscale = 0.1 * all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def rope_interleaved(config: Any) -> bool:
    """Whether the checkpoint's rotary values come in interleaved pairs: V2's always, V3's where rope_interleave."""
    return config.model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", True))


def rope_rows_to_halves(tensor: torch.Tensor, heads: int, skipped: int, rope: int) -> torch.Tensor:
    """Rows [heads x (skipped + rope), ...] with each head's last `rope` rows reordered from interleaved pairs into
    halves (rows 0, 2, 4, ..., then 1, 3, 5, ...): the layout `RotaryEmbedding` turns."""
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    rows = tensor.reshape(heads, skipped + rope, *tensor.shape[1:]).clone()
    rows[:, skipped:] = rows[:, skipped:][:, order]
    return rows.reshape(tensor.shape)


def mla_rope_rows(config: Any, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor with its interleaved rotary rows reordered into halves where it has some (q_proj's or
    q_b_proj's, kv_a_proj_with_mqa's); any other as it is."""
    if not rope_interleaved(config):
        return tensor
    nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim
    if name.endswith((".q_proj.weight", ".q_b_proj.weight")):
        return rope_rows_to_halves(tensor, config.num_attention_heads, nope, rope)
    if name.endswith((".kv_a_proj_with_mqa.weight", ".kv_a_proj_with_mqa.bias")):
        return rope_rows_to_halves(tensor, 1, config.kv_lora_rank, rope)
    return tensor


class MLAttention(nn.Module):
    """Multi-head latent attention over a paged cache of its expanded keys and (padded) values; on one rank."""

    def __init__(self, config: Any, dtype: torch.dtype, attn_backend: AttentionBackend,
                 rotary_emb: RotaryEmbedding, tp: tuple[int, int]) -> None:
        super().__init__()
        if tp[1] > 1:
            raise ValueError("multi-head latent attention (DeepSeek's) runs on one rank (tensor_parallel_size=1)")
        self.num_heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.qk_dim, self.kv_rank = self.nope + self.rope, config.kv_lora_rank
        if self.v_dim > self.qk_dim:
            raise ValueError(f"v_head_dim {self.v_dim} wider than the keys ({self.qk_dim}) is not supported")
        hidden, bias, q_rank = config.hidden_size, bool(getattr(config, "attention_bias", False)), config.q_lora_rank
        queries = self.num_heads * self.qk_dim
        self.q_proj = None if q_rank else ColumnParallelLinear(hidden, queries, bias=False, dtype=dtype)
        self.q_a_proj = ColumnParallelLinear(hidden, q_rank, bias=bias, dtype=dtype) if q_rank else None
        self.q_a_layernorm = RMSNorm(q_rank, _LATENT_NORM_EPS, dtype) if q_rank else None
        self.q_b_proj = ColumnParallelLinear(q_rank, queries, bias=False, dtype=dtype) if q_rank else None
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, self.kv_rank + self.rope, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, _LATENT_NORM_EPS, dtype)
        self.kv_b_proj = ColumnParallelLinear(self.kv_rank, self.num_heads * (self.nope + self.v_dim), bias=False,
                                              dtype=dtype)
        self.o_proj = RowParallelLinear(self.num_heads * self.v_dim, hidden, bias=bias, dtype=dtype)
        self.rotary_emb = rotary_emb
        self.attn_backend = attn_backend
        self.scale = mla_scale(config)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """[T, heads, qk_head_dim], not yet turned."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(-1, self.num_heads, self.qk_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                lora: Any = None) -> torch.Tensor:
        q = self.queries(x)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent.contiguous())).view(-1, self.num_heads, self.nope + self.v_dim)
        q_rot, k_rot = self.rotary_emb(positions, q[..., self.nope:].contiguous(), k_rot.reshape(-1, 1, self.rope))
        query = torch.cat([q[..., :self.nope], q_rot], dim=-1)
        key = torch.cat([kv[..., :self.nope], k_rot.expand(-1, self.num_heads, -1)], dim=-1)
        value = F.pad(kv[..., self.nope:], (0, self.qk_dim - self.v_dim))
        k_cache, v_cache = kv_cache
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = self.attn_backend(query, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out[..., :self.v_dim].flatten(1))
