"""What vLLM users count on over HTTP, on a tiny random Llama (tests/models/tiny.py) behind the real server,
driven with the `openai` SDK: `n` goes through the engine's forks, as offline (the children share the prompt's KV
blocks, the same request and seed give the same completions both ways, a client that leaves aborts every child);
`prompt_logprobs` on /v1/completions equal the offline ones; a chat's last message continued
(`continue_final_message`) and echoed; `bad_words` and `allowed_token_ids`, offline and served alike; SageMaker's
/invocations."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pagedllm import LLM, SamplingParams
from tests.entrypoints.server_utils import RunningServer, metric, scrape, start_server, wait_until
from tests.reliability.tiny_server import build_tiny_engine, pool_is_whole

PROMPT = "Once upon a time, in a paged cache,"
SAMPLED = dict(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)




@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    running = start_server(build_tiny_engine(tiny_llama_dir), api_key=None)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", block_size=16, num_kv_blocks=512)


def _offline_texts(llm: LLM, prompt, n: int, seed: int = SAMPLED["seed"]) -> list[str]:
    (output,) = llm.generate(prompt, SamplingParams(n=n, **{**SAMPLED, "seed": seed}), use_tqdm=False)
    return [c.text for c in sorted(output.outputs, key=lambda c: c.index)]


def _create(client, server, prompt, n: int, seed: int = SAMPLED["seed"], **kwargs):
    body = {**SAMPLED, "seed": seed}
    return client.completions.create(model=server.model_name, prompt=prompt, n=n, seed=body.pop("seed"),
                                     temperature=body.pop("temperature"), top_p=body.pop("top_p"),
                                     max_tokens=body.pop("max_tokens"), extra_body=body, **kwargs)


def test_n_with_a_seed_gives_the_offline_completions(client, server, offline):
    expected = _offline_texts(offline, PROMPT, 3)
    assert len(set(expected)) == 3
    out = _create(client, server, PROMPT, 3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == expected
    assert out.usage.completion_tokens == 3 * SAMPLED["max_tokens"]
    # Seed s with n=2 is not seed s+1 with n=1 (the children's seeds are derived, not s+1, s+2, ...).
    (next_seed,) = _offline_texts(offline, PROMPT, 1, seed=SAMPLED["seed"] + 1)
    assert _create(client, server, PROMPT, 2).choices[1].text != next_seed


def test_streamed_choices_carry_their_index_and_match_offline(client, server, offline):
    expected = _offline_texts(offline, PROMPT, 3)
    texts = ["", "", ""]
    finished = set()
    for chunk in _create(client, server, PROMPT, 3, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert texts == expected and finished == {0, 1, 2}


def test_several_prompts_each_with_n(client, server, offline):
    prompts = [PROMPT, "A second prompt"]
    out = _create(client, server, prompts, 2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == _offline_texts(offline, prompts[0], 2) + \
        _offline_texts(offline, prompts[1], 2)


def test_the_children_share_the_prompt_prefill(client, server):
    """One prefix-cache lookup (one prefill) for the prompt, whatever n: the children are forks of one request,
    not n requests that each look the prompt up and prefill it."""
    stats = server.engine.engine.prefix_cache_stats
    before = stats.num_query_tokens
    _create(client, server, "a prompt no other test sends, to be prefilled once", 4)
    num_prompt_tokens = len(server.engine.tokenizer.encode("a prompt no other test sends, to be prefilled once"))
    assert stats.num_query_tokens - before == num_prompt_tokens


def test_a_client_that_leaves_aborts_every_child(server):
    engine = server.engine.engine
    assert wait_until(lambda: pool_is_whole(engine))
    aborts = metric(scrape(server.base_url), "pagedllm:request_success_total", finished_reason="abort")
    body = {"prompt": "Tell me", "n": 4, "max_tokens": 240, "temperature": 1.0, "ignore_eos": True, "stream": True}

    async def open_and_drop() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http, \
                http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break       # one chunk, then hang up
    asyncio.run(open_and_drop())
    # The abort of the one engine request ends all four completions at once: none is left to run its 240 tokens.
    assert wait_until(lambda: metric(scrape(server.base_url), "pagedllm:request_success_total",
                                     finished_reason="abort") == aborts + 1)
    assert not engine.scheduler.requests
    assert wait_until(lambda: pool_is_whole(engine))


# ---- prompt_logprobs ------------------------------------------------------------------------------------------
def _offline_prompt_logprobs(llm: LLM, prompt: str | dict) -> list:
    (output,) = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    return [None if p is None else {str(t): (lp.logprob, lp.rank, lp.decoded_token) for t, lp in p.items()}
            for p in output.prompt_logprobs]


def _served(prompt_logprobs: list) -> list:
    return [None if p is None else {t: (e["logprob"], e["rank"], e["decoded_token"]) for t, e in p.items()}
            for p in prompt_logprobs]


def _assert_same(got: list, expected: list) -> None:
    assert len(got) == len(expected) and got[0] is None and expected[0] is None
    for mine, theirs in zip(got[1:], expected[1:]):
        assert mine.keys() == theirs.keys()
        for token_id, (logprob, rank, text) in mine.items():
            assert logprob == pytest.approx(theirs[token_id][0], abs=1e-4)
            assert (rank, text) == theirs[token_id][1:]


def test_prompt_logprobs_on_every_choice_match_offline(client, server, offline):
    prompts = ["The first prompt of two", "and the second"]
    out = client.completions.create(model=server.model_name, prompt=prompts, n=2, max_tokens=2,
                                    extra_body={"prompt_logprobs": 2})
    for choice in out.choices:
        _assert_same(_served(choice.model_extra["prompt_logprobs"]),
                     _offline_prompt_logprobs(offline, prompts[choice.index // 2]))


def test_prompt_logprobs_are_right_for_a_prompt_in_the_prefix_cache(client, server, offline):
    prompt = "a prompt sent twice, so that its blocks are cached the second time"
    first = client.completions.create(model=server.model_name, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=server.model_name, prompt=prompt, max_tokens=1,
                                      extra_body={"prompt_logprobs": 2})
    assert first.choices[0].model_extra.get("prompt_logprobs") is None
    _assert_same(_served(again.choices[0].model_extra["prompt_logprobs"]), _offline_prompt_logprobs(offline, prompt))


def test_prompt_logprobs_of_a_chat_are_those_of_its_templated_prompt(client, server, offline):
    messages = [{"role": "user", "content": "Say something short."}]
    out = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=2,
                                         extra_body={"prompt_logprobs": 2})
    templated = offline.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    _assert_same(_served(out.model_extra["prompt_logprobs"]), _offline_prompt_logprobs(
        offline, {"prompt_token_ids": offline.get_tokenizer().encode(templated)}))


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize(("body", "param"), [
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_bad_prompt_logprobs_are_a_400_naming_the_field(server, endpoint, body, param):
    prompt = {"prompt": "Hi"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    response = httpx.post(f"{server.base_url}/v1/{endpoint}", json={**prompt, "max_tokens": 1, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


PREFILL = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite colour is"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def test_continue_final_message_continues_the_reply_given(client, server, offline):
    tokenizer = offline.get_tokenizer()
    text = tokenizer.apply_chat_template(PREFILL, tokenize=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nMy favourite colour is")   # no end of turn after it
    ids = tokenizer.encode(text, add_special_tokens=False)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    continuation = offline.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0].outputs[0].text
    assert offline.chat(PREFILL, greedy, use_tqdm=False, add_generation_prompt=False,
                        continue_final_message=True)[0].outputs[0].text == continuation
    out = client.chat.completions.create(model=server.model_name, messages=PREFILL, max_tokens=6, temperature=0,
                                         extra_body={**CONTINUE, "ignore_eos": True})
    assert out.usage.prompt_tokens == len(ids) and out.choices[0].message.content == continuation
    echoed = client.chat.completions.create(model=server.model_name, messages=PREFILL, max_tokens=6, temperature=0,
                                            extra_body={**CONTINUE, "ignore_eos": True, "echo": True})
    assert echoed.choices[0].message.content == "My favourite colour is" + continuation
    stream = client.chat.completions.create(model=server.model_name, messages=PREFILL, max_tokens=6, temperature=0,
                                            stream=True, extra_body={**CONTINUE, "ignore_eos": True, "echo": True})
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == echoed.choices[0].message.content
    tokenized = httpx.post(f"{server.base_url}/tokenize", json={"messages": PREFILL, **CONTINUE}).json()
    assert tokenized["tokens"] == ids


def test_echo_repeats_only_an_assistant_message(client, server):
    question = PREFILL[:1]
    plain, echoed = (client.chat.completions.create(model=server.model_name, messages=question, max_tokens=4,
                                                    temperature=0, extra_body={"echo": echo}) for echo in (False, True))
    assert echoed.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"continue_final_message": True}, "messages", "add_generation_prompt to false"),
    ({"echo": True, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "echo", "echo cannot be combined with tool calls"),
])
def test_what_a_chat_cannot_combine_is_a_400(server, body, param, message):
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": PREFILL, "max_tokens": 1,
                                                                          **body})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and message in error["message"], error


GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True)


def _printable_pair(tokenizer, token_ids: list[int]) -> tuple[int, str]:
    """The first j whose tokens j, j + 1 are a two-character word that tokenizes back to them (the tiny model's
    tokenizer has a token a byte)."""
    for j in range(len(token_ids) - 1):
        word = tokenizer.decode(token_ids[j:j + 2])
        if word.isascii() and word.isprintable() and word == word.strip() and len(word) == 2:
            assert tokenizer.encode(word, add_special_tokens=False) == token_ids[j:j + 2]
            return j, word
    raise AssertionError(f"no printable pair in {token_ids}")


def test_bad_words_ban_a_word_where_it_would_be_completed(client, server, offline):
    base = offline.generate(PROMPT, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    j, word = _printable_pair(offline.get_tokenizer(), base)
    params = SamplingParams(**GREEDY, bad_words=[word])
    banned = offline.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    tokenizer = offline.get_tokenizer()
    params.resolve_bad_words(lambda text: tokenizer.encode(text, add_special_tokens=False))     # as the engine does
    assert params.bad_words_token_ids == [base[j:j + 2]]    # " " + word is three tokens: not another form
    # the same up to the word's first token, then anything but its second, and never the word again
    assert banned.token_ids[:j + 1] == base[:j + 1] and banned.token_ids[j + 1] != base[j + 1]
    assert all(banned.token_ids[k:k + 2] != base[j:j + 2] for k in range(len(banned.token_ids) - 1))
    served = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True, "bad_words": [word]})
    assert served.choices[0].text == banned.text


def test_allowed_token_ids_are_the_only_tokens_generated(client, server, offline):
    allowed = offline.get_tokenizer().encode("aeiou xyz", add_special_tokens=False)
    vocab_size = offline.engine.vocab_size
    only = offline.generate(PROMPT, SamplingParams(**GREEDY, allowed_token_ids=allowed), use_tqdm=False)
    # the oracle: every other token pushed down by logit_bias
    pushed = offline.generate(PROMPT, SamplingParams(**GREEDY, logit_bias={
        t: -100.0 for t in range(vocab_size) if t not in allowed}), use_tqdm=False)
    assert only[0].outputs[0].token_ids == pushed[0].outputs[0].token_ids
    assert set(only[0].outputs[0].token_ids) <= set(allowed)
    sampled = offline.generate(PROMPT, SamplingParams(**SAMPLED, allowed_token_ids=allowed), use_tqdm=False)
    assert set(sampled[0].outputs[0].token_ids) <= set(allowed)
    served = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert served.choices[0].text == only[0].outputs[0].text


@pytest.mark.parametrize(("body", "param"), [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"bad_words": ["ab"], "structured_outputs": {"regex": "[a-z]+"}}, "bad_words"),
])
def test_bad_token_limits_are_a_400_naming_the_field(server, body, param):
    response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(client, server):
    stream = client.chat.completions.create(model=server.model_name, messages=PREFILL[:1], max_tokens=5, n=2,
                                            temperature=1.0, seed=3, stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    so_far: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        assert chunk.usage.prompt_tokens == chunks[-1].usage.prompt_tokens
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        so_far[choice.index].append(chunk.usage.completion_tokens)
    for counts in so_far.values():   # the opening chunk (the role) before any token, then one more per token
        assert counts[0] == 0 and counts[1:] == list(range(1, 6)), counts
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_return_token_ids_give_each_choices_tokens_and_its_prompts(client, server, offline):
    prompts = ["Once upon", "a paged cache"]
    expected = [offline.generate(p, SamplingParams(**GREEDY), use_tqdm=False)[0] for p in prompts]
    whole = client.completions.create(model=server.model_name, prompt=prompts, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    for choice, reference in zip(whole.choices, expected):
        assert choice.model_extra["prompt_token_ids"] == reference.prompt_token_ids
        assert choice.model_extra["token_ids"] == reference.outputs[0].token_ids
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for chunk in client.completions.create(model=server.model_name, prompt=prompts, max_tokens=24, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}):
        (choice,) = chunk.choices
        first = not streamed[choice.index]
        assert ("prompt_token_ids" in choice.model_extra) == first      # on each choice's first chunk only
        streamed[choice.index] += choice.model_extra["token_ids"]
    assert [streamed[0], streamed[1]] == [r.outputs[0].token_ids for r in expected]
    chat = client.chat.completions.create(model=server.model_name, messages=PREFILL[:1], max_tokens=5, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
    tokenizer = offline.get_tokenizer()
    templated = tokenizer.apply_chat_template(PREFILL[:1], tokenize=False, add_generation_prompt=True)
    assert chat.model_extra["prompt_token_ids"] == tokenizer.encode(templated, add_special_tokens=False)
    assert tokenizer.decode(chat.choices[0].model_extra["token_ids"]) == chat.choices[0].message.content
    plain = client.completions.create(model=server.model_name, prompt=prompts[0], max_tokens=2)
    assert "token_ids" not in plain.choices[0].model_extra and "prompt_token_ids" not in plain.model_extra


def test_a_stream_interval_sends_a_chunk_every_that_many_tokens(client, server, offline):
    (expected,) = offline.generate(PROMPT, SamplingParams(**GREEDY), use_tqdm=False)
    sizes, tokens = [], []
    for chunk in client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=24, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                                    "stream_interval": 5}):
        sizes.append(len(chunk.choices[0].model_extra["token_ids"]))
        tokens += chunk.choices[0].model_extra["token_ids"]
    assert tokens == expected.outputs[0].token_ids
    assert sizes == [1, 5, 5, 5, 5, 3], sizes


def test_return_tokens_as_token_ids_name_logprobs_tokens_by_id(client, server):
    asked = dict(model=server.model_name, prompt="Once upon", max_tokens=4, temperature=0, logprobs=2)
    by_text = client.completions.create(**asked).choices[0].logprobs
    by_id = client.completions.create(**asked, extra_body={"return_tokens_as_token_ids": True,
                                                           "return_token_ids": True}).choices[0]
    assert by_id.logprobs.tokens == [f"token_id:{t}" for t in by_id.model_extra["token_ids"]]
    assert by_id.logprobs.token_logprobs == by_text.token_logprobs
    assert by_id.logprobs.text_offset == by_text.text_offset     # offsets still count the text
    assert all(all(name.startswith("token_id:") for name in top) for top in by_id.logprobs.top_logprobs)


def test_truncate_prompt_tokens_keeps_the_last_or_first_tokens(client, server, offline):
    """As vLLM 0.32: the last k (truncation_side "left"), the first k ("right"), and without a side the
    tokenizer's own ("right" here, as transformers defaults it)."""
    tokenizer = offline.get_tokenizer()
    assert tokenizer.truncation_side == "right"
    prompt = "abcdefghijklmnop"        # a token a character
    for side, kept in (("left", "mnop"), ("right", "abcd"), (None, "abcd")):
        out = client.completions.create(model=server.model_name, prompt=prompt, max_tokens=6, temperature=0,
                                        echo=True, extra_body={"truncate_prompt_tokens": 4, "truncation_side": side,
                                                               "return_token_ids": True, "ignore_eos": True})
        expected = offline.generate(kept, SamplingParams(**{**GREEDY, "max_tokens": 6}), use_tqdm=False)[0]
        choice = out.choices[0]
        assert out.usage.prompt_tokens == 4 and choice.model_extra["prompt_token_ids"] == expected.prompt_token_ids
        assert choice.text == kept + expected.outputs[0].text                  # echo repeats what was kept
    chat = client.chat.completions.create(model=server.model_name, messages=PREFILL[:1], max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 5, "return_token_ids": True})
    templated = tokenizer.apply_chat_template(PREFILL[:1], tokenize=False, add_generation_prompt=True)
    assert chat.model_extra["prompt_token_ids"] == tokenizer.encode(templated, add_special_tokens=False)[:5]


