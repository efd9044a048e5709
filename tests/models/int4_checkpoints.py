"""AWQ, GPTQ and compressed-tensors (pack-quantized) checkpoints of tiny models, written from the published layouts,
for tests. Nothing is downloaded.

The packers transcribe AutoAWQ's `WQLinear_GEMM.from_linear`, AutoGPTQ's `QuantLinear.pack` loops and
compressed-tensors' `pack_to_int32`; the dequantisers read the tensors back as those projects define them, value by
value, independently of pagedllm's unpacking. Quantization itself is plain asymmetric min-max per group (symmetric
absolute max for compressed-tensors; what AWQ and GPTQ add is how they choose the values, which does not change the
layout).

    folder, dequantised = save_int4_checkpoint(tmp_path / "awq", hf_model, "awq", group_size=64)
    # folder: safetensors + config.json with quantization_config; dequantised: transformers' model with W = s (q - z)
"""

from __future__ import annotations

import copy
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.models.tiny import build_byte_tokenizer

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: value i of an int32 holds output column 8c + AWQ_ORDER[i]
QUANTIZED_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                    "w1", "w2", "w3")   # (Mixtral's experts: gate, down, up)


def quantize_groups(weight: torch.Tensor, g_idx: torch.Tensor, min_zero: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit min-max per output row and group: (q int64 [N, K], scales fp16 [G, N], zeros int64 [G, N])
    with weight ~= scales[g_idx].T (q - zeros[g_idx].T). Zeros below `min_zero` are raised to it (GPTQ v1 stores
    zero - 1 in 4 bits, so a zero of 0 cannot be stored)."""
    num_groups = int(g_idx.max()) + 1
    w = weight.detach().float()
    lo = torch.stack([w[:, g_idx == g].amin(1) for g in range(num_groups)]).clamp(max=0)  # [G, N]
    hi = torch.stack([w[:, g_idx == g].amax(1) for g in range(num_groups)]).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-4).half()
    zeros = torch.round(-lo / scales.float()).clamp(min_zero, 15).long()
    q = torch.round(w / scales.float()[g_idx].t() + zeros[g_idx].t()).clamp(0, 15).long()
    return q, scales, zeros


def quantize_symmetric(weight: torch.Tensor, g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric 4-bit absolute max per output row and group, as compressed-tensors' W4A16: (q int64 [N, K], the
    signed value + 8; scales bf16 [G, N]; zeros, all 8) with weight ~= scales[g_idx].T (q - 8)."""
    num_groups = int(g_idx.max()) + 1
    w = weight.detach().float()
    scales = (torch.stack([w[:, g_idx == g].abs().amax(1) for g in range(num_groups)]) / 7).clamp(min=1e-4)
    scales = scales.bfloat16()
    q = (torch.round(w / scales.float()[g_idx].t()).clamp(-8, 7) + 8).long()
    return q, scales, torch.full((num_groups, q.shape[0]), 8)


def pack_compressed(q: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, act_order: bool,
                    zeros: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized: weight_packed int32 [N, K/8] (value i of column c is input 8c + i, already
    + 8), weight_scale [N, G], weight_shape [N, K], act-order's weight_g_idx, and an asymmetric one's
    weight_zero_point int32 [N/8, G] (value i of row r is output 8r + i's zero, already + 8)."""
    packed = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for i in range(8):
        packed |= q[:, i::8] << (4 * i)
    tensors = {"weight_packed": _int32(packed), "weight_scale": scales.t().contiguous(),
               "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64)}
    if zeros is not None:   # [G, N] -> packed along N
        packed_zeros = torch.zeros(zeros.shape[1] // 8, zeros.shape[0], dtype=torch.int64)
        for i in range(8):
            packed_zeros |= zeros.t()[i::8] << (4 * i)
        tensors["weight_zero_point"] = _int32(packed_zeros)
    return tensors | ({"weight_g_idx": g_idx.int()} if act_order else {})


def dequantize_compressed(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_shape: torch.Tensor,
                          weight_g_idx: torch.Tensor | None = None, weight_zero_point: torch.Tensor | None = None,
                          group_size: int = 32) -> torch.Tensor:
    """A compressed-tensors pack-quantized layer's float32 [N, K] weight, read value by value."""
    n, k = weight_shape.tolist()
    q = torch.empty(n, k, dtype=torch.int64)
    for i in range(8):
        q[:, i::8] = _nibble(weight_packed, i)
    zeros = torch.full((n, weight_scale.shape[1]), 8, dtype=torch.int64)
    if weight_zero_point is not None:
        for i in range(8):
            zeros[i::8] = _nibble(weight_zero_point, i)
    g_idx = torch.arange(k) // group_size if weight_g_idx is None else weight_g_idx.long()
    return weight_scale.float()[:, g_idx] * (q - zeros[:, g_idx]).float()


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor
                      ) -> torch.Tensor:
    """float32 [N, K]: W[n, k] = s[g, n] (q[n, k] - z[g, n]), g = g_idx[k]."""
    return scales.float()[g_idx].t() * (q - zeros[g_idx].t()).float()


def pack_awq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM: qweight int32 [K, N/8] and qzeros int32 [G, N/8], columns in AWQ_ORDER; scales [G, N]."""
    def pack_columns(values: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N/8]
        packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
        for col in range(values.shape[1] // 8):
            for i in range(8):
                packed[:, col] |= values[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
        return _int32(packed)

    return {"qweight": pack_columns(q.t()), "qzeros": pack_columns(zeros), "scales": scales}


def pack_gptq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, v1: bool = True
              ) -> dict[str, torch.Tensor]:
    """AutoGPTQ: qweight int32 [K/8, N] (value i of row r is input 8r + i), qzeros int32 [G, N/8] (value i of
    column c is output 8c + i; v1 stores zero - 1), scales [G, N], g_idx int32 [K]."""
    intweight = q.t()  # [K, N]
    qweight = torch.zeros(intweight.shape[0] // 8, intweight.shape[1], dtype=torch.int64)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= intweight[row * 8 + j] << (4 * j)
    stored = zeros - 1 if v1 else zeros
    qzeros = torch.zeros(stored.shape[0], stored.shape[1] // 8, dtype=torch.int64)
    for col in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, col] |= stored[:, col * 8 + j] << (4 * j)
    return {"qweight": _int32(qweight), "qzeros": _int32(qzeros), "scales": scales, "g_idx": g_idx.int()}


def _int32(packed: torch.Tensor) -> torch.Tensor:
    """Eight 4-bit values in the low 32 bits of an int64 -> the int32 with those bits."""
    packed = packed & 0xFFFFFFFF
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _nibble(packed: torch.Tensor, i: int) -> torch.Tensor:
    return (packed.long() >> (4 * i)) & 0xF


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
                   ) -> torch.Tensor:
    """An AWQ GEMM layer's float32 [N, K] weight, read value by value."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    q, z = torch.empty(k, n, dtype=torch.int64), torch.empty(qzeros.shape[0], n, dtype=torch.int64)
    for col in range(n // 8):
        for i in range(8):
            q[:, col * 8 + AWQ_ORDER[i]] = _nibble(qweight[:, col], i)
            z[:, col * 8 + AWQ_ORDER[i]] = _nibble(qzeros[:, col], i)
    return dequantize_groups(q.t(), scales, z, torch.arange(k) // group_size)


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    v1: bool = True) -> torch.Tensor:
    """A GPTQ layer's float32 [N, K] weight, read value by value."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    q, z = torch.empty(k, n, dtype=torch.int64), torch.empty(qzeros.shape[0], n, dtype=torch.int64)
    for i in range(8):
        q[i::8] = _nibble(qweight, i)
        z[:, i::8] = _nibble(qzeros, i)
    return dequantize_groups(q.t(), scales, z + int(v1), g_idx.long())


def act_order_g_idx(num_inputs: int, group_size: int, seed: int) -> torch.Tensor:
    """AutoGPTQ's g_idx with desc_act: inputs quantized in a permuted order, group i the i-th run of group_size."""
    perm = torch.randperm(num_inputs, generator=torch.Generator().manual_seed(seed))
    position = torch.empty_like(perm)
    position[perm] = torch.arange(num_inputs)
    return position // group_size


def quantization_config(method: str, group_size: int, act_order: bool = False, v1: bool = True,
                        symmetric: bool = True) -> dict[str, Any]:
    if method == "compressed-tensors":
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
                    "group_size": group_size, "actorder": "group" if act_order else None}}}}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": False,
            "checkpoint_format": "gptq" if v1 else "gptq_v2"}


