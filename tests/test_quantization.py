"""quantization="int8" (linear weights stored as int8 with per-row scales), "w8a8" (those weights times activations
quantized per token), "gguf" (a GGUF's blocks kept) and "awq"/"gptq" (such checkpoints' 4-bit weights kept), end to
end.

The oracle is the same engine in float32 on a checkpoint whose linear weights were replaced by their dequantised
int8 values: it computes the same function up to float32 rounding, so greedy tokens must be identical. A w8a8
model's is the float32 model whose every matmul is `w8a8_reference`, to the bit. GGUF blocks (and AWQ's and GPTQ's
4-bit weights, repacked as such) multiply activations quantized to 16 bits per 32 values: their oracle is the model
whose packed matmuls are `gguf_reference`, to the bit, and the dequantised model (the float32 engine on the same
GGUF, transformers on an AWQ or GPTQ checkpoint's dequantised weights) within that noise."""

from __future__ import annotations

import argparse

import psutil
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.args import add_engine_args
from pagedllm.config import ModelConfig
from pagedllm.entrypoints.openai.cli_args import add_server_args, engine_config_from_args
from pagedllm.layers import embedding
from pagedllm.layers import linear as linear_module
from pagedllm.layers.linear import dequantize_int8, quantize_int8, w8a8_reference
from pagedllm.loader import load_model
from tests.models.int4_checkpoints import save_int4_checkpoint
from tests.models.tiny import (
    SimplePagedRunner,
    build_byte_tokenizer,
    build_tiny_hf_model,
    hf_greedy,
    run_modules,
    use_gguf_reference,
)

