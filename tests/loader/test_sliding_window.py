"""A model with a sliding attention window runs up to its window (pagedllm's attention reads whole contexts)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.loader import max_model_len_of, sliding_window_of
from tests.models.tiny import hf_greedy, save_tiny_model, tiny_config


def test_the_window_caps_the_context_where_a_layer_slides():
    mistral = tiny_config("mistral", sliding_window=64)          # max_position_embeddings 256
    assert sliding_window_of(mistral) == 64
    assert max_model_len_of(mistral, None) == 64 and max_model_len_of(mistral, 32) == 32
    with pytest.raises(ValueError, match="sliding attention window of 64"):
        max_model_len_of(mistral, 128)
    assert max_model_len_of(tiny_config("mistral", sliding_window=None), None) == 256
    assert max_model_len_of(tiny_config("mistral", sliding_window=1024), None) == 256    # past the context: no cap
    # Qwen2 slides only with use_sliding_window, in its layers from max_window_layers on
    assert max_model_len_of(tiny_config("qwen2", sliding_window=64, use_sliding_window=False), None) == 256
    assert max_model_len_of(tiny_config("qwen2", sliding_window=64, use_sliding_window=True,
                                        max_window_layers=1), None) == 64


def test_a_sliding_window_model_answers_as_transformers_within_its_window(tmp_path):
    folder, hf_model = save_tiny_model(tmp_path / "m", "mistral", sliding_window=48)
    prompt = list(range(3, 33))
    with LLM(str(folder), dtype="float32", num_kv_blocks=64) as llm:
        assert llm.engine.max_model_len == 48
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12,
                                                                           ignore_eos=True), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(hf_model, [prompt], 12)[0]
        with pytest.raises(ValueError, match="48"):
            llm.generate([{"prompt_token_ids": list(range(3, 60))}], use_tqdm=False)
