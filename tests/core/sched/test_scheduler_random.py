"""Random workloads: arrivals, prompt lengths (with shared prefixes), priorities and aborts, on pools from tiny
to roomy. Every step is checked (budget, max_num_seqs, block tables, integrity); at the end every request
has exactly the tokens an uncached, never-preempted run gives, and every block is free."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache.manager import KVCacheManager, cdiv
from pagedllm.core.request import FinishReason, Request
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from tests.core.sched.fakes import FakeRunner, Result, reference, run_steps

EOS = 3


@dataclass
class Spec:
    prompt: list[int]
    max_tokens: int
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
    priority=st.integers(0, 2),
    arrival_step=st.integers(0, 15),
    abort_step=st.none() | st.integers(0, 30),
), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(specs=specs_strategy, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(4, 24),
       max_num_batched_tokens=st.integers(1, 24), max_num_seqs=st.integers(1, 4), enable_caching=st.booleans())
def test_random_workloads(specs: list[Spec], block_size: int, num_blocks: int, max_num_batched_tokens: int,
                          max_num_seqs: int, enable_caching: bool) -> None:
    config = SchedulerConfig(max_model_len=32, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens)
    scheduler = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching))
    capacity = (num_blocks - 1) * block_size  # tokens the whole pool holds

    def before_step(step: int) -> bool:
        for i, spec in enumerate(specs):
            if spec.arrival_step == step:
                scheduler.add_request(Request(f"r{i}", spec.prompt, SamplingParams(max_tokens=spec.max_tokens),
                                              eos_token_id=EOS, arrival_time=float(step), priority=spec.priority))
            if spec.abort_step == step:
                scheduler.finish_requests(f"r{i}", FinishReason.ABORT)
        return step < 31

    results: dict[str, Result] = {}
    run_steps(scheduler, FakeRunner(block_size), results, before_step)
    for i, spec in enumerate(specs):
        result = results.get(f"r{i}", Result())
        expected = reference(spec.prompt, spec.max_tokens, EOS)
        if cdiv(len(spec.prompt), block_size) > num_blocks - 1:
            assert result.token_ids == [] and result.finish_reason in (FinishReason.ABORT, None)
            continue
        assert result.token_ids == expected[:len(result.token_ids)]
        if result.finish_reason is not None:  # None: aborted by finish_requests (no update for that)
            ran_out_of_pool = len(spec.prompt) + len(result.token_ids) > capacity
            assert result.token_ids == expected or (ran_out_of_pool and result.finish_reason is FinishReason.LENGTH)
        elif spec.abort_step is None:
            raise AssertionError(f"r{i} never finished")
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert not scheduler.running and not scheduler.waiting and not scheduler.requests
