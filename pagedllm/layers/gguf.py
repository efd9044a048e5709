"""GGUF's Q4_0, Q4_1, Q8_0, Q4_K and MXFP4 weights kept packed for pagedllm's `linear_gguf` kernel
(quantization="gguf"; gpt-oss's MXFP4 experts: quantization="mxfp4").

A GGUF row of K values is K/32 blocks; each block is one f16 scale d (and Q4_1's f16 min m) and 32 values:

    Q8_0: d | q[32] int8                                      W = d q
    Q4_0: d | 16 bytes: value i in byte i % 16, low nibble    W = d (q - 8)
              for i < 16, high nibble for i >= 16
    Q4_1: d m | 16 bytes, as Q4_0                             W = d q + m
    MXFP4: e (u8) | 16 bytes, as Q4_0                         W = 2^(e - 127) e2m1(q), e2m1's 16 values 0, +-0.5,
                                                              +-1, +-1.5, +-2, +-3, +-4, +-6 (OCP microscaling)

`pack_gguf_weight` regroups the blocks of 16 output rows side by side, with the scales widened to float32, so that
the kernel reads one group of 32 k's for 16 columns in 64-byte rows of 16 lanes of 4 k's, vpdpbusd's operand
(linear_gguf.cpp):

    packed [ceil(N/16), K/32, group bytes], per (16 rows b, 32 k's g):
      d[16] float32 | (Q4_1) m[16] float32 | values:
        Q8_0       8 quads of 4 k's, 64 bytes each: byte 4 j + t of quad i = column j's k 4 i + t (int8)
        Q4_0/Q4_1  4 octets of 8 k's, 64 bytes each: byte 4 j + t of octet o = column j's k 8 o + t (low nibble)
        /MXFP4     | k 8 o + 4 + t << 4

MXFP4 packs with d = 2^(e - 128) and runs as a 4-bit type whose nibble n stands for `MXFP4_VALUES[n]` = 12 +
2 e2m1(n) (0..24) and whose m is -12 d (as Q4_0's is -8 d): W = d (value - 12), exactly the block's weight.

Other 4-bit formats whose groups of 32 k's are each an affine map of 4-bit values pack as Q4_1 through `Q4Rows`
(W = d q + m per row and group, d and m float32): GGUF's Q4_K here, AWQ, GPTQ and compressed-tensors' in
`pagedllm.layers.int4`.
A Q4_K super-block of 256 values is 8 such groups, with d = d_super * sc_j and m = -dmin * m_j (exact in float32:
an f16 times a 6-bit integer), so it runs in the Q4_1 kernel with no kernel of its own:

    Q4_K: d dmin (f16) | 12 bytes: 6-bit sc_j, m_j of the 8 groups | 128 bytes: for each 64 values, 32 bytes whose
          low nibbles are values 0..31 and high nibbles values 32..63          W = d sc_j q - dmin m_j

The values are the checkpoint's own, so the packed weight stands for exactly the weight the loader's dequantisers
give (`dequantize_gguf_packed` computes it, with their arithmetic); the kernel multiplies the values by activations
quantized to int8 (`pagedllm.layers.linear.gguf_reference`).
Missing rows of the last block are zero bytes: d = m = 0, so they are 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedllm.kernels import cpu_kernels, kernels_disabled

PACKED_GGUF_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
                     GGMLQuantizationType.Q4_K, GGMLQuantizationType.MXFP4)
# MXFP4's nibbles as the kernel reads them (linear_gguf.h's kMxfp4Values): 12 + 2 e2m1, with m = -12 d
MXFP4_VALUES = torch.tensor([12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0], dtype=torch.uint8)
# the m per d of the 4-bit types that store no m
_MIN_PER_D = {GGMLQuantizationType.Q4_0: -8.0, GGMLQuantizationType.MXFP4: -12.0}
_ROWS = 16   # output rows per packed block (the kernel's column block)
_GROUP = 32  # k's per GGUF block
_Q4_K_BYTES = 144  # per super-block of 256 values: d, dmin (f16), 12 bytes of scales and mins, 128 of nibbles


class Q4Rows(NamedTuple):
    """4-bit weight rows in the Q4_1 kernel's terms: W[n, k] = d[n, k // 32] * q[n, k] + m[n, k // 32]."""

    q: torch.Tensor  # uint8 [N, K], values 0..15
    d: torch.Tensor  # float32 [N, K/32]
    m: torch.Tensor  # float32 [N, K/32]


