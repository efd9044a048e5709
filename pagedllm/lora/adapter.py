"""LoRA adapters as PEFT saves them, loaded onto the model's fused layers, and applied per step to their rows.

A PEFT LoRA adapter adds `scaling * B (A x)` to a linear layer's output, with A [r, in] and B [out, r] per target
module and `scaling = lora_alpha / r` (`/ sqrt(r)` with `use_rslora`). The model fuses q/k/v into qkv_proj and
gate/up into gate_up_proj, so an adapter is stored per fused layer: the targeted parts' A stacked [parts * r, in],
and their B, times the scaling, block-diagonal [out, parts * r] (zero rows for an untargeted part), so that one
pair of matrix products adds every part's update: `out += (x A^T) B^T`.

A step may run requests of several adapters and of none: `LoRABatch` holds each adapter's rows of the step, and
each layer adds an adapter's update to those rows only (an index_select, two small products, an index_add).
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from pagedllm.lora.request import LoRARequest
from pagedllm.models.llama import PACKED_MODULES_MAPPING, has_conv_layers

# fused module -> the checkpoint modules whose output rows it stacks, in row order
_FUSED_PARTS: dict[str, list[str]] = {**PACKED_MODULES_MAPPING, "o_proj": ["o_proj"], "down_proj": ["down_proj"]}
_FUSED_OF = {part: fused for fused, parts in _FUSED_PARTS.items() for part in parts}
_KEY = re.compile(r"base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.default)?\.weight")
_UNSUPPORTED_CONFIG = {"use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
                       "layers_to_transform": None}


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter on the model's fused layers: (layer index, fused module) -> (A^T [in, parts * r], B^T [parts * r,
    out]) with the scaling in B, both stored transposed and contiguous (the products' layout: ~5% of the mixed
    workload's time under an adapter against transposed views)."""

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _part_sizes(model: Any) -> dict[str, tuple[int, int]]:
    """Each checkpoint module's (in features, out features) in the model (its attention layers', not its short
    convolutions' or recurrent layers'; the MLP's of its dense layers: a mixture of experts takes no adapter)."""
    attn = next(layer.self_attn for layer in model.model.layers if hasattr(layer.self_attn, "qkv_proj"))
    hidden = model.config.hidden_size
    q_size, kv_size = attn.qkv_proj.q_size, attn.qkv_proj.kv_size
    sizes = {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
             "o_proj": (q_size, hidden)}
    dense = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate_up_proj")]
    if dense:
        inter = dense[0].gate_up_proj.output_sizes[0]
        sizes.update(gate_proj=(hidden, inter), up_proj=(hidden, inter), down_proj=(inter, hidden))
    return sizes


def _check_dense(request: LoRARequest, model: Any, layer: int, fused: str) -> None:
    """ValueError unless layer `layer` has module `fused` to adapt: a mixture of experts' layer has no
    gate_up_proj or down_proj of its own, a short convolution or a recurrent layer no attention."""
    if fused in ("qkv_proj", "o_proj"):
        if not hasattr(model.model.layers[layer].self_attn, "qkv_proj"):
            raise ValueError(f"LoRA adapter {request.lora_name!r}: layer {layer} is no attention (a short "
                             f"convolution, a Mamba-2 or Gated DeltaNet layer), whose projections take no adapter "
                             "here")
    elif not hasattr(model.model.layers[layer].mlp, fused):
        raise ValueError(f"LoRA adapter {request.lora_name!r}: layer {layer}'s MLP is a mixture of experts, whose "
                         "experts take no adapter here (only the attention's q/k/v/o_proj)")


