"""GGUF's Q4_0, Q4_1 and Q8_0 weights kept packed for pagedllm's `linear_gguf` kernel (quantization="gguf").

A GGUF row of K values is K/32 blocks; each block is one f16 scale d (and Q4_1's f16 min m) and 32 values:

    Q8_0: d | q[32] int8                                      W = d q
    Q4_0: d | 16 bytes: value i in byte i % 16, low nibble    W = d (q - 8)
              for i < 16, high nibble for i >= 16
    Q4_1: d m | 16 bytes, as Q4_0                             W = d q + m

`pack_gguf_weight` regroups the blocks of 16 output rows side by side, k-major, with the scales widened to
float32, so that the kernel dequantises one group of 32 k's for 16 columns with a few vector instructions:

    packed [ceil(N/16), K/32, group bytes], per (16 rows b, 32 k's g):
      d[16] float32 | (Q4_1) m[16] float32 | values [32 k][16 columns]: Q8_0 one int8 each;
                                             Q4_0/Q4_1 8 bytes per k, byte j = column j | column j + 8 << 4

The values are the checkpoint's own, so the packed weight stands for exactly the weight the loader's dequantisers
give (`dequantize_gguf_packed` computes it, with their arithmetic, and is the kernel's reference). Missing rows
of the last block are zero bytes: d = m = 0, so they are 0.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

PACKED_GGUF_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
_ROWS = 16   # output rows per packed block (the kernel's column block)
_GROUP = 32  # k's per GGUF block


def _num_scales(ggml_type: GGMLQuantizationType) -> int:
    return 2 if ggml_type == GGMLQuantizationType.Q4_1 else 1


def _header_bytes(ggml_type: GGMLQuantizationType) -> int:
    return 2 * _num_scales(ggml_type)  # f16 d (and m) at the start of a GGUF block


def pack_gguf_weight(rows: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """GGUF rows (uint8 [N, K/32 * block bytes], as stored) -> uint8 [ceil(N/16), K/32, group bytes] (above)."""
    if ggml_type not in PACKED_GGUF_TYPES:
        raise ValueError(f"ggml_type must be one of {[t.name for t in PACKED_GGUF_TYPES]}, got {ggml_type.name}")
    block_bytes = GGML_QUANT_SIZES[ggml_type][1]
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] % block_bytes:
        raise ValueError(f"rows must be uint8 [N, K/32 * {block_bytes}] GGUF blocks, got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    n, groups = rows.shape[0], rows.shape[1] // block_bytes
    blocks = torch.cat([rows, rows.new_zeros(-n % _ROWS, rows.shape[1])]).view(-1, _ROWS, groups, block_bytes)
    head = _header_bytes(ggml_type)
    scales = blocks[..., :head].contiguous().view(torch.float16).float()  # [B, 16, G, 1 or 2]
    scales = scales.permute(0, 2, 3, 1).contiguous().view(torch.uint8).flatten(2)  # [B, G, (d[16], m[16]) bytes]
    values = blocks[..., head:]  # [B, 16 columns, G, 32 or 16 bytes]
    if ggml_type != GGMLQuantizationType.Q8_0:
        nibbles = torch.cat([values & 0x0F, values >> 4], dim=-1)  # [B, 16, G, 32]: value i of the block
        values = nibbles[:, :8] | (nibbles[:, 8:] << 4)  # [B, 8, G, 32]: byte j = column j | column j + 8
    return torch.cat([scales, values.permute(0, 2, 3, 1).flatten(2)], dim=-1).contiguous()


def dequantize_gguf_packed(packed: torch.Tensor, ggml_type: GGMLQuantizationType, n: int) -> torch.Tensor:
    """The float32 [N, K] weight a packed GGUF weight stands for: the reference of the `linear_gguf` kernel."""
    num_blocks, groups = packed.shape[:2]
    num_scales = _num_scales(ggml_type)
    scales = packed[..., :4 * _ROWS * num_scales].contiguous().view(torch.float32)
    scales = scales.view(num_blocks, groups, 1, num_scales, _ROWS)  # [B, G, 1, d / m, 16]
    values = packed[..., 4 * _ROWS * num_scales:].reshape(num_blocks, groups, _GROUP, -1)
    if ggml_type == GGMLQuantizationType.Q8_0:
        q = values.view(torch.int8).float()  # [B, G, 32, 16]
    else:
        q = torch.cat([values & 0x0F, values >> 4], dim=-1).to(torch.int8)
        q = (q - 8 if ggml_type == GGMLQuantizationType.Q4_0 else q).float()
    weight = scales[..., 0, :] * q
    if ggml_type == GGMLQuantizationType.Q4_1:
        weight = weight + scales[..., 1, :]
    return weight.permute(0, 3, 1, 2).reshape(num_blocks * _ROWS, groups * _GROUP)[:n]
