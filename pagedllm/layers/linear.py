"""Linear layers shaped for tensor parallelism (Megatron style): each rank holds its slice of every weight.

Each parameter carries a `weight_loader(param, loaded_weight[, shard_id])` that takes the *full* checkpoint
tensor and copies this rank's slice into place, so the model's `load_weights` never needs to know the split.

    ColumnParallelLinear   W [out, in]  split by rows:    rank r holds W[r*out/tp:(r+1)*out/tp]
    RowParallelLinear      W [out, in]  split by columns: rank r holds W[:, r*in/tp:(r+1)*in/tp]; sum-reduce

After loading, `pack_linear_weights` swaps CPU weights for packed copies (oneDNN's for bf16 where it has bf16
instructions, pagedllm's own kernel's otherwise, int8 with row scales under quantization="int8", and the same int8
weights in the int8 x int8 kernel's layout under quantization="w8a8"). Before loading, `pack_gguf_linear_weights`
packs a GGUF's Q4_0/Q4_1/Q8_0/Q4_K blocks (quantization="gguf"), and `pack_int4_linear_weights` an AWQ or GPTQ
checkpoint's 4-bit weights (quantization="awq"/"gptq"), in place of weights loading then skips
(`packed_checkpoint_names`). `linear` takes
any of them, and so does the C++ kernels' LinearWeights (`linear_weights`), which repeats its branches for the
model's DecoderStack.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.cpu import cpu_info, onednn_bf16_ok
from pagedllm.distributed.communicator import communicator
from pagedllm.kernels import cpu_kernels, kernels_disabled
from pagedllm.layers.gguf import (
    cat_q4_rows,
    dequantize_gguf_packed,
    pack_gguf_weight,
    pack_q4_rows,
    packed_type,
    unpack_gguf_packed,
)
from pagedllm.layers.int4 import Int4Weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b, for a plain [out, in] weight or one packed by `pack_linear_weights` (oneDNN's or pagedllm's),
    `pack_gguf_linear_weights` or `pack_int4_linear_weights`. A packed weight whose `input_perm` is set (GPTQ
    act-order) runs over its inputs in that order: x[:, input_perm]."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if getattr(weight, "brgemm", False):  # bf16 in torch's brgemm blocks (`pack_linear_weights`, small_calls)
        out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)  # type: ignore[attr-defined]
        cpu_kernels().linear_brgemm(out, x, weight, bias)  # type: ignore[union-attr]
        return out
    if weight.dtype == torch.uint8:  # GGUF blocks, [ceil(out / 16), in / 32, group bytes] (pagedllm.layers.gguf)
        perm = getattr(weight, "input_perm", None)
        x = x if perm is None else x.index_select(1, perm)  # GPTQ act-order: K as the weight stores it
        out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)  # type: ignore[attr-defined]
        cpu_kernels().linear_gguf(out, x, weight, weight.ggml_type, bias,  # type: ignore[union-attr,attr-defined]
                                  gguf_call_bits(weight, x.shape[0]))
        return out
    if weight.dim() == 3:  # pagedllm's blocked layouts
        out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)  # type: ignore[attr-defined]
        col_sums = getattr(weight, "col_sums", None)
        if col_sums is None:  # [ceil(out / 16), in, 16]; int8 carries its row scales
            cpu_kernels().linear_packed(out, x, weight, bias, getattr(weight, "scale", None))  # type: ignore[union-attr]
        else:  # W8A8: [ceil(out / 16), ceil(in / 4), 64] int8, its row scales and column sums; x quantized too
            cpu_kernels().linear_w8a8(out, x, weight, col_sums, weight.scale, bias)  # type: ignore[union-attr,attr-defined]
        return out
    return F.linear(x, weight, bias)


def linear_weights(kernels: ModuleType, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   row_bias: torch.Tensor | None = None) -> Any:
    """`weight` as the C++ kernels' LinearWeights (for their DecoderStack, pagedllm/kernels/csrc/decoder.cpp), which
    computes `linear(x, weight, bias)`, then adds `row_bias` as a row-parallel layer adds its bias."""
    return kernels.LinearWeights(weight, getattr(weight, "out_features", weight.shape[0]), bias, row_bias,
                                 getattr(weight, "scale", None), getattr(weight, "col_sums", None),
                                 getattr(weight, "input_perm", None), getattr(weight, "ggml_type", 0),
                                 getattr(weight, "activation_bits", 16), getattr(weight, "brgemm", False),
                                 getattr(weight, "few_rows_activation_bits", None))


def linear_packing(dtype: torch.dtype) -> str | None:
    """How `pack_linear_weights` stores CPU weights of `dtype` here: "brgemm", "onednn", "pagedllm" or None (plain).

    bf16 goes to torch's brgemm blocks with AMX tiles, else to oneDNN where it has bf16 instructions (torch is asked)
    and its bf16 dot products outrun float32 FMAs (`bf16_kernel`); elsewhere (AVX2, ARM, plain x86-64) to
    pagedllm's packed kernel, which widens bf16 to float32 in registers: bf16 through `F.linear` is emulated there
    and several times slower than float32. float32 goes
    to pagedllm's kernel everywhere: it reads each weight once per call at any batch size (MKL's small-batch GEMMs
    reach half the memory bandwidth) and gives a row the same bits in any batch. float16 stays plain.
    """
    if kernels_disabled() or dtype not in (torch.bfloat16, torch.float32):
        return None
    if cpu_kernels() is None:
        return "onednn" if dtype == torch.bfloat16 and onednn_bf16_ok() else None
    if dtype == torch.bfloat16 and onednn_bf16_ok():
        return bf16_kernel()
    return "pagedllm"


BF16_KERNEL_ENV = "PAGEDLLM_BF16_KERNEL"


def bf16_kernel() -> str:
    """Which kernel multiplies bf16 weights where oneDNN has bf16 instructions: "brgemm", "onednn" or "pagedllm".

    With AMX tiles, torch's brgemm blocks (`linear_brgemm`), where torch packs bf16 for them: each call streams its
    weight's blocks in order, 1.1-1.5x the rate of oneDNN's matmuls at decode batches on the AMX Xeon (1.4x on
    SmolLM2's small weights, whose oneDNN calls cost more than their bytes), the same at 2,048 rows on Gemma 3 1B's
    shapes, 0.8-0.9x on SmolLM2's (docs/benchmarks.md). oneDNN where bf16 dot products otherwise outrun float32 FMAs
    (`CpuInfo.bf16_dot_outruns_fma`: AMD's AVX512-BF16), pagedllm's kernel elsewhere; $PAGEDLLM_BF16_KERNEL names
    one. A rule, not a timing at start-up: timing one matmul both ways picked the slower kernel in 2 of 6 starts on
    a 2-core VM (busy or not, the two came within 10% there while the whole workload differed by 27%), and the
    kernels round a bf16 matmul differently, so a timed choice would make the same model's greedy tokens differ
    from one start to the next.
    """
    choice = os.environ.get(BF16_KERNEL_ENV)
    brgemm = brgemm_bf16_available()
    if choice is None:
        if "amx_bf16" in cpu_info().flags and brgemm:
            return "brgemm"
        return "onednn" if cpu_info().bf16_dot_outruns_fma else "pagedllm"
    if choice not in ("brgemm", "onednn", "pagedllm"):
        raise ValueError(f"{BF16_KERNEL_ENV} must be 'brgemm', 'onednn' or 'pagedllm', got {choice!r}")
    if choice == "brgemm" and not brgemm:
        raise ValueError(f"{BF16_KERNEL_ENV}=brgemm: torch's brgemm does not pack bf16 on this CPU")
    return choice


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: (q [N, K] int8, scale [N] float32) with weight ~= scale[:, None] * q.

    Each row's largest magnitude maps to 127 (an all-zero row gets scale 1); values round to nearest. A row holding
    a NaN or an infinity gets a NaN or infinite scale and q 0, so that whatever it multiplies comes out NaN.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127)
    q = torch.where(torch.isfinite(scale)[:, None], q, torch.zeros_like(q)).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight an int8 weight stands for (the reference of the int8 kernel)."""
    return q.float() * scale[:, None]


W8A8_SPAN = 64  # k's of an activation row that share one scale under quantization="w8a8" (kSpanK in linear_int8.cpp)
GGUF_SPAN = 32  # the same for GGUF's blocks under quantization="gguf" (one GGUF block; kGroupK in linear_gguf.cpp)


def _quantize_spans(x: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows [M, K], zero-padded to whole spans, quantized as `quantize_int8` quantizes a weight's row, one scale
    per span of `span` k's: (qx int32 [M, spans, span], scale float32 [M, spans])."""
    m, k = x.shape
    qx, scale = quantize_int8(F.pad(x.float(), (0, -k % span)).view(-1, span))
    return qx.view(m, -1, span).int(), scale.view(m, -1)


def w8a8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for W = scale[:, None] * q, with each span of `W8A8_SPAN` k's of x's rows quantized as
    `quantize_int8` quantizes a weight's row: what the W8A8 kernel computes, to the bit (the reference of its every
    ISA path).

    A span's int8 products are summed exactly (in int32: |sum| <= 127^2 x 64); the spans' sums are accumulated in
    float32, `acc = acc + float(sum) * x_scale[m, span]`, span by span, each operation rounded; then each output is
    `acc * scale[n]`, `+ bias[n]`, and the result rounded once to x's dtype.
    """
    qx, x_scale = _quantize_spans(x, W8A8_SPAN)
    qw = F.pad(q, (0, -q.shape[1] % W8A8_SPAN)).view(q.shape[0], -1, W8A8_SPAN).int()
    acc = torch.zeros(x.shape[0], q.shape[0])
    for t in range(qx.shape[1]):
        acc = acc + (qx[:, t] @ qw[:, t].T).float() * x_scale[:, t, None]
    out = acc * scale
    return (out if bias is None else out + bias.float()).to(x.dtype)


def quantize_16bit_spans(x: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows [M, K] quantized to 16 bits per span of `span` k's, as two int8 halves: with s and v = x / s
    clamped to [-127, 127] as `_quantize_spans` has them, hi = round(v) and lo = round(256 (v - hi)) clamped to
    [-127, 127]. Returns (256 hi + lo: int32 [M, spans, span], s / 256: float32 [M, spans]): x ~= (s / 256) (256 hi
    + lo) within s / 512 (s / 256 where lo clamps: v - hi within 1/512 of a half), where 8 bits leave s / 2."""
    m, k = x.shape
    rows = F.pad(x.float(), (0, -k % span)).view(-1, span)
    _, scale = quantize_int8(rows)
    v = (rows / scale[:, None]).clamp_(-127, 127)
    hi = torch.round(v)
    lo = torch.round((v - hi) * 256).clamp_(-127, 127)
    x16 = torch.where(torch.isfinite(scale)[:, None], 256 * hi + lo, torch.zeros_like(v))
    return x16.view(m, -1, span).int(), (scale / 256).view(m, -1)


def gguf_reference(x: torch.Tensor, packed: torch.Tensor, ggml_type: GGMLQuantizationType, n: int,
                   bias: torch.Tensor | None = None, activation_bits: int = 16) -> torch.Tensor:
    """x W^T + b for a packed GGUF Q8_0, Q4_0, Q4_1 or MXFP4 weight (`pack_gguf_weight`; W = d q, Q4_0: d q + m
    with m = -8 d, Q4_1: d q + m, MXFP4: d q + m with q its nibble's value in MXFP4_VALUES and m = -12 d), with
    each group of `GGUF_SPAN` k's of x's rows quantized to 16 bits
    (`quantize_16bit_spans`: x ~= x_scale qx), or with `activation_bits=8` to 8 as `w8a8_reference` quantizes a
    span: what `linear_gguf` computes, to the bit, at every ISA level and any M.

    With `activation_bits=GGUF_BF16`: x rounded to bf16 times W rounded to bf16, summed in float64, the
    result (+ b) rounded to x's dtype: what the AMX tiles and the AVX512-BF16 vectors compute to within their
    float32 sums (in an order that the tiles' hardware fixes, and torch cannot repeat).

    Per group g, the integer products are summed exactly in int32; `acc = acc + (float(sum) * d[n, g]) *
    x_scale[m, g]`, then for the 4-bit types, with sm = x_scale[m, g] * float(sum of the group's qx),
    `acc = acc + m[n, g] * sm`, group by group, each operation rounded; the result `+ bias[n]`, rounded once to x's
    dtype.
    """
    if activation_bits == GGUF_BF16:
        weight = dequantize_gguf_packed(packed, ggml_type, n).bfloat16().double()
        out = x.bfloat16().double() @ weight.T
        return (out if bias is None else out + bias.double()).to(x.dtype)
    q, d, m = unpack_gguf_packed(packed, ggml_type, n)
    qx, x_scale = (quantize_16bit_spans if activation_bits == 16 else _quantize_spans)(x, GGUF_SPAN)
    scaled_sums = x_scale * qx.sum(dim=-1).float()
    qw = q.int().view(n, -1, GGUF_SPAN)
    acc = torch.zeros(x.shape[0], n)
    for g in range(qx.shape[1]):
        acc = acc + (qx[:, g] @ qw[:, g].T).float() * d[:, g] * x_scale[:, g, None]
        if m is not None:
            acc = acc + m[:, g] * scaled_sums[:, g, None]
    return (acc if bias is None else acc + bias.float()).to(x.dtype)


def _packed(weight: torch.Tensor, quantization: str | None = None) -> nn.Parameter:
    """A plain [N, K] weight as a parameter that knows N, in pagedllm's blocked layout; quantized to int8 with its
    row scales (`scale`) for quantization="int8", and in the W8A8 kernel's layout with its column sums (`col_sums`)
    too for "w8a8"."""
    kernels = cpu_kernels()
    if quantization is None:
        packed = nn.Parameter(kernels.pack_linear_weight(weight), requires_grad=False)  # type: ignore[union-attr]
    else:
        q, scale = quantize_int8(weight)
        if quantization == "int8":
            packed = nn.Parameter(kernels.pack_linear_weight(q), requires_grad=False)  # type: ignore[union-attr]
        else:
            w8a8, col_sums = kernels.pack_w8a8_weight(q)  # type: ignore[union-attr]
            packed = nn.Parameter(w8a8, requires_grad=False)
            packed.col_sums = col_sums  # type: ignore[attr-defined]
        packed.scale = scale  # type: ignore[attr-defined]
    packed.out_features = weight.shape[0]  # type: ignore[attr-defined]
    return packed


def pack_linear_weights(model: nn.Module, quantization: str | None = None) -> int:
    """Store the CPU weights of `model`'s linear layers (LM head included) packed for the fastest matmul here.

    `F.linear` in bf16 re-blocks the weight on every call, which for a decode step's few rows costs more than the
    product itself: measured on SmolLM2's shapes with oneDNN, 30 layers' matmuls take 9.6 ms plain and 5.2 ms
    prepacked for one row, 30 and 19 ms for 50 rows, and a 2,048-row prefill is ~20% faster too, with identical
    results. Each layer whose class sets `packable_weight` gets its weight replaced (a tied LM head gets its own
    packed copy; the embedding keeps the plain one). `linear_packing` says which packing, if any, applies.
    With quantization="int8" every such weight is quantized (`quantize_int8`) into pagedllm's layout instead,
    whatever the dtype: a quarter of float32's bytes, half of bf16's. With "w8a8" it is quantized the same way
    into the int8 x int8 kernel's layout, and each call quantizes x's rows too, a scale per 64 k's
    (`w8a8_reference`). Returns how many weights were packed.
    """
    if quantization not in (None, "int8", "w8a8"):
        raise ValueError(f"unknown quantization {quantization!r}: pagedllm runs None, 'int8' or 'w8a8'")
    if quantization is not None:
        _check_kernels(f"quantization={quantization!r}")
    packed = 0
    for layer in model.modules():
        weight = getattr(layer, "weight", None)
        if not getattr(type(layer), "packable_weight", False) or weight is None or weight.device.type != "cpu":
            continue
        packing = None if weight.is_mkldnn or weight.dim() != 2 else quantization or linear_packing(weight.dtype)
        if packing == "onednn" and getattr(layer, "small_calls", False) and brgemm_packs(weight):
            packing = "brgemm"
        elif packing == "brgemm" and not brgemm_packs(weight):   # an odd K
            packing = "onednn"
        if packing == "brgemm":
            layer.weight = nn.Parameter(cpu_kernels().pack_brgemm_weight(weight.detach()),  # type: ignore[union-attr]
                                        requires_grad=False)
            layer.weight.out_features, layer.weight.brgemm = weight.shape[0], True  # type: ignore[attr-defined]
        elif packing == "onednn":
            layer.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1),
                                        requires_grad=False)
        elif packing == "pagedllm":
            layer.weight = _packed(weight.detach())
        elif packing in ("int8", "w8a8"):
            layer.weight = _packed(weight.detach(), packing)
        packed += packing is not None
    return packed