_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
PROMPTS = ["The quick brown fox", "int8 weights, one scale per row:", "0123456789" * 3, "a"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(the tiny model's folder, the folder of its int8-dequantised twin)."""
    root = tmp_path_factory.mktemp("int8")
    model = build_tiny_hf_model("llama-untied", seed=3)
    model.save_pretrained(root / "float")
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in _LINEAR_NAMES:
                module.weight.copy_(dequantize_int8(*quantize_int8(module.weight)))
    model.save_pretrained(root / "dequantised")
    for folder in ("float", "dequantised"):
        build_byte_tokenizer().save_pretrained(root / folder)
    return str(root / "float"), str(root / "dequantised")


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_gives_the_greedy_tokens_of_its_dequantised_weights(checkpoints, dtype):
    original, dequantised = checkpoints
    int8 = LLM(original, dtype=dtype, quantization="int8", kv_cache_memory=16 << 20)
    layer = int8.engine.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.int8 and layer.self_attn.qkv_proj.weight.scale.numel() > 0
    assert layer.mlp.down_proj.weight.dtype == torch.int8
    reference = LLM(dequantised, dtype="float32", kv_cache_memory=16 << 20)
    tokens = _greedy(int8)
    if dtype == "float32":
        assert tokens == _greedy(reference)
    else:  # bf16 activations and KV: rounding may flip a near tie late in a sequence, never the first tokens
        assert [t[:3] for t in tokens] == [t[:3] for t in _greedy(reference)]


def test_int8_weights_are_a_quarter_of_float32s(checkpoints):
    original, _ = checkpoints
    plain = LLM(original, dtype="float32", kv_cache_memory=16 << 20).engine.runner.model
    int8 = LLM(original, dtype="float32", quantization="int8", kv_cache_memory=16 << 20).engine.runner.model
    plain_proj, int8_proj = plain.model.layers[0].mlp.gate_up_proj.weight, int8.model.layers[0].mlp.gate_up_proj.weight
    assert int8_proj.numel() * int8_proj.element_size() * 4 == plain_proj.numel() * plain_proj.element_size()


def test_w8a8_model_computes_w8a8_reference_matmuls(checkpoints, monkeypatch):
    """Every linear layer (LM head included) of a w8a8 model runs the W8A8 kernel, whose bits are
    `w8a8_reference`'s: the logits of a prefill batch and a decode step are the float32 model's with each matmul
    replaced by that reference, exactly."""
    original, _ = checkpoints
    model = load_model(ModelConfig(model=original, dtype="float32", quantization="w8a8")).model
    for proj in (model.model.layers[1].self_attn.qkv_proj, model.model.layers[1].mlp.down_proj, model.lm_head):
        assert proj.weight.dtype == torch.int8 and proj.weight.shape[2] == 64 and proj.weight.col_sums is not None
    steps = [{0: [1, 17, 250, 9, 33, 70, 5], 1: [44, 45]}, {0: [12], 1: [300]}]
    runner = SimplePagedRunner(model)
    logits = [runner.step(step) for step in steps]

    def reference_linear(x, weight, bias=None):
        return w8a8_reference(x, *quantize_int8(weight), bias)

    monkeypatch.setattr(linear_module, "pack_linear_weights", lambda model, quantization=None: 0)
    monkeypatch.setattr(linear_module, "linear", reference_linear)
    monkeypatch.setattr(embedding, "linear", reference_linear)
    run_modules(monkeypatch)
    reference = SimplePagedRunner(load_model(ModelConfig(model=original, dtype="float32")).model)
    for step, got in zip(steps, logits):
        assert torch.equal(got, reference.step(step))


def test_w8a8_stays_close_to_the_unquantized_model(checkpoints):
    """Through the engine, in bf16: greedy tokens start as the unquantized float32 model's (quantizing the
    activations too adds noise of ~1% of a matmul's outputs, which flips near ties only later on)."""
    original, _ = checkpoints
    w8a8 = LLM(original, dtype="bfloat16", quantization="w8a8", kv_cache_memory=16 << 20)
    tokens, expected = _greedy(w8a8), _greedy(LLM(original, dtype="float32", kv_cache_memory=16 << 20))
    assert [t[:3] for t in tokens] == [t[:3] for t in expected]
    assert sum(a == b for t, e in zip(tokens, expected) for a, b in zip(t, e)) >= 0.75 * sum(map(len, expected))


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_quantization_at_load_needs_the_kernels(monkeypatch, quantization):
    monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
    with pytest.raises(RuntimeError, match=f"quantization='{quantization}' runs in pagedllm's CPU kernels, which are "
                                           "disabled"):
        linear_module.pack_linear_weights(torch.nn.Module(), quantization)


def test_an_unknown_quantization_is_refused_by_name():
    with pytest.raises(ValueError, match="quantization must be None, 'int8', 'w8a8', 'gguf', 'awq', 'gptq', 'fp8', "
                                         "'compressed-tensors' or 'mxfp4', got 'bitsandbytes'"):
        ModelConfig(quantization="bitsandbytes")
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="int8", device="cuda")
    assert ModelConfig(quantization="fp8", device="cuda").quantization == "fp8"   # read dequantised: any device


def test_serve_and_bench_take_quantization():
    bench = argparse.ArgumentParser()
    add_engine_args(bench)
    assert bench.parse_args(["-q", "w8a8"]).quantization == "w8a8"
    parser = add_server_args(argparse.ArgumentParser(), positional_model=False)
    assert engine_config_from_args(parser.parse_args(["--quantization", "int8"])).model.quantization == "int8"
    assert engine_config_from_args(parser.parse_args(["-q", "gguf"])).model.quantization == "gguf"
    assert engine_config_from_args(parser.parse_args(["-q", "w8a8"])).model.quantization == "w8a8"
    assert engine_config_from_args(parser.parse_args(["-q", "gptq"])).model.quantization == "gptq"
    assert engine_config_from_args(parser.parse_args(["-q", "fp8"])).model.quantization == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "bitsandbytes"])


