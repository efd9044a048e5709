"""Speculative decoding end to end on a tiny random Llama: greedy tokens (and logprobs) identical with and without
it, under preemption, prefix-cache hits, n > 1, stop strings and max_tokens landing inside an accepted run."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, PoolingParams, SamplingParams
from tests.models.tiny import save_tiny_model
from tests.spec_decode.stepping import assert_same_tokens_and_logprobs, generate_checked

BLOCK_SIZE = 4
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Byte-level prompts with repeats, so that n-gram lookup finds drafts from the first step on.
PROMPTS = ["abcabcabd abcab", "the cat sat. the cat", "xyzzy xyzzy xy", "1 2 3 1 2 3 1 2", "hello hello hel"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    folder, _ = save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa", seed=2, initializer_range=0.2)
    return str(folder)


def _llm(tiny: str, spec: bool, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 256)
    return LLM(model=tiny, dtype="float32", block_size=BLOCK_SIZE, speculative_config=SPEC if spec else None, **kw)


@pytest.fixture(scope="module")
def plain(tiny: str) -> LLM:
    return _llm(tiny, spec=False)


@pytest.fixture(scope="module")
def spec(tiny: str) -> LLM:
    return _llm(tiny, spec=True)


def test_greedy_tokens_and_logprobs_are_identical(plain: LLM, spec: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, logprobs=2)
    assert_same_tokens_and_logprobs(plain, spec, PROMPTS, params)
    stats = spec.engine.make_stats().spec_decoding
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_greedy_identical_under_preemption_prefix_hits_and_n(tiny: str, plain: LLM) -> None:
    shared = "abcabcabcabcabcabcabc "                               # 5 full blocks shared by every prompt
    prompts = [shared + p for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2)
    expected = generate_checked(plain, prompts, params)
    small = _llm(tiny, spec=True, num_kv_blocks=30, max_num_seqs=4)
    assert generate_checked(small, prompts, params) == expected
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.prefix_cache_stats.num_hit_tokens > 0
    assert small.engine.make_stats().spec_decoding.num_accepted_tokens > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 6, 7, 11])
def test_max_tokens_inside_an_accepted_run(plain: LLM, spec: LLM, max_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0] for o in spec.generate(PROMPTS, params, use_tqdm=False)]
    assert [c.token_ids for c in got] == expected
    assert all(c.finish_reason == "length" for c in got)


@pytest.mark.parametrize("length", [3, 4, 5, 6, 7])
def test_stop_string_inside_an_accepted_run(plain: LLM, spec: LLM, length: int) -> None:
    """The stop string is the first `length` characters of the output, so it ends at token `length` (one byte
    a token here) wherever that falls in a verified run; the tokens after it must not be reported."""
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    texts = [o.outputs[0].text for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    stopped = [SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, stop=[text[:length]])
               for text in texts]
    expected = plain.generate(PROMPTS, stopped, use_tqdm=False)
    got = spec.generate(PROMPTS, stopped, use_tqdm=False)
    for e, g in zip(expected, got):
        assert (g.outputs[0].token_ids, g.outputs[0].text, g.outputs[0].finish_reason) == \
            (e.outputs[0].token_ids, e.outputs[0].text, "stop")


def test_seeded_sampling_is_reproducible_whatever_the_batch(spec: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    alone = spec.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    batched = spec.generate(PROMPTS, params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batched


def test_embeddings_in_steps_with_drafts(plain: LLM, spec: LLM) -> None:
    """Pooling requests beside requests verifying drafts (one added at every step): each embedding is the one it
    gets alone, and the drafting requests' tokens are unchanged (a pooling row skips the LM head there too)."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    embedding = torch.tensor(plain.embed([PROMPTS[0]], use_tqdm=False)[0].outputs.embedding)
    engine, stats, finished, beside_drafts = spec.engine, spec.engine.scheduler.spec_decoding_stats, {}, 0
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    for step in range(100):
        if not engine.has_unfinished_requests():
            break
        engine.add_request(f"embed{step}", PROMPTS[0], PoolingParams())
        drafts_before = stats.num_drafts
        done = {o.request_id: o for o in engine.step() if o.finished}
        beside_drafts += f"embed{step}" in done and stats.num_drafts > drafts_before
        finished |= done
    assert beside_drafts > 0
    assert [finished[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == expected
    for request_id, output in finished.items():
        if request_id.startswith("embed"):
            torch.testing.assert_close(torch.tensor(output.embedding), embedding)
