"""Parallel sampling (forks, copy-on-write), swap and auto preemption, priorities with swapped requests, and
the beam-search hooks, on the model-free FakeRunner."""

from __future__ import annotations

import dataclasses

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.request import FinishReason, Request, RequestStatus, child_request_id, child_seed
from pagedllm.core.sched.output import RunnerOutput
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from tests.core.sched.fakes import FakeRunner, Result, check_step, record, reference, run_steps

BLOCK_SIZE = 4


def _scheduler(num_blocks: int = 64, num_swap_blocks: int = 0, mode: str = "recompute", max_num_seqs: int = 8,
               max_num_batched_tokens: int = 64, **costs: float) -> Scheduler:
    config = SchedulerConfig(max_model_len=128, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, preemption_mode=mode, **costs)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, num_swap_blocks=num_swap_blocks))


def _all_free(scheduler: Scheduler) -> bool:
    manager = scheduler.kv_cache_manager
    return (manager.num_free_blocks == manager.num_usable_blocks
            and manager.num_free_swap_blocks == manager.num_usable_swap_blocks)


def test_child_seeds_are_derived_and_stable() -> None:
    assert child_seed(None, 3) is None and child_seed(7, 0) == 7
    seeds = {child_seed(7, i) for i in range(1, 50)} | {child_seed(8, i) for i in range(1, 50)}
    assert len(seeds) == 98 and all(0 <= s < 2**63 for s in seeds)
    # Pinned: a changed derivation would change every seeded n > 1 output.
    assert (child_seed(7, 1), child_seed(7, 2), child_seed(8, 1)) == (
        8483367915304847654, 3068249057399463944, 4313483211066685641)
    assert child_request_id("r", 2) == "r#2"


def test_n4_shares_the_prompt_blocks_and_copies_only_the_partial_one() -> None:
    scheduler = _scheduler()
    manager = scheduler.kv_cache_manager
    prompt = list(range(100, 110))                                  # 2 full blocks + 2 tokens
    scheduler.add_request(Request("p", prompt, SamplingParams(n=4, max_tokens=6)))
    runner, results = FakeRunner(BLOCK_SIZE), dict[str, Result]()

    out = scheduler.schedule()
    assert out.scheduled[0].child_request_ids == ["p#1", "p#2", "p#3"]
    record(results, scheduler.update_from_output(out, runner.execute(out)))
    ids = ["p", "p#1", "p#2", "p#3"]
    assert [scheduler.requests[i].index for i in ids] == [0, 1, 2, 3]
    # The prompt's 3 blocks are held once, by all four tables.
    tables = [manager.get_block_ids(i) for i in ids]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 3
    assert manager.get_ref_counts("p") == [4, 4, 4]
    assert manager.num_free_blocks == manager.num_usable_blocks - 3
    manager.check_integrity()

    out = scheduler.schedule()
    check_step(scheduler, out)
    assert [s.child_request_ids for s in out.scheduled] == [[]] * 4
    # Three writers copy the partial block; the last one writes in place. Full blocks are never copied.
    shared = tables[0][2]
    assert len(out.blocks_to_copy) == 3 and all(src == shared for src, _ in out.blocks_to_copy)
    record(results, scheduler.update_from_output(out, runner.execute(out)))
    assert [manager.get_block_ids(i)[:2] for i in ids] == [tables[0][:2]] * 4
    assert len({manager.get_block_ids(i)[2] for i in ids}) == 4
    assert manager.num_free_blocks == manager.num_usable_blocks - 2 - 4

    run_steps(scheduler, runner, results)
    for index, request_id in enumerate(ids):
        assert results[request_id].token_ids == reference(prompt, 6, None, index)
    assert _all_free(scheduler)


def test_n_counts_against_max_num_seqs() -> None:
    scheduler = _scheduler(max_num_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        scheduler.add_request(Request("big", [1, 2], SamplingParams(n=5)))
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(n=3, max_tokens=3), arrival_time=0))
    scheduler.add_request(Request("b", [4, 5, 6], SamplingParams(n=2, max_tokens=3), arrival_time=1))
    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    assert [s.request_id for s in outputs[0].scheduled] == ["a"]       # b would need 2 more seats than are left
    assert set(results) == {"a", "a#1", "a#2", "b", "b#1"} and _all_free(scheduler)