def brgemm_bf16_available() -> bool:
    """Whether pagedllm's kernels are built and torch's brgemm packs bf16 on this CPU (AMX, AVX512-BF16)."""
    kernels = cpu_kernels()
    return kernels is not None and bool(kernels.brgemm_bf16_available())


def brgemm_packs(weight: torch.Tensor) -> bool:
    """Whether `weight` can go to torch's brgemm blocks here (`linear_brgemm`): bf16 with an even K, where
    `brgemm_bf16_available`. A layer whose class or instance sets `small_calls` (a mixture of experts' experts) is
    packed so where oneDNN would take it: one thread streams its blocks at the memory's speed, where oneDNN's small
    calls read ~25% slower."""
    return weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and brgemm_bf16_available()


def _checkpoint_names(module_name: str, fused: dict[str, list[str]], tied: bool) -> list[str]:
    """The checkpoint weights whose rows, concatenated, make module `module_name`'s weight."""
    prefix, _, leaf = module_name.rpartition(".")
    if leaf in fused:
        return [f"{prefix}.{part}.weight" if prefix else f"{part}.weight" for part in fused[leaf]]
    if module_name == "lm_head" and tied:
        return ["model.embed_tokens.weight"]
    return [f"{module_name}.weight"]


def _linear_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module, list[str]]]:
    """(name, layer, checkpoint weight names) of each of `model`'s linear layers (LM head included): a fused layer
    (`model.packed_modules_mapping`, e.g. qkv_proj from q/k/v_proj) names its parts, whose rows it concatenates; a
    tied LM head names the embedding."""
    fused = getattr(model, "packed_modules_mapping", {})
    tied = bool(getattr(model, "tie_word_embeddings", False))
    for name, layer in model.named_modules():
        if getattr(type(layer), "packable_weight", False) and getattr(layer, "weight", None) is not None:
            yield name, layer, _checkpoint_names(name, fused, tied)


