"""Speculative decoding in the scheduler, on the model-free FakeRunner: drafts are verified by reading their K/V
back through the block tables, so a rollback that counted a rejected slot, or a prefix-cache block hashed over a
draft, changes the tokens. Every step is checked (`check_step`, `check_integrity`)."""

from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.request import FinishReason, Request
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from tests.core.sched.fakes import FakeRunner, Result, next_token, reference, run_steps

BLOCK_SIZE = 4
K = 3


def oracle_drafts(token_ids: list[int], max_num_tokens: int) -> list[int]:
    """Up to K drafts: the fake model's true continuation for a length-dependent number of tokens (0..K), then
    a wrong token, so that full, partial and no acceptance all happen."""
    num_tokens = min(K, max_num_tokens)
    num_right = sum(token_ids) % (K + 1)
    context, drafts = list(token_ids), []
    while len(drafts) < num_tokens:
        token = next_token(tuple(context))
        if len(drafts) >= num_right:
            token = (token + 1) % 50
        drafts.append(token)
        context.append(token)
    return drafts


def _scheduler(num_blocks: int = 64, caching: bool = True, max_num_batched_tokens: int = 64,
               max_model_len: int = 128, draft_model: bool = False) -> Scheduler:
    """n-gram-like drafts from `oracle_drafts` at scheduling time; with `draft_model`, from the runner (a
    `FakeRunner(drafter=oracle_drafts)`) after each sampled step, into K lookahead slots."""
    config = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=8,
                             max_num_batched_tokens=max_num_batched_tokens)
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=caching)
    if draft_model:
        return Scheduler(config, kv, num_lookahead_tokens=K)
    return Scheduler(config, kv, oracle_drafts)


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 31 + i * 7) % 50 for i in range(length)]


@pytest.mark.parametrize("num_blocks,caching", [(64, True), (64, False), (12, True), (12, False)])
def test_drafts_give_the_reference_tokens_with_preemption_and_caching(num_blocks: int, caching: bool) -> None:
    scheduler = _scheduler(num_blocks, caching)
    prompts = {f"r{i}": _prompt(i, 5 + 3 * i) for i in range(5)}
    for request_id, prompt in prompts.items():
        scheduler.add_request(Request(request_id, prompt, SamplingParams(max_tokens=17, ignore_eos=True)))
    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    for request_id, prompt in prompts.items():
        assert results[request_id].token_ids == reference(prompt, 17, None)
        assert results[request_id].finish_reason is FinishReason.LENGTH
    assert any(s.spec_token_ids for out in outputs for s in out.scheduled)
    if num_blocks == 12:
        assert scheduler.num_preemptions > 0
    stats = scheduler.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_draft_tokens == sum(len(s.spec_token_ids) for out in outputs for s in out.scheduled)
    assert stats.num_accepted_tokens_per_pos[0] >= stats.num_accepted_tokens_per_pos[-1] > 0


def test_prefix_cache_holds_only_accepted_tokens() -> None:
    """A second request whose prompt is the first one's whole sequence hits the blocks the first one filled
    while speculating: were a rejected draft hashed into them, the fake model would read it and diverge."""
    scheduler = _scheduler()
    prompt = _prompt(1, 6)
    scheduler.add_request(Request("a", prompt, SamplingParams(max_tokens=21, ignore_eos=True)))
    results: dict[str, Result] = {}
    runner = FakeRunner(BLOCK_SIZE)
    run_steps(scheduler, runner, results)
    assert scheduler.spec_decoding_stats.num_accepted_tokens < scheduler.spec_decoding_stats.num_draft_tokens
    sequence = prompt + results["a"].token_ids                     # 27 tokens: 6 full blocks
    scheduler.add_request(Request("b", sequence, SamplingParams(max_tokens=9, ignore_eos=True)))
    run_steps(scheduler, runner, results)
    assert results["b"].num_cached_tokens == 24
    assert results["b"].token_ids == reference(sequence, 9, None)


def test_drafts_stay_within_max_tokens_max_model_len_and_the_budget() -> None:
    scheduler = _scheduler(max_num_batched_tokens=3, max_model_len=20)
    scheduler.add_request(Request("a", _prompt(2, 4), SamplingParams(max_tokens=9, ignore_eos=True)))
    scheduler.add_request(Request("b", _prompt(3, 10), SamplingParams(max_tokens=None, ignore_eos=True)))
    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    assert results["a"].token_ids == reference(_prompt(2, 4), 9, None)
    assert results["b"].token_ids == reference(_prompt(3, 10), 10, None)       # up to max_model_len
    assert any(s.spec_token_ids for out in outputs for s in out.scheduled)
    for out in outputs:
        assert out.num_batched_tokens <= 3
        for s in out.scheduled:
            end = s.num_computed_tokens + s.num_new_tokens
            assert end <= 20 and (s.request_id != "a" or end + 1 <= 4 + 9)


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size() -> None:
    """max_batch_for_drafts=2: with three requests running no step carries drafts; once one has finished, the
    two left get them again. The tokens are the reference's either way."""
    scheduler = _scheduler()
    scheduler.max_batch_for_drafts = 2
    lengths = {"a": 3, "b": 12, "c": 12}
    for i, (request_id, max_tokens) in enumerate(lengths.items()):
        scheduler.add_request(Request(request_id, _prompt(i, 5), SamplingParams(max_tokens=max_tokens,
                                                                                ignore_eos=True)))
    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    for i, (request_id, max_tokens) in enumerate(lengths.items()):
        assert results[request_id].token_ids == reference(_prompt(i, 5), max_tokens, None)
    drafted = [any(s.spec_token_ids for s in out.scheduled) for out in outputs]
    three_running = [len(out.scheduled) == 3 for out in outputs]
    assert any(three_running) and not any(d and t for d, t in zip(drafted, three_running))
    assert any(drafted)                # after "a" finished


