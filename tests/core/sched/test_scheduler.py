from __future__ import annotations

from typing import Any

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.request import FinishReason, Request, RequestStatus
from pagedllm.core.sched.output import RunnerOutput, SchedulerOutput
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.multimodal import ImageInput
from pagedllm.sampling_params import SamplingParams
from tests.core.sched.fakes import FakeRunner, Result, check_step, record, reference, run_steps

BLOCK_SIZE = 4


def _scheduler(num_blocks: int = 64, max_num_batched_tokens: int = 64, max_num_seqs: int = 8,
               max_model_len: int = 128, enable_caching: bool = True, chunked: bool = True) -> Scheduler:
    config = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=chunked)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching))


def _request(request_id: str, prompt: list[int] | int, max_tokens: int | None = 4, priority: int = 0,
             arrival_time: float = 0.0, eos_token_id: int | None = None, **params: Any) -> Request:
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_id=eos_token_id, arrival_time=arrival_time, priority=priority)


def _plan(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(s.request_id, s.num_new_tokens, s.sample) for s in out.scheduled]


def _step(scheduler: Scheduler, runner: FakeRunner, results: dict[str, Result]) -> SchedulerOutput:
    out = scheduler.schedule()
    check_step(scheduler, out)
    record(results, scheduler.update_from_output(out, runner.execute(out)))
    scheduler.kv_cache_manager.check_integrity()
    return out


def _all_free(scheduler: Scheduler) -> bool:
    manager = scheduler.kv_cache_manager
    return manager.num_free_blocks == manager.num_usable_blocks


def test_chunked_prefill_follows_the_token_budget() -> None:
    scheduler = _scheduler(max_num_batched_tokens=8)
    scheduler.add_request(_request("a", 20, max_tokens=3, arrival_time=0))
    scheduler.add_request(_request("b", list(range(200, 206)), max_tokens=2, arrival_time=1))
    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    assert [_plan(out) for out in outputs] == [
        [("a", 8, False)],
        [("a", 8, False)],
        [("a", 4, True), ("b", 4, False)],
        [("a", 1, True), ("b", 2, True)],
        [("a", 1, True), ("b", 1, True)],
    ]
    assert [n.request_id for n in outputs[2].new_requests] == ["b"]
    assert outputs[4].finished_request_ids == set() and "b" not in scheduler.requests
    assert results["a"].token_ids == reference(list(range(100, 120)), 3, None)
    assert results["a"].finish_reason is FinishReason.LENGTH and results["b"].finish_reason is FinishReason.LENGTH
    assert _all_free(scheduler) and scheduler.num_preemptions == 0


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room_for_all_of_it() -> None:
    """Chunked prefill off, a budget of 20 (a whole 20-token context): "a" runs whole, and "b" waits for the next
    step, where "c" (15 tokens) does not fit beside b's 6 and waits in turn: no prompt is ever cut."""
    scheduler = _scheduler(max_num_batched_tokens=20, max_model_len=20, chunked=False)
    scheduler.add_request(_request("a", 20, max_tokens=3, arrival_time=0))
    scheduler.add_request(_request("b", list(range(200, 206)), max_tokens=2, arrival_time=1))
    scheduler.add_request(_request("c", list(range(300, 315)), max_tokens=2, arrival_time=2))
    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    assert [_plan(out) for out in outputs][:3] == [
        [("a", 20, True)],          # the whole budget: b waits
        [("b", 6, True)],           # a ended at max_model_len (20 tokens), b runs whole; c's 15 do not fit beside
        [("b", 1, True), ("c", 15, True)],
    ]
    assert results["b"].token_ids == reference(list(range(200, 206)), 2, None)
    assert _all_free(scheduler) and all(n <= 20 for out in outputs for _, n, _ in _plan(out))


def test_without_chunked_prefill_the_budget_must_hold_a_whole_context() -> None:
    config = SchedulerConfig(max_model_len=64, max_num_batched_tokens=32, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) must be at least max_model_len \(64\)"):
        config.check_whole_prompts_fit()
    SchedulerConfig(max_model_len=64, max_num_batched_tokens=32).check_whole_prompts_fit()    # chunked: any budget


def test_finished_ids_reach_the_next_output() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 3, max_tokens=1))
    runner, results = FakeRunner(BLOCK_SIZE), dict[str, Result]()
    _step(scheduler, runner, results)
    assert not scheduler.has_unfinished_requests() and results["a"].finish_reason is FinishReason.LENGTH
    assert scheduler.schedule().finished_request_ids == {"a"}
    assert scheduler.schedule().finished_request_ids == set()


