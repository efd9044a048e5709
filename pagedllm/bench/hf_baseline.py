"""The peer: Hugging Face transformers `generate` over left-padded static batches, in its fastest dtype, greedy or
with the requests' sampling parameters.

A static batch runs until its longest request is done, so every row generates max(output_len in the batch)
tokens. Only each request's own output_len counts as useful output; the rest is reported as generated tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GenerationConfig,
    PreTrainedModel,
)

from pagedllm.bench.datasets import BenchRequest
from pagedllm.cpu import torch_bf16_is_native
from pagedllm.loader.resolve import ResolvedModel
from pagedllm.models.llama import attends_both_ways

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def hf_dtype(dtype: str, device: str = "cpu") -> torch.dtype:
    """"auto" is transformers' (and vLLM-CPU's) fastest dtype on `device`: bfloat16 on a GPU, and on a CPU where
    oneDNN has bf16 instructions, float32 where bf16 is emulated (2-4x slower there: `torch_bf16_is_native`); other
    names map directly."""
    if dtype == "auto":
        return torch.bfloat16 if device != "cpu" or torch_bf16_is_native() else torch.float32
    return _DTYPES[dtype]


@dataclass(frozen=True)
class HFRun:
    elapsed_s: float
    num_generated_tokens: int   # batch rows x the batch's longest output, summed over batches


def auto_model_class(config: Any) -> Any:
    """The transformers auto class a config's model is saved as: a sequence classifier (a cross-encoder), an encoder
    (EmbeddingGemma, BERT: the bare model, with no causal LM class), or a causal LM."""
    if any(a.endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or []):
        return AutoModelForSequenceClassification
    return AutoModel if attends_both_ways(config) else AutoModelForCausalLM


def load_hf_model(resolved: ResolvedModel, dtype: str = "auto", device: str = "cpu") -> PreTrainedModel:
    """The model in `dtype` (see `hf_dtype`) on `device`, from an HF folder or a GGUF file (dequantised).

    transformers' own GGUF path (`from_pretrained(gguf_file=)`) needs `accelerate`; instead a GGUF's weights come
    from pagedllm's GGUF reader into the transformers model built from the same config.
    """
    torch_dtype = hf_dtype(dtype, device)
    if resolved.gguf_path is None:
        model_class = auto_model_class(AutoConfig.from_pretrained(resolved.path))
        return model_class.from_pretrained(str(resolved.path), dtype=torch_dtype).to(device).eval()
    from pagedllm.loader import load_hf_config
    from pagedllm.loader.gguf import iterate_gguf

    config = load_hf_config(resolved)  # a GGUF's is generic (see gguf_hf_config): the model's own class
    config = AutoConfig.for_model(config.model_type, **{k: v for k, v in config.to_dict().items() if k != "model_type"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    weights = _stacked_experts(dict(iterate_gguf(resolved.gguf_path, torch_dtype)), model)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"the GGUF does not fit the transformers model: missing {_some(missing)}, "
                           f"unexpected {_some(unexpected)}")
    model.tie_weights()
    return model.to(device).eval()


def _stacked_experts(weights: dict[str, torch.Tensor], model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """`weights` with each mixture of experts' per-expert projections (gate_proj, up_proj and down_proj of
    experts.{e}, as pagedllm's GGUF reader names them) stacked as transformers keeps them: experts.gate_up_proj
    [E, 2 I, H] (each expert's gate rows, then its up rows) and experts.down_proj [E, H, I]."""
    for name, param in model.state_dict().items():
        if not name.endswith("experts.gate_up_proj") or name in weights:
            continue
        prefix = name.removesuffix("gate_up_proj")
        experts = range(param.shape[0])
        if f"{prefix}0.gate_proj.weight" not in weights:
            continue
        weights[name] = torch.stack([torch.cat([weights.pop(f"{prefix}{e}.gate_proj.weight"),
                                                weights.pop(f"{prefix}{e}.up_proj.weight")]) for e in experts])
        weights[f"{prefix}down_proj"] = torch.stack([weights.pop(f"{prefix}{e}.down_proj.weight") for e in experts])
    return weights


def _some(names: list[str], shown: int = 8) -> str:
    """A few of `names`, and how many more."""
    return str(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _left_padded(batch: list[BenchRequest], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask, each [B, P_max], with the padding on the left."""
    width = max(r.prompt_len for r in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        input_ids[row, width - request.prompt_len:] = torch.tensor(request.prompt_token_ids)
        attention_mask[row, width - request.prompt_len:] = 1
    return input_ids, attention_mask


@torch.inference_mode()
def hf_sampling(sampling: dict[str, float | int]) -> dict[str, Any]:
    """transformers' generation options for the requests' sampling parameters (vLLM's names, see
    `pagedllm.bench.args.sampling_kwargs`): greedy at temperature 0, where only the repetition penalty applies, as
    in vLLM; top-k off unless given (transformers' own default is 50). It has no presence or frequency penalty."""
    missing = sorted({"presence_penalty", "frequency_penalty"} & sampling.keys())
    if missing:
        raise ValueError(f"transformers generate has no {' or '.join(missing)}: compare it without them")
    penalty = {"repetition_penalty": sampling["repetition_penalty"]} if "repetition_penalty" in sampling else {}
    if sampling["temperature"] == 0:
        return {"do_sample": False, **penalty}
    return {"do_sample": True, "temperature": sampling["temperature"], "top_p": sampling.get("top_p", 1.0),
            "top_k": max(sampling.get("top_k", 0), 0), "min_p": sampling.get("min_p"), **penalty}


def generate_batch(model: PreTrainedModel, batch: list[BenchRequest], pad_token_id: int,
                   sampling: dict[str, float | int] | None = None) -> int:
    """Generate exactly max(output_len) tokens for every row, greedy or with `sampling` (see `hf_sampling`); returns
    how many tokens were generated."""
    num_new = max(r.output_len for r in batch)
    input_ids, attention_mask = _left_padded(batch, pad_token_id)
    config = GenerationConfig(max_new_tokens=num_new, min_new_tokens=num_new,
                              pad_token_id=pad_token_id, eos_token_id=model.generation_config.eos_token_id,
                              **hf_sampling(sampling or {"temperature": 0.0}))
    out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                         generation_config=config)
    num_generated = out.shape[1] - input_ids.shape[1]
    if num_generated != num_new:
        raise RuntimeError(f"transformers generated {num_generated} tokens per row instead of {num_new}")
    return len(batch) * num_generated


def run_hf(model: PreTrainedModel, requests: list[BenchRequest], batch_size: int, pad_token_id: int,
           sampling: dict[str, float | int] | None = None) -> HFRun:
    """Run the requests in dataset order, `batch_size` at a time."""
    start = time.perf_counter()
    num_generated = sum(generate_batch(model, requests[i:i + batch_size], pad_token_id, sampling)
                        for i in range(0, len(requests), batch_size))
    return HFRun(time.perf_counter() - start, num_generated)
