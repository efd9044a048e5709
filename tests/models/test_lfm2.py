"""LFM2's short convolutions keep their inputs in the paged KV pool: through the engine, with prompts prefilled in
chunks, a prompt whose blocks the prefix cache holds, preemption and n-gram drafts (rejected ones overwritten),
pagedllm's greedy tokens are transformers'."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.models.llama import cache_layers
from tests.models.tiny import hf_greedy, save_tiny_model, tiny_config

FIRST = [3 + (7 * i) % 200 for i in range(30)]
PROMPTS = [FIRST, FIRST[:24] + [100, 101, 102, 103], [9, 8, 7, 6, 5, 4, 3, 9, 8, 7, 6, 5, 4, 3]]


def test_a_convolution_takes_the_pool_layers_its_input_fills() -> None:
    # 64 values a token, in pool layers of K and V rows of 1 x 16 values each
    config = tiny_config("lfm2", num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"])
    assert cache_layers(config) == [slice(0, 2), slice(2, 3), slice(3, 5)]
    assert cache_layers(tiny_config("llama-gqa")) == [slice(0, 1), slice(1, 2)]


def test_what_a_convolution_cannot_take_is_refused(tmp_path) -> None:
    folder, _ = save_tiny_model(tmp_path / "m", "lfm2")
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' .* LFM2"):
        LLM(str(folder), dtype="float32", num_kv_blocks=16, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="LoRA adapters on a model with short convolution layers"):
        LLM(str(folder), dtype="float32", num_kv_blocks=16, enable_lora=True)


@pytest.mark.parametrize("mode", ["plain", "ngram", "preempted"])
def test_lfm2_answers_as_transformers(tmp_path, mode: str) -> None:
    folder, hf_model = save_tiny_model(tmp_path / "m", "lfm2", initializer_range=0.5)
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(str(folder), dtype="float32", block_size=4, max_num_batched_tokens=8,
             num_kv_blocks=16 if mode == "preempted" else 64, enable_prefix_caching=True,
             speculative_config=speculative if mode == "ngram" else None) as llm:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        if mode == "preempted":     # all at once, in a pool too small for them
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            assert sum(llm.engine.make_stats().num_preemptions_total.values()) > 0
        else:                       # one after another: the second hits the first's cached blocks
            outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in PROMPTS]
            assert outs[1].num_cached_tokens >= 20
        if mode == "ngram":     # drafts verified, and the rejected ones' convolution inputs overwritten
            assert llm.engine.make_stats().spec_decoding.num_draft_tokens > 0
        assert len(llm.engine.runner.model.model.stacks) == 1    # its layers in the C++ stack
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf_model, PROMPTS, 20)