def test_max_num_seqs() -> None:
    scheduler = _scheduler(max_num_seqs=2)
    for i in range(5):
        scheduler.add_request(_request(f"r{i}", 5, max_tokens=3, arrival_time=i))
    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    assert max(len(out.scheduled) for out in outputs) == 2
    assert all(len(results[f"r{i}"].token_ids) == 3 for i in range(5))


@pytest.mark.parametrize("enable_caching", [True, False])
def test_preemption_in_a_tiny_pool_still_gives_the_same_tokens(enable_caching: bool) -> None:
    scheduler = _scheduler(num_blocks=9, enable_caching=enable_caching)  # 8 usable blocks = 32 tokens
    prompts = {f"r{i}": [i, 1, 2, 3, 4, 5] for i in range(4)}  # each grows to 16 tokens = 4 blocks
    for i, (request_id, prompt) in enumerate(prompts.items()):
        scheduler.add_request(_request(request_id, prompt, max_tokens=10, arrival_time=i))
    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    assert scheduler.num_preemptions > 0 and any(out.preempted_request_ids for out in outputs)
    for request_id, prompt in prompts.items():
        assert results[request_id].token_ids == reference(prompt, 10, None)
    assert _all_free(scheduler)


def test_no_admission_in_a_step_with_a_preemption() -> None:
    scheduler = _scheduler(num_blocks=5)  # 4 usable blocks
    scheduler.add_request(_request("a", 7, max_tokens=8, arrival_time=0))
    scheduler.add_request(_request("b", 7, max_tokens=8, arrival_time=1))
    runner, results = FakeRunner(BLOCK_SIZE), dict[str, Result]()
    _step(scheduler, runner, results)
    _step(scheduler, runner, results)
    scheduler.add_request(_request("c", 1, max_tokens=1, arrival_time=2))
    out = _step(scheduler, runner, results)  # a needs a 3rd block: b is preempted
    assert out.preempted_request_ids == {"b"} and _plan(out) == [("a", 1, True)]
    assert scheduler.requests["b"].status is RequestStatus.PREEMPTED
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


def test_victim_is_the_lowest_priority_even_if_already_scheduled() -> None:
    scheduler = _scheduler(num_blocks=5)  # 4 usable blocks
    scheduler.add_request(_request("low", 5, priority=5, arrival_time=0))
    runner, results = FakeRunner(BLOCK_SIZE), dict[str, Result]()
    assert _plan(_step(scheduler, runner, results)) == [("low", 5, True)]
    scheduler.add_request(_request("high", list(range(200, 207)), priority=0, arrival_time=1))
    assert _plan(_step(scheduler, runner, results)) == [("low", 1, True), ("high", 7, True)]
    assert _plan(_step(scheduler, runner, results)) == [("low", 1, True), ("high", 1, True)]
    # low's next token fits its block and is scheduled first; high then needs a 3rd block: low, the lower
    # priority, is the victim although it arrived first, and its token goes back to the budget.
    out = _step(scheduler, runner, results)
    assert _plan(out) == [("high", 1, True)] and out.preempted_request_ids == {"low"}
    assert out.num_batched_tokens == 1
    low = scheduler.requests["low"]
    assert low.status is RequestStatus.PREEMPTED and low.num_computed_tokens == 0 and low.num_preemptions == 1
    resumed = [n for out in run_steps(scheduler, runner, results) for n in out.new_requests]
    assert [(n.request_id, n.output_token_ids) for n in resumed] == [("low", results["low"].token_ids[:3])]
    assert results["low"].token_ids == reference(list(range(100, 105)), 4, None)
    assert results["high"].token_ids == reference(list(range(200, 207)), 4, None)


def test_priority_orders_admission() -> None:
    scheduler = _scheduler(max_num_seqs=1)
    for request_id, priority, arrival in [("a", 2, 0), ("b", 0, 1), ("c", 1, 2), ("d", 0, 3)]:
        scheduler.add_request(_request(request_id, 3, max_tokens=1, priority=priority, arrival_time=arrival))
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE), {})
    assert [out.scheduled[0].request_id for out in outputs] == ["b", "d", "c", "a"]