def test_gguf_mode_gives_smollm2s_dequantised_models_tokens(smol_llm):
    """SmolLM2's Q4_1 linear weights (and its Q8_0 tied LM head) kept packed, in float32: the layers quantize their
    activations to 16 bits per 32 values, so greedy tokens are the default float32 engine's (which dequantises the
    same blocks), on the chat question whose first token is a 0.08-nat near tie too, which 8-bit activations flip
    (the kernel's bits against `gguf_reference` are tested on tiny models)."""
    gguf = LLM(dtype="float32", quantization="gguf", kv_cache_memory=64 << 20, max_model_len=2048)
    model = gguf.engine.runner.model
    assert model.model.layers[0].mlp.gate_up_proj.weight.ggml_type == 3  # Q4_1
    assert model.lm_head.weight.ggml_type == 8  # Q8_0: the tied embedding's type
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    tokens = [o.outputs[0].token_ids for o in gguf.generate(prompts, params, use_tqdm=False)]
    expected = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params, use_tqdm=False)]
    assert tokens == expected
    question = [{"role": "user", "content": "What is the capital of France?"}]
    reply = gguf.chat(question, params, use_tqdm=False)[0].outputs[0]
    assert reply.token_ids == smol_llm.chat(question, params, use_tqdm=False)[0].outputs[0].token_ids
    assert reply.text.startswith("The capital of France is Paris")


def test_gguf_blocks_kept_packed_are_never_read_to_load(monkeypatch):
    """A .gguf file's blocks are packed before loading, so that loading reads, and dequantises, only the tensors
    the model keeps dense: SmolLM2's norms and its Q8_0 embedding (the tied LM head packs the embedding's blocks,
    the lookup keeps a dequantised copy); the file is opened once."""
    from pagedllm.loader.gguf import GGUFFile

    read, read_tensor = [], GGUFFile.read_tensor
    monkeypatch.setattr(GGUFFile, "read_tensor", lambda self, info: read.append(info.name) or read_tensor(self, info))
    opened, init = [], GGUFFile.__init__
    monkeypatch.setattr(GGUFFile, "__init__", lambda self, *args: opened.append(args) or init(self, *args))
    model = load_model(ModelConfig(dtype="float32", quantization="gguf")).model
    assert len(opened) == 1   # its header parsed once, for the config, the packing and the tensors
    assert set(read) == {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{norm}.weight" for i in range(model.num_layers) for norm in ("attn_norm", "ffn_norm")}
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.lm_head.weight.ggml_type == 8  # Q8_0


AVX2 = frozenset({"avx2", "fma", "f16c"})
AVX512_VNNI = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}


def _report_cpu(monkeypatch, flags: frozenset[str], amx: bool = False) -> None:
    """Make pagedllm.cpu report an x86 CPU with these features (and with AMX's tiles and oneDNN's bf16)."""
    import pagedllm.cpu

    tiles = {"amx_tile", "amx_bf16", "amx_int8", "avx512_bf16"} if amx else set()
    cpu = pagedllm.cpu.CpuInfo("x86_64", "Intel(R) Xeon(R)" if amx else "AMD EPYC", flags | tiles)
    monkeypatch.setattr(pagedllm.cpu, "cpu_info", lambda max_isa=None: cpu)
    if amx:
        monkeypatch.setattr(pagedllm.cpu, "onednn_bf16_ok", lambda: True)


def test_a_gguf_file_keeps_its_blocks_unless_a_dtype_is_named(checkpoints, monkeypatch):
    """As vLLM runs a .gguf file as quantization="gguf": implied under dtype "auto" where the blocks can stay packed
    (the CPU kernels, one rank) and VNNI multiplies them; a dtype named outright, another device or tensor
    parallelism dequantise it; an explicit quantization wins; a Hugging Face folder implies nothing."""
    from pagedllm.loader import load_hf_config, resolve_quantization
    from pagedllm.loader.resolve import resolve_model

    _report_cpu(monkeypatch, AVX512_VNNI)
    smollm2 = resolve_model(None)
    config = load_hf_config(smollm2)
    assert resolve_quantization(None, smollm2, config) == "gguf"
    assert resolve_quantization(None, smollm2, config, dtype="float32") is None
    assert resolve_quantization(None, smollm2, config, dtype="bfloat16") is None
    assert resolve_quantization(None, smollm2, config, tp_size=2) is None
    assert resolve_quantization(None, smollm2, config, device="cuda") is None
    assert resolve_quantization("int8", smollm2, config) == "int8"
    folder = resolve_model(checkpoints[0])
    assert resolve_quantization(None, folder, load_hf_config(folder)) is None
    monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
    assert resolve_quantization(None, smollm2, config) is None


