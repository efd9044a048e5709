"""vLLM's periodic log line: averages over the time since the last line, one line per interval of activity, the
replicas' figures summed; and a served engine writes it unless --disable-log-stats."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from pagedllm import SamplingParams
from pagedllm.config import CacheConfig, EngineConfig, ModelConfig
from pagedllm.engine import data_parallel
from pagedllm.entrypoints.openai.cli_args import add_server_args
from pagedllm.metrics.log_stats import LoggingStatLogger
from pagedllm.metrics.stats import IterationStats, SchedulerStats
from tests.models.tiny import save_tiny_model


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _stats(running: int, waiting: int, free: int, queries: int, hits: int) -> SchedulerStats:
    return SchedulerStats(num_running=running, num_waiting=waiting, num_blocks_free=free, num_blocks_total=100,
                          prefix_cache_queries_total=queries, prefix_cache_hits_total=hits)


def test_a_line_per_interval_with_the_averages_since_the_last():
    clock, lines = Clock(), []
    stat_logger = LoggingStatLogger(interval=10.0, clock=clock, log=lines.append)
    clock.now = 104.0
    stat_logger.record(_stats(2, 1, 90, 100, 0), IterationStats(num_prompt_tokens=300, num_generation_tokens=10))
    assert lines == []                                  # 4 s: too soon
    clock.now = 110.0
    stat_logger.record(_stats(3, 0, 80, 400, 150), IterationStats(num_prompt_tokens=200, num_generation_tokens=40))
    assert lines == ["Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 3 "
                     "reqs, Waiting: 0 reqs, KV cache usage: 20.0%, Prefix cache hit rate: 37.5%"]
    clock.now = 125.0                                   # an idle gap, then one step: averaged over the 15 s
    stat_logger.record(_stats(1, 0, 95, 500, 200), IterationStats(num_generation_tokens=30))
    assert lines[1] == ("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 2.0 tokens/s, Running: 1 "
                        "reqs, Waiting: 0 reqs, KV cache usage: 5.0%, Prefix cache hit rate: 50.0%")


def test_replicas_are_summed():
    clock, lines = Clock(), []
    stat_logger = LoggingStatLogger(interval=10.0, clock=clock, log=lines.append)
    stat_logger.record(_stats(2, 1, 50, 100, 50), IterationStats(num_generation_tokens=100), replica=0)
    clock.now = 110.0
    stat_logger.record(_stats(4, 0, 100, 100, 0), IterationStats(num_generation_tokens=100), replica=1)
    assert lines == ["Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 6 "
                     "reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"]


@pytest.mark.parametrize("log_stats", [True, False])
def test_the_servers_engine_logs_stats_unless_told_not_to(tmp_path, monkeypatch, log_stats):
    lines: list[str] = []
    monkeypatch.setattr(data_parallel, "LoggingStatLogger",
                        lambda: LoggingStatLogger(interval=0.0, log=lines.append))   # a line a step, kept here
    folder = save_tiny_model(tmp_path / "m", "llama-gqa")[0]
    config = EngineConfig(model=ModelConfig(model=str(folder), dtype="float32"),
                          cache=CacheConfig(block_size=16, num_blocks=64))
    engine = data_parallel.build_async_engine(config, log_stats=log_stats)

    async def one_request() -> None:
        engine.start(asyncio.get_running_loop())
        try:
            async for _ in engine.generate("r", "Hello", SamplingParams(max_tokens=3, ignore_eos=True)):
                pass
        finally:
            await asyncio.to_thread(engine.shutdown)

    asyncio.run(one_request())
    assert bool(lines) == log_stats and all(line.startswith("Avg prompt throughput") for line in lines)
    parser = add_server_args(argparse.ArgumentParser(), positional_model=True)
    assert parser.parse_args([]).disable_log_stats is False
    assert parser.parse_args(["--disable-log-stats"]).disable_log_stats is True