def test_stop_and_abort_of_children() -> None:
    prompt = [7, 8, 9]
    first_of_child_2 = reference(prompt, 1, None, 2)[0]
    scheduler = _scheduler()
    scheduler.add_request(Request("p", prompt, SamplingParams(n=3, max_tokens=5, stop_token_ids=[first_of_child_2])))
    runner, results = FakeRunner(BLOCK_SIZE), dict[str, Result]()
    out = scheduler.schedule()
    record(results, scheduler.update_from_output(out, runner.execute(out)))
    assert results["p#2"].finish_reason is FinishReason.STOP and "p#2" not in scheduler.requests
    scheduler.finish_requests("p#1", FinishReason.ABORT)
    run_steps(scheduler, runner, results)
    assert results["p"].token_ids == reference(prompt, 5, None) and _all_free(scheduler)


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_preemption_in_a_tiny_pool_gives_the_same_tokens(mode: str) -> None:
    scheduler = _scheduler(num_blocks=9, num_swap_blocks=16, mode=mode, swap_seconds_per_block=1.0,
                           recompute_seconds_per_token=1.0)        # auto: swapping 1 block < 4 tokens
    prompts = {f"r{i}": [i, 1, 2, 3, 4, 5] for i in range(4)}      # each grows to 16 tokens = 4 blocks
    for i, (request_id, prompt) in enumerate(prompts.items()):
        scheduler.add_request(Request(request_id, prompt, SamplingParams(max_tokens=10), arrival_time=i))
    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    assert scheduler.num_preemptions_by_mode == {"recompute": 0, "swap": 2}
    assert any(out.blocks_to_swap_out for out in outputs) and any(out.blocks_to_swap_in for out in outputs)
    for request_id, prompt in prompts.items():
        assert results[request_id].token_ids == reference(prompt, 10, None)
    assert _all_free(scheduler) and scheduler.num_swapped == 0


def test_auto_recomputes_when_recompute_is_cheaper() -> None:
    scheduler = _scheduler(num_blocks=9, num_swap_blocks=16, mode="auto", swap_seconds_per_block=10.0,
                           recompute_seconds_per_token=1.0)
    for i in range(4):
        scheduler.add_request(Request(f"r{i}", [i, 1, 2, 3, 4, 5], SamplingParams(max_tokens=10), arrival_time=i))
    run_steps(scheduler, FakeRunner(BLOCK_SIZE), {})
    assert scheduler.num_preemptions_by_mode == {"recompute": 2, "swap": 0} and scheduler.num_preemptions == 2


def test_a_full_swap_pool_falls_back_to_recompute() -> None:
    scheduler = _scheduler(num_blocks=9, num_swap_blocks=3, mode="swap")   # room for 2 blocks only
    prompts = {f"r{i}": [i, 1, 2, 3, 4, 5] for i in range(4)}
    for i, (request_id, prompt) in enumerate(prompts.items()):
        scheduler.add_request(Request(request_id, prompt, SamplingParams(max_tokens=10), arrival_time=i))
    results: dict[str, Result] = {}
    run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    assert scheduler.num_preemptions_by_mode == {"recompute": 1, "swap": 1}   # no room left for the other
    assert all(results[r].token_ids == reference(p, 10, None) for r, p in prompts.items()) and _all_free(scheduler)


@pytest.mark.parametrize("new_priority", [2, -5])
def test_swapped_requests_come_back_before_waiting_ones_of_no_higher_priority(new_priority: int) -> None:
    scheduler = _scheduler(num_blocks=7, num_swap_blocks=16, mode="swap", max_num_batched_tokens=64)
    runner, results = FakeRunner(BLOCK_SIZE), dict[str, Result]()
    # Three requests of 8 prompt tokens (2 blocks each) fill 6 blocks; each needs a 3rd block at its 9th token.
    for i, priority in enumerate([0, 2, 1]):
        scheduler.add_request(Request(f"r{i}", list(range(10 * i, 10 * i + 8)), SamplingParams(max_tokens=3),
                                      arrival_time=i, priority=priority))
    out = scheduler.schedule()
    record(results, scheduler.update_from_output(out, runner.execute(out)))
    out = scheduler.schedule()                                     # r0 needs a block: r1 (priority 2) swaps out
    check_step(scheduler, out)
    assert out.preempted_request_ids == {"r1"} and scheduler.requests["r1"].status is RequestStatus.SWAPPED
    assert len(out.blocks_to_swap_out) == 2
    record(results, scheduler.update_from_output(out, runner.execute(out)))
    scheduler.add_request(Request("new", [1, 2], SamplingParams(max_tokens=1), arrival_time=9,
                                  priority=new_priority))
    outputs = run_steps(scheduler, runner, results)
    first_step = {r: min(i for i, o in enumerate(outputs) if r in {n.request_id for n in o.new_requests})
                  for r in ("r1", "new")}
    # (step, place in the step's batch) at which each starts: r1 is swapped back in first unless "new" has a
    # strictly higher priority, which skips the swapped requests as it skips the waiting ones
    starts = {r: (step, [s.request_id for s in outputs[step].scheduled].index(r)) for r, step in first_step.items()}
    assert (starts["r1"] < starts["new"]) == (new_priority >= 2), starts
    assert outputs[first_step["r1"]].blocks_to_swap_in
    for i in range(3):
        assert results[f"r{i}"].token_ids == reference(list(range(10 * i, 10 * i + 8)), 3, None)
    assert _all_free(scheduler)


def test_victims_are_the_lowest_priority_latest_arrival_among_forks_too() -> None:
    scheduler = _scheduler(num_blocks=6, num_swap_blocks=32, mode="swap")
    scheduler.add_request(Request("hi", list(range(6)), SamplingParams(max_tokens=12), priority=0))
    scheduler.add_request(Request("lo", list(range(50, 56)), SamplingParams(n=2, max_tokens=12), priority=1))
    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    preempted = set().union(*(out.preempted_request_ids for out in outputs))
    assert preempted and "hi" not in preempted
    assert results["hi"].token_ids == reference(list(range(6)), 12, None)
    assert results["lo#1"].token_ids == reference(list(range(50, 56)), 12, None, 1) and _all_free(scheduler)


