"""SamplingParams.prompt_logprobs on a tiny random Llama, against log_softmax of Hugging Face transformers' logits:
whole prompts, chunked prefill, a prompt whose blocks sit in the prefix cache, preemption, n > 1, streaming; and
against the logits themselves with logprobs_mode "raw_logits" (and "processed_logits", as vLLM)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.outputs import PromptLogprobs
from tests.models.tiny import save_tiny_model

NUM_TOP = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, hf_model = save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa", initializer_range=0.5)
    return str(folder), hf_model


def _llm(tiny, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 256)
    return LLM(model=tiny[0], dtype="float32", block_size=4, **kw)


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 259, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 3, "ignore_eos": True, "prompt_logprobs": NUM_TOP, **kw})


def _check_against_hf(hf_model, prompt: list[int], got: PromptLogprobs | None, logits: bool = False) -> None:
    """`got` holds the log_softmax of transformers' logits at each prompt position (the logits themselves with
    `logits`, logprobs_mode "raw_logits")."""
    with torch.inference_mode():
        reference = hf_model(torch.tensor([prompt])).logits[0].float()     # [P, V]
    if not logits:
        reference = torch.log_softmax(reference, dim=-1)
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for position, token_id in enumerate(prompt[1:]):
        row, entry = reference[position], got[position + 1]
        top = row.topk(NUM_TOP)
        assert set(entry) == {token_id, *top.indices.tolist()}
        assert entry[token_id].logprob == pytest.approx(row[token_id].item(), abs=1e-4)
        assert entry[token_id].rank == int((row > row[token_id]).sum()) + 1
        for rank, (top_id, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[top_id].logprob == pytest.approx(value, abs=1e-4)
            if top_id != token_id:
                assert entry[top_id].rank == rank
        assert all(lp.decoded_token is not None for lp in entry.values())


def test_prompt_logprobs_match_transformers(tiny):
    llm = _llm(tiny)
    prompts = [_prompt(1, 19), _prompt(2, 2), _prompt(3, 33)]
    outputs = llm.generate(prompts, _params(), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        _check_against_hf(tiny[1], prompt, output.prompt_logprobs)
    assert llm.generate(prompts[0], SamplingParams(max_tokens=2), use_tqdm=False)[0].prompt_logprobs is None


def test_raw_logits_mode_reports_the_models_logits_for_the_prompt_and_the_output(tiny):
    llm = _llm(tiny, logprobs_mode="raw_logits")
    prompt = _prompt(4, 11)
    (output,) = llm.generate([prompt], _params(logprobs=2, max_tokens=1), use_tqdm=False)
    _check_against_hf(tiny[1], prompt, output.prompt_logprobs, logits=True)
    with torch.inference_mode():
        last = tiny[1](torch.tensor([prompt])).logits[0, -1].float()
    (token_id,) = output.outputs[0].token_ids
    (entries,) = output.outputs[0].logprobs
    assert entries[token_id].logprob == pytest.approx(last.max().item(), abs=1e-4) and entries[token_id].rank == 1


@pytest.mark.parametrize("mode", ["processed_logits", "processed_logprobs"])
def test_a_processed_mode_reports_the_prompts_raw_scores(tiny, mode: str):
    """A prompt position goes through no processing: the processed modes report what the raw ones do (vLLM's
    logits in "processed_logits", log-probabilities in "processed_logprobs")."""
    llm = _llm(tiny, logprobs_mode=mode)
    prompt = _prompt(6, 13)
    (output,) = llm.generate([prompt], _params(), use_tqdm=False)
    _check_against_hf(tiny[1], prompt, output.prompt_logprobs, logits=mode == "processed_logits")


def test_chunked_prefill_gives_every_position_once(tiny):
    llm = _llm(tiny, max_num_batched_tokens=8)       # a 30-token prompt runs in four chunks
    prompt = _prompt(4, 30)
    _check_against_hf(tiny[1], prompt, llm.generate(prompt, _params(), use_tqdm=False)[0].prompt_logprobs)


def test_a_prefix_cache_hit_is_refused_and_the_logprobs_stay_right(tiny):
    llm = _llm(tiny)
    prompt = _prompt(5, 26)
    llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)             # its blocks are now cached
    output = llm.generate(prompt, _params(), use_tqdm=False)[0]
    assert output.num_cached_tokens == 0
    _check_against_hf(tiny[1], prompt, output.prompt_logprobs)
    # The blocks it computed are cached for everyone else.
    assert llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0].num_cached_tokens == 24


def test_preemption_by_recompute_reports_each_position_once(tiny):
    llm = _llm(tiny, num_kv_blocks=24, max_num_batched_tokens=16)    # 23 usable blocks of 4 for 4 x 40 tokens
    prompts = [_prompt(10 + i, 24) for i in range(4)]
    outputs = llm.generate(prompts, _params(max_tokens=16), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        _check_against_hf(tiny[1], prompt, output.prompt_logprobs)


def test_n_completions_share_one_set_of_prompt_logprobs(tiny):
    llm = _llm(tiny)
    prompt = _prompt(6, 14)
    output = llm.generate(prompt, _params(n=3, temperature=1.0, seed=3), use_tqdm=False)[0]
    assert len(output.outputs) == 3
    _check_against_hf(tiny[1], prompt, output.prompt_logprobs)


def test_a_streamed_request_gets_them_in_its_first_output_only(tiny):
    engine = _llm(tiny, max_num_batched_tokens=8).engine
    prompt = _prompt(7, 20)
    params = _params(max_tokens=4)
    params.output_kind = "delta"
    engine.add_request("s", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 1, 1, 1]
    _check_against_hf(tiny[1], prompt, outputs[0].prompt_logprobs)
    assert all(o.prompt_logprobs is None for o in outputs[1:])


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_prompt_logprobs_is_refused(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprob_token_ids_report_those_tokens_as_the_full_ranking_does(tiny, mode):
    """vLLM's logprob_token_ids: each generated token's entry carries the asked ids' logprobs and ranks, the same
    as a ranking of the whole vocabulary gives them (in the mode's scores: a logit bias moves the processed ones),
    with or without top logprobs, with speculative decoding too."""
    llm = _llm(tiny, logprobs_mode=mode)
    prompt, ids = _prompt(3, 12), [5, 9, 200]
    common = dict(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={9: 2.0})
    vocab_size = llm.engine.vocab_size      # every token ranked: the reference
    (whole,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**common, logprobs=vocab_size),
                            use_tqdm=False)
    for extra in ({}, {"logprobs": 2}):
        (asked,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**common, logprob_token_ids=ids, **extra),
                                use_tqdm=False)
        assert asked.outputs[0].token_ids == whole.outputs[0].token_ids
        for position, (got, full) in enumerate(zip(asked.outputs[0].logprobs, whole.outputs[0].logprobs,
                                                   strict=True)):
            sampled = asked.outputs[0].token_ids[position]
            top = {token for token, logprob in full.items() if logprob.rank <= extra.get("logprobs", 0)}
            assert set(got) == {sampled, *ids, *top}
            for token in ids:
                assert got[token].logprob == pytest.approx(full[token].logprob, abs=1e-5)
                assert got[token].rank == full[token].rank
    with pytest.raises(ValueError, match=rf"logprob_token_ids take token ids in \[0, {vocab_size}\)"):
        llm.generate([5], SamplingParams(logprob_token_ids=[vocab_size]), use_tqdm=False)
    with pytest.raises(ValueError, match="logprob_token_ids must be a non-empty list"):
        SamplingParams(logprob_token_ids=[])
    # with speculative decoding: the tokens the verifier decides (drafts proposed from the repetitive prompt) carry
    # the same entries
    spec = _llm(tiny, logprobs_mode=mode, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    looping = {"prompt_token_ids": [7, 8, 9, 10] * 6}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprob_token_ids=ids)
    (plain,) = llm.generate(looping, params, use_tqdm=False)
    (drafted,) = spec.generate(looping, params, use_tqdm=False)
    assert spec.engine.make_stats().spec_decoding.num_drafts > 0
    assert drafted.outputs[0].token_ids == plain.outputs[0].token_ids
    for got, want in zip(drafted.outputs[0].logprobs, plain.outputs[0].logprobs, strict=True):
        assert set(got) == set(want)
        for token in ids:
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)
            assert got[token].rank == want[token].rank
