"""`pagedllm bench dashboard`: the step clock counts only the gaps between steps taken while requests were
unfinished, and the command is registered."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.bench import dashboard
from pagedllm.bench.cli import add_bench_commands
from pagedllm.metrics.stats import IterationStats, SchedulerStats


def test_step_clock_skips_idle_gaps(monkeypatch: pytest.MonkeyPatch) -> None:
    times = iter([1.0, 1.5, 1.75, 9.0, 9.5])
    monkeypatch.setattr(dashboard.time, "perf_counter", lambda: next(times))
    clock = dashboard._StepClock()
    busy, idle = SchedulerStats(num_running=2), SchedulerStats()
    for stats in (busy, busy, idle, busy, busy):     # the engine idles from 1.75 to 9.0
        clock(stats, IterationStats())
    assert clock.gaps == [0.5, 0.25, 0.5]


def test_the_command_is_registered() -> None:
    parser = argparse.ArgumentParser()
    add_bench_commands(parser)
    args = parser.parse_args(["dashboard", "--num-prompts", "4", "--rounds", "1"])
    assert (args.func, args.num_prompts, args.rounds) == (dashboard.main, 4, 1)
