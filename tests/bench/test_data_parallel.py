from __future__ import annotations

import pytest
import torch

from pagedllm.bench.cli import main


@pytest.fixture(autouse=True)
def restore_torch_threads():
    before = torch.get_num_threads()
    yield
    assert torch.get_num_threads() == before        # the bench gives back the threads the replicas divided


def test_one_engine_then_two_replicas_prefix_aware_then_round_robin(tiny_model_dir, capsys):
    result = main(["dp", "--model", tiny_model_dir, "--num-prefixes", "3", "--num-prompts", "6", "--prefix-len",
                   "160", "--output-len", "2", "--kv-cache-memory", "8M", "--dtype", "float32",
                   "--max-num-batched-tokens", "512"])
    one, aware, rr = result["one_engine"], result["prefix_aware"], result["round_robin"]
    assert (one["data_parallel_size"], aware["data_parallel_size"], rr["router"]) == (1, 2, "round_robin")
    assert one["total_prompt_tokens"] == aware["total_prompt_tokens"] == rr["total_prompt_tokens"]
    assert one["total_output_tokens"] == aware["total_output_tokens"] == 12
    assert aware["hit_rate"] > rr["hit_rate"] > 0
    assert "DP=2 (prefix-aware router) over one engine" in capsys.readouterr().out


def test_bad_sizes_are_refused(tiny_model_dir):
    with pytest.raises(SystemExit, match="data-parallel-size"):
        main(["dp", "--model", tiny_model_dir, "--data-parallel-size", "1"])
