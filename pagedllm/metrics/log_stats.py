"""vLLM's periodic log line of a busy server (off with --disable-log-stats):

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 402.0 tokens/s, Running: 12 reqs,
    Waiting: 3 reqs, KV cache usage: 4.1%, Prefix cache hit rate: 38.5%

The averages are over the time since the last line; a line comes with the first step at least `interval` seconds
after it, so an idle server writes none. With data parallelism the replicas' figures are summed (KV usage and the
hit rate over all their blocks and lookups).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pagedllm.metrics.stats import IterationStats, SchedulerStats

logger = logging.getLogger(__name__)


class LoggingStatLogger:
    """A stat logger (`AsyncEngine.add_stat_logger(LoggingStatLogger().record)`) that logs every `interval` s."""

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = logger.info) -> None:
        self.interval, self._clock, self._log = interval, clock, log
        self._lock = threading.Lock()        # replicas record from their own engine threads
        self._since = clock()
        self._prompt_tokens = self._generation_tokens = 0
        self._latest: dict[int, SchedulerStats] = {}           # replica -> its last step's stats
        self._prefix_at_last_line = (0, 0)                     # (queries, hits) summed over replicas

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats | None,
               replica: int = 0) -> None:
        with self._lock:
            if iteration is not None:
                self._prompt_tokens += iteration.num_prompt_tokens
                self._generation_tokens += iteration.num_generation_tokens
            if scheduler_stats is not None:
                self._latest[replica] = scheduler_stats
            now = self._clock()
            if now - self._since >= self.interval:
                self._log(self._line(now - self._since))
                self._since, self._prompt_tokens, self._generation_tokens = now, 0, 0

    def _line(self, elapsed: float) -> str:
        stats = list(self._latest.values())
        blocks_total = sum(s.num_blocks_total for s in stats)
        blocks_used = blocks_total - sum(s.num_blocks_free for s in stats)
        prefix = (sum(s.prefix_cache_queries_total for s in stats), sum(s.prefix_cache_hits_total for s in stats))
        queries, hits = prefix[0] - self._prefix_at_last_line[0], prefix[1] - self._prefix_at_last_line[1]
        self._prefix_at_last_line = prefix
        return (f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
                f"Running: {sum(s.num_running for s in stats)} reqs, "
                f"Waiting: {sum(s.num_waiting for s in stats)} reqs, "
                f"KV cache usage: {100 * blocks_used / max(blocks_total, 1):.1f}%, "
                f"Prefix cache hit rate: {100 * hits / max(queries, 1):.1f}%")
