"""LLMEngine's contract with the async engine: aborts return the requests' last outputs, streamed outputs go out
every stream_interval tokens, the stats snapshot, and prompt validation that any thread may call."""

from __future__ import annotations

import copy

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedllm.engine.llm_engine import LLMEngine, PromptTooLongError, tokenize_prompt
from tests.models.tiny import save_tiny_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa", seed=5)[0])


@pytest.fixture(scope="module")
def engine(folder: str):
    return LLM(model=folder, dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64).engine


def test_the_callers_config_is_left_as_it_was(folder: str) -> None:
    config = EngineConfig(model=ModelConfig(model=folder, dtype="float32"),
                          cache=CacheConfig(block_size=4, kv_cache_memory=1 << 20))
    before = copy.deepcopy(config)
    engine = LLMEngine(config)
    assert config == before
    assert engine.config.cache.num_blocks > 0 and engine.config.scheduler.max_model_len == engine.max_model_len


def test_abort_returns_the_last_output_of_each_live_request(engine) -> None:
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True, n=2))
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=20, ignore_eos=True, output_kind="delta"))
    for _ in range(3):
        engine.step()
    assert engine.make_stats().num_running == 3     # a's two completions and b
    outputs = {o.request_id: o for o in engine.abort_request(["a", "b", "never-added"], stop_reason="bye")}
    assert set(outputs) == {"a", "b"} and all(o.finished for o in outputs.values())
    assert [c.index for c in outputs["a"].outputs] == [0, 1]
    assert all(c.finish_reason == "abort" and c.stop_reason == "bye" for o in outputs.values() for c in o.outputs)
    assert all(len(c.token_ids) >= 2 for c in outputs["a"].outputs)   # cumulative: all tokens so far
    assert outputs["b"].outputs[0].token_ids == []                      # delta: nothing unsent
    assert engine.abort_request(["a"]) == []                            # already gone
    assert not engine.has_unfinished_requests()
    stats = engine.make_stats()
    assert stats.num_running == 0 and stats.num_blocks_free == stats.num_blocks_total


@pytest.mark.parametrize("engine_interval, request_interval, kind", [(1, 4, "delta"), (4, None, "delta"),
                                                                     (3, 2, "cumulative")])
def test_a_stream_goes_out_every_interval_tokens_its_first_and_last_at_once(
        folder: str, engine_interval: int, request_interval: int | None, kind: str) -> None:
    config = EngineConfig(model=ModelConfig(model=folder, dtype="float32"),
                          cache=CacheConfig(block_size=4, num_blocks=64),
                          scheduler=SchedulerConfig(max_model_len=64, stream_interval=engine_interval))
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=11, ignore_eos=True, output_kind=kind, stream_interval=request_interval)
    engine.add_request("s", [5, 6, 7], params)
    sent = []
    while engine.has_unfinished_requests():
        sent += [len(o.outputs[0].token_ids) for o in engine.step()]
    interval = max(engine_interval, request_interval or 1)
    if kind == "delta":
        assert sent == [1, interval, interval, 10 - 2 * interval]   # 11 tokens: the first, two full chunks, the rest
    else:
        assert sent == [1, 1 + interval, 1 + 2 * interval, 1 + 3 * interval, 11]


def test_stats_snapshot_names_the_step_and_its_kv_slots(engine) -> None:
    engine.add_request("s", list(range(10, 19)), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    stats = engine.make_stats()
    assert stats.scheduled_request_ids == ["s"] and stats.num_running == 1
    assert (stats.num_kv_slots_running, stats.num_kv_slots_filled) == (12, 9)   # 9 tokens in 3 blocks of 4
    while engine.has_unfinished_requests():
        engine.step()


def test_prompt_validation_reads_only_its_arguments(engine) -> None:
    tokenizer, vocab_size = engine.tokenizer, engine.runner.shape.vocab_size
    assert tokenize_prompt(tokenizer, [1, 2], vocab_size, 64) == engine.tokenize_prompt([1, 2]) == [1, 2]
    with pytest.raises(PromptTooLongError, match="max_model_len is 64") as too_long:
        tokenize_prompt(tokenizer, [1] * 64, vocab_size, 64)
    assert (too_long.value.num_tokens, too_long.value.max_model_len) == (64, 64)
    with pytest.raises(ValueError, match="empty"):
        tokenize_prompt(tokenizer, [], vocab_size, 64)
    with pytest.raises(ValueError, match=rf"\[0, {vocab_size}\)"):
        tokenize_prompt(tokenizer, [vocab_size], vocab_size, 64)


def test_detokenize_false_gives_the_same_tokens_without_text(folder: str) -> None:
    llm = LLM(model=folder, dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64)
    letters = llm.get_tokenizer().encode("abcdefgh", add_special_tokens=False)     # so that the output is text
    asked = dict(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                 allowed_token_ids=letters)
    with_text, ids_only = (llm.generate("hello there", SamplingParams(**asked, detokenize=detokenize),
                                        use_tqdm=False)[0] for detokenize in (True, False))
    assert ids_only.outputs[0].token_ids == with_text.outputs[0].token_ids and with_text.outputs[0].text
    assert ids_only.outputs[0].text == ""
    for got, expected in zip(ids_only.outputs[0].logprobs + ids_only.prompt_logprobs[1:],
                             with_text.outputs[0].logprobs + with_text.prompt_logprobs[1:]):
        assert {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in got.items()} == {
            t: (lp.logprob, lp.rank, None) for t, lp in expected.items()}
        assert all(lp.decoded_token is not None for lp in expected.values())


def test_without_chunked_prefill_prompts_run_whole_and_give_the_same_tokens(folder: str) -> None:
    """vLLM's enable_chunked_prefill=False: each prompt runs in one step (here 40- and 50-token prompts in a budget
    of 64, one step each, never together), with the same greedy tokens as chunked in steps of 16; a budget that
    cannot hold a whole context is refused at start-up."""
    prompts = [{"prompt_token_ids": list(range(3, 43))}, {"prompt_token_ids": list(range(60, 110))}]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    chunked = LLM(model=folder, dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64,
                  max_num_batched_tokens=16)
    whole = LLM(model=folder, dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64,
                max_num_batched_tokens=64, enable_chunked_prefill=False)
    steps = []
    whole.engine.scheduler.schedule = _recording(whole.engine.scheduler.schedule, steps)
    assert [o.outputs[0].token_ids for o in whole.generate(prompts, greedy, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in chunked.generate(prompts, greedy, use_tqdm=False)]
    prefills = [[s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1] for out in steps]
    assert [p for p in prefills if p] == [[40], [50]]
    with pytest.raises(ValueError, match="must be at least max_model_len"):
        LLM(model=folder, dtype="float32", num_kv_blocks=64, max_model_len=64, max_num_batched_tokens=32,
            enable_chunked_prefill=False)


def _recording(schedule, outputs: list):
    def recorded():
        outputs.append(schedule())
        return outputs[-1]
    return recorded
