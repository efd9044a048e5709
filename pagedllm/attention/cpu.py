"""The batched CPU paged-attention backend: `torch.nn.functional.scaled_dot_product_attention` over K/V
gathered through the block tables. Same signature and results as `torch_ref.paged_attention_ref`.

Pure decode batches (every q_len == 1) run as one padded SDPA call with a key mask; mixed batches run one
SDPA call per sequence, causal with the query block aligned to the end of the context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import gather_kv, write_kv

__all__ = ["paged_attention", "write_kv"]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal paged attention; see `paged_attention_ref`. query: [T, Hq, D] -> [T, Hq, D]."""
    if meta.is_pure_decode and meta.num_seqs > 1:
        return _decode_batched(query, k_cache, v_cache, meta, scale)
    return _per_sequence(query, k_cache, v_cache, meta, scale)


def _per_sequence(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
    out = torch.empty_like(query)
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        q = query[start:end].transpose(0, 1)  # [H, q_len, D]
        k = gather_kv(k_cache, meta.block_tables[i], seq_len).transpose(0, 1)  # [Hkv, seq_len, D]
        v = gather_kv(v_cache, meta.block_tables[i], seq_len).transpose(0, 1)
        mask = None
        if 1 < q_len:
            # Query j sits at position seq_len - q_len + j: an offset causal mask (SDPA's is_causal aligns
            # to the top-left, which is only right when there is no cached prefix).
            mask = _offset_causal_mask(q_len, seq_len, query.device)
        o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def _offset_causal_mask(q_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, seq_len] bool, True where query row j may see key k (k <= seq_len - q_len + j)."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
    return torch.arange(seq_len, device=device).unsqueeze(0) <= q_pos


def _decode_batched(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One SDPA call for B single-token queries over contexts padded to the longest block table."""
    block_size = k_cache.shape[1]
    num_blocks = (meta.max_seq_len + block_size - 1) // block_size
    tables = meta.block_tables[:, :num_blocks].long()  # [B, nb]
    k = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, nb*bs, D]
    v = v_cache[tables].flatten(1, 2).transpose(1, 2)
    positions = torch.arange(num_blocks * block_size, device=query.device)
    mask = positions.unsqueeze(0) < meta.seq_lens.to(query.device).unsqueeze(1)  # [B, nb*bs]
    q = query.unsqueeze(2)  # [B, H, 1, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                       enable_gqa=True)
    return o.squeeze(2)  # [B, H, D]
