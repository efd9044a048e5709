"""Plain records of what the engine did: a snapshot of the scheduler per step, and per-request timings.

The scheduler makes the snapshot (`Scheduler.make_stats`); `RequestStatsTracker` turns the engine's outputs into
per-request timings. `StepRecorder` runs both after each step, on the thread that steps the engine (the async
engine's, or `LLM`'s with `disable_log_stats=False`), and hands the records to stat loggers (`prometheus.py`,
`log_stats.py`). No prometheus_client and no torch here, so the core can import this and the records can be
logged or tested on their own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pagedllm.outputs import RequestOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SpecDecodingStats:
    """Speculative decoding's counters since start-up (vLLM's `spec_decode_*`): verified draft runs, their draft
    tokens, the accepted ones, and how often the draft at each position (0-based) was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's drafts verified: the first `num_accepted_tokens` of `num_draft_tokens` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for position in range(num_accepted_tokens):
            per_pos[position] += 1

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed ones (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens each verify pass produced on average: the accepted drafts plus the sampled token (vLLM's)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(frozen=True, slots=True)
class BlockResidency:
    """One sampled KV block's life, ended when its memory was handed out again (vLLM's KV cache eviction event):
    seconds from its allocation, seconds since its last read (or its allocation), and the gaps between its last few
    reads (a prefix-cache hit or a fork takes a reference to it: a read)."""

    lifetime: float
    idle: float
    reuse_gaps: tuple[float, ...] = ()


@dataclass(slots=True)
class SchedulerStats:
    """The scheduler and KV pool after one engine step. Counters (`*_total`) are cumulative since start-up."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_blocks_free: int = 0
    num_blocks_total: int = 0
    num_swap_blocks_free: int = 0
    num_swap_blocks_total: int = 0          # the swap pool's usable blocks (0: no swap pool)
    num_preemptions_total: dict[str, int] = field(default_factory=dict)   # mode -> count
    prefix_cache_queries_total: int = 0     # prompt tokens looked up in the prefix cache, once a request
    prefix_cache_hits_total: int = 0        # of those, tokens found
    num_kv_slots_running: int = 0           # token slots of the blocks the running requests hold
    num_kv_slots_filled: int = 0            # of those, slots holding a computed token (the rest is tail waste)
    scheduled_request_ids: list[str] = field(default_factory=list)   # the requests the last step ran
    num_scheduled_tokens: int = 0           # the tokens the last step ran (drafts included)
    spec_decoding: SpecDecodingStats | None = None   # None without speculative decoding
    max_loras: int | None = None            # None: LoRA off
    running_lora_adapters: list[str] = field(default_factory=list)   # the adapters' names, each once, sorted
    waiting_lora_adapters: list[str] = field(default_factory=list)
    # the sampled blocks whose lives ended since the last snapshot (None: CacheConfig.kv_cache_metrics off)
    kv_block_residencies: list[BlockResidency] | None = None
    sleep_level: int | None = None          # the engine's sleep level (LLMEngine.sleep); None: awake

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the pool's blocks in use (0..1); cached-but-free blocks count as free."""
        if self.num_blocks_total <= 0:
            return 0.0
        return 1.0 - self.num_blocks_free / self.num_blocks_total

    @property
    def kv_waste(self) -> float:
        """Fraction of the running requests' token slots that hold no computed token (mostly tail blocks)."""
        if self.num_kv_slots_running <= 0:
            return 0.0
        return 1.0 - self.num_kv_slots_filled / self.num_kv_slots_running


@dataclass(slots=True)
class FinishedRequestStats:
    """One request's life, recorded when it finishes (or is aborted), in vLLM's phases: queued (arrival to first
    scheduled), prefill (to its first token), decode (to its last), inference (scheduled to finished); None for a
    phase it never reached. `max_num_generation_tokens`: its longest completion's (of n); `max_tokens`, `n`: its
    sampling parameters (None for an embedding's)."""

    finish_reason: str
    e2e_latency: float
    queue_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    max_num_generation_tokens: int = 0
    max_tokens: int | None = None
    n: int | None = None

    @property
    def time_per_output_token(self) -> float | None:
        """The decode phase over the tokens after the first of its longest completion (vLLM's TPOT)."""
        if self.decode_time is None or self.max_num_generation_tokens < 2:
            return None
        return self.decode_time / (self.max_num_generation_tokens - 1)


@dataclass(slots=True)
class IterationStats:
    """What happened in one engine step."""

    num_prompt_tokens: int = 0          # prompts whose first token came out this step
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    num_step_tokens: int = 0            # the tokens the engine step ran (0: no step ran)
    started: float | None = None        # time.monotonic() as the step began: when it scheduled its requests


@dataclass(slots=True)
class RequestTimes:
    """Timestamps of one request, kept by the engine thread. `arrival` is time.monotonic() at the server."""

    arrival: float
    num_prompt_tokens: int
    max_tokens: int | None = None
    n: int | None = None
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0
    per_completion: dict[int, int] = field(default_factory=dict)   # completion index -> its tokens so far

    def on_tokens(self, stats: IterationStats, num_new_tokens: int, now: float,
                  per_completion: Iterable[tuple[int, int]] = ()) -> None:
        """Record `num_new_tokens` arriving at `now` (`per_completion`: (index, tokens) of each completion's)."""
        for index, count in per_completion:
            self.per_completion[index] = self.per_completion.get(index, 0) + count
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

    def response_metrics(self) -> dict[str, float | None]:
        """vLLM's per-request metrics of a response (`--enable-per-request-metrics`), in milliseconds: first token
        after scheduling, decode time (first to last token), queue time, mean inter-token latency, and tokens a
        second over the inference (scheduled to last token); None where a timestamp is missing."""
        scheduled, first, last, count = self.scheduled, self.first_token, self.last_token, self.num_generation_tokens

        def ms(start: float | None, end: float | None) -> float | None:
            return None if start is None or end is None else (end - start) * 1000

        inference, decode = ms(scheduled, last), ms(first, last)
        return {"time_to_first_token_ms": ms(scheduled, first), "generation_time_ms": decode,
                "queue_time_ms": ms(self.arrival, scheduled),
                "mean_itl_ms": decode / (count - 1) if decode is not None and count > 1 else None,
                "tokens_per_second": count / inference * 1000 if inference else None}

    def on_finished(self, stats: IterationStats, finish_reason: str, now: float) -> None:
        scheduled, first, last = self.scheduled, self.first_token, self.last_token
        stats.finished.append(FinishedRequestStats(
            finish_reason, now - self.arrival, None if scheduled is None else scheduled - self.arrival,
            self.num_prompt_tokens, self.num_generation_tokens,
            prefill_time=None if scheduled is None or first is None else first - scheduled,
            decode_time=None if first is None or last is None else last - first,
            inference_time=None if scheduled is None else now - scheduled,
            max_num_generation_tokens=max(self.per_completion.values(), default=self.num_generation_tokens),
            max_tokens=self.max_tokens, n=self.n))


class RequestStatsTracker:
    """Each request's timings from the engine's side: queue time, time to first token, inter-token latency and
    end-to-end latency, recorded into the step's IterationStats. Used by one thread (the one stepping the engine).
    """

    def __init__(self) -> None:
        self._times: dict[str, RequestTimes] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._times

    def on_added(self, request_id: str, arrival: float, num_prompt_tokens: int, max_tokens: int | None = None,
                 n: int | None = None) -> None:
        self._times[request_id] = RequestTimes(arrival, num_prompt_tokens, max_tokens, n)

    def on_step(self, outputs: Iterable[RequestOutput], scheduled_request_ids: Iterable[str], iteration: IterationStats,
                now: float, new_tokens: dict[str, dict[int, int]] | None = None) -> None:
        """A step ran `scheduled_request_ids` (their queue time ends as it began) and produced `outputs`. Its new
        tokens are the outputs' own (streamed deltas), or `new_tokens` (request id -> completion index -> count,
        `LLMEngine.step_new_tokens`) where the outputs do not carry each step's: the offline "final" outputs."""
        scheduled_at = now if iteration.started is None else iteration.started
        for request_id in scheduled_request_ids:
            times = self._times.get(request_id)
            if times is not None:
                times.on_scheduled(iteration, scheduled_at)
        outputs = [output for output in outputs if output.request_id in self._times]
        for output in outputs:
            times = self._times[output.request_id]
            if not times.num_prompt_tokens:
                times.num_prompt_tokens = len(output.prompt_token_ids)
            times.on_scheduled(iteration, scheduled_at)
            if output.embedding is not None:    # an embedding: its prompt ran, and nothing is generated
                iteration.num_prompt_tokens += times.num_prompt_tokens
        if new_tokens is None:
            new_tokens = {}
            for output in outputs:
                counts = new_tokens.setdefault(output.request_id, {})
                for c in output.outputs:
                    counts[c.index] = counts.get(c.index, 0) + len(c.token_ids)
        for request_id, counts in new_tokens.items():
            times = self._times.get(request_id)
            if times is not None:
                times.on_tokens(iteration, sum(counts.values()), now, counts.items())
        for output in outputs:
            if output.finished and output.request_id in self._times:
                reason = output.outputs[0].finish_reason if output.outputs else None
                output.metrics = self._times.pop(output.request_id)     # the response's per-request metrics
                output.metrics.on_finished(iteration, reason or "stop", now)

    def on_aborted(self, request_ids: Iterable[str], iteration: IterationStats, now: float) -> None:
        for request_id in request_ids:
            times = self._times.pop(request_id, None)
            if times is not None:
                times.on_finished(iteration, "abort", now)


StatLogger = Callable[[SchedulerStats, IterationStats], None]


class _SteppedEngine(Protocol):
    def make_stats(self) -> SchedulerStats: ...


class StepRecorder:
    """What each engine step did, for the stat loggers: the scheduler's snapshot, and the step's IterationStats
    with each request's timings (`requests`, told of each request as it is added and aborted). Used by one thread,
    the one that steps the engine."""

    def __init__(self) -> None:
        self.requests = RequestStatsTracker()
        self.loggers: list[StatLogger] = []

    def record(self, engine: _SteppedEngine, outputs: Iterable[RequestOutput], iteration: IterationStats,
               stepped: bool, new_tokens: dict[str, dict[int, int]] | None = None) -> SchedulerStats:
        """After a step (`stepped`) that gave `outputs` (and `new_tokens`: see RequestStatsTracker.on_step), or
        after adds and aborts alone: the engine's snapshot, given to every logger with `iteration` (a logger that
        raises is logged, and never stops the engine)."""
        stats = engine.make_stats()
        if stepped:
            iteration.num_step_tokens = stats.num_scheduled_tokens
        self.requests.on_step(outputs, stats.scheduled_request_ids, iteration, time.monotonic(), new_tokens)
        for stat_logger in self.loggers:
            try:
                stat_logger(stats, iteration)
            except Exception:  # noqa: BLE001 - metrics must never stop the engine
                logger.exception("stat logger failed")
        return stats