def test_truncate_prompt_tokens_minus_one_fits_a_prompt_longer_than_the_context(client, server):
    max_len = client.models.list().data[0].model_extra["max_model_len"]
    too_long = "x" * (max_len + 50)
    refused = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": too_long, "max_tokens": 1})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    out = client.completions.create(model=server.model_name, prompt=too_long, max_tokens=1,
                                    extra_body={"truncate_prompt_tokens": -1})
    assert out.usage.prompt_tokens == max_len - 1 and out.usage.completion_tokens == 1


@pytest.mark.parametrize("keep", [0, -2, 10**6])
def test_a_truncation_that_cannot_be_is_a_400(server, keep):
    response = httpx.post(f"{server.base_url}/v1/completions",
                          json={"prompt": "abc", "max_tokens": 1, "truncate_prompt_tokens": keep})
    assert response.status_code == 400 and response.json()["error"]["param"] == "truncate_prompt_tokens"


def test_usage_says_how_many_prompt_tokens_the_prefix_cache_held(client, server):
    prompts = [f"{i}: a prompt for the cached-tokens test, long enough to fill a few blocks." for i in (1, 2)]
    first = client.completions.create(model=server.model_name, prompt=prompts, max_tokens=1, n=2)
    again = client.completions.create(model=server.model_name, prompt=prompts, max_tokens=1, n=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # each prompt's full blocks of 16, counted once per prompt (not per choice): its last token is always computed
    assert again.usage.prompt_tokens_details.cached_tokens == sum((len(p) - 1) // 16 * 16 for p in prompts)
    chat = dict(model=server.model_name, messages=[{"role": "user", "content": prompts[0]}], max_tokens=1,
                stream=True, stream_options={"include_usage": True})
    streamed, streamed_again = client.chat.completions.create(**chat), client.chat.completions.create(**chat)
    usages = [list(stream)[-1].usage for stream in (streamed, streamed_again)]
    assert usages[0].prompt_tokens_details.cached_tokens < usages[1].prompt_tokens_details.cached_tokens
    response = client.responses.create(model=server.model_name, input=prompts[1], max_output_tokens=1)
    repeated = client.responses.create(model=server.model_name, input=prompts[1], max_output_tokens=1)
    assert repeated.usage.input_tokens_details.cached_tokens > response.usage.input_tokens_details.cached_tokens


def test_invocations_answers_a_body_as_the_api_whose_fields_it_has(server: RunningServer) -> None:
    """SageMaker's /invocations: each body gets what its own route gives it; a body of none of theirs, 400."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    bodies = [("/v1/chat/completions", chat),
              ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}),
              ("/v1/embeddings", {"input": PROMPT}),
              ("/rerank", {"query": "a", "documents": ["a", "b"]}),
              ("/score", {"text_1": "a", "text_2": ["a", "b"]})]

    def same_part(answer: dict) -> dict:    # less its id and time, and the prefix cache's hits (the second hits)
        usage = {k: v for k, v in answer.get("usage", {}).items() if k != "prompt_tokens_details"}
        return {k: v for k, v in answer.items() if k not in ("id", "created")} | {"usage": usage}
    for path, body in bodies:
        direct = httpx.post(f"{server.base_url}{path}", json={"model": server.model_name, **body}, timeout=60)
        routed = httpx.post(f"{server.base_url}/invocations", json={"model": server.model_name, **body}, timeout=60)
        assert routed.status_code == direct.status_code == 200, (path, routed.text)
        assert same_part(routed.json()) == same_part(direct.json()), path
    for body, message in (({"model": server.model_name}, "has none of them"),
                          ({"messages": "not a list"}, "messages")):
        refused = httpx.post(f"{server.base_url}/invocations", json=body, timeout=60)
        assert refused.status_code == 400 and message in refused.text, refused.text
    assert httpx.post(f"{server.base_url}/invocations", content=b"{not json", timeout=60).status_code == 400


def test_beam_search_over_http_answers_the_offline_beams(server: RunningServer, offline: LLM) -> None:
    """vLLM's use_beam_search: n beams, the n best sequences as choices, best first, as LLM.beam_search gives
    them; a chat's for its templated prompt; what beam search does not take is a 400."""
    from pagedllm.engine.beam_search import BeamSearchParams

    url, model = server.base_url, server.model_name
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "n": 3, "use_beam_search": True,
            "length_penalty": 0.5}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    expected = offline.beam_search([PROMPT], BeamSearchParams(3, 6, length_penalty=0.5))[0].sequences
    assert [c["text"] for c in answer["choices"]] == [s.text for s in expected]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert answer["usage"]["completion_tokens"] == sum(len(s.output_token_ids) for s in expected)
    messages = [{"role": "user", "content": "Say something."}]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 5,
                                                         "n": 2, "use_beam_search": True}, timeout=60).json()
    tokenizer = offline.get_tokenizer()
    templated = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                 add_special_tokens=False)
    beams = offline.beam_search([{"prompt_token_ids": templated}], BeamSearchParams(2, 5))[0].sequences
    assert [c["message"]["content"] for c in chat["choices"]] == [s.text for s in beams]
    assert all(c["message"]["role"] == "assistant" for c in chat["choices"])
    for extra, param in (({"stream": True}, "stream"), ({"stop": ["x"]}, "stop"), ({"logprobs": 1}, "logprobs"),
                         ({"length_penalty": 1000}, "length_penalty")):
        refused = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    assert not server.engine.engine.beam_search.groups


def test_a_cancelled_beam_search_is_aborted(server: RunningServer) -> None:
    """Its beams stop within a step or two of the cancel, rather than running their 200 tokens out."""
    from pagedllm.engine.beam_search import BeamSearchParams

    engine = server.engine
    steps, step = [], engine.engine.step
    engine.engine.step = lambda: (steps.append(1), step())[1]

    async def cancel_one() -> None:
        search = asyncio.ensure_future(engine.beam_search("beam-cancelled", PROMPT, BeamSearchParams(4, 200)))
        while not steps:
            await asyncio.sleep(0.001)
        search.cancel()
        with pytest.raises(asyncio.CancelledError):
            await search
    try:
        asyncio.run_coroutine_threadsafe(cancel_one(), engine._loop).result(timeout=60)
        assert wait_until(lambda: not engine.engine.has_unfinished_requests())
    finally:
        engine.engine.step = step
    assert not engine.engine.beam_search.groups and len(steps) < 50, len(steps)
