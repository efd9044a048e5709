"""8-bit checkpoints read dequantised (pagedllm.loader.fp8): a tiny random model's linear weights saved as FP8 blocks
("fp8", as Qwen3-*-FP8: weight_scale_inv a block, here blocks of 48 that leave partial ones at the edges), as FP8
tensors (Mistral's releases: a scale a tensor, static activation scales beside), as compressed-tensors' FP8 rows or
tensors, or its int8 rows, sharded; against transformers running the dequantised
weights; and the configurations refused, each with a clear error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.loader.fp8 import dequantize
from tests.loader.test_text_part import _tiny_text_part
from tests.models.tiny import build_byte_tokenizer, build_tiny_hf_model, hf_greedy

PROMPTS = [[(7 * i + 3) % 250 for i in range(20)], [5, 17, 99]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(8-bit values, scales, the weight they stand for) of a weight [N, K]: FP8 over blocks of 48 x 48 ("block"),
    rows ("channel") or the whole tensor ("tensor", and "fp8 tensor": Mistral's FP8 releases' layout), or int8 rows
    ("int8")."""
    if layout == "block":
        rows, columns = weight.shape
        padded = torch.nn.functional.pad(weight, (0, -columns % 48, 0, -rows % 48))
        blocks = padded.unflatten(0, (-1, 48)).unflatten(2, (-1, 48))     # [R, 48, C, 48]
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    elif layout in ("tensor", "fp8 tensor"):
        scale = weight.abs().amax().reshape(1) / 448.0
    else:
        scale = weight.abs().amax(dim=1, keepdim=True) / (127.0 if layout == "int8" else 448.0)
    full = scale if scale.dim() < 2 or scale.shape[1] == 1 else \
        scale.repeat_interleave(48, 0)[:weight.shape[0]].repeat_interleave(48, 1)[:, :weight.shape[1]]
    values = (weight / full).round().clamp(-127, 127).to(torch.int8) if layout == "int8" else \
        (weight / full).to(torch.float8_e4m3fn)
    return values, scale, values.float() * full


def _save_eight_bit(folder: Path, layout: str) -> Any:
    """A tiny Llama saved with its linear layers' weights in 8 bits (`layout`) in two shards (a layer's scale may
    sit in the other shard than its weight) and the quantization_config that says so; returns transformers' model
    with the dequantised weights, the oracle."""
    model = build_tiny_hf_model("llama-gqa")
    model.save_pretrained(folder, max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = {shard: load_file(folder / shard) for shard in set(index["weight_map"].values())}
    names = sorted(shards)
    for shard in names:
        for name in [n for n in shards[shard] if n.endswith(".weight") and n.rpartition(".")[0].endswith(_LINEARS)]:
            values, scale, dequantized = _quantize(shards[shard][name], layout)
            shards[shard][name] = values
            fp8 = layout in ("block", "fp8 tensor")
            scale_name = name.replace(".weight", ".weight_scale_inv" if fp8 else ".weight_scale")
            other = names[(names.index(shard) + 1) % len(names)]    # the next shard holds the scale
            shards[other][scale_name] = scale.reshape(()) if layout == "fp8 tensor" else scale
            index["weight_map"][scale_name] = other
            if layout == "fp8 tensor":     # Mistral's releases: a static activation scale, never read
                shards[shard][name.replace(".weight", ".activation_scale")] = torch.tensor(0.5)
                index["weight_map"][name.replace(".weight", ".activation_scale")] = shard
            with torch.no_grad():
                model.get_parameter(name).copy_(dequantized)
    for shard, tensors in shards.items():
        save_file(tensors, folder / shard, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((folder / "config.json").read_text())
    if layout == "block":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                         "weight_block_size": [48, 48]}
    elif layout == "fp8 tensor":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static",
                                         "weight_block_size": None, "modules_to_not_convert": ["lm_head"]}
    else:
        weights = {"num_bits": 8, "type": "int" if layout == "int8" else "float", "symmetric": True,
                   "strategy": "channel" if layout != "tensor" else "tensor"}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "int-quantized" if layout == "int8" else "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": {
                "num_bits": 8, "type": weights["type"], "dynamic": True, "strategy": "token"}}},
            "ignore": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    build_byte_tokenizer().save_pretrained(folder)
    return model


