"""The Triton paged-attention backend, the CUDA device's. Same signature and results as
`torch_ref.paged_attention_ref`.

One kernel serves decode and prefill alike. A program takes one sequence, one KV head and a tile of BLOCK_M
query rows, where a row is one (new token, query head of that KV head's group) pair, so that the group's heads
read each K/V tile once (GQA and MQA) and a decode's group fills the rows that a prefill fills with tokens:

    rows of seq i, kv head h (GROUP = Hq / Hkv = 3):   r = t * GROUP + g   ->   query[qsl[i] + t, h * GROUP + g]
    r:     0  1  2 | 3  4  5 | 6 ...
    t, g: 00 01 02 |10 11 12 |20 ...                  row r sits at position seq_len - q_len + t

It walks the context in tiles of BLOCK_N keys, each key found through the block table
(`block_tables[i][pos // block_size]`, slot `pos % block_size`), with an online softmax, and stops at the last
key its rows may see (causal); with a sliding window it starts at the first key its first row's window holds, and
masks the keys before each row's. ALiBi's slopes (`alibi_slopes`) bias each row's scores by its head's slope times
how far each key lies after it; a head's sink (`sinks`, gpt-oss's) joins its rows' softmax denominators as
exp(sink - m) when the output is made. Decodes (the runner puts them first) run as their own launch with small row
tiles, prefill chunks as another.

Matmul precision: float16 operands multiply as float16; bfloat16 and float32 ones as float32, in TF32 for
bfloat16 (exact for bf16 inputs, whose 8-bit mantissas fit in TF32's 11) and in IEEE float32 for float32. Triton's
interpreter cannot multiply bfloat16 tiles (it multiplies their raw bits), and one kernel tested on every machine
is worth more than bf16 tensor cores on the attention matmuls. An int8 cache (`torch_ref.quantize_kv`) is read as
q * s, row by row.

`TRITON_INTERPRET=1`, set before this module is imported, runs the kernel on CPU tensors through numpy: the tests
do, on every machine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.metadata import AttentionMetadata

__all__ = ["paged_attention", "decode_attention"]

# Rows and keys per tile. Untuned: no GPU measured them yet (docs/benchmarks.md).
_DECODE_BLOCK_M, _DECODE_BLOCK_N = 16, 64
_PREFILL_BLOCK_M, _PREFILL_BLOCK_N = 64, 32


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr,       # scale pointers: float32 views of int8 caches
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, scale, window,       # window: 0, or the sliding window
    softcap,                                                                  # 0, or the scores' soft cap
    alibi_ptr,                                                                # ALiBi's slopes (read if HAS_ALIBI)
    sinks_ptr,                                                                # the heads' sinks (read if HAS_SINKS)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch,                               # the caches' block, slot and head strides
    stride_bt,
    first_seq,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_INT8: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = first_seq + tl.program_id(0)
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_row = tl.program_id(2) * BLOCK_M
    if first_row >= q_len * GROUP:
        return
    rows = first_row + tl.arange(0, BLOCK_M)
    tokens = rows // GROUP
    row_ok = tokens < q_len
    heads = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_offsets = (q_start + tokens).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_M, D]
    q_pos = seq_len - q_len + tokens                                                      # [BLOCK_M]
    # The last key any row of this tile may see, and the first (the first row's window's first).
    kv_end = tl.minimum(seq_len, seq_len - q_len + (first_row + BLOCK_M - 1) // GROUP + 1)
    kv_start = tl.where(window > 0, tl.maximum(0, seq_len - q_len + first_row // GROUP - window + 1), 0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(kv_start, kv_end, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        key_ok = k_pos < kv_end
        block_ids = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + k_pos // BLOCK_SIZE, mask=key_ok,
                            other=0)
        row_offsets = block_ids.to(tl.int64) * stride_cb + (k_pos % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        k = _load_kv(k_ptr, k_scale_ptr, row_offsets, dims, key_ok, dim_ok, HEAD_DIM, IS_INT8)  # [BLOCK_N, D]
        v = _load_kv(v_ptr, v_scale_ptr, row_offsets, dims, key_ok, dim_ok, HEAD_DIM, IS_INT8)
        scores = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * scale
        if softcap > 0:     # softcap * tanh(scores / softcap), tanh(y) = 1 - 2 / (e^(2y) + 1)
            scores = softcap - 2 * softcap / (tl.exp(2 * scores / softcap) + 1)
        if HAS_ALIBI:
            slopes = tl.load(alibi_ptr + heads)                                          # [BLOCK_M]
            scores += slopes[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
        in_window = (k_pos[None, :] > q_pos[:, None] - window) | (window == 0)
        visible = (k_pos[None, :] <= q_pos[:, None]) & in_window & key_ok[None, :]      # [BLOCK_M, BLOCK_N]
        p, alpha, m, denom = _online_softmax(tl.where(visible, scores, float("-inf")), m, denom)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    if HAS_SINKS:   # exp(sink - m) joins the denominator (m = -inf: a padding row, not stored)
        denom += tl.exp(tl.load(sinks_ptr + heads) - tl.where(m == float("-inf"), 0.0, m))
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]    # 0: a padding row, past its window's keys; not stored
    o_offsets = (q_start + tokens).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _online_softmax(scores, m, denom):
    """One tile of the online softmax over [BLOCK_M, BLOCK_N] scores (-inf where hidden): (p, the factor that rescales
    the sums so far, the new running max, the new sum). A row that has seen no key yet (m = -inf: a window's later
    rows) takes its exps against 0, which leaves its p, sum and acc 0 where exp(-inf - -inf) would be NaN."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    return p, alpha, m_new, denom * alpha + tl.sum(p, axis=1)


