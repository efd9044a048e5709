"""AWQ, GPTQ and compressed-tensors 4-bit weights as `Q4Rows`, so that they run in the Q4_1 `linear_gguf` kernel
with no kernel of their own (quantization="awq" / "gptq" / "compressed-tensors").

Each stores W [out, in] as 4-bit values q, with an fp16 (compressed-tensors: or bf16) scale s and a 4-bit zero z per
output column and group of inputs: W[n, k] = s[g, n] (q[k, n] - z[g, n]), g the group of input k. Eight values go in
an int32, value i in bits 4i..4i+3:

    AWQ (AutoAWQ GEMM)  qweight int32 [in, out/8]        value i of column c: output 8c + AWQ_ORDER[i]
                        qzeros  int32 [in/group, out/8]  the same order
                        scales  fp16  [in/group, out]    g = k // group_size
    GPTQ (AutoGPTQ,     qweight int32 [in/8, out]        value i of row r: input 8r + i
      GPTQModel)        qzeros  int32 [in/group, out/8]  value i of column c: output 8c + i; "gptq" (v1) stores
                                                         z - 1, "gptq_v2" z
                        scales  fp16  [in/group, out]
                        g_idx   int32 [in]               g = g_idx[k], not sorted in act-order (desc_act) ones
    compressed-tensors  weight_packed int32 [out, in/8]  value i of column c: input 8c + i, stored as q, the
      (pack-quantized,                                   signed value + 8: z = 8 where symmetric (none stored)
      llm-compressor's  weight_scale  [out, in/group]    g = k // group_size
      W4A16)            weight_shape  int [2]            [out, in]
                        weight_g_idx  int32 [in]         act-order's groups, where saved
                        weight_zero_point int32 [out/8, in/group]  an asymmetric one's z, + 8, value i of row r:
                                                         output 8r + i

As `Q4Rows`, d = s and m = -s z: both exact in float32 (a 16-bit float times a 4-bit integer), and so is d q + m = s
(q - z). A Q4Rows group is 32 consecutive inputs with one (d, m), so AWQ's group_size must be a multiple of 32.
GPTQ's (and compressed-tensors') inputs are first sorted by group (stably: the identity unless act-order), and
`linear` gathers the activations in that order (`Int4Weight.input_perm`); each 32 sorted inputs must then share a
group.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedllm.layers.gguf import Q4Rows, dequantize_q4_rows

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: value i of an int32 is output 8c + AWQ_ORDER[i]
_AWQ_VALUE_OF_OUTPUT = [AWQ_ORDER.index(j) for j in range(8)]
_GROUP = 32  # inputs per Q4Rows group


class Int4Weight(NamedTuple):
    """A 4-bit weight ready to pack: `rows` runs over the inputs x[:, input_perm] (None: x as it is)."""

    rows: Q4Rows
    input_perm: torch.Tensor | None  # int64 [K]


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., M] -> uint8 [..., 8 M]: the 4-bit values of each int32, value i (bits 4i..4i+3) at 8 j + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed[..., None] >> shifts) & 0x0F).to(torch.uint8).flatten(-2)


def _awq_outputs(values: torch.Tensor) -> torch.Tensor:
    """AWQ's unpacked values [R, out] in pack order -> in output order."""
    return values.view(values.shape[0], -1, 8)[..., _AWQ_VALUE_OF_OUTPUT].flatten(1)


def awq_int4_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
                    ) -> Int4Weight:
    """An AWQ GEMM layer's tensors (above) as an `Int4Weight`; ValueError unless group_size is a multiple of 32."""
    if group_size % _GROUP:
        raise ValueError(f"AWQ group_size {group_size} is not a multiple of 32: pagedllm runs 4-bit weights in "
                         "groups of 32 inputs")
    q = _awq_outputs(unpack_int32(qweight)).t()  # [N, K]
    groups = torch.arange(q.shape[1]) // group_size
    return Int4Weight(_q4_rows(q, scales, _awq_outputs(unpack_int32(qzeros)), groups), None)


def gptq_int4_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                     zero_offset: int) -> Int4Weight:
    """A GPTQ layer's tensors (above) as an `Int4Weight`, inputs sorted by group; `zero_offset` is added to the
    stored zeros (1 for v1 checkpoints). ValueError if 32 sorted inputs in a row span two groups."""
    return _sorted_by_group(unpack_int32(qweight.t()), scales, unpack_int32(qzeros) + zero_offset, g_idx.long())


def packed_int4_weight(packed: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], group_size: int,
                       g_idx: torch.Tensor | None, zero_points: torch.Tensor | None = None) -> Int4Weight:
    """A compressed-tensors pack-quantized layer's tensors (above) as an `Int4Weight`: `shape` its weight's [N, K]
    (the packing pads K to 8), `g_idx` its act-order groups (None: input k's group is k // group_size; -1: one
    group a row), `zero_points` an asymmetric one's (None: 8, symmetric). ValueError if 32 sorted inputs in a row
    span two groups."""
    rows, inputs = shape
    q = unpack_int32(packed)[:rows, :inputs]
    groups = g_idx.long() if g_idx is not None else torch.arange(inputs) // (inputs if group_size < 0 else group_size)
    zeros = torch.full_like(scales.t(), 8, dtype=torch.int64) if zero_points is None else \
        unpack_int32(zero_points.t())[:, :rows]
    return _sorted_by_group(q, scales.t(), zeros, groups)


def _sorted_by_group(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, groups: torch.Tensor
                     ) -> Int4Weight:
    """q uint8 [N, K], scales and zeros [num groups, N], input k's group `groups[k]` -> an `Int4Weight` over the
    inputs sorted by group (stably: none moves but in act-order checkpoints), with that order where they moved."""
    perm = torch.sort(groups, stable=True).indices
    if torch.equal(perm, torch.arange(len(perm))):
        return Int4Weight(_q4_rows(q, scales, zeros, groups), None)
    return Int4Weight(_q4_rows(q[:, perm], scales, zeros, groups[perm]), perm)


def _q4_rows(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, groups: torch.Tensor) -> Q4Rows:
    """q uint8 [N, K], scales and zeros [num groups, N], groups int64 [K] (input k's group) -> Q4Rows."""
    block_groups = groups.view(-1, _GROUP)  # [K/32, 32]
    if not torch.equal(block_groups, block_groups[:, :1].expand_as(block_groups)):
        raise ValueError("a run of 32 inputs spans two quantization groups: pagedllm runs 4-bit weights in groups "
                         "of 32 inputs, so group_size must be a multiple of 32")
    first = block_groups[:, 0]  # [K/32]
    d = scales[first].t().float()  # [N, K/32]
    return Q4Rows(q.contiguous(), d.contiguous(), (-(d * zeros[first].t().float())).contiguous())


def dequantize_int4(weight: Int4Weight) -> torch.Tensor:
    """The float32 [N, K] weight, inputs in the checkpoint's order, that `weight` stands for."""
    rows = dequantize_q4_rows(weight.rows)
    if weight.input_perm is None:
        return rows
    return torch.empty_like(rows).index_copy_(1, weight.input_perm, rows)
