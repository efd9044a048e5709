"""vLLM's sleep mode offline (LLM.sleep, wake_up, release_kv_cache_memory): levels, tags and the modes for the
requests not finished, on a tiny random Llama (tests/distributed: on two ranks)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, RequestOutput, SamplingParams
from tests.models.tiny import save_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = ["hello there, a prompt of several blocks", "and another one"]


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", block_size=4, num_kv_blocks=64)


@pytest.fixture(scope="module")
def expected(llm) -> list[list[int]]:
    return _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_level_1_releases_the_kv_pool_and_generate_waits_for_wake_up(llm, expected):
    engine = llm.llm_engine
    llm.sleep()
    assert engine.is_sleeping() and engine.runner.kv is None and engine.runner.kv_caches == []
    with pytest.raises(RuntimeError, match="asleep .* generate runs its prompts: call wake_up"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.embed(PROMPTS, use_tqdm=False)
    assert not engine.has_unfinished_requests(), "a refused call leaves nothing queued"
    assert llm.wake_up() and not engine.is_sleeping() and engine.runner.kv is not None
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(again) == expected
    assert [o.num_cached_tokens for o in again] == [0, 0], "the prefix cache was emptied with the pool"
    # what wake_up names: scheduling alone leaves the pool released, and the engine asleep
    llm.sleep(level=2)
    assert not llm.wake_up(["scheduling"]) and engine.is_sleeping()
    assert llm.wake_up(["weights", "kv_cache"]) and not engine.is_sleeping()


def test_level_0_takes_queued_requests_and_runs_them_after_wake_up(llm, expected):
    """vLLM's recipe for queueing a whole batch before any runs: sleep(0), enqueue, wake_up(["scheduling"])."""
    llm.sleep(level=0)
    queued = llm.enqueue(PROMPTS, GREEDY)
    assert llm.llm_engine.step() == [] and llm.llm_engine.get_num_unfinished_requests() == 2
    with pytest.raises(RuntimeError, match="asleep .* wait_for_completion runs the queued requests"):
        llm.wait_for_completion()
    assert llm.wake_up(["scheduling"])
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == queued and _tokens(outputs) == expected
    # release_kv_cache_memory: from a level-0 sleep only
    with pytest.raises(RuntimeError, match=r"sleep\(level=0\) first"):
        llm.release_kv_cache_memory()
    llm.sleep(level=0)
    llm.release_kv_cache_memory()
    assert llm.llm_engine.runner.kv is None
    assert llm.wake_up(["kv_cache"]) and _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_each_mode_answers_every_request(llm, expected, mode):
    """Requests caught mid-run: "abort" ends them, "wait" finishes them first, "keep" recomputes them after
    wake_up; wait_for_completion answers each."""
    engine = llm.llm_engine
    llm.enqueue(PROMPTS, GREEDY)
    assert engine.step() == [] and engine.step() == []     # prefilled, one token each: running, not finished
    assert engine.scheduler.num_running == 2
    llm.sleep(level=1, mode=mode)
    assert engine.scheduler.num_running == 0 and engine.runner.kv is None
    assert engine.get_num_unfinished_requests() == (2 if mode == "keep" else 0)
    assert llm.wake_up()
    outputs = llm.wait_for_completion(use_tqdm=False)
    if mode == "abort":
        assert [o.outputs[0].finish_reason for o in outputs] == ["abort", "abort"]
        assert all(0 < len(tokens) < GREEDY.max_tokens for tokens in _tokens(outputs))
    else:
        assert _tokens(outputs) == expected
    engine.kv_cache_manager.check_integrity()
    assert engine.scheduler.num_preemptions == 0, "a sleep is not counted as a preemption"


def test_bad_arguments_are_refused_before_anything_changes(llm):
    with pytest.raises(ValueError, match=r"sleep level must be one of \(0, 1, 2\), got 3"):
        llm.sleep(3)
    with pytest.raises(ValueError, match="sleep mode must be one of .*'later'"):
        llm.sleep(mode="later")
    with pytest.raises(ValueError, match=r"wake_up tags are among .*\['gpu'\]"):
        llm.wake_up(["gpu"])
    assert not llm.llm_engine.is_sleeping()


def test_a_hybrids_kept_requests_start_their_recurrent_states_again(tmp_path):
    """Granite 4's Mamba-2 layers: a request kept over a level-1 sleep leaves its recurrent state's slot, and its
    recompute after wake_up gives the tokens it gives awake."""
    folder, _ = save_tiny_model(tmp_path / "m", "granite4-hybrid-dense", seed=3)
    with LLM(str(folder), dtype="float32", block_size=4, num_kv_blocks=64) as hybrid:
        awake = _tokens(hybrid.generate(PROMPTS, GREEDY, use_tqdm=False))
        hybrid.enqueue(PROMPTS, GREEDY)
        engine = hybrid.llm_engine
        assert engine.step() == [] and engine.step() == [] and engine.scheduler.num_running == 2
        hybrid.sleep(mode="keep")
        assert engine.runner.recurrent.pairs == {}, "a waiting request holds no slots"
        assert hybrid.wake_up() and _tokens(hybrid.wait_for_completion(use_tqdm=False)) == awake


def test_reset_prefix_cache_may_requeue_the_running_requests(llm, expected):
    """vLLM's reset_prefix_cache(reset_running_requests=True): the running requests drop their blocks, wait to be
    recomputed, and give the same tokens; without it the reset waits for an idle pool (False)."""
    engine = llm.llm_engine
    llm.enqueue(PROMPTS, GREEDY)
    assert engine.step() == [] and engine.step() == [] and engine.scheduler.num_running == 2
    assert not llm.reset_prefix_cache() and engine.scheduler.num_running == 2
    assert llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    assert engine.scheduler.num_running == 0 and engine.get_num_unfinished_requests() == 2
    assert _tokens(llm.wait_for_completion(use_tqdm=False)) == expected
    assert engine.scheduler.num_preemptions == 0
