from __future__ import annotations

from pagedllm.bench.cli import main


def test_structured_bench_reports_the_cost_compile_time_and_validity(tiny_model_dir, capsys):
    result = main(["structured", "--model", tiny_model_dir, "--num-prompts", "2", "--dataset", "random",
                   "--input-len", "16", "--output-len", "32", "--json-max-tokens", "900",
                   "--kv-cache-memory", "16M", "--dtype", "float32"])
    free, constrained = result["free"], result["constrained"]
    assert free["total_output_tokens"] == 64                       # ignore_eos: every request runs to the end
    assert constrained["complete_share"] == constrained["valid_share"] == 1.0, constrained
    assert result["ratio"] == constrained["output_tokens_per_second"] / free["output_tokens_per_second"]
    assert result["schema_compile_s"] > 0 and result["tokenizer_build_s"] > 0
    assert "Outputs that validate: 100.0%" in capsys.readouterr().out