def test_a_gguf_file_keeps_its_blocks_on_a_cpu_with_amx(monkeypatch):
    """With AMX the blocks stay packed too: the kernel multiplies them in bf16 tiles there (`gguf_activation_bits`)."""
    from pagedllm.loader import load_hf_config, resolve_quantization
    from pagedllm.loader.resolve import resolve_model

    smollm2 = resolve_model(None)
    _report_cpu(monkeypatch, AVX512_VNNI, amx=True)
    assert resolve_quantization(None, smollm2, load_hf_config(smollm2)) == "gguf"


@pytest.mark.parametrize("flags", [AVX2, frozenset()], ids=["avx2", "baseline"])
def test_without_vnni_a_small_gguf_file_is_dequantised_and_a_big_one_keeps_its_blocks(monkeypatch, caplog, flags):
    """Without VNNI the blocks' integer products cost what float32 FMAs on bf16 weights do: a small model (its bf16
    weights within SMALL_GGUF_SHARE of the RAM) runs as bf16 weights, faster in a batch; a bigger one keeps its
    blocks (its memory, and the bytes that bind its decode steps); quantization="gguf" keeps them anyway."""
    import pagedllm.loader
    from pagedllm.loader import load_hf_config, resolve_quantization
    from pagedllm.loader.resolve import resolve_model

    _report_cpu(monkeypatch, flags)
    smollm2 = resolve_model(None)
    config = load_hf_config(smollm2)
    with caplog.at_level("INFO", logger="pagedllm.loader"):
        assert resolve_quantization(None, smollm2, config) is None
    assert "without VNNI" in caplog.text and "quantization='gguf' keeps the blocks" in caplog.text
    assert resolve_quantization("gguf", smollm2, config) == "gguf"
    file_bytes = smollm2.gguf_path.stat().st_size
    monkeypatch.setattr(pagedllm.loader, "SMALL_GGUF_SHARE", 3 * file_bytes / psutil.virtual_memory().total)
    assert resolve_quantization(None, smollm2, config) == "gguf"     # 4 x the file over the share: "big"
    monkeypatch.setattr(pagedllm.loader, "SMALL_GGUF_SHARE", 5 * file_bytes / psutil.virtual_memory().total)
    assert resolve_quantization(None, smollm2, config) is None


def test_gguf_mode_needs_a_gguf_file_and_one_rank(checkpoints):
    original, _ = checkpoints
    with pytest.raises(ValueError, match="quantization='gguf'.*not a .gguf file"):
        load_model(ModelConfig(model=original, quantization="gguf"))
    with pytest.raises(ValueError, match="quantization='gguf' runs on one rank"):
        load_model(ModelConfig(quantization="gguf"), tp_rank=0, tp_size=2)


INT4_CHECKPOINTS = {  # name: (method, group_size, act_order, GPTQ v1)
    "awq-g64": ("awq", 64, False, True),
    "gptq-g32-act-order": ("gptq", 32, True, True),
    "gptq_v2-g64": ("gptq", 64, False, False),
    "compressed-tensors-g64": ("compressed-tensors", 64, False, True),
    "compressed-tensors-g32-act-order": ("compressed-tensors", 32, True, True),
    "compressed-tensors-asymmetric-g32": ("compressed-tensors", 32, False, True, False),
}