def _quantizable_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module, list[str]]]:
    """`_linear_layers` that still have a plain 2-D weight."""
    return ((name, layer, names) for name, layer, names in _linear_layers(model) if layer.weight.dim() == 2)


def packed_checkpoint_names(model: nn.Module) -> set[str]:
    """The checkpoint weights that only layers packed from blocks (`pack_gguf_linear_weights`,
    `pack_int4_linear_weights`, which run before loading) are made of: loading need not read, let alone
    dequantise, them. The embedding under a tied LM head still loads, for the lookup."""
    names = {name for _, layer, parts in _linear_layers(model) if is_block_packed(layer.weight) for name in parts}
    return names - {name for name, param in model.named_parameters() if not is_block_packed(param)}


def is_block_packed(weight: torch.Tensor | None) -> bool:
    """Whether `weight` is a linear weight packed from a checkpoint's blocks (`_set_packed`)."""
    return getattr(weight, "ggml_type", None) is not None


GGUF_ACTIVATION_BITS_ENV = "PAGEDLLM_GGUF_ACTIVATION_BITS"
GGUF_BF16 = 0  # activation_bits for x in bf16 times the blocks dequantised to bf16 (AMX tiles or AVX512-BF16)


def gguf_bf16_available() -> bool:
    """Whether `linear_gguf` multiplies GGUF blocks by x in bf16 here (`GGUF_BF16`): kernels built with AVX512-BF16
    (in vectors), or with AMX-BF16 and Linux granting the tiles to this process (in tiles)."""
    kernels = cpu_kernels()
    return kernels is not None and bool(kernels.gguf_bf16_available())  # type: ignore[attr-defined]