def save_int4_checkpoint(folder: Path, hf_model: Any, method: str, group_size: int, act_order: bool = False,
                         v1: bool = True, symmetric: bool = True) -> tuple[Path, Any]:
    """Quantize `hf_model`'s linear layers (not the LM head) into an AWQ, GPTQ or compressed-tensors checkpoint in
    `folder` (with a byte tokenizer), under the names transformers saves them by (a mixture of experts' experts one
    by one, as released checkpoints hold them); returns (folder, transformers' model loaded from the dequantised
    weights, saved beside it). With act_order, the layers that share an input (q/k/v, gate/up) share a permutation,
    as GPTQ's shared Hessian gives them."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    plain = folder.with_name(folder.name + "-dequantised")
    hf_model.save_pretrained(plain)
    tensors, quantized = load_file(plain / "model.safetensors"), {}
    for name, weight in list(tensors.items()):
        layer, _, suffix = name.rpartition(".")
        leaf = layer.rpartition(".")[2]
        if suffix != "weight" or leaf not in QUANTIZED_LAYERS:
            continue
        k = weight.shape[1]
        shared_input = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj", "w3": "w1"}.get(leaf, leaf)
        seed = zlib.crc32(f"{layer.rpartition('.')[0]}.{shared_input}".encode())
        g_idx = act_order_g_idx(k, group_size, seed) if act_order else torch.arange(k) // group_size
        q, scales, zeros = quantize_symmetric(weight, g_idx) if method == "compressed-tensors" and symmetric else \
            quantize_groups(weight, g_idx, min_zero=int(method == "gptq" and v1))
        tensors[name] = dequantize_groups(q, scales, zeros, g_idx).to(weight.dtype).contiguous()
        packed = pack_awq(q, scales, zeros) if method == "awq" else pack_gptq(q, scales, zeros, g_idx, v1) \
            if method == "gptq" else pack_compressed(q, scales, g_idx, act_order, None if symmetric else zeros)
        quantized.update({f"{layer}.{part}": t for part, t in packed.items()})
        if method == "gptq" and f"{layer}.bias" not in tensors:  # AutoGPTQ stores a zero bias for every layer
            quantized[f"{layer}.bias"] = torch.zeros(weight.shape[0], dtype=torch.float16)
    save_file(tensors, str(plain / "model.safetensors"), metadata={"format": "pt"})
    layers = {name.rpartition(".")[0] for name in quantized}
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: t for name, t in tensors.items() if name.removesuffix(".weight") not in layers} | quantized,
              str(folder / "model.safetensors"))
    config = copy.deepcopy(hf_model.config)
    config.quantization_config = quantization_config(method, group_size, act_order, v1, symmetric)
    config.save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return folder, AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32, attn_implementation="eager").eval()