@pytest.fixture(scope="module")
def int4_checkpoints(tmp_path_factory):
    """{name: (folder of the quantized tiny model, transformers model on its dequantised weights)}."""
    root = tmp_path_factory.mktemp("int4")
    model = build_tiny_hf_model("llama-untied", seed=5)
    return {name: save_int4_checkpoint(root / name, model, *spec) for name, spec in INT4_CHECKPOINTS.items()}


def _close_to(logits: torch.Tensor, expected: torch.Tensor) -> bool:
    """Within the noise of 16-bit activations (8-bit ones left ~2% of the largest logit on these tiny models), same
    argmax."""
    return bool((logits - expected).abs().max() < 1e-3 * expected.abs().max() and logits.argmax() == expected.argmax())


@pytest.mark.parametrize("name", list(INT4_CHECKPOINTS))
def test_int4_checkpoint_computes_w4a16_on_its_weights(int4_checkpoints, name, monkeypatch):
    """The quantization comes from the checkpoint's config; each linear layer but the (unquantized) LM head keeps
    its 4 bits; prefill and decode logits are the model's with `gguf_reference` matmuls, bitwise, and
    transformers' on the dequantised weights within the activations' quantization noise."""
    folder, dequantised = int4_checkpoints[name]
    model = load_model(ModelConfig(model=str(folder), dtype="float32")).model
    layer = model.model.layers[1]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert proj.weight.dtype == torch.uint8 and proj.weight.ggml_type == 3  # Q4_1
    assert (layer.self_attn.qkv_proj.weight.input_perm is not None) == ("act-order" in name)
    assert model.lm_head.weight.dtype != torch.uint8
    runner, tokens = SimplePagedRunner(model), [1, 17, 250, 9, 33, 70, 5]
    steps, logits = [list(tokens)], [runner.step({0: tokens})[0]]
    for _ in range(4):
        with torch.inference_mode():
            expected = dequantised(torch.tensor([tokens])).logits[0, -1]
        assert _close_to(logits[-1], expected)
        tokens.append(int(expected.argmax()))
        steps.append(tokens[-1:])
        logits.append(runner.step({0: tokens[-1:]})[0])
    use_gguf_reference(monkeypatch)
    reference = SimplePagedRunner(model)
    for step, got in zip(steps, logits):
        assert torch.equal(got, reference.step({0: step})[0])


@pytest.mark.parametrize("name", ["awq-g64", "compressed-tensors-g32-act-order"])
def test_int4_checkpoints_run_in_the_engine(int4_checkpoints, name):
    folder, dequantised = int4_checkpoints[name]
    llm = LLM(str(folder), dtype="float32", quantization=INT4_CHECKPOINTS[name][0], kv_cache_memory=16 << 20)
    prompt = [1, 44, 45, 46, 47]
    tokens = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    with torch.inference_mode():
        expected = dequantised.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10)
    assert list(tokens) == expected[0, len(prompt):].tolist()  # transformers' greedy tokens on the dequantised weights


def test_int4_quantization_must_match_the_checkpoint(checkpoints, int4_checkpoints):
    original, _ = checkpoints
    awq, gptq = str(int4_checkpoints["awq-g64"][0]), str(int4_checkpoints["gptq_v2-g64"][0])
    cases = [(original, "awq", "quantization='awq' needs a checkpoint whose config.json has "
                               "quantization_config.quant_method='awq'"),
             (gptq, "awq", "is a 'gptq' checkpoint .* not 'awq'"),
             (awq, "int8", "is a 'awq' checkpoint .* not 'int8'")]
    for model, quantization, message in cases:
        with pytest.raises(ValueError, match=message):
            load_model(ModelConfig(model=model, quantization=quantization))
    with pytest.raises(ValueError, match="quantization='awq' runs on one rank"):
        load_model(ModelConfig(model=awq), tp_rank=0, tp_size=2)