def test_abort_anywhere_frees_blocks() -> None:
    scheduler = _scheduler(max_num_seqs=1)
    scheduler.add_request(_request("run", 6, max_tokens=10, arrival_time=0))
    scheduler.add_request(_request("wait", 6, arrival_time=1))
    runner, results = FakeRunner(BLOCK_SIZE), dict[str, Result]()
    _step(scheduler, runner, results)
    assert scheduler.kv_cache_manager.get_block_ids("run") == [1, 2]
    scheduler.finish_requests(["run", "wait", "unknown"], FinishReason.ABORT)
    scheduler.finish_requests("run", FinishReason.ABORT)  # twice: ignored
    assert not scheduler.has_unfinished_requests() and _all_free(scheduler)
    assert scheduler.num_running == scheduler.num_waiting == 0
    assert scheduler.schedule().finished_request_ids == {"run", "wait"}


def test_abort_between_schedule_and_update() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 6))
    out = scheduler.schedule()
    res = FakeRunner(BLOCK_SIZE).execute(out)
    scheduler.finish_requests("a", FinishReason.ABORT)
    assert scheduler.update_from_output(out, res) == [] and _all_free(scheduler)


def test_request_that_can_never_fit_is_finished() -> None:
    scheduler = _scheduler(num_blocks=3)  # 2 usable blocks = 8 tokens
    scheduler.add_request(_request("huge", 9, arrival_time=0))
    scheduler.add_request(_request("grows", 8, max_tokens=5, arrival_time=1))
    results: dict[str, Result] = {}
    run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    assert results["huge"].finish_reason is FinishReason.ABORT and results["huge"].token_ids == []
    # The prompt fits, but after one generated token the request needs a third block that does not exist.
    assert results["grows"].finish_reason is FinishReason.LENGTH and len(results["grows"].token_ids) == 1
    assert _all_free(scheduler)


def test_add_request_validation() -> None:
    scheduler = _scheduler(max_model_len=8)
    scheduler.add_request(_request("a", 8))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(_request("a", 3))
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(_request("b", 9))
    with pytest.raises(ValueError):
        scheduler.add_request(_request("c", []))


@pytest.mark.parametrize(("script", "params", "expected", "reason", "stop_reason"), [
    ([5, 2, 7], {}, [5, 2], FinishReason.STOP, None),
    ([5, 2, 7], {"ignore_eos": True}, [5, 2, 7], FinishReason.LENGTH, None),
    ([2, 2, 7], {"min_tokens": 2}, [2, 2], FinishReason.STOP, None),
    ([5, 7, 8], {"stop_token_ids": [7]}, [5, 7], FinishReason.STOP, 7),
    ([7, 5, 8], {"stop_token_ids": [7], "min_tokens": 2}, [7, 5, 8], FinishReason.LENGTH, None),
])
def test_stop_conditions(script: list[int], params: dict[str, Any], expected: list[int],
                         reason: FinishReason, stop_reason: int | None) -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 3, max_tokens=3, eos_token_id=2, **params))
    results: dict[str, Result] = {}
    run_steps(scheduler, FakeRunner(BLOCK_SIZE, {"a": list(script)}), results)
    assert results["a"].token_ids == expected
    assert (results["a"].finish_reason, results["a"].stop_reason) == (reason, stop_reason)


def test_max_model_len_ends_with_length() -> None:
    scheduler = _scheduler(max_model_len=8)
    scheduler.add_request(_request("a", 6, max_tokens=None))
    scheduler.add_request(_request("full", 8, max_tokens=None))
    results: dict[str, Result] = {}
    run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    assert len(results["a"].token_ids) == 2 and results["a"].finish_reason is FinishReason.LENGTH
    assert len(results["full"].token_ids) == 1 and results["full"].finish_reason is FinishReason.LENGTH


def test_prefix_hit_is_scheduled_and_reported() -> None:
    scheduler, runner = _scheduler(), FakeRunner(BLOCK_SIZE)  # one runner: the KV of "a" stays in its slots
    prompt = list(range(12))
    scheduler.add_request(_request("a", prompt, max_tokens=2))
    results: dict[str, Result] = {}
    run_steps(scheduler, runner, results)
    scheduler.add_request(_request("b", prompt, max_tokens=2))
    outputs = run_steps(scheduler, runner, results)
    assert _plan(outputs[0]) == [("b", 4, True)] and outputs[0].scheduled[0].num_computed_tokens == 8
    assert results["b"].num_cached_tokens == 8 and results["b"].token_ids == results["a"].token_ids
    assert scheduler.kv_cache_manager.prefix_cache_stats.num_hit_tokens == 8


def test_empty_step() -> None:
    scheduler = _scheduler()
    out = scheduler.schedule()
    assert out.is_empty and out.num_batched_tokens == 0
    assert scheduler.update_from_output(out, RunnerOutput()) == []