def test_drafts_without_free_blocks_are_dropped_not_preempted_for() -> None:
    """A request that fills the pool: drafts would need a fifth block. Were they allocated by preempting, the
    request would preempt itself and recompute everything at each token; it runs without them, and is preempted
    once, when its next token no longer fits, to end at the pool's size."""
    scheduler = _scheduler(num_blocks=5)                           # 4 usable blocks: 16 slots
    prompt = _prompt(6, 14)
    scheduler.add_request(Request("a", prompt, SamplingParams(max_tokens=None, ignore_eos=True)))
    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE), results, max_steps=20)
    assert results["a"].token_ids == reference(prompt, 3, None)
    assert results["a"].finish_reason is FinishReason.LENGTH
    assert not any(s.spec_token_ids for out in outputs for s in out.scheduled)
    assert scheduler.num_preemptions == 1


def test_eos_inside_an_accepted_run_truncates_there() -> None:
    prompt = _prompt(4, 7)
    expected = reference(prompt, 30, None)
    eos = expected[5]
    first = expected.index(eos)
    scheduler = _scheduler()
    scheduler.add_request(Request("a", prompt, SamplingParams(max_tokens=30), eos_token_id=eos))
    results: dict[str, Result] = {}
    run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    assert results["a"].token_ids == expected[:first + 1]
    assert results["a"].finish_reason is FinishReason.STOP


def test_parallel_sampling_children_speculate_after_the_fork() -> None:
    scheduler = _scheduler()
    prompt = _prompt(5, 9)
    scheduler.add_request(Request("p", prompt, SamplingParams(n=3, max_tokens=12, ignore_eos=True)))
    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE), results)
    assert not outputs[0].scheduled[0].spec_token_ids
    for index, request_id in enumerate(["p", "p#1", "p#2"]):
        assert results[request_id].token_ids == reference(prompt, 12, None, index)
    assert {s.request_id for out in outputs for s in out.scheduled if s.spec_token_ids} >= {"p#1", "p#2"}


@pytest.mark.parametrize("num_blocks,caching,max_num_batched_tokens",
                         [(64, True, 64), (64, False, 64), (12, True, 64), (12, False, 64), (64, True, 8)])
def test_draft_model_drafts_give_the_reference_tokens(num_blocks: int, caching: bool,
                                                      max_num_batched_tokens: int) -> None:
    """Drafts from the runner: each sampled step asks for K of them, with room for their K/V past the step's
    tokens (checked each step, and written there by the fake drafter); the next step verifies them. The tokens
    are the reference's through preemptions, prefix hits and chunked prompts."""
    scheduler = _scheduler(num_blocks, caching, max_num_batched_tokens, draft_model=True)
    prompts = {f"r{i}": _prompt(i, 5 + 3 * i) for i in range(5)}
    for request_id, prompt in prompts.items():
        scheduler.add_request(Request(request_id, prompt, SamplingParams(max_tokens=17, ignore_eos=True)))
    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE, drafter=oracle_drafts), results)
    for request_id, prompt in prompts.items():
        assert results[request_id].token_ids == reference(prompt, 17, None)
    assert any(s.num_lookahead_tokens == K for out in outputs for s in out.scheduled)
    stats = scheduler.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if num_blocks == 12:
        assert scheduler.num_preemptions > 0


def test_draft_model_lookahead_only_from_free_blocks() -> None:
    """A request that fills the pool gets no lookahead slots (and so no drafts) rather than a preemption: it is
    preempted once, only when its next token no longer fits."""
    scheduler = _scheduler(num_blocks=5, draft_model=True)                 # 4 usable blocks: 16 slots
    prompt = _prompt(6, 14)
    scheduler.add_request(Request("a", prompt, SamplingParams(max_tokens=None, ignore_eos=True)))
    results: dict[str, Result] = {}
    outputs = run_steps(scheduler, FakeRunner(BLOCK_SIZE, drafter=oracle_drafts), results, max_steps=20)
    assert results["a"].token_ids == reference(prompt, 3, None)
    assert not any(s.num_lookahead_tokens for out in outputs for s in out.scheduled)
    assert scheduler.num_preemptions == 1


def test_no_lookahead_for_structured_outputs_beams_or_the_last_token() -> None:
    scheduler = _scheduler(draft_model=True)
    scheduler.add_request(Request("json", _prompt(1, 5), SamplingParams(max_tokens=9, structured_outputs=
                                                                        StructuredOutputsParams(json={}))))
    scheduler.add_request(Request("beam", _prompt(2, 5), SamplingParams(max_tokens=9), engine_appends_tokens=True))
    scheduler.add_request(Request("one", _prompt(3, 5), SamplingParams(max_tokens=1)))
    scheduler.add_request(Request("two", _prompt(4, 5), SamplingParams(max_tokens=3)))
    out = scheduler.schedule()
    assert {s.request_id: s.num_lookahead_tokens for s in out.scheduled} == {"json": 0, "beam": 0, "one": 0,
                                                                              "two": K}
