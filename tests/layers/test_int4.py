"""AWQ, GPTQ and compressed-tensors weights repacked for the Q4_1 kernel (pagedllm.layers.int4) against each format's
own dequantisation (tests.models.int4_checkpoints, which reads the published layouts value by value)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from pagedllm.layers.gguf import dequantize_gguf_packed, pack_q4_rows
from pagedllm.layers.int4 import Int4Weight, awq_int4_weight, dequantize_int4, gptq_int4_weight, packed_int4_weight
from tests.models.int4_checkpoints import (
    act_order_g_idx,
    dequantize_awq,
    dequantize_compressed,
    dequantize_gptq,
    pack_awq,
    pack_compressed,
    pack_gptq,
    quantize_groups,
    quantize_symmetric,
)

N, K = 40, 256  # N: two blocks of 16 rows and a partial one


def _kernel_weight(weight: Int4Weight) -> torch.Tensor:
    """The float32 [N, K] weight the kernel multiplies by (the packed layout's reference), inputs back in the
    checkpoint's order."""
    rows = dequantize_gguf_packed(pack_q4_rows(weight.rows), GGMLQuantizationType.Q4_1, N)
    perm = weight.input_perm
    return rows if perm is None else torch.empty_like(rows).index_copy_(1, perm, rows)


def _random_weight(seed: int) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.1


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_repacks_to_its_own_dequantisation(group_size: int) -> None:
    q, scales, zeros = quantize_groups(_random_weight(group_size), torch.arange(K) // group_size)
    tensors = pack_awq(q, scales, zeros)
    expected = dequantize_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], group_size)
    weight = awq_int4_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], group_size)
    assert weight.input_perm is None
    assert torch.equal(_kernel_weight(weight), expected) and torch.equal(dequantize_int4(weight), expected)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("v1", [True, False])
def test_gptq_repacks_to_its_own_dequantisation(group_size: int, act_order: bool, v1: bool) -> None:
    g_idx = act_order_g_idx(K, group_size, seed=group_size) if act_order else torch.arange(K) // group_size
    q, scales, zeros = quantize_groups(_random_weight(group_size), g_idx, min_zero=int(v1))
    tensors = pack_gptq(q, scales, zeros, g_idx, v1)
    expected = dequantize_gptq(**tensors, v1=v1)
    weight = gptq_int4_weight(**tensors, zero_offset=int(v1))
    assert (weight.input_perm is not None) == act_order
    assert torch.equal(_kernel_weight(weight), expected) and torch.equal(dequantize_int4(weight), expected)


@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_repacks_to_its_own_dequantisation(group_size: int, act_order: bool,
                                                              symmetric: bool) -> None:
    size = K if group_size < 0 else group_size
    g_idx = act_order_g_idx(K, size, seed=size) if act_order else torch.arange(K) // size
    q, scales, zeros = (quantize_symmetric if symmetric else quantize_groups)(_random_weight(size), g_idx)
    tensors = pack_compressed(q, scales, g_idx, act_order, None if symmetric else zeros)
    expected = dequantize_compressed(**tensors, group_size=size)
    weight = packed_int4_weight(tensors["weight_packed"], tensors["weight_scale"], (N, K), group_size,
                                tensors.get("weight_g_idx"), tensors.get("weight_zero_point"))
    assert (weight.input_perm is not None) == (act_order and group_size > 0)   # one group: nothing to sort
    assert torch.equal(_kernel_weight(weight), expected) and torch.equal(dequantize_int4(weight), expected)


def test_groups_that_split_a_run_of_32_inputs_are_refused() -> None:
    q, scales, zeros = quantize_groups(_random_weight(0), torch.arange(K) // 48)
    tensors = pack_awq(q, scales, zeros)
    with pytest.raises(ValueError, match="group_size 48 is not a multiple of 32"):
        awq_int4_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], 48)
    gptq = pack_gptq(q, scales, zeros, torch.arange(K) // 48, v1=False)
    with pytest.raises(ValueError, match="group_size must be a multiple of 32"):
        gptq_int4_weight(**gptq, zero_offset=0)