def test_prefix_cache_queries_count_once_per_request_under_memory_pressure() -> None:
    scheduler = _scheduler(num_blocks=9)  # 8 usable blocks = 32 tokens
    prompts = {f"r{i}": [1, 2, 3, 4, i, 5, 6] for i in range(6)}  # 2 blocks each, the first one shared
    for i, (request_id, prompt) in enumerate(prompts.items()):
        scheduler.add_request(_request(request_id, prompt, max_tokens=10, arrival_time=i))
    manager = scheduler.kv_cache_manager
    lookups: list[str] = []
    get_computed_blocks = manager.get_computed_blocks
    manager.get_computed_blocks = lambda request: lookups.append(request.request_id) or get_computed_blocks(request)
    results: dict[str, Result] = {}
    run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    # Admissions failed for want of blocks, and recompute preemptions sent requests back to the queue...
    assert len(lookups) > len(prompts) + scheduler.num_preemptions > len(prompts)
    # ...yet each request's prompt was counted once, at its first admission, with the hit it got then.
    stats = manager.prefix_cache_stats
    assert stats.num_queries == len(prompts) and stats.num_query_tokens == 7 * len(prompts)
    assert stats.num_hit_tokens == sum(results[r].num_cached_tokens for r in prompts) > 0


def test_a_chunk_stops_before_an_image_the_encoder_budget_has_no_room_for() -> None:
    """Encoder budget 10 placeholders a step: a's chunk takes image 1 (8) and stops before image 2, b's before its
    image (6); b's image waits while a's images fill the budget; a's 16-placeholder image, bigger than the budget,
    runs as its step's first. Outputs as without a budget."""
    config = SchedulerConfig(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
                             max_num_encoder_input_tokens=10)
    scheduler = Scheduler(config, KVCacheManager(64, BLOCK_SIZE, True))
    a_images = (ImageInput(2, 8, "1", None), ImageInput(12, 8, "2", None), ImageInput(30, 16, "3", None))
    scheduler.add_request(Request("a", list(range(100, 150)), SamplingParams(max_tokens=2), arrival_time=0,
                                  images=a_images))
    scheduler.add_request(Request("b", list(range(200, 220)), SamplingParams(max_tokens=2), arrival_time=1,
                                  images=(ImageInput(4, 6, "4", None),)))
    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    assert [_plan(out) for out in outputs] == [
        [("a", 12, False), ("b", 4, False)],    # image 1; image 2 would make 16, b's 14
        [("a", 18, False)],                     # image 2 first; image 3 would make 16, b's 14
        [("a", 20, True)],                      # image 3 alone, over the budget
        [("a", 1, True), ("b", 16, True)],
        [("b", 1, True)],
    ]
    assert results["a"].token_ids == reference(list(range(100, 150)), 2, None)
    assert results["b"].token_ids == reference(list(range(200, 220)), 2, None)


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_long_prompt_takes_at_most_the_threshold_while_others_wait(adaptive: bool) -> None:
    """long_prefill_token_threshold 12 (vLLM's): while b waits, a's chunks stop at 12 and b's prompt starts in the
    first step; alone, a request takes the whole budget. Adaptive: at least budget / requests (64 / 2 = 32).
    Outputs as without a cap."""
    config = SchedulerConfig(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
                             long_prefill_token_threshold=12, long_prefill_token_threshold_adaptive=adaptive)
    scheduler = Scheduler(config, KVCacheManager(64, BLOCK_SIZE, True))
    scheduler.add_request(_request("a", 50, max_tokens=2, arrival_time=0))
    scheduler.add_request(_request("b", list(range(300, 320)), max_tokens=2, arrival_time=1))
    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    if adaptive:
        assert [_plan(out) for out in outputs] == [
            [("a", 32, False), ("b", 20, True)],
            [("a", 18, True), ("b", 1, True)],
            [("a", 1, True)],
        ]
    else:
        assert [_plan(out) for out in outputs] == [
            [("a", 12, False), ("b", 12, False)],
            [("a", 12, False), ("b", 8, True)],
            [("a", 12, False), ("b", 1, True)],
            [("a", 14, True)],                  # alone now: no cap
            [("a", 1, True)],
        ]
    assert results["a"].token_ids == reference(list(range(100, 150)), 2, None)
    assert results["b"].token_ids == reference(list(range(300, 320)), 2, None)
    alone = Scheduler(config, KVCacheManager(64, BLOCK_SIZE, True))
    alone.add_request(_request("a", 50, max_tokens=1))
    assert _plan(alone.schedule()) == [("a", 50, True)]
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)


