"""The plain paged-attention reference: the oracle every faster backend is tested against.

Slot mapping: the cache is a flat array of `num_blocks * block_size` slots, viewed as blocks.

    block_table of seq i = [7, 2, 5]          block_size = 4
    position:   0 1 2 3 | 4 5 6 7 | 8 9
    block:      7       | 2       | 5
    slot:      28 .. 31 | 8 .. 11 | 20 21     slot = block_table[pos // 4] * 4 + pos % 4

    k_cache[slot // block_size, slot % block_size] holds the key of that position (a CPU pool stores each block
    head-major: pagedllm.runner.kv_tensors.pool_view; indexing never assumes the cache's strides).
"""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V at their slots.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim].
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place; an int8 cache
            ([..., head_dim + 4]) stores the rows quantized by `quantize_kv`.
        slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset.
    """
    blocks, offsets = slot_mapping // k_cache.shape[1], slot_mapping % k_cache.shape[1]
    k_cache[blocks, offsets] = _to_cache(key, k_cache.dtype)
    v_cache[blocks, offsets] = _to_cache(value, v_cache.dtype)


def _to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    return quantize_kv(x) if cache_dtype == torch.int8 else x.to(cache_dtype)


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """K or V rows in an int8 cache's layout: [..., head_dim] -> [..., head_dim + 4] int8.

    Each row (one token's one kv head) is scaled symmetrically by its own absmax: s = max|x| / 127, q =
    round(x / s), stored as the head_dim int8 values q followed by the 4 bytes of float32 s. Keeping the scale in
    the row keeps it in the block, so that a block copy or swap moves it with the data, and a per-token scale
    makes a token's stored K/V independent of the tokens batched with it.

        row: | q[0] q[1] ... q[D-1] | s (float32, 4 bytes) |      x ~= q * s
    """
    scale = x.float().abs().amax(dim=-1, keepdim=True) / 127.0  # [..., 1]
    q = torch.round(x.float() / torch.where(scale > 0, scale, 1.0)).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor) -> torch.Tensor:
    """Cached K or V rows as float32: an int8 cache's q * s ([..., head_dim + 4] -> [..., head_dim]), a float
    cache's values widened."""
    if rows.dtype != torch.int8:
        return rows.float()
    return rows[..., :-4].float() * rows[..., -4:].contiguous().view(torch.float32)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` positions of one sequence: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def paged_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                        causal: bool = True, alibi_slopes: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context.

    Query row j of seq i sits at position `q = seq_len_i - q_len_i + j` and sees positions <= q; with a sliding
    `window` (0: none), only the last `window` of them, positions in (q - window, q] (transformers' and vLLM's
    `sliding_window`). Not `causal` (an encoder's bidirectional attention, EmbeddingGemma's), it sees every position
    of the context; with a window, those in (q - window, q + window). With a `softcap` (0: none; Gemma 2's
    `attn_logit_softcapping`) the scaled scores s become softcap * tanh(s / softcap) before the softmax. With
    `alibi_slopes` ([num_heads] float32: ALiBi's, BLOOM's and MPT's position bias in place of a rotary embedding), head
    h's score of the key at k for the query at q then gains slopes[h] * (k - q): the further back, the lower (a
    causal layer's). With `sinks` ([num_heads] float32: gpt-oss's attention sinks), head h's softmax runs over one
    more logit, sinks[h], whose value is zero: a row's weights then sum to less than 1, by as much as the sink takes
    (transformers' eager attention concatenates it to the scores and drops its column after the softmax). The K/V of
    the new tokens must already be written to the cache.

    Args:
        query: [num_tokens, num_heads, head_dim].
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] in a float dtype, or int8 caches
            (see `quantize_kv`), dequantized as they are read.
    Returns:
        [num_tokens, num_heads, head_dim], in query's dtype.
    """
    out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        q = query[start:end].float()  # [q_len, H, D]
        k = dequantize_kv(gather_kv(k_cache, meta.block_tables[i], seq_len)).repeat_interleave(group, dim=1)
        v = dequantize_kv(gather_kv(v_cache, meta.block_tables[i], seq_len)).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, q_len, seq_len]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        # how far each key lies after each query row: [q_len, seq_len] (no key is seq_len after one)
        offset = torch.arange(seq_len).unsqueeze(0) - torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.float().cpu()[:, None, None] * offset
        hidden = offset > 0 if causal else offset >= (window or seq_len)
        if window:
            hidden |= offset <= -window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sink = sinks.float().cpu()[:, None, None].expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
