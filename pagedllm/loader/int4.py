"""AWQ, GPTQ and compressed-tensors' 4-bit checkpoints: Hugging Face folders whose config.json has a
`quantization_config` and whose quantized linear layers are stored as `{layer}.qweight`, `.qzeros`, `.scales` (and
GPTQ's `.g_idx`), or compressed-tensors' `{layer}.weight_packed`, `.weight_scale`, `.weight_shape` (and
`.weight_g_idx`), in place of `{layer}.weight` (layouts in `pagedllm.layers.int4`).

`int4_weights` gives the 4-bit weights, which `pack_int4_linear_weights` packs in their layers' place before
the model loads the rest (`iterate_int4`: a layer left unpacked loads its dequantised weight, as from a GGUF).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pagedllm.layers.int4 import Int4Weight, awq_int4_weight, dequantize_int4, gptq_int4_weight, packed_int4_weight
from pagedllm.loader.safetensors import iterate_safetensors, safetensors_files

INT4_METHODS = ("awq", "gptq", "compressed-tensors")
_QUANTIZED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx",
                       "weight_packed", "weight_scale", "weight_shape", "weight_g_idx",     # compressed-tensors'
                       "weight_zero_point")
_GPTQ_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}  # v1 stores each zero minus 1


@dataclass(frozen=True)
class Int4Config:
    """What `quantization_config` says about a checkpoint's layout: method "awq" or "gptq", inputs per group (-1:
    one group; GPTQ reads the groups from g_idx), and what to add to GPTQ's stored zeros."""

    method: str
    group_size: int
    zero_offset: int = 0


def checkpoint_quantization(hf_config: Any) -> str | None:
    """`quantization_config.quant_method` of a transformers config ("awq", "gptq", ...), None if unquantized."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    return None if method is None else str(getattr(method, "value", method)).lower()


def int4_config(hf_config: Any) -> Int4Config:
    """The `Int4Config` of an AWQ, GPTQ or compressed-tensors pack-quantized checkpoint's config; ValueError for a
    layout pagedllm does not run (other than 4 bits, AWQ's GEMV layout or no zero point, GPTQ's Marlin or other
    formats)."""
    config = hf_config.quantization_config
    config = config if isinstance(config, dict) else config.to_dict()
    method = checkpoint_quantization(hf_config)
    if method == "compressed-tensors":
        return _packed_int4_config(config)
    bits = config.get("bits", config.get("w_bit"))
    group_size = int(config.get("group_size", config.get("q_group_size", -1)))
    if method not in INT4_METHODS or bits != 4:
        raise ValueError(f"pagedllm runs 4-bit AWQ and GPTQ checkpoints; this one is {method} with {bits} bits")
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm" or not config.get("zero_point", True):
            raise ValueError(f"pagedllm runs AWQ's GEMM layout with zero points; this checkpoint has version "
                             f"{version!r}, zero_point={config.get('zero_point')}")
        return Int4Config(method, group_size)
    checkpoint_format = str(config.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in _GPTQ_ZERO_OFFSETS:
        raise ValueError(f"pagedllm runs GPTQ's 'gptq' and 'gptq_v2' checkpoint formats, not {checkpoint_format!r}")
    return Int4Config(method, group_size, _GPTQ_ZERO_OFFSETS[checkpoint_format])


def _packed_int4_config(config: dict[str, Any]) -> Int4Config:
    """A compressed-tensors pack-quantized config's `Int4Config`: every group's weights 4-bit integers (symmetric, or
    with zero points), a scale a group of inputs (or a row), all of one group size; ValueError otherwise."""
    specs = [group.get("weights") or {} for group in (config.get("config_groups") or {}).values()]
    sizes = set()
    for spec in specs:
        strategy = spec.get("strategy")
        if spec.get("num_bits") != 4 or spec.get("type") != "int" or strategy not in ("group", "channel"):
            raise ValueError(f"pagedllm runs compressed-tensors' pack-quantized weights as 4-bit integers with a "
                             f"scale a group or a row; this checkpoint has {spec.get('num_bits')}-bit "
                             f"{spec.get('type')}, strategy {strategy!r}")
        sizes.add(int(spec.get("group_size") or -1) if strategy == "group" else -1)
    if len(sizes) != 1:
        raise ValueError(f"the checkpoint's weight groups have {'no' if not sizes else 'several'} group sizes: "
                         f"{sorted(sizes)}")
    return Int4Config("compressed-tensors", sizes.pop())


def int4_weights(folder: Path, config: Int4Config, rename: Callable[[str], str] = str
                 ) -> dict[str, Callable[[], Int4Weight]]:
    """{Hugging Face weight name ("...q_proj.weight"), as `rename` gives it (the model's `checkpoint_name`: Mixtral's
    experts' w1 as gate_proj ...): its `Int4Weight`, made when called} for every quantized layer of the checkpoint;
    only the quantized tensors are read (a few bits a weight)."""
    tensors: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                prefix, _, suffix = name.rpartition(".")
                if suffix in _QUANTIZED_SUFFIXES:
                    tensors[prefix][suffix] = f.get_tensor(name)
    return {rename(f"{prefix}.weight"): partial(_int4_weight, parts, config) for prefix, parts in tensors.items()}


def _int4_weight(tensors: dict[str, torch.Tensor], config: Int4Config) -> Int4Weight:
    if config.method == "compressed-tensors":
        rows, inputs = tensors["weight_shape"].tolist()
        return packed_int4_weight(tensors["weight_packed"], tensors["weight_scale"], (rows, inputs),
                                  config.group_size, tensors.get("weight_g_idx"), tensors.get("weight_zero_point"))
    if config.method == "awq":
        return awq_int4_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], config.group_size)
    g_idx = tensors.get("g_idx")
    if g_idx is None:  # checkpoints without act-order may leave it out: input k is in group k // group_size
        num_inputs = tensors["qweight"].shape[0] * 8
        g_idx = torch.arange(num_inputs) // (num_inputs if config.group_size == -1 else config.group_size)
    return gptq_int4_weight(tensors["qweight"], tensors["qzeros"], tensors["scales"], g_idx, config.zero_offset)


def iterate_int4(folder: Path, dtype: torch.dtype, config: Int4Config, skip: Container[str] = (),
                 rename: Callable[[str], str] = str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs for the model's `load_weights`: the unquantized tensors cast to `dtype`, then each
    quantized layer's dequantised weight in `dtype` under its plain name as `rename` gives it, but for those named
    in `skip` (packed as they are: never read)."""
    for name, tensor in iterate_safetensors(folder, dtype):
        if name.rpartition(".")[2] not in _QUANTIZED_SUFFIXES:
            yield name, tensor
    for name, weight in int4_weights(folder, config, rename).items():
        if name not in skip:
            yield name, dequantize_int4(weight()).to(dtype)