def load_adapter(request: LoRARequest, model: Any, max_rank: int) -> LoRAAdapter:
    """Read a PEFT LoRA adapter folder and place it on the model's fused layers. ValueError, saying what, for a
    folder that is not one, a rank over `max_rank`, or what the model's layers cannot take (a module other than
    q/k/v/o/gate/up/down_proj, DoRA, biases, modules_to_save, per-module ranks)."""
    folder = Path(request.lora_path).expanduser()
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {request.lora_name!r}: {config_file} not found (expected a folder saved "
                         "by PEFT: adapter_config.json and adapter_model.safetensors)")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    _check_config(request, config)
    rank = int(config["r"])
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {request.lora_name!r} has rank {rank}, over max_lora_rank={max_rank}")
    scaling = config.get("lora_alpha", rank) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    parts = _read_parts(request, folder)
    sizes = _part_sizes(model)
    # Granite's residual_multiplier, which the model folded into o_proj's and down_proj's weights, scales their
    # updates too (pagedllm.models.llama)
    residual = float(getattr(model.config, "residual_multiplier", None) or 1.0)
    device = model.model.embed_tokens.weight.device
    weights = {}
    for (layer, fused), by_part in _group_by_fused(request, parts, model.num_layers).items():
        _check_dense(request, model, layer, fused)
        if "q_proj" in by_part and getattr(model.model.layers[layer].self_attn, "output_gate", None) is not None:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: layer {layer}'s q_proj also gives each head's "
                             "output gate (Qwen3-Next's, Qwen3.5's), which takes no adapter here (k/v/o_proj and "
                             "the MLP's do)")
        names = _FUSED_PARTS[fused]
        a_rows, b_blocks, out_total = [], [], sum(sizes[n][1] for n in names)
        row = 0
        for name in names:
            in_size, out_size = sizes[name]
            if name in by_part:
                a, b = by_part[name]
                if a.shape != (rank, in_size) or b.shape != (out_size, rank):
                    raise ValueError(f"LoRA adapter {request.lora_name!r}: layer {layer} {name} has A "
                                     f"{tuple(a.shape)} and B {tuple(b.shape)}, expected ({rank}, {in_size}) "
                                     f"and ({out_size}, {rank}) for this model")
                block = torch.zeros(out_total, rank, dtype=torch.float32)
                block[row:row + out_size] = b.float() * scaling * (residual if name in ("o_proj", "down_proj") else 1)
                a_rows.append(a.float())
                b_blocks.append(block)
            row += out_size
        weights[(layer, fused)] = (torch.cat(a_rows).T.contiguous().to(device, model.dtype),
                                   torch.cat(b_blocks, dim=1).T.contiguous().to(device, model.dtype))
    return LoRAAdapter(weights)


def _check_config(request: LoRARequest, config: dict[str, Any]) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {request.lora_name!r} is a {config['peft_type']} adapter, not LORA")
    for key, plain in _UNSUPPORTED_CONFIG.items():
        if config.get(key, plain) not in (plain, [], {}):
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {key}={config[key]!r} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {request.lora_name!r}: bias={config['bias']!r} is not supported (only "
                         "'none')")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"LoRA adapter {request.lora_name!r}: per-module ranks or alphas (rank_pattern, "
                         "alpha_pattern) are not supported")


def _read_parts(request: LoRARequest, folder: Path) -> dict[str, torch.Tensor]:
    safetensors, bin_file = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    if safetensors.is_file():
        return load_file(str(safetensors))
    if bin_file.is_file():
        return torch.load(bin_file, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {request.lora_name!r}: neither {safetensors.name} nor {bin_file.name} in "
                     f"{folder}")


def _group_by_fused(request: LoRARequest, tensors: dict[str, torch.Tensor], num_layers: int
                    ) -> dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(layer, fused module) -> checkpoint module -> (A, B)."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None or match.group(2) not in _FUSED_OF or int(match.group(1)) >= num_layers:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: tensor {key!r} targets nothing this model's "
                             "LoRA layers take (q/k/v/o_proj and gate/up/down_proj of its decoder layers)")
        halves.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    grouped: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, name), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: layer {layer} {name} lacks lora_"
                             f"{'B' if 'A' in pair else 'A'}")
        grouped.setdefault((layer, _FUSED_OF[name]), {})[name] = (pair["A"], pair["B"])
    return grouped


class LoRARegistry:
    """The adapters loaded, by `lora_int_id`, the least recently used dropped beyond `capacity` (they load again
    from their folders when a request needs them)."""

    def __init__(self, model: Any, max_lora_rank: int, capacity: int) -> None:
        if has_conv_layers(model.config):
            raise ValueError("LoRA adapters on a model with short convolution layers (LFM2) are not supported")
        self.model, self.max_lora_rank, self.capacity = model, max_lora_rank, capacity
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()

    def get(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self._adapters.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(request, self.model, self.max_lora_rank)
            self._adapters[request.lora_int_id] = adapter
            while len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)
        self._adapters.move_to_end(request.lora_int_id)
        return adapter

    def drop(self, lora_int_id: int) -> bool:
        """Forget an adapter (a request still naming it loads it again from its folder); whether it was loaded."""
        return self._adapters.pop(lora_int_id, None) is not None

    def ids(self) -> set[int]:
        """The `lora_int_id`s of the adapters loaded."""
        return set(self._adapters)


class LoRABatch:
    """A step's adapters and the rows (token positions in the step) each one applies to."""

    def __init__(self, groups: list[tuple[LoRAAdapter, torch.Tensor]], num_rows: int) -> None:
        self.groups = groups
        self.num_rows = num_rows

    def add(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (the module's output for x) plus each adapter's update on its rows; out is updated in place."""
        for adapter, rows in self.groups:
            pair = adapter.weights.get((layer, module))
            if pair is None:
                continue
            a_t, b_t = pair
            if len(rows) == self.num_rows:    # every row of the step: no gather
                out.addmm_(x @ a_t, b_t)
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a_t) @ b_t)
        return out
