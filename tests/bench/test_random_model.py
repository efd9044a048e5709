"""`pagedllm bench random-model`: a folder every engine reads, in a preset's shape."""

from __future__ import annotations

import json

from pagedllm import LLM, SamplingParams
from pagedllm.bench import random_model
from pagedllm.bench.cli import main


def test_a_random_model_folder_loads_and_generates_in_its_presets_shape(tmp_path, monkeypatch):
    model_type, fields = random_model.PRESETS["qwen3-moe-1b"]
    small = {**fields, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    monkeypatch.setitem(random_model.PRESETS, "qwen3-moe-1b", (model_type, small))
    result = main(["random-model", str(tmp_path / "m"), "--preset", "qwen3-moe-1b", "--dtype", "float32"])
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_local_experts"] == 4
    assert result["num_params"] > 0 and (tmp_path / "m" / "tokenizer.json").is_file()
    with LLM(str(tmp_path / "m"), num_kv_blocks=64) as llm:
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