@triton.jit
def _load_kv(cache_ptr, scale_ptr, row_offsets, dims, key_ok, dim_ok, HEAD_DIM: tl.constexpr, IS_INT8: tl.constexpr):
    """[BLOCK_N, HEAD_DIM_PAD] keys or values in float32 (zeros where masked); an int8 row's q * s, its scale
    being the float32 after its HEAD_DIM values (at float32 index (row offset + HEAD_DIM) / 4 of the same memory)."""
    rows = tl.load(cache_ptr + row_offsets[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :],
                   other=0.0).to(tl.float32)
    if IS_INT8:
        row_scales = tl.load(scale_ptr + (row_offsets + HEAD_DIM) // 4, mask=key_ok, other=0.0)
        rows = rows * row_scales[:, None]
    return rows


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal paged attention, over a sliding `window` of keys if not 0, its scores soft-capped at `softcap` if not
    0 and biased by ALiBi's `alibi_slopes` ([Hq] float32, on query's device) if given, each head's softmax with its
    sink (`sinks`, [Hq] float32 on query's device) if given; see `paged_attention_ref`.
    query: [T, Hq, D] -> [T, Hq, D].

    Decodes (the leading sequences with one new token) run in one launch, the other sequences in a second.
    """
    out = torch.empty_like(query)
    num_decodes = meta.num_decodes
    if num_decodes:
        _launch(out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, window,
                softcap, alibi_slopes, sinks, seqs=(0, num_decodes), max_query_len=1,
                tile=(_DECODE_BLOCK_M, _DECODE_BLOCK_N))
    if num_decodes < meta.num_seqs:
        _launch(out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, window,
                softcap, alibi_slopes, sinks, seqs=(num_decodes, meta.num_seqs), max_query_len=meta.max_query_len,
                tile=(_PREFILL_BLOCK_M, _PREFILL_BLOCK_N))
    return out


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """One query token per sequence, over its last `window` keys if not 0. query: [B, Hq, D]; block_tables:
    [B, max_blocks]; seq_lens: [B]."""
    out = torch.empty_like(query)
    num_seqs = query.shape[0]
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
    _launch(out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window, 0.0, None,
            None, seqs=(0, num_seqs), max_query_len=1, tile=(_DECODE_BLOCK_M, _DECODE_BLOCK_N))
    return out


def _launch(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
            window: int, softcap: float, alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None,
            seqs: tuple[int, int], max_query_len: int, tile: tuple[int, int]) -> None:
    """Run the kernel for sequences seqs[0]..seqs[1]-1, writing their rows of `out`.

    query, out: [T, Hq, D] with unit stride along D; k_cache, v_cache: [num_blocks, block_size, Hkv, row] with
    unit stride along the row (views into the runner's all-layer tensor are fine).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert query.stride(2) == 1 and out.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride() == \
        k_cache.stride(), "attention needs unit strides along head_dim and K/V caches of one layout"
    group = num_heads // num_kv_heads
    block_m = max(tile[0], triton.next_power_of_2(group))
    is_int8 = k_cache.dtype == torch.int8
    dot_dtype, precision = _dot_types(query.dtype)
    grid = (seqs[1] - seqs[0], num_kv_heads, triton.cdiv(max_query_len * group, block_m))
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, _scales_view(k_cache), _scales_view(v_cache),
        block_tables, seq_lens, query_start_loc, scale, window, softcap,
        query if alibi_slopes is None else alibi_slopes, query if sinks is None else sinks,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        seqs[0],
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=tile[1], IS_INT8=is_int8, HAS_ALIBI=alibi_slopes is not None,
        HAS_SINKS=sinks is not None,
        DOT_DTYPE=dot_dtype, PRECISION=precision,
    )


def _dot_types(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """(operand dtype, input precision) of the kernel's matmuls for a query dtype (see the module docstring)."""
    if dtype == torch.float32:
        return tl.float32, "ieee"
    return (tl.float16 if dtype == torch.float16 else tl.float32), "tf32"  # float16 ignores the precision


def _scales_view(cache: torch.Tensor) -> torch.Tensor:
    """An int8 cache's bytes as float32 (whose element (row offset + head_dim) / 4 is a row's scale); a float
    cache is passed as it is, unread."""
    return cache.view(torch.float32) if cache.dtype == torch.int8 else cache
