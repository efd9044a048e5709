"""The offline LLM's statistics, as vLLM's (`LLM(disable_log_stats=False)`, `LLM.get_metrics()`), on a tiny random
Llama: the families of the server's /metrics, each request's tokens timed as the engine made them although its
output comes back whole, and vLLM's periodic log line."""

from __future__ import annotations

import functools

import pytest

import pagedllm.entrypoints.llm as llm_module
from pagedllm import LLM, SamplingParams
from pagedllm.metrics.log_stats import LoggingStatLogger
from pagedllm.metrics.reader import Counter, Gauge, Histogram
from tests.models.tiny import save_tiny_model

PROMPTS = ["hello", "a longer prompt than that", "x"]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, n=2, max_tokens=4, ignore_eos=True, seed=0)


def test_get_metrics_counts_the_runs_requests_and_times_their_tokens_as_made(tmp_path, monkeypatch, caplog):
    folder, _ = save_tiny_model(tmp_path / "m", "llama-gqa", initializer_range=0.5)
    monkeypatch.setattr(llm_module, "LoggingStatLogger", functools.partial(LoggingStatLogger, interval=0.0))
    caplog.set_level("INFO", logger="pagedllm.metrics.log_stats")
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, disable_log_stats=False)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False) + llm.generate("two of them", SAMPLED, use_tqdm=False)
    records = {(r.name, r.labels.get("finished_reason")): r for r in llm.get_metrics()}
    assert all(r.labels["model_name"] == llm.engine.model_name for r in records.values())

    def value(name: str, reason: str | None = None) -> float:
        record = records[f"pagedllm:{name}", reason]
        assert isinstance(record, Counter | Gauge)
        return record.value

    assert value("request_success", "length") == 4 and value("num_requests_running") == 0
    assert value("prompt_tokens") == sum(len(o.prompt_token_ids) for o in outputs)
    assert value("generation_tokens") == 3 * 5 + 2 * 4
    ttft, itl, e2e = (records[f"pagedllm:{name}", None] for name in
                      ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"))
    assert isinstance(ttft, Histogram) and isinstance(itl, Histogram) and isinstance(e2e, Histogram)
    # One token a step for each completion: a first token, then 4 steps (3 for the pair, two tokens a step).
    assert (ttft.count, itl.count, e2e.count) == (4, 3 * 4 + 3, 4)
    assert 0 < ttft.sum < e2e.sum and ttft.buckets["+Inf"] == 4
    # Each output carries its request's times (vLLM's RequestOutput.metrics): its first token before its last.
    assert all(o.metrics.first_token < o.metrics.last_token for o in outputs)
    assert any("Avg prompt throughput" in r.getMessage() for r in caplog.records), "vLLM's log line"
    # The statistics change no token.
    plain = LLM(model=str(folder), dtype="float32", num_kv_blocks=64)
    assert [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in outputs[:3]]


def test_without_statistics_get_metrics_says_how_to_keep_them(tmp_path):
    folder, _ = save_tiny_model(tmp_path / "m", "llama-gqa", initializer_range=0.5)
    with pytest.raises(ValueError, match="data_parallel_size must be 1"):
        LLM(model=str(folder), data_parallel_size=2, disable_log_stats=False)
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match=r"LLM\(..., disable_log_stats=False\)"):
        llm.get_metrics()
    assert llm.generate("hi", GREEDY, use_tqdm=False)[0].metrics is None
