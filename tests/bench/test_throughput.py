from __future__ import annotations

import argparse
import json

import pytest
import torch

from pagedllm.bench.cli import add_bench_parser, main

_ENGINE = ["--kv-cache-memory", "16M", "--dtype", "float32"]


def test_throughput_with_hf_comparison(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "result.json"
    result = main(["throughput", "--model", tiny_model_dir, "--dataset", "random", "--num-prompts", "5",
                   "--input-len", "12", "--output-len", "6", "--compare", "hf", "--hf-batch-size", "2",
                   "--output-json", str(out), *_ENGINE])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    device = "cuda" if torch.cuda.is_available() else "cpu"    # both run where pagedllm ran
    assert result["device"] == result["hf"]["device"] == device
    for side in (result, result["hf"]):
        assert (side["num_requests"], side["total_prompt_tokens"], side["total_output_tokens"]) == (5, 60, 30)
        for key in ("requests_per_second", "tokens_per_second", "output_tokens_per_second", "elapsed_time",
                    "peak_rss_mib", "startup_s", "first_token_s", "achieved_gflops"):
            assert side[key] > 0, key
        assert (side.get("flops_utilization_pct", 0) > 0) == (device == "cpu")   # the CPU's GEMM peak, on a CPU
    if device == "cpu":
        assert result["gemm_peak_gflops"] > 0 and result["gemm_peak_dtype"] in ("bfloat16", "float32")
    # The engine: 5 requests run together for 6 steps in one 16-slot block each; after steps 1-5 they hold
    # 12..16 tokens (waste 4+3+2+1+0 of 16 slots each), after step 6 none runs. 50 of 400 slots: 12.5%.
    assert result["kv_waste"] == {"mean_waste_slots": 50 / 6, "mean_allocated_slots": 400 / 6, "waste_pct": 12.5,
                                  "num_steps": 6}
    assert result["hf"]["kv_waste"]["waste_pct"] == 0.0      # equal prompt and output lengths: no padding
    assert result["hf"]["backend"] == "hf" and result["hf"]["total_generated_tokens"] == 30
    assert set(result["ratio"]) == {"hf"}
    assert set(result["ratio"]["hf"]) == {"requests_per_second", "tokens_per_second", "output_tokens_per_second"}
    assert result["ratio"]["hf"]["output_tokens_per_second"] == (result["output_tokens_per_second"]
                                                                / result["hf"]["output_tokens_per_second"])
    printed = capsys.readouterr().out
    assert "Throughput: " in printed and "requests/s" in printed and "ratio" in printed
    assert "Device" in printed


def test_throughput_mixed_dataset_pagedllm_only(tiny_model_dir, capsys):
    result = main(["throughput", "--model", tiny_model_dir, "--num-prompts", "3", "--skip-gemm-peak",
                   "--max-num-seqs", "2", *_ENGINE])
    assert result["dataset"] == "mixed" and result["num_requests"] == 3
    assert result["output_tokens_per_second"] > 0 and "hf" not in result and "gemm_peak_gflops" not in result


def test_hf_backend_counts_only_useful_output(tiny_model_dir, tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt": [5, 6, 7], "output_len": 2}\n{"prompt": [8, 9], "output_len": 5}\n')
    result = main(["throughput", "--backend", "hf", "--model", tiny_model_dir, "--dataset", "jsonl",
                   "--dataset-path", str(path), "--hf-batch-size", "2", "--skip-gemm-peak", "--dtype", "float32"])
    assert result["total_output_tokens"] == 7 and result["total_generated_tokens"] == 10
    assert result["kv_waste"]["waste_pct"] > 0


def test_the_hf_peer_draws_with_the_same_sampling_flags(tiny_model_dir, capsys):
    result = main(["throughput", "--model", tiny_model_dir, "--dataset", "random", "--num-prompts", "2",
                   "--input-len", "6", "--output-len", "3", "--compare", "hf", "--skip-gemm-peak", "--temperature",
                   "0.9", "--top-k", "5", *_ENGINE])
    assert result["sampling"] == result["hf"]["sampling"] == {"temperature": 0.9, "top_k": 5}
    assert result["hf"]["total_generated_tokens"] == result["total_output_tokens"] == 6
    assert "Sampling: temperature=0.9 top_k=5" in capsys.readouterr().out


def test_add_bench_parser_registers_the_three_commands():
    parser = argparse.ArgumentParser(prog="pagedllm")
    add_bench_parser(parser.add_subparsers(dest="command"))
    for command in ("throughput", "serve", "prefix"):
        args = parser.parse_args(["bench", command])
        assert args.command == "bench" and args.bench_command == command and callable(args.func)
    args = parser.parse_args(["bench", "throughput", "--no-enable-prefix-caching", "--kv-cache-memory", "1G"])
    assert args.enable_prefix_caching is False and args.kv_cache_memory == 1 << 30


def test_throughput_grounded_dataset_with_speculation(tiny_model_dir, capsys):
    result = main(["throughput", "--model", tiny_model_dir, "--dataset", "grounded", "--num-prompts", "2",
                   "--skip-gemm-peak", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                   *_ENGINE])
    assert result["dataset"] == "grounded" and result["num_requests"] == 2
    spec = result["spec_decoding"]
    assert spec["config"]["num_speculative_tokens"] == 3 and spec["num_drafts"] > 0
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["mean_acceptance_length"] >= 1
    assert "Spec decode: acceptance rate" in capsys.readouterr().out


def test_throughput_runs_every_request_through_a_lora_adapter(tiny_model_dir, tmp_path, capsys):
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[dev]')")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    argv = ["throughput", "--model", tiny_model_dir, "--dataset", "random", "--num-prompts", "3", "--input-len", "8",
            "--output-len", "4", "--lora-path", str(tmp_path / "adapter"), *_ENGINE]
    result = main(argv)
    assert result["lora_path"] == str(tmp_path / "adapter") and result["total_output_tokens"] == 12
    with pytest.raises(ValueError, match="--lora-path runs pagedllm, and vLLM"):
        main([*argv, "--compare", "hf"])
    with pytest.raises(ValueError, match="no adapter_config.json there"):
        main([*argv[:-len(_ENGINE) - 2], "--lora-path", str(tmp_path), *_ENGINE])


@pytest.mark.parametrize("command", ["throughput", "prefix", "serve"])
def test_a_sampling_flag_out_of_range_fails_before_anything_loads(command, capsys):
    with pytest.raises(ValueError, match="top_p"):
        main([command, "--model", "/nowhere/at/all", "--temperature", "0.7", "--top-p", "1.5"])
    assert "Throughput" not in capsys.readouterr().out


def test_a_penalty_transformers_lacks_fails_before_anything_loads(capsys):
    with pytest.raises(ValueError, match="transformers generate has no presence_penalty"):
        main(["throughput", "--model", "/nowhere/at/all", "--compare", "hf", "--temperature", "0.7",
              "--presence-penalty", "0.5"])
    assert "Throughput" not in capsys.readouterr().out