@pytest.mark.parametrize("reserve_full", [True, False])
def test_a_long_prompt_waits_for_room_for_all_of_it(reserve_full: bool) -> None:
    """vLLM's scheduler_reserve_full_isl: a 32-token prompt (8 blocks) is admitted only once the free blocks hold
    all of it, not on its first chunk's one block while another request's blocks leave 7 free; off, it starts at
    once and its later chunks preempt the running request for their blocks."""
    config = SchedulerConfig(max_model_len=64, max_num_batched_tokens=8, scheduler_reserve_full_isl=reserve_full)
    scheduler = Scheduler(config, KVCacheManager(11, BLOCK_SIZE))      # 10 usable blocks
    scheduler.add_request(_request("a", 12, max_tokens=12, arrival_time=0))
    scheduler.add_request(_request("b", list(range(300, 332)), max_tokens=2, arrival_time=1))    # no prefix of a's
    runner, results = FakeRunner(BLOCK_SIZE), dict[str, Result]()
    assert _plan(_step(scheduler, runner, results)) == [("a", 8, False)]
    second = _step(scheduler, runner, results)
    assert _plan(second) == ([("a", 4, True)] if reserve_full else [("a", 4, True), ("b", 4, False)])
    outputs = run_steps(scheduler, runner, results)
    assert (scheduler.num_preemptions == 0) == reserve_full
    assert results["a"].token_ids == reference(list(range(100, 112)), 12, None)
    assert results["b"].token_ids == reference(list(range(300, 332)), 2, None)
    assert _all_free(scheduler) and outputs


def test_an_admission_leaves_the_watermark_free_while_others_run() -> None:
    config = SchedulerConfig(max_model_len=64, max_num_batched_tokens=64, watermark=0.5)
    scheduler = Scheduler(config, KVCacheManager(11, BLOCK_SIZE))      # 10 usable blocks, 5 kept free
    scheduler.add_request(_request("a", 24, max_tokens=4, arrival_time=0))  # alone: 6 blocks, past the watermark
    runner, results = FakeRunner(BLOCK_SIZE), dict[str, Result]()
    assert _plan(_step(scheduler, runner, results)) == [("a", 24, True)]
    scheduler.add_request(_request("big", 8, max_tokens=1, arrival_time=1))     # 2 blocks: 4 free, 2 + 5 > 4
    assert _plan(_step(scheduler, runner, results)) == [("a", 1, True)]
    run_steps(scheduler, runner, results)
    assert results["big"].token_ids == reference(list(range(100, 108)), 1, None)
    with pytest.raises(ValueError, match="watermark"):
        SchedulerConfig(watermark=1.0)


def test_the_whole_prompt_gate_counts_no_block_for_a_hit_on_running_blocks() -> None:
    """The 32-token prompt that starts with the running request's 12-token prompt (its last block cached as the step
    fills it) needs 5 more blocks, not 8: it fits in the 7 free ones and starts at once."""
    config = SchedulerConfig(max_model_len=64, max_num_batched_tokens=8)
    scheduler = Scheduler(config, KVCacheManager(11, BLOCK_SIZE))      # 10 usable blocks
    scheduler.add_request(_request("a", 12, max_tokens=12, arrival_time=0))
    scheduler.add_request(_request("b", 32, max_tokens=2, arrival_time=1))     # a's first 12 tokens, then more
    runner, results = FakeRunner(BLOCK_SIZE), dict[str, Result]()
    _step(scheduler, runner, results)
    second = _step(scheduler, runner, results)
    assert _plan(second) == [("a", 4, True), ("b", 4, False)] and scheduler.requests["b"].num_cached_tokens == 12


def test_max_num_active_seqs_caps_the_running_below_max_num_seqs() -> None:
    config = SchedulerConfig(max_model_len=64, max_num_seqs=8, max_num_active_seqs=2)
    scheduler = Scheduler(config, KVCacheManager(64, BLOCK_SIZE))
    for i in range(4):
        scheduler.add_request(_request(f"r{i}", 4, max_tokens=2, arrival_time=i))
    runner, results = FakeRunner(BLOCK_SIZE), dict[str, Result]()
    outputs = run_steps(scheduler, runner, results)
    assert max(len(out.scheduled) for out in outputs) == 2 and len(results) == 4
    with pytest.raises(ValueError, match="more than the sequences that may run at once"):
        scheduler.add_request(_request("wide", 4, n=3))
    with pytest.raises(ValueError, match="max_num_active_seqs"):
        SchedulerConfig(max_num_seqs=4, max_num_active_seqs=5)
