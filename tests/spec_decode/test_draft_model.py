"""Draft-model speculative decoding end to end on tiny random models: greedy tokens (and logprobs) identical with
and without it, under preemption by swap and by recompute, prefix-cache hits and n > 1. With the target as its
own draft every draft must be accepted, which holds only if the draft's K/V (its own pool, the target's block
tables) is exactly right at every step; a different random model's drafts are mostly rejected, and change
nothing either."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig, ParallelConfig, SpeculativeConfig
from tests.models.tiny import save_tiny_model
from tests.spec_decode.stepping import assert_same_tokens_and_logprobs, generate_checked

BLOCK_SIZE = 4
K = 3
PROMPTS = ["abcabcabd abcab", "the cat sat. the cat", "xyzzy xyzzy xy", "1 2 3 1 2 3 1 2", "hello hello hel"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("draft")
    target, _ = save_tiny_model(folder / "target", "llama-gqa", seed=2, initializer_range=0.2)
    other, _ = save_tiny_model(folder / "other", "llama-mqa", seed=3, initializer_range=0.2, num_hidden_layers=1)
    short, _ = save_tiny_model(folder / "short", "llama-mqa", seed=3, max_position_embeddings=64)
    return {"target": str(target), "other": str(other), "short": str(short)}


def _llm(models: dict[str, str], draft: str | None, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 256)
    spec = {"model": models[draft], "num_speculative_tokens": K} if draft else None
    return LLM(model=models["target"], dtype="float32", block_size=BLOCK_SIZE, speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def plain(models) -> LLM:
    return _llm(models, None)


@pytest.fixture(scope="module")
def itself(models) -> LLM:
    return _llm(models, "target")


def _acceptance(llm: LLM) -> float:
    stats = llm.engine.make_stats().spec_decoding
    assert stats is not None and stats.num_draft_tokens > 0
    return stats.num_accepted_tokens / stats.num_draft_tokens


def test_greedy_tokens_and_logprobs_identical_and_its_own_drafts_all_accepted(plain: LLM, itself: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, logprobs=2)
    assert_same_tokens_and_logprobs(plain, itself, PROMPTS, params)
    assert _acceptance(itself) == 1.0
    stats = itself.engine.make_stats().spec_decoding
    # every verify pass carried K drafts, each a whole run of K + 1 tokens: far fewer steps than tokens
    assert stats.num_draft_tokens == K * stats.num_drafts


def test_another_models_drafts_change_nothing(models, plain: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    other = _llm(models, "other")
    assert [o.outputs[0].token_ids for o in other.generate(PROMPTS, params, use_tqdm=False)] == expected
    assert _acceptance(other) < 0.5


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_greedy_identical_under_preemption_prefix_hits_and_n(models, plain: LLM, preemption_mode: str) -> None:
    """A preempted request's draft K/V is gone (freed blocks, or a swap that carries only the target's): it is
    run through the draft again, so its drafts stay exact."""
    shared = "abcabcabcabcabcabcabc "                               # 5 full blocks shared by every prompt
    prompts = [shared + p for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2)
    expected = generate_checked(plain, prompts, params)
    small = _llm(models, "target", num_kv_blocks=30, max_num_seqs=4, preemption_mode=preemption_mode,
                 swap_space=0.01)
    assert generate_checked(small, prompts, params) == expected
    assert small.engine.scheduler.num_preemptions_by_mode[preemption_mode] > 0
    assert small.engine.prefix_cache_stats.num_hit_tokens > 0
    assert _acceptance(small) == 1.0


def test_seeded_sampling_is_reproducible_whatever_the_batch(itself: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    alone = itself.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    batched = itself.generate(PROMPTS, params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batched


def test_the_pool_holds_both_models_kv(models, plain: LLM) -> None:
    """Under one KV budget a draft's K/V takes its share: fewer blocks, each holding both."""
    budget = 1 << 20
    alone = _llm(models, None, num_kv_blocks=None, kv_cache_memory=budget).engine
    both = _llm(models, "other", num_kv_blocks=None, kv_cache_memory=budget).engine
    per_token = alone.runner.layout.bytes_per_token + both.runner.draft.layout.bytes_per_token
    assert both.runner.kv_bytes_per_token == per_token
    assert both.config.cache.num_blocks == (1 << 20) // (per_token * BLOCK_SIZE) < alone.config.cache.num_blocks


def test_bad_draft_configs_are_clear_errors(models) -> None:
    with pytest.raises(ValueError, match="speculative_config.model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="speculative_config.model"):
        SpeculativeConfig(method="ngram", model=models["other"])
    assert SpeculativeConfig(model=models["other"]).method == "draft_model"      # vLLM's inference
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(speculative=SpeculativeConfig(model=models["other"]),
                     parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="holds 64 tokens of context"):
        _llm(models, "short")
    with pytest.raises(ValueError, match="speculative_config.model '/nonexistent'"):
        LLM(model=models["target"], speculative_config={"model": "/nonexistent"})


def test_a_draft_model_that_raises_is_turned_off_and_the_requests_go_on(models, plain: LLM,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    llm = _llm(models, "target")

    def broken(requests):
        raise RuntimeError("out of memory in the draft")

    llm.engine.runner.draft.propose = broken
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected
    assert llm.engine.runner.draft is None
    assert any("speculative decoding is off from now on" in r.getMessage() for r in caplog.records)
    # and the scheduler no longer holds KV slots for drafts that will never come
    scheduled = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        output = schedule()
        scheduled.extend(output.scheduled)
        return output

    llm.engine.scheduler.schedule = recording
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected
    assert scheduled and not any(s.num_lookahead_tokens for s in scheduled)
