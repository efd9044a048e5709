"""8-bit checkpoints read by dequantising them at load: FP8 ones (transformers' and DeepSeek's `quant_method` "fp8",
Qwen3-*-FP8 and the like; compressed-tensors' "float-quantized", llm-compressor's FP8-dynamic ones) and
compressed-tensors' 8-bit integer ones ("int-quantized", W8A8). Each quantized linear weight is stored as its 8-bit
values, `{layer}.weight`, beside its scales, `{layer}.weight_scale_inv` ("fp8": one a block of weights, 128 x 128
in the released ones) or `{layer}.weight_scale` (compressed-tensors: one a tensor, a row or a block); its weight is

    W[n, k] = float(q[n, k]) x scale[n // block_rows, k // block_columns]   (a row's or a tensor's: broadcast)

computed in float32 and rounded once to the model's dtype, which the model then runs as an unquantized checkpoint (or
quantizes at load: quantization "int8" or "w8a8"). Activation scales (`input_scale`, Mistral's `activation_scale`:
the checkpoint's activations were quantized statically) are not read: activations stay in the dtype, which is what
the scales approximate. vLLM runs these checkpoints' FP8 matmuls on GPUs alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pagedllm.loader.safetensors import INDEX_FILE, safetensors_files

_SCALES = ("weight_scale_inv", "weight_scale")     # a weight's, as "fp8" and compressed-tensors name them
# activations' (Mistral's FP8 releases: activation_scale) and the KV cache's
_UNREAD = ("input_scale", "activation_scale", "output_scale", "k_scale", "v_scale")


def is_eight_bit(hf_config: Any) -> bool:
    """Whether a config's checkpoint is one this module reads: an "fp8" one, or a compressed-tensors one but in its
    4-bit "pack-quantized" format (`pagedllm.loader.int4`'s)."""
    from pagedllm.loader.int4 import checkpoint_quantization

    method = checkpoint_quantization(hf_config)
    if method == "compressed-tensors":
        return "pack-quantized" not in _formats(_as_dict(hf_config.quantization_config))
    return method == "fp8"


def _as_dict(config: Any) -> dict[str, Any]:
    return config if isinstance(config, dict) else config.to_dict()


def _formats(config: dict[str, Any]) -> set[str]:
    """A compressed-tensors config's formats: its own and its weight groups'."""
    groups = (config.get("config_groups") or {}).values()
    return {str(config.get("format"))} | {str(group["format"]) for group in groups if group.get("format")}


def eight_bit_layout(hf_config: Any) -> tuple[int, int] | None:
    """The weights' block (rows, columns) a scale of an 8-bit checkpoint (its quantization_config), None where a
    scale is a row's or a tensor's; ValueError for one that pagedllm does not read: compressed-tensors' other
    formats (sparse ones, asymmetric integers) and any weights not of 8 bits."""
    config = _as_dict(hf_config.quantization_config)
    if str(config.get("quant_method")).lower() == "fp8":
        block = config.get("weight_block_size")
        return None if block is None else (int(block[0]), int(block[1]))
    weights = [group.get("weights") or {} for group in (config.get("config_groups") or {}).values()]
    for spec in weights:
        if spec.get("num_bits") != 8 or spec.get("type") not in ("float", "int") or not spec.get("symmetric", True):
            raise ValueError(f"pagedllm reads compressed-tensors' symmetric 8-bit weights (FP8 or int8); this "
                             f"checkpoint's are {spec.get('num_bits')}-bit {spec.get('type')}"
                             f"{'' if spec.get('symmetric', True) else ', asymmetric'}")
    unread = _formats(config) - {"float-quantized", "int-quantized", "naive-quantized", "None"}
    if unread or not weights:
        raise ValueError(f"pagedllm reads compressed-tensors' float-quantized and int-quantized checkpoints, not "
                         f"{sorted(unread) or 'one without config_groups'}")
    blocks = {tuple(spec["block_structure"]) for spec in weights if spec.get("strategy") == "block"}
    if len(blocks) > 1:
        raise ValueError(f"the checkpoint's weight groups have blocks of several shapes: {sorted(blocks)}")
    return (int(next(iter(blocks))[0]), int(next(iter(blocks))[1])) if blocks else None


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """An 8-bit weight [N, K] times its scales (one; a row's, [N, 1] or [N]; or with `block`, a block's of that many
    rows and columns, [ceil(N / rows), ceil(K / columns)]) in float32, rounded once to `dtype`."""
    rows, columns = values.shape
    scale = scale.float()
    if scale.numel() == 1:
        scale = scale.reshape(())
    elif block is not None and scale.dim() == 2:
        scale = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :columns]
    else:   # a row's
        scale = scale.reshape(rows, 1)
    return (values.float() * scale).to(dtype)


def iterate_eight_bit(folder: Path, dtype: torch.dtype, block: tuple[int, int] | None,
                      rename: Callable[[str], str | None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs for the model's `load_weights`: each quantized weight dequantised into `dtype` (its
    scale, a `block`'s where given, read from whichever shard holds it), the other tensors cast to it, the scales
    and activation scales not yielded; under `rename`'s names (None: not read)."""
    index = Path(folder) / INDEX_FILE
    shard_of = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
            for name in f.keys():
                prefix, _, suffix = name.rpartition(".")
                new_name = name if rename is None else rename(name)
                if new_name is None or suffix in _SCALES or suffix in _UNREAD:
                    continue
                tensor = f.get_tensor(name)
                scale_name = None if suffix != "weight" else next(
                    (f"{prefix}.{s}" for s in _SCALES if f"{prefix}.{s}" in names or shard_of and f"{prefix}.{s}" in
                     shard_of), None)
                if scale_name is not None:
                    yield new_name, dequantize(tensor, _read(f, names, folder, shard_of, scale_name), dtype, block)
                else:
                    yield new_name, tensor.to(dtype) if tensor.is_floating_point() else tensor


def _read(f: Any, names: set[str], folder: Path, shard_of: dict[str, str] | None, name: str) -> torch.Tensor:
    """Tensor `name` from the open shard `f`, or from the shard the index names."""
    if name in names:
        return f.get_tensor(name)
    assert shard_of is not None
    with safe_open(str(Path(folder) / shard_of[name]), framework="pt") as other:
        return other.get_tensor(name)
