"""Prompts given as embeddings (vLLM's prompt_embeds): the rows the model's embedding layer gives for a prompt's
tokens generate what the tokens do, and transformers' tokens from the same embeddings; through chunked prefill, the
prefix cache (the same embeddings hit, others do not) and preemption; served, as base64 of torch.save'd tensors; bad
ones are refused, saying why."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.entrypoints.server_utils import start_server
from tests.models.tiny import save_tiny_model

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12, 13, 14], [60, 61, 62, 63, 64]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, hf_model = save_tiny_model(tmp_path_factory.mktemp("embeds") / "m", "llama-gqa", initializer_range=0.5)
    return str(folder), hf_model


def _embeds(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model.get_input_embeddings()(torch.tensor(token_ids)).clone()


def test_embeddings_generate_what_their_tokens_do_and_transformers_does(tiny) -> None:
    folder, hf_model = tiny
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=8,
              enable_prompt_embeds=True)
    by_tokens = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    by_embeds = llm.generate([{"prompt_embeds": _embeds(hf_model, p)} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_embeds] == [o.outputs[0].token_ids for o in by_tokens]
    assert [o.outputs[0].text for o in by_embeds] == [o.outputs[0].text for o in by_tokens]
    assert by_embeds[0].prompt_token_ids == [0] * len(PROMPTS[0])      # a placeholder a row
    with torch.inference_mode():
        expected = hf_model.generate(inputs_embeds=_embeds(hf_model, PROMPTS[0])[None], max_new_tokens=10,
                                     do_sample=False, attention_mask=torch.ones(1, len(PROMPTS[0]), dtype=torch.long))
    assert by_embeds[0].outputs[0].token_ids == expected[0, -10:].tolist()
    # the same embeddings again: their blocks are in the prefix cache; other embeddings of the same length are not
    again = llm.generate({"prompt_embeds": _embeds(hf_model, PROMPTS[0])}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 8 and again.outputs[0].token_ids == by_embeds[0].outputs[0].token_ids
    other = llm.generate({"prompt_embeds": _embeds(hf_model, PROMPTS[0][::-1])}, GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0


def test_the_repetition_penalty_counts_no_placeholder_as_seen(tiny) -> None:
    """A prompt of embeddings has no tokens for the penalties to count: its placeholder ids (0) are not seen, as
    transformers' generate from inputs_embeds sees none (the oracle); the tokens generated are. The tiny model's
    first greedy token after this prompt is token 0 itself, which a penalised placeholder would push down."""
    folder, hf_model = tiny
    prompt, penalty = [151, 147, 269, 71, 296, 270, 324, 110, 275], 3.0
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=64, enable_prompt_embeds=True)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=penalty)
    embeds = _embeds(hf_model, prompt)
    with torch.inference_mode():
        expected = hf_model.generate(inputs_embeds=embeds[None], max_new_tokens=20, do_sample=False,
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     repetition_penalty=penalty)[0].tolist()
    assert expected[0] == 0, "the prompt was meant to make token 0 the first greedy token"
    assert llm.generate({"prompt_embeds": embeds}, params, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_prompt_logprobs_of_embeddings_are_refused(tiny) -> None:
    folder, hf_model = tiny
    llm = LLM(folder, dtype="float32", num_kv_blocks=16, enable_prompt_embeds=True)
    with pytest.raises(ValueError, match="prompt_logprobs .* prompt_embeds"):
        llm.generate({"prompt_embeds": _embeds(hf_model, PROMPTS[1])}, SamplingParams(prompt_logprobs=1),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_preempted_embeddings_are_recomputed_from_themselves(tiny) -> None:
    folder, hf_model = tiny
    small = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=12, enable_prompt_embeds=True)
    prompts = [{"prompt_embeds": _embeds(hf_model, p)} for p in PROMPTS] * 2
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert sum(small.engine.make_stats().num_preemptions_total.values()) > 0
    alone = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=64).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in alone] * 2


def test_bad_embeddings_are_refused(tiny, tmp_path) -> None:
    folder, hf_model = tiny
    embeds = _embeds(hf_model, PROMPTS[1])
    with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
        LLM(folder, dtype="float32", num_kv_blocks=16).generate({"prompt_embeds": embeds}, use_tqdm=False)
    llm = LLM(folder, dtype="float32", num_kv_blocks=16, enable_prompt_embeds=True)
    assert llm.generate({"prompt_embeds": embeds[None]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids    # [1, P, H]
    for bad, match in ((embeds[:, :10], "hidden_size 64"), (embeds.long(), "floating-point"),
                       ([[0.1] * 64], "floating-point torch tensor"), (embeds[:0], r"got \(0, 64\)")):
        with pytest.raises(ValueError, match=match):
            llm.generate({"prompt_embeds": bad}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="'prompt_embeds' goes alone"):
        llm.generate({"prompt_embeds": embeds, "prompt": "x"}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="not in beam search"):
        from pagedllm import BeamSearchParams

        llm.beam_search([{"prompt_embeds": embeds}], BeamSearchParams(2, 4))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kind", ["gemma3", "granite"])
def test_models_that_scale_their_embeddings_take_them_as_transformers_does(tmp_path, kind) -> None:
    """Gemma's embedding layer scales its rows (the normalizer is the layer's: its rows come scaled and are taken as
    they are); Granite's embedding_multiplier scales every input embedding, given ones too: either way, the rows of
    the embedding layer generate what their tokens do and what transformers generates from them."""
    folder, hf_model = save_tiny_model(tmp_path / "m", kind, initializer_range=0.5)
    llm = LLM(str(folder), dtype="float32", block_size=4, num_kv_blocks=32, enable_prompt_embeds=True)
    by_tokens = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    by_embeds = llm.generate({"prompt_embeds": _embeds(hf_model, PROMPTS[0])}, GREEDY, use_tqdm=False)[0]
    with torch.inference_mode():
        expected = hf_model.generate(inputs_embeds=_embeds(hf_model, PROMPTS[0])[None], max_new_tokens=10,
                                     do_sample=False, attention_mask=torch.ones(1, len(PROMPTS[0]), dtype=torch.long))
    assert by_embeds.outputs[0].token_ids == by_tokens == expected[0, -10:].tolist()


def _encoded(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_the_server_takes_base64_embeddings_beside_prompts(tiny) -> None:
    folder, hf_model = tiny
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, enable_prompt_embeds=True)
    expected = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    running = start_server(llm.engine, api_key=None)
    try:
        body = {"model": running.model_name, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        reply = httpx.post(f"{running.base_url}/v1/completions", timeout=60, json={
            **body, "prompt": [PROMPTS[0]], "prompt_embeds": _encoded(_embeds(hf_model, PROMPTS[1]))}).json()
        assert [c["token_ids"] for c in sorted(reply["choices"], key=lambda c: c["index"])] == \
            [o.outputs[0].token_ids for o in expected]
        assert reply["usage"]["prompt_tokens"] == len(PROMPTS[0]) + len(PROMPTS[1])
        for extra, message in (({"prompt_embeds": "bm90IGEgdGVuc29y"}, "could not be read"),
                               ({"prompt_embeds": _encoded(torch.zeros(2, 3))}, "hidden_size 64"),
                               ({"prompt_embeds": _encoded(torch.zeros(2, 64)), "echo": True}, "no tokens to echo"),
                               ({}, "give a prompt")):
            bad = httpx.post(f"{running.base_url}/v1/completions", timeout=60, json={**body, **extra})
            assert bad.status_code == 400 and message in bad.text, bad.text
    finally:
        running.stop()