def test_beam_hooks_fork_append_and_finish() -> None:
    scheduler = _scheduler()
    manager = scheduler.kv_cache_manager
    scheduler.add_request(Request("b0", list(range(6)), SamplingParams(max_tokens=8), group_size=2,
                                  engine_appends_tokens=True))
    out = scheduler.schedule()
    updates = scheduler.update_from_output(out, RunnerOutput({"b0": 99}, {"b0": ["logprobs"]}))
    assert [(u.request_id, u.new_token_ids, u.new_logprobs) for u in updates] == [("b0", [], ["logprobs"])]
    assert scheduler.requests["b0"].output_token_ids == []          # the engine picks the token
    assert scheduler.schedule().scheduled == []                     # b0 waits for its token
    scheduler.update_from_output(scheduler.schedule(), RunnerOutput())
    scheduler.fork_request("b0", "b1", 11)
    scheduler.append_token("b0", 10)
    assert manager.get_ref_counts("b1") == [2, 2]
    out = scheduler.schedule()
    check_step(scheduler, out)
    assert [n.request_id for n in out.new_requests] == ["b1"] and len(out.blocks_to_copy) == 1
    assert [(s.request_id, s.token_ids) for s in out.scheduled] == [("b0", [10]), ("b1", [11])]
    scheduler.update_from_output(out, RunnerOutput())
    scheduler.finish_requests(["b0", "b1"], FinishReason.ABORT)
    assert _all_free(scheduler)


def _shared_prefix_batch(scheduler: Scheduler) -> dict[str, list[int]]:
    shared = list(range(100, 109))                  # 2 full blocks + 1 token
    prompts = {"a": shared + [1, 2, 3], "b": shared + [4, 5], "c": shared + [6]}
    for name, prompt in prompts.items():
        scheduler.add_request(Request(name, prompt, SamplingParams(max_tokens=5, ignore_eos=True)))
    return prompts


def test_requests_admitted_in_one_step_hit_the_blocks_that_step_computes() -> None:
    """A block is cached when its step is planned (as vLLM caches at allocation): b and c, admitted in a's step,
    hit the shared prefix's full blocks that step computes, and read them in the same pass (the fake runner writes
    a's slots before it reads theirs)."""
    scheduler = _scheduler()
    manager = scheduler.kv_cache_manager
    prompts = _shared_prefix_batch(scheduler)
    runner, results = FakeRunner(BLOCK_SIZE), dict[str, Result]()
    out = scheduler.schedule()
    check_step(scheduler, out)
    tables = {name: manager.get_block_ids(name) for name in prompts}
    assert tables["a"][:2] == tables["b"][:2] == tables["c"][:2]    # the prefix's two full blocks, held once
    assert [(s.request_id, s.num_computed_tokens) for s in out.scheduled] == [("a", 0), ("b", 8), ("c", 8)]
    assert manager.get_ref_counts("a")[:2] == [3, 3]
    record(results, scheduler.update_from_output(out, runner.execute(out)))
    run_steps(scheduler, runner, results)
    for name, prompt in prompts.items():
        assert results[name].token_ids == reference(prompt, 5, None)
    assert [results[name].num_cached_tokens for name in prompts] == [0, 8, 8]
    assert _all_free(scheduler)


def test_a_failed_step_takes_back_its_blocks_cached_ahead_and_requeues_their_readers() -> None:
    """When a step raises, the blocks it cached ahead may hold nothing: their hashes go, the requests that hit
    them wait again and recompute, and the writers offer their blocks again once a step computed them."""
    scheduler = _scheduler()
    manager = scheduler.kv_cache_manager
    prompts = _shared_prefix_batch(scheduler)
    out = scheduler.schedule()
    assert scheduler.undo_step_sharing(out.scheduled) == {"b", "c"}
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"] and scheduler.requests["b"].num_computed_tokens == 0
    assert manager.get_ref_counts("a") == [1, 1, 1] and not manager.get_block_ids("b")
    fresh = Request("probe", prompts["a"], SamplingParams(max_tokens=1))
    assert manager.get_computed_blocks(fresh).num_computed_tokens == 0      # no hash of an unsure block is left
    manager.check_integrity()
    # the step's other requests run again (here: a alone) and a's blocks are cached once it computed them
    runner, results = FakeRunner(BLOCK_SIZE), dict[str, Result]()
    rerun = dataclasses.replace(out, scheduled=[s for s in out.scheduled if s.request_id == "a"])
    record(results, scheduler.update_from_output(rerun, runner.execute(rerun)))
    assert manager.get_computed_blocks(fresh).num_computed_tokens == 8
    run_steps(scheduler, runner, results)
    for name, prompt in prompts.items():
        assert results[name].token_ids == reference(prompt, 5, None)
    assert manager.prefix_cache_stats.num_queries == 3          # b and c counted once, not again when requeued
    assert _all_free(scheduler)
