"""Plain records of what the engine did: a snapshot of the scheduler per step, and per-request timings.

The async engine fills these on its engine thread and hands them to stat loggers (`prometheus.py`). No
prometheus_client here, so the records can be logged or tested on their own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.core.kv_cache.manager import KVCacheManager
    from pagedllm.core.sched.scheduler import Scheduler


@dataclass(slots=True)
class SchedulerStats:
    """The scheduler and KV pool after one engine step. Counters (`*_total`) are cumulative since start-up."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_blocks_free: int = 0
    num_blocks_total: int = 0
    num_preemptions_total: dict[str, int] = field(default_factory=dict)   # mode -> count
    prefix_cache_queries_total: int = 0     # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0        # of those, tokens found

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the pool's blocks in use (0..1); cached-but-free blocks count as free."""
        if self.num_blocks_total <= 0:
            return 0.0
        return 1.0 - self.num_blocks_free / self.num_blocks_total


@dataclass(slots=True)
class FinishedRequestStats:
    """One request's life, recorded when it finishes (or is aborted)."""

    finish_reason: str
    e2e_latency: float
    queue_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass(slots=True)
class IterationStats:
    """What happened in one engine step."""

    num_prompt_tokens: int = 0          # prompts whose first token came out this step
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass(slots=True)
class RequestTimes:
    """Timestamps of one request, kept by the engine thread. `arrival` is time.monotonic() at the server."""

    arrival: float
    num_prompt_tokens: int
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0

    def on_tokens(self, stats: IterationStats, num_new_tokens: int, now: float) -> None:
        """Record `num_new_tokens` arriving at `now`."""
        if num_new_tokens <= 0:
            return
        if self.first_token is None:
            self.first_token = now
            stats.time_to_first_tokens.append(now - self.arrival)
            stats.num_prompt_tokens += self.num_prompt_tokens
        elif self.last_token is not None:
            stats.inter_token_latencies.append((now - self.last_token) / num_new_tokens)
        self.last_token = now
        self.num_generation_tokens += num_new_tokens
        stats.num_generation_tokens += num_new_tokens

    def on_scheduled(self, stats: IterationStats, now: float) -> None:
        if self.scheduled is None:
            self.scheduled = now
            stats.queue_times.append(now - self.arrival)

    def on_finished(self, stats: IterationStats, finish_reason: str, now: float) -> None:
        queue_time = None if self.scheduled is None else self.scheduled - self.arrival
        stats.finished.append(FinishedRequestStats(finish_reason, now - self.arrival, queue_time,
                                                   self.num_prompt_tokens, self.num_generation_tokens))


def read_scheduler_stats(scheduler: Scheduler, kv_manager: KVCacheManager) -> SchedulerStats:
    """Snapshot the scheduler and KV manager. Call it only from the thread that steps the engine."""
    prefix = kv_manager.prefix_cache_stats
    return SchedulerStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped),
        num_blocks_free=kv_manager.num_free_blocks,
        num_blocks_total=kv_manager.num_usable_blocks,
        num_preemptions_total=dict(scheduler.num_preemptions_by_mode),
        prefix_cache_queries_total=prefix.num_query_tokens,
        prefix_cache_hits_total=prefix.num_hit_tokens,
    )


def monotonic() -> float:
    return time.monotonic()
