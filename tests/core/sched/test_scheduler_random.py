"""Random workloads: arrivals, prompt lengths (with shared prefixes), n (forks), priorities and aborts, on pools
from tiny to roomy, preempting by recompute, swap or auto, with swap pools from none to roomy. Every step is
checked (budget, max_num_seqs, block tables, transfers, integrity of both pools, ref counts of shared blocks);
at the end every sequence has exactly the tokens an uncached, never-preempted run gives, and every block of
both pools is free."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import event, given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache.manager import KVCacheManager, cdiv
from pagedllm.core.request import FinishReason, Request, child_request_id
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from tests.core.sched.fakes import FakeRunner, Result, reference, run_steps

EOS = 3


@dataclass
class Spec:
    prompt: list[int]
    max_tokens: int
    n: int
    priority: int
    arrival_step: int
    abort_step: int | None


SHARED_PREFIX = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
# A piece of a shared prefix, then a few tokens of its own: prefix-cache hits are common.
prompt_strategy = st.builds(lambda n, tail: SHARED_PREFIX[:n] + tail, st.integers(0, len(SHARED_PREFIX)),
                            st.lists(st.integers(0, 2), max_size=6)).filter(bool)
specs_strategy = st.lists(st.builds(
    Spec,
    prompt=prompt_strategy,
    max_tokens=st.integers(1, 12),
    n=st.sampled_from([1, 1, 2, 3]),
    priority=st.integers(0, 2),
    arrival_step=st.integers(0, 15),
    abort_step=st.none() | st.integers(0, 30),
), min_size=1, max_size=8)


def _sequence_ids(request_id: str, n: int) -> list[str]:
    return [request_id] + [child_request_id(request_id, j) for j in range(1, n)]


@settings(max_examples=400, deadline=None)
@given(specs=specs_strategy, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(4, 24),
       max_num_batched_tokens=st.integers(1, 24), max_num_seqs=st.integers(1, 4), enable_caching=st.booleans(),
       mode=st.sampled_from(["recompute", "swap", "swap", "auto"]),
       num_swap_blocks=st.sampled_from([0, 3, 12, 32, 32]), swap_seconds_per_block=st.sampled_from([0.1, 0.5, 4.0]))
def test_random_workloads(specs: list[Spec], block_size: int, num_blocks: int, max_num_batched_tokens: int,
                          max_num_seqs: int, enable_caching: bool, mode: str, num_swap_blocks: int,
                          swap_seconds_per_block: float) -> None:
    config = SchedulerConfig(max_model_len=32, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, preemption_mode=mode,
                             swap_seconds_per_block=swap_seconds_per_block, recompute_seconds_per_token=1.0)
    scheduler = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching, num_swap_blocks))
    capacity = (num_blocks - 1) * block_size  # tokens the whole pool holds
    n_of = [min(spec.n, max_num_seqs) for spec in specs]

    def before_step(step: int) -> bool:
        for i, spec in enumerate(specs):
            if spec.arrival_step == step:
                params = SamplingParams(max_tokens=spec.max_tokens, n=n_of[i])
                scheduler.add_request(Request(f"r{i}", spec.prompt, params, eos_token_id=EOS,
                                              arrival_time=float(step), priority=spec.priority))
            if spec.abort_step == step:
                scheduler.finish_requests(_sequence_ids(f"r{i}", n_of[i]), FinishReason.ABORT)
        return step < 31

    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(block_size), results, before_step)
    for name, count in scheduler.num_preemptions_by_mode.items():
        event(f"preempted by {name}: {count > 0}")
    event(f"copy-on-write: {any(out.blocks_to_copy for out in outputs)}")
    for i, spec in enumerate(specs):
        parent = results.get(f"r{i}", Result())
        for index, request_id in enumerate(_sequence_ids(f"r{i}", n_of[i])):
            result = results.get(request_id, Result())
            if index > 0 and not parent.token_ids:  # the parent never sampled: no children
                assert request_id not in results
                continue
            expected = reference(spec.prompt, spec.max_tokens, EOS, index)
            if cdiv(len(spec.prompt), block_size) > num_blocks - 1:
                assert result.token_ids == [] and result.finish_reason in (FinishReason.ABORT, None)
                continue
            assert result.token_ids == expected[:len(result.token_ids)]
            if result.finish_reason is not None:  # None: aborted by finish_requests (no update for that)
                ran_out_of_pool = len(spec.prompt) + len(result.token_ids) > capacity
                assert result.token_ids == expected or (ran_out_of_pool and
                                                        result.finish_reason is FinishReason.LENGTH)
            elif spec.abort_step is None:
                raise AssertionError(f"{request_id} never finished")
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert manager.num_free_swap_blocks == manager.num_usable_swap_blocks
    assert not scheduler.running and not scheduler.waiting and not scheduler.swapped and not scheduler.requests