def gguf_bf16_tiles_available() -> bool:
    """Whether `GGUF_BF16` runs in AMX-BF16 tiles here: kernels built with AMX-BF16, and Linux granting the tiles to
    this process."""
    kernels = cpu_kernels()
    return kernels is not None and bool(kernels.gguf_bf16_tiles_available())  # type: ignore[attr-defined]


def gguf_activation_bits(dtype: torch.dtype) -> int:
    """How `linear_gguf` multiplies GGUF blocks in a model whose activations are `dtype`, read by the loader when it
    packs. bf16 activations where bf16 dot products pay: `GGUF_BF16` (0), the blocks dequantised to bf16, which
    rounds nothing of x and W that a bf16 model does not (the dequantised file's bf16 weights): in AMX tiles where
    there are (a batch as fast as oneDNN's bf16 tiles from a third of the bytes), else in AVX512-BF16 vectors on AMD
    (`CpuInfo.bf16_vectors_at_fma_rate`; linear_gguf_bf16.cpp: on a Zen 5, prefill chunks 1.3-1.5x faster than 16
    bits, batches of ~17 rows level, one to six rows 0.8-0.9x; the mixed workload 1.12x, one stream 0.9x). Elsewhere,
    Intel's VDPBF16PS at half its FMA's rate among them, activations quantized to 16 bits (two int8 halves, the
    dequantised weights' results within float noise). PAGEDLLM_GGUF_ACTIVATION_BITS names one: 16, 8 (llama.cpp's
    arithmetic: ~1.45x faster 4-bit matmuls than 16, near ties flipped) or bf16."""
    value = os.environ.get(GGUF_ACTIVATION_BITS_ENV)
    if value is None:
        pays = gguf_bf16_tiles_available() or cpu_info().bf16_vectors_at_fma_rate
        return GGUF_BF16 if dtype == torch.bfloat16 and gguf_bf16_available() and pays else 16
    if value not in ("8", "16", "bf16"):
        raise ValueError(f"{GGUF_ACTIVATION_BITS_ENV} must be 8, 16 or bf16, got {value!r}")
    if value == "bf16" and not gguf_bf16_available():
        raise ValueError(f"{GGUF_ACTIVATION_BITS_ENV}=bf16 multiplies GGUF blocks with AVX512-BF16, which this CPU "
                         "(or this build of the kernels) does not have: use 16 or 8")
    return GGUF_BF16 if value == "bf16" else int(value)


