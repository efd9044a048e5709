"""Multi-head latent attention (MLA: DeepSeek-V2's and V3's, DeepSeek-V2-Lite's, Moonlight's).

Each token's keys and values come from one small latent, shared by every head, and one rotary key, shared too:

    latent, k_rot = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope_head_dim]);  c = kv_a_layernorm(latent)
    k_nope_h = W_UK_h c,  v_h = W_UV_h c                       (kv_b_proj's rows: each head's W_UK_h, then W_UV_h)
    q_nope_h, q_rot_h = split(q_proj(x), per head [...])       (V2's and V3's: q_b_proj(q_a_layernorm(q_a_proj(x))))
    o = o_proj(concat_h softmax([q_nope_h, rope(q_rot_h)] . [k_nope_h, rope(k_rot)] * scale) v_h)

transformers caches c and k_rot and expands them into every head's keys and values each step. Here the projections
are absorbed instead (DeepSeek's own inference, vLLM's decode): q_nope_h . W_UK_h c = (W_UK_h^T q_nope_h) . c, and
sum_k p_k W_UV_h c_k = W_UV_h sum_k p_k c_k, so the paged cache holds one row a token a layer, [c, rope(k_rot)]
(kv_lora_rank + qk_rope_head_dim values: 576 for DeepSeek's; its value row c, zero-padded to that width so that one
pool of rows of one width holds both), attended as a multi-query attention's by the queries [W_UK_h^T q_nope_h,
rope(q_rot_h)] of every head, each head's output W_UV_h applied to its first kv_lora_rank values. DeepSeek-V2-Lite: 27
layers x 2 x 576 x 2 bytes, ~62 KB a bf16 token (the expanded keys and values would take ~330 KB). The same sums in
another order: float32 logits within ~1e-6 of transformers'.

The rope turns interleaved pairs of the rotary values (V2's complex multiplication; V3's `rope_interleave`): their
rows of q's and kv_a_proj_with_mqa's weights are reordered into halves at load (`mla_rope_rows`), as for ERNIE's,
which leaves q . k as it was. YaRN's `mscale_all_dim` scales the scores too (`mla_scale`).
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


def mla_cache_row(config: Any) -> int:
    """The values of a token's one cache row (K and V alike) in each layer: the latent and the rotary key."""
    return config.kv_lora_rank + config.qk_rope_head_dim


class _Weight(nn.Module):
    """A weight that stays a plain tensor (kv_b_proj's: absorbed into the queries and outputs head by head, never a
    linear layer's call, so never packed)."""

    def __init__(self, rows: int, columns: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, columns, dtype=dtype), requires_grad=False)


class MLAttention(nn.Module):
    """Multi-head latent attention over a paged cache of latents, its projections absorbed; on one rank."""

    def __init__(self, config: Any, dtype: torch.dtype, attn_backend: AttentionBackend,
                 rotary_emb: RotaryEmbedding, tp: tuple[int, int]) -> None:
        super().__init__()
        if tp[1] > 1:
            raise ValueError("multi-head latent attention (DeepSeek's) runs on one rank (tensor_parallel_size=1)")
        self.num_heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.qk_dim, self.kv_rank = self.nope + self.rope, config.kv_lora_rank
        hidden, bias, q_rank = config.hidden_size, bool(getattr(config, "attention_bias", False)), config.q_lora_rank
        queries = self.num_heads * self.qk_dim
        self.q_proj = None if q_rank else ColumnParallelLinear(hidden, queries, bias=False, dtype=dtype)
        self.q_a_proj = ColumnParallelLinear(hidden, q_rank, bias=bias, dtype=dtype) if q_rank else None
        self.q_a_layernorm = RMSNorm(q_rank, _LATENT_NORM_EPS, dtype) if q_rank else None
        self.q_b_proj = ColumnParallelLinear(q_rank, queries, bias=False, dtype=dtype) if q_rank else None
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, self.kv_rank + self.rope, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, _LATENT_NORM_EPS, dtype)
        self.kv_b_proj = _Weight(self.num_heads * (self.nope + self.v_dim), self.kv_rank, dtype)
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
        heads = self.num_heads
        absorbed = self.kv_b_proj.weight.view(heads, self.nope + self.v_dim, self.kv_rank)
        w_uk, w_uv = absorbed[:, :self.nope], absorbed[:, self.nope:]             # [H, nope, rank], [H, v, rank]
        q = self.queries(x)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())                          # [T, rank]
        q_rot, k_rot = self.rotary_emb(positions, q[..., self.nope:].contiguous(), k_rot.reshape(-1, 1, self.rope))
        q_latent = torch.bmm(q[..., :self.nope].transpose(0, 1), w_uk).transpose(0, 1)   # [T, H, rank]
        query = torch.cat([q_latent, q_rot], dim=-1)
        key = torch.cat([latent[:, None], k_rot], dim=-1)                          # [T, 1, rank + rope]
        value = F.pad(latent, (0, self.rope))[:, None]
        k_cache, v_cache = kv_cache
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = self.attn_backend(query, k_cache, v_cache, meta, self.scale)         # [T, H, rank + rope]
        out = torch.bmm(out[..., :self.kv_rank].transpose(0, 1), w_uv.transpose(1, 2))    # [H, T, v]
        return self.o_proj(out.transpose(0, 1).flatten(1))
