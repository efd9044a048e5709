"""The CPU paged-attention backend. Same signature and results as `torch_ref.paged_attention_ref`.

The runner puts decode sequences (one new token) first; they run through the C++ decode kernel
(`pagedllm/kernels/csrc/decode_attention.cpp`), the rest (prefill chunks, with or without a cached prefix) through
the C++ prefill kernel (`prefill_attention.cpp`). Both read K/V in place through the block tables. When every
sequence's context starts with the same blocks (a system prompt the prefix cache holds, the samples of one prompt),
the step runs as cascade attention (`paged_attention.cpp`): all its query rows score the shared prefix in one pass,
and each sequence's own keys continue from there; same results, within rounding. Without the
kernels: decodes through one padded, masked SDPA call, and each prefill chunk through one SDPA call over its
gathered context (plainly causal when the chunk is the whole context, with an offset causal mask otherwise).
An int8 cache (kv_cache_dtype="int8", see `torch_ref.quantize_kv`) is dequantized where it is read: by the
kernels row by row, by the torch paths after each gather. `write_kv` stores a step's new K/V through the C++
`write_kv` (`cache_write.cpp`), which quantizes an int8 cache's rows as it goes.
A layer with a sliding window (`window` keys) has each query read only its window: the kernels start each row's keys
at the window's first (a step of such a layer never runs as cascade attention, its rows seeing different parts of a
shared prefix); the torch paths mask the keys before it. Soft-capped scores (`softcap`, Gemma 2's) are capped by the
kernels as each chunk's scores are made, and ALiBi's biases (`alibi_slopes`, BLOOM's and MPT's) added to them there
(such a step never runs as cascade attention either: each row's biases run from its own position). Attention sinks
(`sinks`, gpt-oss's) join each row's softmax denominator as the kernels make its output (a cascade's rows too, after
all their keys). Without the kernels, all three through the reference (SDPA has no soft-capping and no sinks).
An encoder's bidirectional attention (`bidirectional_attention`: each query sees the keys after it too) runs
through SDPA over the step's own K/V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention import torch_ref
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import dequantize_kv, gather_kv
from pagedllm.kernels import kernels_for

__all__ = ["paged_attention", "bidirectional_attention", "decode_attention", "cascade_prefix_len", "write_kv"]


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V at their slots: `torch_ref.write_kv`, in one C++ pass where the kernels run (a
    float cache of key's dtype, or an int8 cache quantized row by row) instead of two to two dozen torch ops."""
    kernels = kernels_for(key)
    if kernels is None or k_cache.dtype not in (key.dtype, torch.int8):
        return torch_ref.write_kv(key, value, k_cache, v_cache, slot_mapping)
    kernels.write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                    causal: bool = True, alibi_slopes: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal paged attention (or not: an encoder's, which the decoder stack runs through the kernels), over a
    sliding `window` of keys if not 0, its scores soft-capped at `softcap` if not 0 and biased by ALiBi's
    `alibi_slopes` if given, each head's softmax with its sink (`sinks`) if given; see `paged_attention_ref`.
    query: [T, Hq, D] -> [T, Hq, D]."""
    kernels = kernels_for(query)
    if kernels is None and (softcap or not causal or alibi_slopes is not None or sinks is not None):
        return torch_ref.paged_attention_ref(query, k_cache, v_cache, meta, scale, window, softcap, causal,
                                             alibi_slopes, sinks)
    if kernels is None:
        return _paged_attention_torch(query, k_cache, v_cache, meta, scale, window)
    query = query.contiguous()
    out = torch.empty_like(query)
    k_cache, v_cache = _kv_head_views(query, k_cache, v_cache)
    kernels.paged_attention(out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                            meta.num_decodes, scale, meta.cascade, window, softcap, causal, alibi_slopes, sinks)
    return out


def cascade_prefix_len(query: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> int:
    """The positions `paged_attention` runs as cascade attention's shared prefix for this batch (0: none, or no
    kernels): the same blocks at the start of every block table, seen by every query, in whole 64-key chunks, where
    enough sequences share enough of them to pay for the prefix's pass; 0 where `meta.cascade` is off."""
    kernels = kernels_for(query)
    if kernels is None or not meta.cascade:
        return 0
    return kernels.cascade_prefix_len(query, k_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """One query token per sequence, over its last `window` keys if not 0. query: [B, Hq, D]; block_tables:
    [B, max_blocks]; seq_lens: [B]."""
    kernels = kernels_for(query)
    if kernels is None:
        return _decode_padded(query, k_cache, v_cache, block_tables, seq_lens, scale, window)
    query = query.contiguous()
    out = torch.empty_like(query)
    k_cache, v_cache = _kv_head_views(query, k_cache, v_cache)
    kernels.decode_attention(out, query, k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(), scale,
                             window, 0.0, None, None)
    return out


# The most query heads the kernels' fixed-size decode paths take over one kv head's rows (their groups of 1-8).
_KERNEL_GROUP = 8


def _kv_head_views(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One kv head under a multiple of 8 query heads (DeepSeek's latent row under its 16 or 128 heads:
    pagedllm.models.mla) as several views of it (stride 0), 8 query heads each: the kernels' fixed-size paths, and
    a task for each view (one sequence's decode on both threads). One sequence's decode at 1,000 keys of 576 values,
    bf16, Zen 4: 0.30 ms a layer as two views of 8 heads, 1.25 ms as one group of 16 (the generic path). Other caches
    as they are."""
    group = query.shape[1] // k_cache.shape[2]
    if k_cache.shape[2] != 1 or group <= _KERNEL_GROUP or group % _KERNEL_GROUP:
        return k_cache, v_cache
    views = (-1, -1, group // _KERNEL_GROUP, -1)
    return k_cache.expand(views), v_cache.expand(views)


def _paged_attention_torch(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, window: int) -> torch.Tensor:
    num_decodes = meta.num_decodes
    if num_decodes == meta.num_seqs:
        return _decode_padded(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, window)
    out = torch.empty_like(query)
    if num_decodes:
        out[:num_decodes] = _decode_padded(query[:num_decodes], k_cache, v_cache, meta.block_tables[:num_decodes],
                                           meta.seq_lens[:num_decodes], scale, window)
    _prefill_per_sequence(out, query, k_cache, v_cache, meta, scale, window, first_seq=num_decodes)
    return out


def bidirectional_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata,
                            scale: float, window: int = 0) -> torch.Tensor:
    """An encoder's attention (EmbeddingGemma's bidirectional layers): each query row sees every key of its prompt,
    within `window` positions either side if not 0; `paged_attention_ref` with causal=False over a cache holding
    these keys. An encoder's prompt runs whole in one step, so it reads the step's own K/V, [T, Hkv, D] as `query`'s
    [T, Hq, D] rows (and no cache: nothing reads its K/V again). One SDPA call for each run of prompts of one length
    side by side in the step (a batch of equal documents: one call), on any device: such a model only embeds, so its
    attention is all prefill, which SDPA's flash kernel does well; masked only where the prompts are longer than the
    window. Prompts of lengths near one another (a cross-encoder's pairs), where padding each to the longest costs at
    most twice their own work, run padded in one call, the padding masked (a call per prompt cost ~0.3 ms each), and
    so do several prompts of one length that is not a multiple of `_KEY_MULTIPLE` (`_bidirectional_padded`)."""
    lens = meta.seq_lens_cpu
    longest = max(lens)
    if meta.num_seqs > 1 and meta.num_seqs * longest * longest <= 2 * sum(n * n for n in lens) and \
            (any(n != longest for n in lens) or longest % _KEY_MULTIPLE):
        return _bidirectional_padded(query, key, value, lens, longest, scale, window)
    out = torch.empty_like(query)
    qsl = meta.query_start_loc_cpu
    i = 0
    while i < meta.num_seqs:
        length = lens[i]
        j = i + 1
        while j < meta.num_seqs and lens[j] == length:
            j += 1
        start, end = qsl[i], qsl[j]
        assert end - start == (j - i) * length, "an encoder's prompt runs whole in one step"
        q, k, v = (x[start:end].unflatten(0, (j - i, length)).transpose(1, 2) for x in (query, key, value))
        mask = _visible(length, length, window, query.device, causal=False) if window and length > window else None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)  # [n, H, len, D]
        out[start:end] = o.transpose(1, 2).flatten(0, 1)
        i = j
    return out


_KEY_MULTIPLE = 16   # the padded keys' multiple in _bidirectional_padded


def _bidirectional_padded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lens: list[int], longest: int,
                          scale: float, window: int) -> torch.Tensor:
    """`bidirectional_attention` in one SDPA call over the prompts padded, [n, H, longest, D] queries over
    [n, H, keys, D] keys and values, each row seeing its own prompt's keys alone (and within `window` of it). The keys
    are padded to a multiple of 16: torch's CPU flash attention runs a tail of keys slowly (30 prompts of 12 heads of
    32, bf16: 68 keys 3.0-4.1 ms, the same padded to 80 2.0-2.3, 64 keys 1.5-1.7)."""
    keys = -(-longest // _KEY_MULTIPLE) * _KEY_MULTIPLE
    lengths = torch.tensor(lens).unsqueeze(1)
    starts = lengths.cumsum(0) - lengths
    valid = torch.arange(keys).unsqueeze(0) < lengths                                       # [n, keys]
    rows = (starts + torch.arange(keys)).where(valid, 0).to(query.device)                    # padding reads row 0
    valid = valid.to(query.device)
    mask = valid[:, None, None, :]                                                           # [n, 1, 1, keys]
    if window and longest > window:
        mask = mask & _visible(keys, keys, window, query.device, causal=False)[:longest]
    q = query[rows[:, :longest]].transpose(1, 2)                                             # [n, H, longest, D]
    k, v = (x[rows].transpose(1, 2) for x in (key, value))                                   # [n, H, keys, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)[valid[:, :longest]]                                           # the prompts' rows


def _prefill_per_sequence(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float, window: int, first_seq: int) -> None:
    qsl = meta.query_start_loc_cpu
    for i in range(first_seq, meta.num_seqs):
        seq_len, start, end = meta.seq_lens_cpu[i], qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        q = query[start:end].transpose(0, 1)  # [H, q_len, D]
        k = _as_query(query, gather_kv(k_cache, meta.block_tables[i], seq_len)).transpose(0, 1)  # [Hkv, seq_len, D]
        v = _as_query(query, gather_kv(v_cache, meta.block_tables[i], seq_len)).transpose(0, 1)
        # Query j sits at position seq_len - q_len + j. SDPA's is_causal aligns the mask to the top-left, which is
        # right only when nothing was cached before this chunk; otherwise the mask is offset.
        fresh = q_len == seq_len and not window
        mask = None if fresh or (q_len == 1 and not window) else _visible(q_len, seq_len, window, query.device)
        o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                           is_causal=fresh and q_len > 1, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)


def _visible(q_len: int, seq_len: int, window: int, device: torch.device, causal: bool = True) -> torch.Tensor:
    """[q_len, seq_len] bool, True where query row j, at q = seq_len - q_len + j, may see key k: k <= q if causal,
    any k otherwise; with a window, only k within `window` positions of q (the reference's rule)."""
    offset = (torch.arange(seq_len, device=device).unsqueeze(0)
              - torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1))   # k - q
    visible = offset <= 0 if causal else offset < (window or seq_len)
    if window:
        visible &= offset > -window
    return visible


def _decode_padded(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """The torch fallback: one SDPA call for B single-token queries over contexts padded to the longest."""
    block_size = k_cache.shape[1]
    num_blocks = (int(seq_lens.max()) + block_size - 1) // block_size
    tables = block_tables[:, :num_blocks].long()  # [B, nb]
    k = _as_query(query, k_cache[tables]).flatten(1, 2).transpose(1, 2)  # [B, Hkv, nb*bs, D]
    v = _as_query(query, v_cache[tables]).flatten(1, 2).transpose(1, 2)
    positions = torch.arange(num_blocks * block_size, device=query.device)
    lens = seq_lens.to(query.device).unsqueeze(1)
    mask = positions.unsqueeze(0) < lens  # [B, nb*bs]
    if window:
        mask &= positions.unsqueeze(0) >= lens - window
    o = F.scaled_dot_product_attention(query.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                       enable_gqa=True)
    return o.squeeze(2)  # [B, H, D]


def _as_query(query: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Gathered cache rows in the query's dtype: an int8 cache's dequantized, a float cache's as they are."""
    return rows if rows.dtype == query.dtype else dequantize_kv(rows).to(query.dtype)