FEW_ROWS = 8  # kFewRows in pagedllm/kernels/csrc/decoder.cpp


def few_rows_activation_bits(layer: nn.Module, activation_bits: int) -> int | None:
    """How a call of at most FEW_ROWS rows multiplies `layer`'s GGUF blocks, where it differs from `activation_bits`
    (None elsewhere): 16-bit integers for a mixture of experts' expert (`small_calls`) whose blocks multiply bf16 by
    the CPU's default (`gguf_activation_bits`, no PAGEDLLM_GGUF_ACTIVATION_BITS). bf16 dequantises the expert's
    whole weight in every call, at any row count, where the integer arithmetic multiplies the blocks as they are: one
    thread's call on one of a random Qwen3-MoE's gate_up weights (768 x 1024, Q4_1) in AMX tiles 85-88 us at 1-8
    rows, in 16-bit integers 45 us at one row, 58 at four, 74 at eight, 110 at twelve (docs/benchmarks.md), and a
    decode step routes a few rows to each expert. An expert's rows then get the bits of one arithmetic or the other
    by how many rows its call has, which depends on the batch: a request's greedy tokens can differ by the batch it
    ran in, as with cascade attention; naming an arithmetic in PAGEDLLM_GGUF_ACTIVATION_BITS keeps them to one."""
    if (activation_bits == GGUF_BF16 and getattr(layer, "small_calls", False)
            and os.environ.get(GGUF_ACTIVATION_BITS_ENV) is None):
        return 16
    return None


