from __future__ import annotations

import statistics

import pytest

from pagedllm.bench.cli import main


def test_prefix_cache_on_and_off(tiny_model_dir, capsys):
    result = main(["prefix", "--model", tiny_model_dir, "--num-prompts", "4", "--prefix-len", "96",
                   "--output-len", "3", "--kv-cache-memory", "16M", "--dtype", "float32"])
    on, off = result["cache_on"], result["cache_off"]
    assert on["enable_prefix_caching"] and not off["enable_prefix_caching"]
    assert on["total_prompt_tokens"] == off["total_prompt_tokens"] and on["total_output_tokens"] == 12
    assert on["hit_rate"] == on["ideal_hit_rate"] > 0.3
    assert on["kv_manager_hit_rate"] == on["hit_rate"]        # the manager is asked about the prompts alone
    assert off["hit_rate"] == 0 and off["kv_manager_hit_rate"] == 0
    assert result["ratio"] == on["output_tokens_per_second"] / off["output_tokens_per_second"]
    assert "Speed-up with the prefix cache" in capsys.readouterr().out


def test_a_cold_batch_shares_the_prefix_its_first_step_computes(tiny_model_dir):
    """--cold: nothing cached before the batch; the first request computes the system prompt and every other
    reuses its full blocks, the ones admitted in the same step too."""
    result = main(["prefix", "--model", tiny_model_dir, "--num-prompts", "4", "--prefix-len", "96", "--cold",
                   "--output-len", "3", "--kv-cache-memory", "16M", "--dtype", "float32"])
    on = result["cache_on"]
    assert 0 < on["hit_rate"] == on["ideal_hit_rate"] < main(
        ["prefix", "--model", tiny_model_dir, "--num-prompts", "4", "--prefix-len", "96", "--output-len", "3",
         "--kv-cache-memory", "16M", "--dtype", "float32"])["cache_on"]["hit_rate"]


def test_repeated_runs_each_start_from_the_system_prompt_alone(tiny_model_dir, capsys):
    """--repeat: the batch runs three times in one engine, the prefix cache emptied and the system prompt served
    again before each run, so that every run hits what the first does (not its own prompts, cached by the run
    before); the figures are the median run's, and each run's are listed."""
    result = main(["prefix", "--model", tiny_model_dir, "--num-prompts", "4", "--prefix-len", "96",
                   "--output-len", "3", "--kv-cache-memory", "16M", "--dtype", "float32", "--repeat", "3"])
    on, off = result["cache_on"], result["cache_off"]
    assert on["hit_rate"] == on["ideal_hit_rate"] > 0.3 and on["kv_manager_hit_rate"] == on["hit_rate"]
    for figures in (on, off):
        runs = figures["runs_output_tokens_per_second"]
        assert len(runs) == 3 and figures["output_tokens_per_second"] == statistics.median(runs)
    printed = capsys.readouterr().out
    assert "cache on: the median of 3 runs" in printed and "cache off: the median of 3 runs" in printed


def test_repeat_must_be_at_least_one_and_times_pagedllm(capsys):
    with pytest.raises(SystemExit):
        main(["prefix", "--repeat", "0"])
    assert "must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="transformers .--backend hf. runs once"):
        main(["throughput", "--backend", "hf", "--repeat", "2"])
