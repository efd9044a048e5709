"""MXFP4 checkpoints (pagedllm.loader.mxfp4): a tiny random gpt-oss saved as gpt-oss's releases are, its experts'
stacked projections as MXFP4 blocks and scales (quantized by gguf-py's MXFP4 quantizer, written in the checkpoints'
nibble order) beside bf16-free tensors, and a quantization_config of quant_method "mxfp4"; run with the experts kept
in 4 bits (quantization "mxfp4", the default on a CPU rank) and read dequantised (without the kernels, and on two
ranks), against transformers running the dequantised weights; the reader against transformers' own MXFP4
dequantiser; and the configurations refused, each with a clear error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu_kernels
from pagedllm.loader.mxfp4 import dequantize_mxfp4, gguf_mxfp4_rows
from tests.models.tiny import build_byte_tokenizer, build_tiny_hf_model, hf_greedy

PROMPTS = [[(7 * i + 3) % 250 for i in range(20)], [5, 17, 99], [200, 13, 9, 77, 150, 151, 40, 41, 42, 8] * 3]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _checkpoint_blocks(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's MXFP4 rows [N, K/32 x 17] as a checkpoint's (blocks [N, K/32, 16], scales [N, K/32]): value
    2 i in byte i's low nibble, 2 i + 1 in its high one."""
    blocks = rows.view(rows.shape[0], -1, 17)
    qs = blocks[..., 1:]
    values = torch.cat([qs & 0x0F, qs >> 4], dim=-1)                # [N, G, 32] in order
    return (values[..., 0::2] | (values[..., 1::2] << 4)).contiguous(), blocks[..., 0].contiguous()


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] as MXFP4 (gguf-py's quantizer) in a checkpoint's layout (`_checkpoint_blocks`)."""
    rows = torch.from_numpy(gguf_quants.quantize(weight.float().numpy(), GGMLQuantizationType.MXFP4))
    return _checkpoint_blocks(rows)


def save_mxfp4_gpt_oss(folder: Path, seed: int = 5) -> Any:
    """A tiny gpt-oss (intermediate size 64: MXFP4 blocks of 32 along both projections' inputs) saved with its
    experts' projections in MXFP4, as gpt-oss-20b is; returns transformers' model with the dequantised experts,
    the oracle."""
    model = build_tiny_hf_model("gpt-oss", seed, intermediate_size=64)
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stacked = tensors.pop(name)                                  # [E, in, out], transformers' layout
        parts = [_quantize(expert.T) for expert in stacked]          # each [out, in]
        tensors[name + "_blocks"] = torch.stack([blocks for blocks, _ in parts])
        tensors[name + "_scales"] = torch.stack([scales for _, scales in parts])
        with torch.no_grad():
            model.get_parameter(name).copy_(dequantize_mxfp4(tensors[name + "_blocks"], tensors[name + "_scales"],
                                                             torch.float32).transpose(1, 2))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    build_byte_tokenizer().save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[list[int]]]:
    """(folder, transformers' greedy tokens on the dequantised weights) of a tiny MXFP4 gpt-oss."""
    folder = tmp_path_factory.mktemp("mxfp4") / "gpt-oss"
    model = save_mxfp4_gpt_oss(folder)
    return str(folder), hf_greedy(model, PROMPTS, MAX_TOKENS)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                         use_tqdm=False)]


def test_the_reader_dequantises_as_transformers_does() -> None:
    """`dequantize_mxfp4` against transformers' own MXFP4 dequantiser (its [E, K, N] layout), on random blocks and
    exponents; and the blocks as llama.cpp's rows stand for the same weight by gguf-py's dequantiser."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 135, (3, 40, 4), dtype=torch.uint8, generator=g)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)                                   # [E, N, K]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)                 # [E, K, N]
    assert torch.equal(ours.transpose(1, 2), theirs)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), ours)      # exact in bf16
    rows = gguf_mxfp4_rows(blocks[0], scales[0])
    assert torch.equal(torch.from_numpy(gguf_quants.dequantize(rows.numpy(), GGMLQuantizationType.MXFP4)), ours[0])
    assert torch.equal(_checkpoint_blocks(rows)[0], blocks[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mxfp4_experts_stay_packed_and_give_transformers_tokens(gpt_oss: tuple[str, list[list[int]]],
                                                                dtype: str) -> None:
    """On one CPU rank the checkpoint runs as quantization "mxfp4" by default: every expert's projections packed
    from the blocks (never dequantised), the rest in the dtype; float32's greedy tokens are transformers' on the
    dequantised weights (its activations quantized to 16 bits: ~1e-5), bf16's first tokens too."""
    if cpu_kernels() is None:
        pytest.skip("pagedllm's CPU kernels are not built here")
    folder, expected = gpt_oss
    with LLM(folder, dtype=dtype, block_size=4, num_kv_blocks=64) as llm:
        assert llm.engine.quantization == "mxfp4"
        block = llm.engine.runner.model.model.layers[0].mlp
        packed = [block.experts[3].gate_up_proj.weight, block.experts[0].down_proj.weight]
        assert all(int(weight.ggml_type) == int(GGMLQuantizationType.MXFP4) for weight in packed)
        assert not hasattr(block.gate.weight, "ggml_type")     # the router keeps the dtype
        tokens = _tokens(llm)
    if dtype == "float32":
        assert tokens == expected
    else:
        assert [t[:2] for t in tokens] == [t[:2] for t in expected]


@pytest.mark.parametrize("how", ["without kernels", "two ranks"])
def test_mxfp4_experts_read_dequantised_elsewhere(gpt_oss: tuple[str, list[list[int]]], how: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the blocks cannot stay packed (no kernels; tensor parallelism) the experts are read dequantised, exactly,
    and run as an unquantized checkpoint: transformers' tokens."""
    folder, expected = gpt_oss
    if how == "without kernels":
        monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
    with LLM(folder, dtype="float32", block_size=4, num_kv_blocks=64,
             tensor_parallel_size=2 if how == "two ranks" else 1) as llm:
        assert llm.engine.quantization is None
        assert _tokens(llm) == expected


def test_mxfp4_refusals(gpt_oss: tuple[str, list[list[int]]]) -> None:
    """Another quantization asked of an MXFP4 checkpoint; "mxfp4" where the blocks cannot stay packed."""
    from pagedllm.loader import load_hf_config, resolve_quantization
    from pagedllm.loader.resolve import resolve_model

    folder, _ = gpt_oss
    with pytest.raises(ValueError, match="an 'mxfp4' checkpoint: it runs as quantization 'mxfp4' \\(or None\\)"):
        LLM(folder, dtype="float32", block_size=4, num_kv_blocks=64, quantization="int8")
    resolved = resolve_model(folder)
    config = load_hf_config(resolved)
    with pytest.raises(ValueError, match="keeps the experts in 4 bits on one rank"):
        resolve_quantization("mxfp4", resolved, config, tp_size=2)
    assert resolve_quantization(None, resolved, config, tp_size=2) is None


def test_mxfp4_asked_of_an_unquantized_checkpoint_is_refused(tmp_path: Path) -> None:
    model = build_tiny_hf_model("gpt-oss")
    model.save_pretrained(tmp_path / "m")
    build_byte_tokenizer().save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="quantization='mxfp4' reads a checkpoint saved so"):
        LLM(str(tmp_path / "m"), dtype="float32", quantization="mxfp4", num_kv_blocks=64)


def _round_trip_experts(model: Any) -> None:
    """The model's experts' weights as MXFP4 holds them (quantized and dequantised by gguf-py), in place: what a
    GGUF file of it stores, exactly."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                for expert in param:
                    rows = gguf_quants.quantize(expert.T.contiguous().numpy(), GGMLQuantizationType.MXFP4)
                    expert.copy_(torch.from_numpy(gguf_quants.dequantize(rows, GGMLQuantizationType.MXFP4)).T)


@pytest.mark.parametrize("quantization", ["gguf", None])
def test_a_gpt_oss_gguf_file_matches_transformers(tmp_path: Path, quantization: str | None) -> None:
    """A gpt-oss GGUF file as llama.cpp's converter writes one (its experts MXFP4, gate and up split, their biases
    stacked, its sinks and router beside): its config as transformers' (every other layer local, the first among
    them; the SwiGLU llama.cpp fixes), and transformers' greedy tokens on the weights the file holds, its experts
    packed as MXFP4 blocks (quantization "gguf") or dequantised."""
    from pagedllm.loader.gguf import GGUFFile, gguf_hf_config
    from tests.loader.test_gguf import write_model_gguf

    if quantization == "gguf" and cpu_kernels() is None:
        pytest.skip("pagedllm's CPU kernels are not built here")
    model = build_tiny_hf_model("gpt-oss", 5, intermediate_size=64)
    _round_trip_experts(model)
    path = tmp_path / "gpt-oss.gguf"
    write_model_gguf(model, path, "gpt-oss")
    g = GGUFFile(path)
    assert g.tensors["blk.0.ffn_gate.3.weight"].ggml_type == GGMLQuantizationType.MXFP4
    config = gguf_hf_config(g)
    assert config.model_type == "gpt_oss" and config.layer_types == model.config.layer_types
    assert (config.sliding_window, config.swiglu_limit, config.num_local_experts) == (6, 7.0, 4)
    model.config.swiglu_limit = 7.0     # (llama.cpp's, which the tiny model's 0.5 is not)
    for layer in model.model.layers:
        layer.mlp.experts.limit = 7.0
    expected = hf_greedy(model, PROMPTS, MAX_TOKENS)
    build_byte_tokenizer().save_pretrained(tmp_path / "tokenizer")
    with LLM(str(path), dtype="float32", quantization=quantization, tokenizer=str(tmp_path / "tokenizer"),
             block_size=4, num_kv_blocks=64) as llm:
        expert = llm.engine.runner.model.model.layers[1].mlp.experts[2].down_proj.weight
        assert (getattr(expert, "ggml_type", None) == GGMLQuantizationType.MXFP4) == (quantization == "gguf")
        assert _tokens(llm) == expected