def gguf_call_bits(weight: torch.Tensor, num_rows: int) -> int:
    """The activation bits `linear` multiplies a GGUF weight's blocks with in a call of `num_rows` rows."""
    few_rows = getattr(weight, "few_rows_activation_bits", None)
    return few_rows if few_rows is not None and num_rows <= FEW_ROWS else weight.activation_bits  # type: ignore[attr-defined]


def fuses_silu_and_mul(weight: torch.Tensor, num_rows: int) -> bool:
    """Whether a gate_up projection's `weight` (gate's rows, then up's) runs with its SiLU-and-mul in one kernel,
    `linear_silu_and_mul`, in a call of `num_rows` rows: GGUF blocks times x in bf16, each half whole blocks of 16
    columns."""
    return (weight.dtype == torch.uint8 and gguf_call_bits(weight, num_rows) == GGUF_BF16
            and getattr(weight, "input_perm", None) is None
            and weight.out_features % 32 == 0)  # type: ignore[attr-defined]


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of `linear(x, weight, bias)` = [gate, up] for a weight that `fuses_silu_and_mul`, the same bits
    as SiluAndMul after it, computed as the kernel stores its sums: the [T, 2 I] product is never written (a
    2,048-token prefill of SmolLM2's gate_up and its SiLU-and-mul ~1.1x faster in AMX tiles)."""
    out = torch.empty(x.shape[0], weight.out_features // 2, dtype=x.dtype)  # type: ignore[attr-defined]
    cpu_kernels().linear_gguf_silu_and_mul(out, x, weight, weight.ggml_type, bias)  # type: ignore[union-attr,attr-defined]
    return out


def gguf_arithmetic(activation_bits: int) -> str:
    """`activation_bits` in words, for the start-up line."""
    if activation_bits == GGUF_BF16:
        return f"bf16 activations in {'AMX tiles' if gguf_bf16_tiles_available() else 'AVX512-BF16 vectors'}"
    return f"{activation_bits}-bit activations"


def _set_packed(layer: nn.Module, name: str, num_rows: int, packed: torch.Tensor, ggml_type: GGMLQuantizationType,
                activation_bits: int, input_perm: torch.Tensor | None = None) -> None:
    """Replace `layer`'s weight by `packed`, a `linear_gguf` weight of the checkpoint's `num_rows` rows, to
    multiply activations quantized to `activation_bits` (`input_perm`: see `linear`)."""
    n = layer.weight.shape[0]
    if num_rows != n:
        raise ValueError(f"{name}: the checkpoint has {num_rows} rows, the layer {n}")
    layer.weight = nn.Parameter(packed, requires_grad=False)
    layer.weight.out_features = n
    layer.weight.ggml_type = int(ggml_type)
    layer.weight.activation_bits = activation_bits
    layer.weight.few_rows_activation_bits = few_rows_activation_bits(layer, activation_bits)
    layer.weight.input_perm = input_perm


def quantized_kernels_available() -> bool:
    """Whether pagedllm's CPU kernels, which every quantized weight format runs in, are built and enabled here."""
    return not kernels_disabled() and cpu_kernels() is not None


def _check_kernels(mode: str) -> None:
    if not quantized_kernels_available():
        raise RuntimeError(f"{mode} runs in pagedllm's CPU kernels, which are disabled or not built here")


def pack_gguf_linear_weights(model: nn.Module, rows: Mapping[str, tuple[GGMLQuantizationType, torch.Tensor]],
                             activation_bits: int = 16) -> Counter[str]:
    """Replace the weight of each of `model`'s linear layers (LM head included) whose checkpoint tensors are all
    in `rows` ({Hugging Face name: (type, GGUF rows)}, `pagedllm.loader.gguf.gguf_block_rows`), in one type, by
    those blocks packed (`pack_gguf_weight`): a fused layer concatenates its parts' rows, which share K. A tied LM
    head packs the embedding's rows; the embedding keeps its dequantised copy for the lookup. Other layers keep
    their weight for `pack_linear_weights`. The packed weights multiply activations as `activation_bits` says
    (`gguf_activation_bits`). Returns how many weights were packed per GGUF type name.
    """
    _check_kernels("quantization='gguf'")
    counts: Counter[str] = Counter()
    for name, layer, names in _quantizable_layers(model):
        parts = [rows.get(part) for part in names]
        if any(part is None for part in parts) or len({part[0] for part in parts}) != 1:  # type: ignore[index]
            continue
        ggml_type = parts[0][0]  # type: ignore[index]
        layer_rows = torch.cat([part[1] for part in parts])  # type: ignore[index]
        _set_packed(layer, name, layer_rows.shape[0], pack_gguf_weight(layer_rows, ggml_type), packed_type(ggml_type),
                    activation_bits)
        counts[ggml_type.name] += 1
    return counts


def pack_int4_linear_weights(model: nn.Module, weights: dict[str, Callable[[], Int4Weight]],
                             activation_bits: int = 16) -> int:
    """Replace the weight of each of `model`'s linear layers whose checkpoint weights are all in `weights`
    ({Hugging Face name: its 4-bit weight, read on demand}, `pagedllm.loader.int4.int4_weights`) by their rows
    packed as Q4_1 (`pack_q4_rows`). A fused layer's parts must permute K alike (GPTQ act-order gives q/k/v, and
    gate/up, one permutation: they share their input); one whose parts do not keeps its dequantised weight, as do
    layers the checkpoint left unquantized. Activations are quantized to `activation_bits`, as in
    `pack_gguf_linear_weights`. Returns how many weights were packed.
    """
    _check_kernels("quantization='awq', 'gptq' or 'compressed-tensors' (4-bit)")
    packed = 0
    for name, layer, names in _quantizable_layers(model):
        if not all(part in weights for part in names):
            continue
        parts = [weights[part]() for part in names]
        perm = parts[0].input_perm
        if not all(_same_perm(part.input_perm, perm) for part in parts):
            continue
        rows = cat_q4_rows([part.rows for part in parts])
        _set_packed(layer, name, rows.q.shape[0], pack_q4_rows(rows), GGMLQuantizationType.Q4_1, activation_bits, perm)
        packed += 1
    return packed


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and torch.equal(a, b))


def _param(*shape: int, dtype: torch.dtype, loader: Callable) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def _divide(n: int, tp_size: int, what: str) -> int:
    if n % tp_size:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={tp_size}")
    return n // tp_size


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b, with W's output rows split across ranks. x: [T, in] -> y: [T, out / tp]."""

    packable_weight = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype = torch.float32,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size = input_size
        self.output_size_per_partition = _divide(output_size, tp_size, "output_size")
        self.weight = _param(self.output_size_per_partition, input_size, dtype=dtype, loader=self.weight_loader)
        self.bias = _param(self.output_size_per_partition, dtype=dtype, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = param.shape[0]
        _copy(param, loaded.narrow(0, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def kernel_weights(self, kernels: ModuleType) -> Any:
        """This layer for the C++ kernels' DecoderStack (`linear_weights`)."""
        return linear_weights(kernels, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (e.g. gate_up); shard ids 0, 1, ..."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, dtype, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            return super().weight_loader(param, loaded)
        shard = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _copy(param.data.narrow(0, offset, shard), loaded.narrow(0, self.tp_rank * shard, shard))


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one tensor-parallel rank computes: query heads [q_start, q_start + num_heads) and KV
    heads [kv_start, kv_start + num_kv_heads)."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def head_shard(num_heads: int, num_kv_heads: int, tp_rank: int, tp_size: int) -> HeadShard:
    """Split the attention heads across ranks by whole GQA groups (a KV head with the query heads that read it).

    With at least as many KV heads as ranks, each rank takes a run of groups, the first `num_kv_heads % tp_size`
    ranks one more (SmolLM2's 3 KV heads of 3 query heads each at tp 2: rank 0 takes 2 groups, 6 query heads;
    rank 1 takes 1 group, 3 query heads), so no KV head is stored twice. With fewer KV heads than ranks, the query
    heads split evenly and each KV head is replicated on the tp_size / num_kv_heads ranks whose queries read it.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        base, extra = divmod(num_kv_heads, tp_size)
        kv_start, num_kv = tp_rank * base + min(tp_rank, extra), base + (tp_rank < extra)
        return HeadShard(kv_start * group, num_kv * group, kv_start, num_kv)
    if tp_size % num_kv_heads or num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} with {num_kv_heads} KV heads and {num_heads} query heads: "
                         "with fewer KV heads than ranks, the ranks must be a multiple of the KV heads and divide "
                         "the query heads")
    num_q = num_heads // tp_size
    return HeadShard(tp_rank * num_q, num_q, tp_rank * num_kv_heads // tp_size, 1)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projection of this rank's heads (`head_shard`). Output: [T, (Hq_r + 2 * Hkv_r) * D];
    shard ids "q", "k", "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.head_dim = head_dim
        self.heads = head_shard(num_heads, num_kv_heads, tp_rank, tp_size)
        output_size = (self.heads.num_heads + 2 * self.heads.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias, dtype, tp_rank, tp_size)

    @property
    def q_size(self) -> int:
        return self.heads.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.heads.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is None:
            raise ValueError("QKVParallelLinear needs a shard id: 'q', 'k' or 'v'")
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.heads.q_start
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, self.heads.kv_start
        else:
            raise ValueError(f"unknown qkv shard id {shard_id!r}")
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, start * self.head_dim, size))


class RowParallelLinear(nn.Module):
    """y = x W^T + b, with W's input columns split across ranks; partial sums are all-reduced.

    x: [T, in / tp] -> y: [T, out].
    """

    packable_weight = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype = torch.float32,
                 tp_rank: int = 0, tp_size: int = 1, input_shard: tuple[int, int] | None = None,
                 reduce_results: bool = True) -> None:
        """`input_shard`: (first column, columns) of this rank, when the split is not even (attention heads split
        by `head_shard`); None splits the input columns evenly. `reduce_results=False` returns this rank's partial
        sums, for a caller that adds several layers' before one all-reduce (a mixture of experts); rank 0's have
        the bias in them, as vLLM's, so that the sum has it once."""
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.reduce_results = reduce_results
        if input_shard is None:
            size = _divide(input_size, tp_size, "input_size")
            input_shard = (tp_rank * size, size)
        self.input_offset, self.input_size_per_partition = input_shard
        self.output_size = output_size
        self.weight = _param(output_size, self.input_size_per_partition, dtype=dtype, loader=self.weight_loader)
        self.bias = _param(output_size, dtype=dtype, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is not split: it is added once, after the reduce
            return _copy(param, loaded)
        _copy(param, loaded.narrow(1, self.input_offset, self.input_size_per_partition))

    @property
    def _bias_after(self) -> torch.Tensor | None:
        """The bias this rank adds after its product under tensor parallelism: after the all-reduce; rank 0's
        alone where the caller reduces."""
        return self.bias if self.reduce_results or self.tp_rank == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:   # the bias in the product (rounded once, as torch's addmm): no pass of its own
            return linear(x, self.weight, self.bias)
        y = linear(x, self.weight)
        if self.reduce_results:
            communicator().all_reduce(y)
        bias = self._bias_after
        return y if bias is None else y + bias

    def kernel_weights(self, kernels: ModuleType) -> Any:
        """This layer for the C++ kernels (`linear_weights`): on one rank (they have no all-reduce), its bias in the
        product as `forward` has it; or a layer that leaves its reduce to the caller, rank 0's bias added after."""
        assert self.tp_size == 1 or not self.reduce_results, "the kernels' layers do not all-reduce"
        if self.tp_size == 1:
            return linear_weights(kernels, self.weight, self.bias)
        return linear_weights(kernels, self.weight, row_bias=self._bias_after)