@pytest.mark.parametrize("layout", ["block", "fp8 tensor", "channel", "tensor", "int8"])
def test_an_eight_bit_checkpoint_gives_its_dequantised_weights_tokens(tmp_path: Path, layout: str) -> None:
    oracle = _save_eight_bit(tmp_path, layout)
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64)
    assert llm.engine.quantization is None      # run as the dequantised weights
    scored = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], scored, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(oracle, PROMPTS, 8)
    with torch.inference_mode():    # each prompt token's logprob, as the dequantised weights give it
        expected = torch.log_softmax(oracle(torch.tensor([PROMPTS[0]])).logits[0].float(), dim=-1)
    got = [entry[token].logprob for entry, token in zip(outputs[0].prompt_logprobs[1:], PROMPTS[0][1:], strict=True)]
    torch.testing.assert_close(torch.tensor(got), expected[torch.arange(19), PROMPTS[0][1:]], atol=1e-4, rtol=1e-4)


def test_an_fp8_checkpoint_quantized_again_at_load(tmp_path: Path) -> None:
    _save_eight_bit(tmp_path, "block")
    llm = LLM(model=str(tmp_path), dtype="float32", quantization="int8", num_kv_blocks=64)
    assert llm.engine.quantization == "int8"
    named = LLM(model=str(tmp_path), dtype="float32", quantization="fp8", num_kv_blocks=64)
    assert named.engine.quantization is None
    assert len(llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_eight_bit_layouts_pagedllm_does_not_read_are_refused(tmp_path: Path) -> None:
    _save_eight_bit(tmp_path, "channel")
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    with pytest.raises(ValueError, match="runs as quantization 'compressed-tensors'.*not 'gptq'"):
        LLM(model=str(tmp_path), quantization="gptq")
    group = config["quantization_config"]["config_groups"]["group_0"]
    for change, message in [({"format": "sparse-bitmask"}, "not \\['sparse-bitmask'\\]"),
                            ({"weights": {**group["weights"], "num_bits": 4, "type": "int"}}, "4-bit int"),
                            ({"weights": {**group["weights"], "symmetric": False}}, "asymmetric")]:
        quantization = dict(config["quantization_config"])
        quantization["config_groups"] = {"group_0": {**group, **{k: v for k, v in change.items() if k != "format"}}}
        quantization["format"] = change.get("format", quantization["format"])
        config_path.write_text(json.dumps({**config, "quantization_config": quantization}))
        with pytest.raises(ValueError, match=message):
            LLM(model=str(tmp_path))
    plain = tmp_path / "plain"
    build_tiny_hf_model("llama-gqa").save_pretrained(plain)
    with pytest.raises(ValueError, match="quantization='fp8' reads a checkpoint saved so"):
        LLM(model=str(plain), quantization="fp8")


def test_dequantize_reads_each_scale_layout() -> None:
    values = torch.arange(-12, 12, dtype=torch.float32).reshape(4, 6).to(torch.float8_e4m3fn)
    expected = values.float()
    assert torch.equal(dequantize(values, torch.tensor([2.0]), torch.float32), expected * 2)     # a tensor's
    rows = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    assert torch.equal(dequantize(values, rows, torch.float32), expected * rows)                  # each row's
    blocks = torch.tensor([[1.0, 2.0], [3.0, 4.0]])     # blocks of 3 x 4: the last row's and columns' partial
    full = torch.tensor([[1.0] * 4 + [2.0] * 2] * 3 + [[3.0] * 4 + [4.0] * 2])
    assert torch.equal(dequantize(values, blocks, torch.float32, (3, 4)), expected * full)
    assert dequantize(values, blocks, torch.bfloat16, (3, 4)).dtype == torch.bfloat16


def test_a_multimodal_checkpoints_fp8_language_model_serves_its_text(tmp_path: Path) -> None:
    """Qwen2-VL's layout (its language model's names a text model's own, its tower beside) with FP8 rows."""
    model = _tiny_text_part(tmp_path, "Qwen2VLForConditionalGeneration")
    tensors = load_file(tmp_path / "model.safetensors")
    for name in [n for n in tensors if n.startswith("model.layers.") and n.rpartition(".")[0].endswith(_LINEARS)
                 and n.endswith(".weight")]:
        tensors[name], tensors[name + "_scale"], dequantized = _quantize(tensors[name], "channel")
        with torch.no_grad():
            model.get_parameter(name.replace("model.", "model.language_model.", 1)).copy_(dequantized)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                     "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                         "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(model, PROMPTS, 8)
