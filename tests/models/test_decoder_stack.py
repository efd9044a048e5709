"""The decoder layers in one C++ call (DecoderStack, pagedllm/kernels/csrc/decoder.cpp) give the modules' bits.

The engine runs a model's layers through the stack unless enforce_eager=True. Each case runs the same requests both
ways, through chunked prefills, steps that mix prefill chunks with decodes, and decodes alone, and compares every
prompt and sample logprob exactly, for each weight format the kernels take and both KV cache dtypes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.cpu import onednn_bf16_ok
from pagedllm.layers.linear import BF16_KERNEL_ENV, GGUF_BF16, fuses_silu_and_mul, gguf_activation_bits
from pagedllm.loader import load_model
from tests.loader.test_gguf import write_model_gguf
from tests.models.tiny import SimplePagedRunner, build_tiny_hf_model, save_tiny_model

_generator = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(3, 259, (n,), generator=_generator).tolist() for n in (5, 23, 41)]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)

# case -> (tiny model kind, config overrides, LLM arguments)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "float32": ("llama-gqa", {}, dict(dtype="float32")),
    "bfloat16": ("llama-gqa", {}, dict(dtype="bfloat16")),
    "float16, plain weights": ("llama-gqa", {}, dict(dtype="float16")),
    "qwen2, qkv bias": ("qwen2", {}, dict(dtype="float32")),
    "qwen3, q/k norms": ("qwen3", {}, dict(dtype="float32")),
    "qwen3 in bfloat16": ("qwen3", {}, dict(dtype="bfloat16")),
    "o_proj and mlp biases": ("llama-untied", dict(attention_bias=True, mlp_bias=True), dict(dtype="float32")),
    "mqa, head_dim 32": ("llama-mqa", {}, dict(dtype="float32")),
    "int8": ("llama-gqa", {}, dict(dtype="float32", quantization="int8")),
    "w8a8": ("llama-gqa", {}, dict(dtype="bfloat16", quantization="w8a8")),
    "int8 kv cache": ("llama-gqa", {}, dict(dtype="float32", kv_cache_dtype="int8")),
    "mixture of experts, shared expert, a dense layer": ("qwen2-moe", {}, dict(dtype="float32")),
    "mixture of experts in bfloat16": ("qwen3-moe", {}, dict(dtype="bfloat16")),
    # Granite MoE's stacked experts and multipliers; OLMoE's q/k norms over all the heads
    "granite moe": ("granitemoe", {}, dict(dtype="bfloat16")),
    # Granite 4's shared MLP: beside the experts, ungated; alone (granite-4.0-micro's); attention without a rope
    "granite moe shared": ("granitemoeshared", {}, dict(dtype="float32")),
    "granite 4 dense": ("granite4-dense", {}, dict(dtype="bfloat16")),
    "granite 4 nope": ("granite4-nope", {}, dict(dtype="float32")),
    "granite moe swa": ("granitemoe-swa", {}, dict(dtype="float32")),
    "olmoe": ("olmoe", {}, dict(dtype="float32")),
    # ERNIE 4.5 MoE's float32 router for bf16 rows, its selection bias and ungated shared experts
    "ernie 4.5 moe in bfloat16": ("ernie4_5-moe", {}, dict(dtype="bfloat16")),
    # LFM2-MoE's short convolutions beside experts with sigmoid scores
    "lfm2 moe": ("lfm2-moe", {}, dict(dtype="float32")),
    # gpt-oss's attention sinks (each layer's own), biased router and experts, clamped SwiGLU, a local layer
    "gpt-oss": ("gpt-oss", {}, dict(dtype="float32")),
    "gpt-oss in bfloat16": ("gpt-oss", {}, dict(dtype="bfloat16")),
    # Granite SWA's sinks, a rotary base of each layer's own and a layer without one
    "granite swa": ("granite-swa", {}, dict(dtype="float32")),
    # branch norms, GELU, a local layer (its window shorter than the long prompts, its own rope) and a global one
    "gemma3": ("gemma3", {}, dict(dtype="float32")),
    "gemma3 in bfloat16": ("gemma3", {}, dict(dtype="bfloat16")),
    # soft-capped attention scores, as the kernels cap them
    "gemma2": ("gemma2", {}, dict(dtype="float32")),
    # the first Gemma's: Llama's layers with Gemma's norms, scaled embeddings and GELU, heads past the hidden size
    "gemma": ("gemma", {}, dict(dtype="bfloat16")),
    # Gemma 2's without the branches' output norms
    "vaultgemma": ("vaultgemma", {}, dict(dtype="float32")),
    # fused checkpoint weights, longrope over 3/4 of each head, steps before and past an original context of 16
    "phi3, longrope": ("phi3-longrope", dict(original_max_position_embeddings=16), dict(dtype="float32")),
    # a layer without a rotary embedding (NoPE): a rotary part of no values
    "smollm3": ("smollm3", {}, dict(dtype="float32")),
    # Ministral 3's queries scaled past its original context of 8, YaRN's tables
    "ministral3": ("ministral3", {}, dict(dtype="float32")),
    "ministral3 in bfloat16": ("ministral3", {}, dict(dtype="bfloat16")),
    # Granite's multipliers: the residual's folded into o_proj and down_proj, the scores' as the attention scale
    "granite": ("granite", {}, dict(dtype="bfloat16")),
    # the branches' outputs normed, not their inputs: OLMo's q/k norms over all the heads, EXAONE 4's per head and
    # its global layer without a rotary embedding
    "olmo2": ("olmo2", {}, dict(dtype="float32")),
    "olmo3 in bfloat16": ("olmo3", {}, dict(dtype="bfloat16")),
    "exaone4": ("exaone4", {}, dict(dtype="float32")),
    # GLM-4's: norms on both sides of each branch (plain weights), biased q/k/v, half of each head turned
    "glm4": ("glm4", {}, dict(dtype="float32")),
    # LFM2's short convolutions: their inputs written to and read from two of the pool's layers
    "lfm2": ("lfm2", {}, dict(dtype="float32")),
    "lfm2 in bfloat16": ("lfm2", {}, dict(dtype="bfloat16")),
    # LayerNorm models: StableLM's (Llama's layers otherwise, q/k/v biased, a quarter of each head turned); Phi's
    # parallel branches under one norm, its ungated tanh-GELU MLP; GPT-NeoX's under a norm each, exact GELU;
    # StarCoder2's biased layers over a window; Cohere2's norms without biases, its NoPE global layer; OPT's learned
    # positions and ReLU MLP; Falcon 40B's groups of queries
    "stablelm": ("stablelm", {}, dict(dtype="float32")),
    "phi": ("phi", {}, dict(dtype="float32")),
    "phi in bfloat16": ("phi", {}, dict(dtype="bfloat16")),
    "gpt-neox": ("gpt-neox", {}, dict(dtype="float32")),
    "starcoder2": ("starcoder2", {}, dict(dtype="float32")),
    "cohere2": ("cohere2", {}, dict(dtype="float32")),
    "opt": ("opt", {}, dict(dtype="float32")),
    "falcon 40b": ("falcon-new", {}, dict(dtype="bfloat16")),
    # ALiBi's slopes: BLOOM's in bfloat16 (its embeddings normed), MPT's (its clamp and scale)
    "bloom in bfloat16": ("bloom", {}, dict(dtype="bfloat16")),
    "mpt": ("mpt", {}, dict(dtype="float32")),
    # OLMo's LayerNorms without weights or biases and its q/k/v clamped; Nemotron's 1 + w norms and squared ReLU
    "olmo": ("olmo", {}, dict(dtype="float32")),
    "nemotron in bfloat16": ("nemotron", {}, dict(dtype="bfloat16")),
    # each head's q/k norms after the rotary embedding (Hunyuan's)
    "hunyuan": ("hunyuan", {}, dict(dtype="float32")),
    # RMSNorms before an ungated MLP (Arcee's)
    "arcee": ("arcee", {}, dict(dtype="float32")),
}


def _run(model: str, **kwargs: Any) -> tuple[list[Any], LLM]:
    # 16-token steps: the long prompts prefill in chunks, beside the short one's decodes
    llm = LLM(model, block_size=4, max_num_batched_tokens=16, num_kv_blocks=128, **kwargs)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], llm


def _stacks(llm: LLM) -> dict | None:
    return llm.engine.runner.model.model.stacks


def _assert_stack_gives_the_modules_bits(model: str, **kwargs: Any) -> None:
    stacked, llm = _run(model, **kwargs)
    eager, eager_llm = _run(model, enforce_eager=True, **kwargs)
    assert len(_stacks(llm)) == 1 and _stacks(eager_llm) is None  # one stack built and run; none under eager
    assert stacked == eager


@pytest.mark.parametrize("case", list(CASES))
def test_stack_gives_the_modules_bits(tmp_path: Path, case: str) -> None:
    kind, overrides, kwargs = CASES[case]
    folder, _ = save_tiny_model(tmp_path / "m", kind, seed=3, **overrides)
    _assert_stack_gives_the_modules_bits(str(folder), **kwargs)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_gives_the_modules_bits_on_gguf_blocks(tmp_path: Path, qtype: Q, dtype: str, isa_level: str) -> None:
    """A .gguf file's blocks (its default), at each ISA level's build of the kernels and the stack; the steps
    prefill two sequences, decode them, then decode one beside a third's prefill. In bf16 where the blocks multiply x
    in bf16 (`gguf_activation_bits`), gate_up runs with its SiLU-and-mul in one kernel."""
    path = tmp_path / "m.gguf"
    write_model_gguf(build_tiny_hf_model("llama-untied", seed=3), path, "llama", qtype)
    logits = []
    for enforce_eager in (False, True):
        model = load_model(ModelConfig(model=str(path), dtype=dtype, quantization="gguf",
                                       enforce_eager=enforce_eager)).model
        assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.uint8
        in_bf16 = gguf_activation_bits(getattr(torch, dtype)) == GGUF_BF16
        assert fuses_silu_and_mul(model.model.layers[0].mlp.gate_up_proj.weight, 1) == in_bf16
        runner = SimplePagedRunner(model, dtype=getattr(torch, dtype))
        logits.append([runner.step({0: PROMPTS[0], 1: PROMPTS[1]}), runner.step({0: [40], 1: [41]}),
                       runner.step({1: [42], 2: PROMPTS[2]})])
        assert (model.model.stacks is None) == enforce_eager
    assert all(torch.equal(a, b) for a, b in zip(*logits))


@pytest.mark.skipif(not onednn_bf16_ok(), reason="oneDNN has no bf16 linear on this CPU")
def test_stack_gives_the_modules_bits_on_onednn_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BF16_KERNEL_ENV, "onednn")
    folder, _ = save_tiny_model(tmp_path / "m", "llama-gqa", seed=3)
    _assert_stack_gives_the_modules_bits(str(folder), dtype="bfloat16")
    llm = LLM(str(folder), dtype="bfloat16", num_kv_blocks=16)
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.weight.is_mkldnn


def test_a_stack_refuses_caches_that_do_not_match_its_layers(tmp_path: Path) -> None:
    folder, _ = save_tiny_model(tmp_path / "m", "llama-gqa", seed=3)
    llm = LLM(str(folder), dtype="float32", block_size=4, num_kv_blocks=16)
    runner = llm.engine.runner
    x = torch.zeros(1, runner.model.config.hidden_size)
    stack = runner.model.model.stack_for(x)
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="the layers take 2 layers of the KV pool, given 1"):
        stack.forward(x, torch.zeros(1, dtype=torch.int64), runner.kv_caches[:1], torch.zeros(1, dtype=torch.int64),
                      one.view(1, 1), one, torch.tensor([0, 1], dtype=torch.int32), 1, True)