def test_a_fused_layer_whose_parts_permute_k_differently_keeps_its_dequantised_weight(int4_checkpoints, monkeypatch):
    """Layer 0's v_proj is given an equivalent weight whose first two runs of 32 sorted inputs are swapped (the
    same function, a different permutation): its qkv_proj cannot run as one packed weight and stays dense."""
    from pagedllm.layers.int4 import Int4Weight
    from pagedllm.loader import int4

    folder, dequantised = int4_checkpoints["gptq-g32-act-order"]
    original = int4.int4_weights

    def with_layer0_v_reordered(*args):
        weights = original(*args)
        name = "model.layers.0.self_attn.v_proj.weight"
        weight = weights[name]()
        swap = torch.cat([torch.arange(32, 64), torch.arange(32), torch.arange(64, len(weight.input_perm))])
        groups = [1, 0, *range(2, weight.rows.d.shape[1])]
        rows = weight.rows._replace(q=weight.rows.q[:, swap], d=weight.rows.d[:, groups], m=weight.rows.m[:, groups])
        weights[name] = lambda: Int4Weight(rows, weight.input_perm[swap])
        return weights

    monkeypatch.setattr(int4, "int4_weights", with_layer0_v_reordered)
    dequantised_shapes, dequantize = [], int4.dequantize_int4
    monkeypatch.setattr(int4, "dequantize_int4",
                        lambda weight: dequantised_shapes.append(tuple(weight.rows.q.shape)) or dequantize(weight))
    model = load_model(ModelConfig(model=str(folder), dtype="float32")).model
    qkv = model.model.layers[0].self_attn.qkv_proj
    hidden = model.config.hidden_size
    # loading dequantised the dense layer's q, k and v, and none of the 4-bit weights packed before it
    assert sorted(dequantised_shapes) == sorted([(qkv.q_size, hidden), (qkv.kv_size, hidden), (qkv.kv_size, hidden)])
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert model.model.layers[1].self_attn.qkv_proj.weight.dtype == torch.uint8
    tokens = [1, 17, 250, 9, 33]
    with torch.inference_mode():
        expected = dequantised(torch.tensor([tokens])).logits[0, -1]
    logits = SimplePagedRunner(model).step({0: tokens})[0]
    assert _close_to(logits, expected)
    use_gguf_reference(monkeypatch)
    assert torch.equal(logits, SimplePagedRunner(model).step({0: tokens})[0])


@pytest.mark.parametrize("kind, method, act_order", [("qwen3-moe", "gptq", True), ("qwen2-moe", "awq", False),
                                                     ("qwen3-moe", "compressed-tensors", False),
                                                     ("mixtral", "gptq", False)])
def test_a_mixture_of_experts_runs_its_int4_experts(tmp_path, kind, method, act_order):
    """Each expert's layers (and Qwen2-MoE's shared expert's) packed from the checkpoint's 4 bits (Mixtral's under
    their checkpoint names, block_sparse_moe's w1/w3/w2), the router never quantized; transformers' greedy tokens on
    the dequantised weights."""
    model = build_tiny_hf_model(kind, seed=7, tie_word_embeddings=False,
                                **({} if kind == "mixtral" else {"moe_intermediate_size": 64}))
    folder, dequantised = save_int4_checkpoint(tmp_path / method, model, method, 32, act_order)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=16 << 20)
    block = llm.engine.runner.model.model.layers[0].mlp
    packed = [block.experts[0].gate_up_proj.weight, block.experts[3].down_proj.weight]
    if block.shared_expert is not None:
        packed.append(block.shared_expert.down_proj.weight)
    assert all(w.dtype == torch.uint8 for w in packed)
    assert block.gate.weight.dtype == torch.float32
    prompt = [1, 44, 45, 46, 47, 9, 100, 3]
    tokens = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert list(tokens) == hf_greedy(dequantised, [prompt], 10)[0]