def cat_q4_rows(parts: list[Q4Rows]) -> Q4Rows:
    """The rows of `parts` one after another (a fused layer's parts, which share K)."""
    return Q4Rows(*(torch.cat(field) for field in zip(*parts)))


def dequantize_q4_rows(rows: Q4Rows) -> torch.Tensor:
    """The float32 [N, K] weight `rows` stand for, with the Q4_1 kernel's arithmetic."""
    n, k = rows.q.shape
    q = rows.q.float().view(n, k // _GROUP, _GROUP)
    return (rows.d[..., None] * q + rows.m[..., None]).view(n, k)


def packed_type(ggml_type: GGMLQuantizationType) -> GGMLQuantizationType:
    """The kernel type of `pack_gguf_weight(rows, ggml_type)`: Q4_K packs as Q4_1, the others as themselves."""
    return GGMLQuantizationType.Q4_1 if ggml_type == GGMLQuantizationType.Q4_K else ggml_type


def _num_scales(ggml_type: GGMLQuantizationType) -> int:
    return 2 if ggml_type == GGMLQuantizationType.Q4_1 else 1


def _header_bytes(ggml_type: GGMLQuantizationType) -> int:
    """f16 d (and m) at the start of a GGUF block; MXFP4's one byte e."""
    return 1 if ggml_type == GGMLQuantizationType.MXFP4 else 2 * _num_scales(ggml_type)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """MXFP4's block exponents (uint8) as the float32 d its values (12 + 2 e2m1) are scaled by: 2^(e - 128), half of
    the block's 2^(e - 127) (llama.cpp's ggml_e8m0_to_fp32_half: exponent e - 1, subnormal for e < 2)."""
    e = e.int()
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def pack_gguf_weight(rows: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """GGUF rows (uint8 [N, K / block values * block bytes], as stored) -> uint8 [ceil(N/16), K/32, group bytes]
    (above; Q4_K's as Q4_1's): in one pass of pagedllm's kernels where they run (their `pack_gguf_weight`, the bytes of
    `pack_gguf_weight_reference`, tested), else in torch. Q4_K repacks in torch (`q4_k_rows`)."""
    kernels = None if kernels_disabled() or ggml_type == GGMLQuantizationType.Q4_K else cpu_kernels()
    if kernels is None:
        return pack_gguf_weight_reference(rows, ggml_type)
    _check_gguf_rows(rows, ggml_type)
    return kernels.pack_gguf_weight(rows.contiguous(), int(ggml_type))  # type: ignore[attr-defined]


def _check_gguf_rows(rows: torch.Tensor, ggml_type: GGMLQuantizationType) -> None:
    if ggml_type not in PACKED_GGUF_TYPES:
        raise ValueError(f"ggml_type must be one of {[t.name for t in PACKED_GGUF_TYPES]}, got {ggml_type.name}")
    block_values, block_bytes = GGML_QUANT_SIZES[ggml_type]
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] % block_bytes:
        raise ValueError(f"rows must be uint8 [N, K/{block_values} * {block_bytes}] GGUF blocks, got {rows.dtype} "
                         f"{tuple(rows.shape)}")


def pack_gguf_weight_reference(rows: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """`pack_gguf_weight` in torch ops."""
    _check_gguf_rows(rows, ggml_type)
    if ggml_type == GGMLQuantizationType.Q4_K:
        return pack_q4_rows(q4_k_rows(rows))
    block_bytes = GGML_QUANT_SIZES[ggml_type][1]
    n, groups = rows.shape[0], rows.shape[1] // block_bytes
    blocks = torch.cat([rows, rows.new_zeros(-n % _ROWS, rows.shape[1])]).view(-1, _ROWS, groups, block_bytes)
    head = _header_bytes(ggml_type)
    scales = e8m0_half(blocks[..., :head]) if ggml_type == GGMLQuantizationType.MXFP4 else \
        blocks[..., :head].contiguous().view(torch.float16).float()  # [B, 16, G, 1 or 2]
    scales.view(-1, groups, scales.shape[-1])[n:] = 0     # (the padding's zero bytes are MXFP4's e = 0: d 2^-128)
    scales = scales.permute(0, 2, 3, 1).contiguous().view(torch.uint8).flatten(2)  # [B, G, (d[16], m[16]) bytes]
    words = _words(blocks[..., head:])  # [B, 16 columns, G, 8 quads of int8 (Q8_0) or 4 words of 8 nibbles]
    if ggml_type == GGMLQuantizationType.Q8_0:
        values = _interleave_columns(words)
    else:  # value i in byte i % 16, low nibble for i < 16: the words of values 0..15, then of 16..31
        values = _octets(torch.cat([words & _LOW_NIBBLES, (words >> 4) & _LOW_NIBBLES], dim=-1))
    return torch.cat([scales, values], dim=-1).contiguous()


# The packing moves 4-byte words, never single bytes: a permuted copy of int32s is ~4x faster than of uint8s.
_LOW_NIBBLES = 0x0F0F0F0F


def _words(values: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4 w] -> int32 [..., w]: word i holds bytes 4 i .. 4 i + 3 (byte t in bits 8 t .. 8 t + 7)."""
    return values.contiguous().view(torch.int32)


def _interleave_columns(words: torch.Tensor) -> torch.Tensor:
    """int32 [B, 16 columns j, G, W] -> bytes [B, G, W x 64]: word i's 64-byte row holds column j's word i at 4 j."""
    return words.permute(0, 2, 3, 1).contiguous().view(torch.uint8).flatten(2)


def _octets(q: torch.Tensor) -> torch.Tensor:
    """4-bit values in words (`_words` of [B, 16 columns, G, 32 k], one a byte) -> bytes [B, G, 256]: 4 octets of
    8 k's, byte 4 j + t of octet o = q[j, 8 o + t] | q[j, 8 o + 4 + t] << 4."""
    return _interleave_columns(q[..., 0::2] | (q[..., 1::2] << 4))


def pack_q4_rows(rows: Q4Rows) -> torch.Tensor:
    """`Q4Rows` -> the Q4_1 packed layout (above): uint8 [ceil(N/16), K/32, 384], for `linear_gguf` as Q4_1."""
    n, k = rows.q.shape
    pad = -n % _ROWS
    q = torch.cat([rows.q, rows.q.new_zeros(pad, k)]).view(-1, _ROWS, k // _GROUP, _GROUP)  # [B, 16, G, 32]
    scales = torch.stack([rows.d, rows.m], dim=-1).float()  # [N, G, d / m]
    scales = torch.cat([scales, scales.new_zeros(pad, *scales.shape[1:])]).view(-1, _ROWS, k // _GROUP, 2)
    scales = scales.permute(0, 2, 3, 1).contiguous().view(torch.uint8).flatten(2)  # [B, G, (d[16], m[16]) bytes]
    return torch.cat([scales, _octets(_words(q))], dim=-1).contiguous()


def q4_k_rows(rows: torch.Tensor) -> Q4Rows:
    """GGUF Q4_K rows (uint8 [N, K/256 * 144], as stored) as `Q4Rows`: each sub-block of 32 is one group."""
    n = rows.shape[0]
    blocks = rows.reshape(-1, _Q4_K_BYTES)  # [S, 144], S super-blocks
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [S, 1]
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    sc, mins = _q4_k_scales_and_mins(blocks[:, 4:16])  # [S, 8] each
    chunks = blocks[:, 16:].reshape(-1, 4, 1, 32)  # [S, 4 x 64 values, 1, 32 bytes]
    q = torch.cat([chunks & 0x0F, chunks >> 4], dim=2)  # [S, 4, low / high, 32]: values in order
    return Q4Rows(q.reshape(n, -1), (d * sc.float()).view(n, -1), (-(dmin * mins.float())).view(n, -1))


def _q4_k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes [S, 12] -> 6-bit (sc, m) [S, 8] each, as llama.cpp's get_scale_min_k4: bytes 0-3 hold sc_0..3 (and
    the top bits of sc_4..7), 4-7 hold m_0..3 (and those of m_4..7), 8-11 the low 4 bits of sc_4..7 and m_4..7."""
    sc_lo, m_lo, low4 = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([sc_lo & 0x3F, (low4 & 0x0F) | ((sc_lo >> 2) & 0x30)], dim=1)
    mins = torch.cat([m_lo & 0x3F, (low4 >> 4) | ((m_lo >> 2) & 0x30)], dim=1)
    return sc, mins


def unpack_gguf_packed(packed: torch.Tensor, ggml_type: GGMLQuantizationType, n: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A packed GGUF weight's values as the kernel reads them (float32 [N, K]: Q8_0's int8, the 4-bit types' 0..15,
    MXFP4's looked up in MXFP4_VALUES) and its float32 scales d and mins m, [N, K/32] each (m: Q4_1's; Q4_0's and
    MXFP4's made of d, `_MIN_PER_D`; None for Q8_0); `ggml_type` is the packed one (`packed_type`)."""
    num_blocks, groups = packed.shape[:2]
    num_scales = _num_scales(ggml_type)
    scales = packed[..., :4 * _ROWS * num_scales].contiguous().view(torch.float32)
    scales = scales.view(num_blocks, groups, num_scales, _ROWS).permute(2, 0, 3, 1)  # [d / m, B, 16, G]
    scales = scales.reshape(num_scales, num_blocks * _ROWS, groups)[:, :n]
    values = packed[..., 4 * _ROWS * num_scales:]
    if ggml_type == GGMLQuantizationType.Q8_0:  # [B, G, quad, 16 j, 4 t] -> [B, 16 j, G, quad, t]
        q = values.contiguous().view(torch.int8).view(num_blocks, groups, 8, _ROWS, 4).permute(0, 3, 1, 2, 4)
    else:  # [B, G, octet, 16 j, 4 t] -> [B, 16 j, G, octet, low / high, t]
        octets = values.reshape(num_blocks, groups, 4, _ROWS, 4)
        q = torch.stack([octets & 0x0F, octets >> 4], dim=3).permute(0, 4, 1, 2, 3, 5)
    q = q.reshape(num_blocks * _ROWS, groups * _GROUP)[:n]
    if ggml_type == GGMLQuantizationType.MXFP4:
        q = MXFP4_VALUES[q.long()]
    d = scales[0]
    m = scales[1] if num_scales == 2 else d * _MIN_PER_D[ggml_type] if ggml_type in _MIN_PER_D else None
    return q.float(), d, m


def dequantize_gguf_packed(packed: torch.Tensor, ggml_type: GGMLQuantizationType, n: int) -> torch.Tensor:
    """The float32 [N, K] weight a packed GGUF weight stands for, with the loader's dequantisers' arithmetic.
    `ggml_type` is the packed one (`packed_type`)."""
    q, d, m = unpack_gguf_packed(packed, ggml_type, n)
    if ggml_type in _MIN_PER_D:     # d (q - 8), d (q - 12): exact, where d q + m would round
        return d.repeat_interleave(_GROUP, dim=1) * (q + _MIN_PER_D[ggml_type])
    weight = d.repeat_interleave(_GROUP, dim=1) * q
    return weight if m is None else weight + m.repeat_interleave(_GROUP, dim=1)
