"""`pagedllm plan`: the KV cache a model gets from a memory budget, computed as the engine computes it.

Reads the model's config only (never its weights), then applies the engine's own sizing: `KVLayout` for the
bytes per token, `kv_budget_bytes` for the default budget, `num_blocks_for` for the blocks, `CapacityReport`
for the concurrency. Beside the model's own attention it shows the same model with MHA (a KV head per query
head), GQA (its own grouping, when it has one) and MQA (one KV head).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from pagedllm.models.llama import kv_window
from pagedllm.runner import kv_tensors
from pagedllm.runner.model_runner import model_shape

# About one ShareGPT conversation: the PagedAttention paper's mean prompt (161) plus mean output (338).
DEFAULT_CONTEXT_LEN = 500


@dataclass(frozen=True)
class AttentionVariant:
    """One attention layout of the model and what the budget holds with it.

    `paged_seqs`: sequences of `context_len` tokens whose blocks fit in the pool, `cdiv(context_len, block_size)`
    blocks each. `contiguous_seqs`: sequences that fit when each reserves `max_model_len` slots up front.
    """

    name: str
    num_kv_heads: int
    bytes_per_token: int
    num_blocks: int
    paged_seqs: int
    contiguous_seqs: int


@dataclass(frozen=True)
class KVPlan:
    model: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_cache_dtype: str
    budget_bytes: int
    context_len: int
    capacity: kv_tensors.CapacityReport
    variants: list[AttentionVariant]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def attention_kind(num_heads: int, num_kv_heads: int) -> str:
    return "MHA" if num_kv_heads == num_heads else "MQA" if num_kv_heads == 1 else "GQA"


def make_plan(model: str | None, budget_bytes: int | None = None, block_size: int = 8,
              context_len: int | None = None, max_model_len: int | None = None, dtype: str = "auto",
              kv_cache_dtype: str = "auto") -> KVPlan:
    """The plan for `model` (a folder, a .gguf file or None for the default) and a KV budget.

    Args:
        budget_bytes: the KV pool's bytes; None takes the engine's default on a CPU.
        context_len: tokens per sequence for the "how many fit" columns; None is `DEFAULT_CONTEXT_LEN` (capped
            by max_model_len).
        max_model_len: as the engine's flag: caps the model's context length; None keeps it.
        kv_cache_dtype: as the engine's: "auto" (the model's dtype) or "int8" (int8 plus a float32 scale per row).
    """
    from pagedllm.loader import load_hf_config, max_model_len_of, resolve_dtype, resolve_model

    resolved = resolve_model(model)
    hf_config = load_hf_config(resolved)
    model_len = max_model_len_of(hf_config, max_model_len)
    shape = model_shape(hf_config)
    torch_dtype = resolve_dtype(dtype)
    if budget_bytes is None:
        budget_bytes = kv_tensors.kv_budget_bytes(None, None, 0, torch.device("cpu"))
    context_len = context_len or min(DEFAULT_CONTEXT_LEN, model_len)
    if not 0 < context_len <= model_len:
        raise ValueError(f"context_len must be in [1, max_model_len={model_len}], got {context_len}")
    num_heads = hf_config.num_attention_heads
    layout = kv_tensors.KVLayout(shape.num_layers, shape.num_kv_heads, shape.head_dim, torch_dtype, kv_cache_dtype)
    capacity = kv_tensors.CapacityReport(kv_tensors.num_blocks_for(budget_bytes, layout.bytes_per_token, block_size),
                                         block_size, layout.bytes_per_token, model_len, kv_window(hf_config))
    kv_heads = {"MHA": num_heads, attention_kind(num_heads, shape.num_kv_heads): shape.num_kv_heads, "MQA": 1}
    variants = [_variant(name, layout, heads, budget_bytes, block_size, context_len, model_len)
                for name, heads in sorted(kv_heads.items(), key=lambda item: -item[1])]
    return KVPlan(resolved.name, shape.num_layers, num_heads, shape.num_kv_heads, shape.head_dim,
                  str(torch_dtype).removeprefix("torch."), kv_cache_dtype, budget_bytes, context_len, capacity,
                  variants)


def _variant(name: str, layout: kv_tensors.KVLayout, num_kv_heads: int, budget_bytes: int, block_size: int,
             context_len: int, max_model_len: int) -> AttentionVariant:
    layout = replace(layout, num_kv_heads=num_kv_heads)
    num_blocks = kv_tensors.num_blocks_for(budget_bytes, layout.bytes_per_token, block_size)
    num_slots = (num_blocks - 1) * block_size   # block 0 is the null block
    return AttentionVariant(name, num_kv_heads, layout.bytes_per_token, num_blocks,
                            (num_blocks - 1) // -(-context_len // block_size), num_slots // max_model_len)


def format_plan(plan: KVPlan) -> str:
    """The plan as a short report and a table, one row per attention variant."""
    kind = attention_kind(plan.num_heads, plan.num_kv_heads)
    row_bytes = plan.capacity.bytes_per_token // (2 * plan.num_layers * plan.num_kv_heads)
    int8 = plan.kv_cache_dtype == "int8"
    row = (f"({plan.head_dim} int8 + a 4-byte scale)" if int8
           else f"{plan.head_dim} x {row_bytes // plan.head_dim} bytes")
    lines = [f"model: {plan.model}: {plan.num_layers} layers, {plan.num_heads} query heads, {plan.num_kv_heads} "
             f"KV heads ({kind}), head_dim {plan.head_dim}, {plan.dtype}{', int8 KV cache' if int8 else ''}",
             f"KV bytes per token: 2 x {plan.num_layers} layers x {plan.num_kv_heads} KV heads x {row} "
             f"= {plan.capacity.bytes_per_token:,}",
             f"budget: {plan.budget_bytes / kv_tensors.GiB:.2f} GiB -> {plan.capacity}",
             f"sequences of {plan.context_len} tokens that fit: paged (blocks of {plan.capacity.block_size}) vs "
             f"contiguous (each reserves max_model_len={plan.capacity.max_model_len}):", ""]
    header = f"{'attention':<12}{'KV heads':>9}{'bytes/token':>13}{'blocks':>10}{'paged seqs':>12}{'contiguous':>12}"
    lines.append(header)
    for v in plan.variants:
        label = f"{v.name}{' *' if v.num_kv_heads == plan.num_kv_heads else ''}"
        lines.append(f"{label:<12}{v.num_kv_heads:>9}{v.bytes_per_token:>13,}{v.num_blocks:>10,}{v.paged_seqs:>12,}"
                     f"{v.contiguous_seqs:>12,}")
    lines.append("* the model's own attention")
    return "\n".join(lines)
