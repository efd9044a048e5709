"""`pagedllm simulate`: replay a trace through the real scheduler and block pool under allocation policies.

No model runs: a runner that "samples" token 0 stands in for it, and every request generates exactly its
trace's output length (ignore_eos). Time is virtual: each engine step takes `step_seconds`, and a request joins
the waiting queue once the clock passes its arrival (an idle engine jumps to the next arrival).

Policies, over the same budget of `num_slots` KV token slots:

    paged-B    the engine itself: `KVCacheManager` with blocks of B tokens (budget // B blocks, plus the null
               block), allocating a block when a request's tokens need one
    max        each request reserves max_model_len slots when admitted (Orca "Max")
    pow2       ... the next power of two of its final length, prompt + output (Orca "Pow2")
    oracle     ... exactly its final length (Orca "Oracle")

The three reservation policies are not the engine's. `ReservingKVCacheManager` models them on the same
scheduler: blocks of one slot, and a request's first allocation takes its whole reservation, so it is admitted
FCFS while that many slots are free and never allocates again. Contiguity is not modelled (any free slots
will do), so they show no external fragmentation.

Measured after every step, as `pagedllm bench` measures the engine (`KVWaste`): the slots held by running
requests and, of those, the slots holding a computed token's K/V. `token_state_pct` is their ratio over the
whole run; `max_batch` is the most requests one step ran.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from pagedllm.bench.measure import KVWaste
from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache.manager import ComputedBlocks, KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.sched.output import RunnerOutput, SchedulerOutput
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.memory.traces import TraceRequest
from pagedllm.metrics.stats import SchedulerStats
from pagedllm.sampling_params import SamplingParams

PAGED_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
RESERVATION_POLICIES = ("max", "pow2", "oracle")
DEFAULT_POLICIES = (*RESERVATION_POLICIES, *(f"paged-{size}" for size in PAGED_BLOCK_SIZES))
# OPT-13B on a 40 GB A100, the paper's setup: ~12 GiB left for the KV cache after the 26 GB of weights, at
# 2 x 40 layers x 5120 hidden x 2 bytes = 800 KiB per token.
DEFAULT_NUM_SLOTS = 12 * (1 << 30) // (800 * 1024)


@dataclass(frozen=True)
class SimConfig:
    """The engine limits and the memory budget of a simulation; `num_slots` is in tokens."""

    num_slots: int = DEFAULT_NUM_SLOTS
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    step_seconds: float = 0.03

    def __post_init__(self) -> None:
        if self.num_slots < self.max_model_len:
            raise ValueError(f"the budget of {self.num_slots} token slots must hold at least one request of "
                             f"max_model_len ({self.max_model_len}) tokens")
        if self.step_seconds <= 0:
            raise ValueError(f"step_seconds must be > 0, got {self.step_seconds}")


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    token_state_pct: float   # of the slots running requests held, the share holding a token's K/V (sampled per step)
    mean_slots_held: float
    max_batch: int
    mean_batch: float
    num_steps: int
    num_preemptions: int

    def to_json(self) -> dict[str, float | int | str]:
        return asdict(self)


def reservation(policy: str, max_model_len: int) -> Callable[[Request], int]:
    """Slots a request reserves under a reservation policy, from its final length (prompt + max_tokens)."""
    def final_len(request: Request) -> int:
        assert request.sampling_params.max_tokens is not None
        return request.num_prompt_tokens + request.sampling_params.max_tokens

    policies: dict[str, Callable[[Request], int]] = {
        "max": lambda request: max_model_len,
        "pow2": lambda request: min(max_model_len, 1 << (final_len(request) - 1).bit_length()),
        "oracle": final_len,
    }
    return policies[policy]


class ReservingKVCacheManager(KVCacheManager):
    """A contiguous-reservation allocator on the block pool: slots of one token, reserved whole at admission."""

    def __init__(self, num_slots: int, reserve: Callable[[Request], int]) -> None:
        super().__init__(num_slots + 1, block_size=1, enable_caching=False)   # + the null block
        self._reserve = reserve
        self._block_ids: dict[str, list[int]] = {}   # a table never changes once reserved: build its ids once

    def get_block_ids(self, request_id: str) -> list[int]:
        if request_id not in self._block_ids:
            return super().get_block_ids(request_id)
        return self._block_ids[request_id]

    def free(self, request: Request) -> None:
        self._block_ids.pop(request.request_id, None)
        super().free(request)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks | None = None) -> list[int] | None:
        if self.num_blocks_held(request.request_id):
            return []   # the reservation holds the request's final length: nothing more, ever
        new_block_ids = super().allocate_slots(request, self._reserve(request) - request.num_computed_tokens,
                                               computed)
        if new_block_ids is not None:
            self._block_ids[request.request_id] = new_block_ids
        return new_block_ids


def paged_block_size(policy: str) -> int | None:
    """B of "paged-B"; None for a reservation policy. Raises ValueError for an unknown policy."""
    if policy in RESERVATION_POLICIES:
        return None
    size = policy.removeprefix("paged-")
    if policy.startswith("paged-") and size.isdigit() and int(size) > 0 and int(size) & (int(size) - 1) == 0:
        return int(size)
    raise ValueError(f"unknown policy {policy!r}: expected one of {', '.join(RESERVATION_POLICIES)} or paged-B "
                     "with B a power of two")


def make_kv_cache_manager(policy: str, config: SimConfig) -> KVCacheManager:
    """The allocator of a policy name: "max", "pow2", "oracle" or "paged-B"."""
    block_size = paged_block_size(policy)
    if block_size is None:
        return ReservingKVCacheManager(config.num_slots, reservation(policy, config.max_model_len))
    return KVCacheManager(config.num_slots // block_size + 1, block_size, enable_caching=False)


def _sample_zeros(scheduler_output: SchedulerOutput) -> RunnerOutput:
    """The stand-in runner: token 0 for every request that samples this step."""
    return RunnerOutput({s.request_id: 0 for s in scheduler_output.scheduled if s.sample})


def simulate(trace: list[TraceRequest], policy: str, config: SimConfig = SimConfig(),
             on_step: Callable[[SchedulerStats], None] | None = None) -> PolicyResult:
    """Run the whole trace under one policy; every request finishes (the budget holds any one request).
    `on_step` sees the scheduler's snapshot after every step."""
    too_long = [r for r in trace if r.prompt_len + r.output_len > config.max_model_len]
    if too_long:
        raise ValueError(f"{len(too_long)} requests of the trace are longer than max_model_len "
                         f"({config.max_model_len}), e.g. {too_long[0]}")
    scheduler = Scheduler(SchedulerConfig(config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens),
                          make_kv_cache_manager(policy, config))
    waste, clock, next_index, max_batch, total_batch = KVWaste(), 0.0, 0, 0, 0
    while next_index < len(trace) or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests():
            clock = max(clock, trace[next_index].arrival_s)
        while next_index < len(trace) and trace[next_index].arrival_s <= clock:
            scheduler.add_request(_request(next_index, trace[next_index]))
            next_index += 1
        scheduler_output = scheduler.schedule()
        scheduler.update_from_output(scheduler_output, _sample_zeros(scheduler_output))
        stats = scheduler.make_stats()
        waste.add(stats.num_kv_slots_running - stats.num_kv_slots_filled, stats.num_kv_slots_running)
        if on_step is not None:
            on_step(stats)
        max_batch = max(max_batch, len(scheduler_output.scheduled))
        total_batch += len(scheduler_output.scheduled)
        clock += config.step_seconds
    return PolicyResult(policy, 100 - waste.waste_pct, waste.mean_allocated_slots, max_batch,
                        total_batch / max(waste.num_steps, 1), waste.num_steps, scheduler.num_preemptions)


def _request(index: int, trace_request: TraceRequest) -> Request:
    params = SamplingParams(max_tokens=trace_request.output_len, ignore_eos=True)
    return Request(str(index), [0] * trace_request.prompt_len, params, arrival_time=trace_request.arrival_s)


def format_results(results: dict[str, list[PolicyResult]], config: SimConfig) -> str:
    """A table per trace: token-state share, slots held, batch sizes, steps, preemptions."""
    lines = [f"KV budget: {config.num_slots:,} token slots; max_model_len {config.max_model_len}, max_num_seqs "
             f"{config.max_num_seqs}, max_num_batched_tokens {config.max_num_batched_tokens}"]
    for trace, trace_results in results.items():
        lines += ["", f"trace {trace}:",
                  f"{'policy':<11}{'token states':>13}{'slots held':>12}{'max batch':>11}{'mean batch':>12}"
                  f"{'steps':>8}{'preemptions':>13}"]
        lines += [f"{r.policy:<11}{r.token_state_pct:>12.1f}%{r.mean_slots_held:>12,.0f}{r.max_batch:>11}"
                  f"{r.mean_batch:>12.1f}{r.num_steps:>8,}{r.num_preemptions:>13,}" for r in trace_results]
    return "\n".join(lines)
