"""vLLM's load_format: "dummy" runs a model folder's config with random weights, no checkpoint read; "safetensors"
and "gguf" refuse the other kind of model; the formats pagedllm does not read are refused."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.entrypoints.openai.api_server import make_parser
from pagedllm.entrypoints.openai.cli_args import engine_config_from_args
from pagedllm.loader import load_model
from tests.loader.test_gguf import write_model_gguf
from tests.models.tiny import build_tiny_hf_model, save_tiny_model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dummy_weights_run_a_config_without_its_checkpoint(tmp_path, dtype):
    folder, _ = save_tiny_model(tmp_path / "m", "qwen2")
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(FileNotFoundError):
        load_model(ModelConfig(model=str(folder), dtype=dtype))
    def weights(model):   # (a bf16 weight packed by oneDNN, as on a CPU with AVX512-BF16 and no AMX, as plain)
        return [p.to_dense() if p.is_mkldnn else p for p in model.parameters()]

    params = weights(load_model(ModelConfig(model=str(folder), dtype=dtype, load_format="dummy")).model)
    assert all(p.abs().max() <= 1e-3 and p.std() > 1e-4 for p in params)
    again = weights(load_model(ModelConfig(model=str(folder), dtype=dtype, load_format="dummy")).model)
    assert all(torch.equal(a, b) for a, b in zip(params, again))    # the same seed, the same weights
    with LLM(str(folder), dtype=dtype, load_format="dummy", num_kv_blocks=32, block_size=4) as llm:
        out = llm.generate(["hello there"], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5


def test_dummy_weights_quantized_at_load(tmp_path):
    folder, _ = save_tiny_model(tmp_path / "m", "llama-gqa", with_tokenizer=False)
    model = load_model(ModelConfig(model=str(folder), dtype="float32", load_format="dummy", quantization="int8")).model
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.int8


def test_formats_that_do_not_fit_the_model_are_refused(tmp_path):
    folder, _ = save_tiny_model(tmp_path / "m", "llama-gqa", with_tokenizer=False)
    path = tmp_path / "m.gguf"
    write_model_gguf(build_tiny_hf_model("llama-gqa"), path, "llama")
    assert load_model(ModelConfig(model=str(folder), dtype="float32", load_format="safetensors")).model is not None
    assert load_model(ModelConfig(model=str(path), dtype="float32", load_format="gguf")).model is not None
    with pytest.raises(ValueError, match="load_format 'gguf' reads a .gguf file"):
        load_model(ModelConfig(model=str(folder), load_format="gguf"))
    for load_format in ("safetensors", "dummy"):
        with pytest.raises(ValueError, match="is a .gguf file"):
            load_model(ModelConfig(model=str(path), load_format=load_format))
    with pytest.raises(ValueError, match="load_format must be one of auto, safetensors, gguf, dummy"):
        ModelConfig(load_format="pt")
    args = make_parser().parse_args(["--model", str(folder), "--load-format", "dummy"])
    assert engine_config_from_args(args).model.load_format == "dummy"
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--load-format", "npcache"])
