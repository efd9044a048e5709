"""`pagedllm bench accuracy` on a tiny random Llama: the windows, perplexity against transformers, greedy agreement,
and the command line."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from pagedllm.bench import accuracy
from pagedllm.bench.accuracy import AccuracyConfig, Window, greedy_agreement, plan_windows
from pagedllm.bench.cli import main

MiB = 1 << 20


@pytest.mark.parametrize("num_tokens,window,stride", [(300, 64, 32), (300, 64, 64), (65, 64, 16), (10, 64, 32),
                                                      (2, 8, 3)])
def test_windows_score_every_token_once_with_enough_context(num_tokens, window, stride):
    windows = plan_windows(num_tokens, window, stride)
    scored = [pos for w in windows for pos in range(w.score_from, w.end)]
    skipped = {w.start for w in windows[1:]} if stride == window else set()   # no context: not scored
    assert sorted(scored) == scored and set(scored) == set(range(1, num_tokens)) - skipped
    assert windows[-1].end == num_tokens
    for w in windows:
        assert w.end - w.start <= window and w.start < w.score_from
    for w in windows[1:]:
        assert w.score_from - w.start >= window - stride


@pytest.mark.parametrize("num_tokens,window,stride,match", [(100, 64, 0, "stride"), (100, 64, 65, "stride"),
                                                            (1, 64, 32, "at least 2 tokens")])
def test_bad_windows_are_refused(num_tokens, window, stride, match):
    with pytest.raises(ValueError, match=match):
        plan_windows(num_tokens, window, stride)


def test_greedy_agreement_counts_the_prefix_and_every_equal_position():
    reference = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]]
    assert greedy_agreement(reference, reference) == accuracy.Agreement(1.0, 1.0, 12, 2)
    perturbed = [[1, 2, 3, 0, 5, 6, 7, 8], [9, 9, 9, 9, 9]]    # one token changed; one output longer
    assert greedy_agreement(reference, perturbed) == accuracy.Agreement((3 + 4) / 13, (7 + 4) / 13, 13, 0)
    with pytest.raises(ValueError, match="2 reference outputs against 1"):
        greedy_agreement(reference, reference[:1])


def test_engine_perplexity_equals_transformers_loss(tiny_model_dir):
    """One window: the engine's prompt logprobs give exp(transformers' mean cross-entropy) on the same weights."""
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM

    token_ids = torch.randint(3, 259, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    with LLM(tiny_model_dir, dtype="float32", kv_cache_memory=16 * MiB) as llm:
        got = accuracy.engine_perplexity(llm, token_ids, plan_windows(200, 256, 128))
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        loss = hf_model(torch.tensor([token_ids]), labels=torch.tensor([token_ids])).loss.item()
    assert got.num_scored_tokens == 199
    assert got.value == pytest.approx(math.exp(loss), rel=1e-5)


def test_two_engines_of_one_config_agree_fully(tiny_model_dir, tiny_tokenizer):
    from pagedllm import LLM, SamplingParams
    from pagedllm.bench.datasets import mixed_requests

    prompts = [r.prompt_token_ids for r in mixed_requests(tiny_tokenizer, 3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = []
    for _ in range(2):
        with LLM(tiny_model_dir, dtype="float32", kv_cache_memory=16 * MiB) as llm:
            outputs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
    assert greedy_agreement(*outputs) == accuracy.Agreement(1.0, 1.0, 36, 3)


def test_the_command_measures_each_config_against_the_reference(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "acc.json"
    result = main(["accuracy", "--model", tiny_model_dir, "--dtype", "float32", "--kv-cache-memory", "16M",
                   "--config", "int8", "--num-text-tokens", "200", "--window", "64", "--stride", "32",
                   "--num-prompts", "2", "--max-tokens", "12", "--hf-check", "--output-json", str(path)])
    reference, int8 = result["configs"]
    assert (reference["config"], int8["config"]) == ("none/auto", "int8/auto")
    assert result["text"]["sha256"] == hashlib.sha256(accuracy.TEXT_PATH.read_bytes()).hexdigest()
    assert result["text"]["num_tokens"] == 200 and result["text"]["num_scored_tokens"] == 199
    assert result["hf_float32_perplexity"] == pytest.approx(reference["perplexity"], rel=1e-5)
    assert reference["prefix_share"] == reference["overall_share"] == 1.0 and reference["perplexity_change_pct"] == 0
    assert int8["num_tokens"] == 24 and int8["prefix_share"] <= int8["overall_share"] < 1.0
    assert int8["perplexity"] != reference["perplexity"]
    assert json.loads(path.read_text())["configs"][1]["config"] == "int8/auto"
    assert "| int8/auto |" in capsys.readouterr().out


@pytest.mark.parametrize("config,message", [("int4", "weights must be one of none, int8, w8a8, gguf"),
                                            ("int8/fp8", "KV cache dtype must be one of auto, int8")])
def test_a_bad_config_is_refused_by_the_parser(config, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["accuracy", "--config", config])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags,match", [(["--max-tokens", "0"], "--max-tokens must be at least 1"),
                                         (["--num-text-tokens", "1"], "--num-text-tokens must be at least 2")])
def test_bad_numbers_are_refused_before_anything_runs(flags, match):
    with pytest.raises(ValueError, match=match):
        main(["accuracy", "--config", "none", *flags])


def test_a_kv_cache_dtype_the_build_lacks_is_refused_before_anything_runs(monkeypatch):
    monkeypatch.setattr(accuracy, "llm_accepts_kv_cache_dtype", lambda: False)
    assert accuracy.default_configs(False) == [AccuracyConfig(None), AccuracyConfig("int8"), AccuracyConfig("w8a8")]
    with pytest.raises(ValueError, match="none/int8: this build's LLM has no kv_cache_dtype"):
        main(["accuracy", "--config", "none/int8"])
    monkeypatch.setattr(accuracy, "llm_accepts_kv_cache_dtype", lambda: True)
    assert AccuracyConfig("int8", "int8") in accuracy.default_configs(False)
    assert AccuracyConfig("gguf", "int8") in accuracy.default_configs(True)
    assert AccuracyConfig(None, "int8").llm_kwargs() == {"quantization": None, "kv_cache_dtype": "int8"}
    assert AccuracyConfig("int8").llm_kwargs() == {"quantization": "int8"}


def test_gguf_weights_need_a_gguf_model(tiny_model_dir):
    """The default model is a .gguf file, so gguf is among its configurations; a Hugging Face folder is refused
    before anything runs."""
    assert AccuracyConfig("gguf") in accuracy.default_configs(True)
    assert AccuracyConfig("gguf") not in accuracy.default_configs(False)
    with pytest.raises(ValueError, match="gguf/auto: gguf weights need a .gguf model"):
        main(["accuracy", "--model", str(tiny_model_dir), "--config", "gguf"])


def test_window_is_plain_data():
    assert plan_windows(5, 4, 2) == [Window(0, 4, 1), Window(2, 5, 4)]
