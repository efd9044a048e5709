"""Completions and chat through the official openai SDK: plain, streamed, n=2, logprobs, stop strings, usage."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.server_utils import API_KEY, RunningServer

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def greedy_text(client, model, prompt, max_tokens=16, **kwargs) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, **kwargs)
    return out.choices[0].text


def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [server.model_name]
    assert client.models.retrieve(server.model_name).id == server.model_name
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.body["code"] == "model_not_found"


def test_completion_greedy_has_usage_and_length_finish(client, server):
    out = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=6, temperature=0)
    choice = out.choices[0]
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and choice.text
    prompt_tokens = len(server.engine.tokenizer.encode(PROMPT))
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == 6
    assert out.usage.total_tokens == prompt_tokens + 6
    assert greedy_text(client, server.model_name, PROMPT, 6) == choice.text     # greedy is repeatable


def test_completion_prompt_forms(client, server):
    ids = server.engine.tokenizer.encode(PROMPT)
    expected = greedy_text(client, server.model_name, PROMPT, 5)
    assert greedy_text(client, server.model_name, ids, 5) == expected
    out = client.completions.create(model=server.model_name, prompt=[PROMPT, "Hello"], max_tokens=5, temperature=0)
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].text == expected
    out = client.completions.create(model=server.model_name, prompt=[ids, ids], max_tokens=5, temperature=0)
    assert [c.text for c in out.choices] == [expected, expected]
    assert out.usage.prompt_tokens == 2 * len(ids) and out.usage.completion_tokens == 10


def test_completion_echo(client, server):
    out = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert out.choices[0].text == PROMPT + greedy_text(client, server.model_name, PROMPT, 4)


def test_completion_echo_with_logprobs_covers_the_prompt(client, server):
    ids = server.engine.tokenizer.encode(PROMPT)
    plain = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    prompt_only = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=1, temperature=0,
                                            extra_body={"prompt_logprobs": 2})
    out = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                                    echo=True)
    lp, generated = out.choices[0].logprobs, plain.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 3
    assert "".join(lp.tokens) == out.choices[0].text == PROMPT + plain.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None     # nothing predicts the first token
    # The prompt part: each token's log-probability as prompt_logprobs reports it; then the generated part as
    # without echo, its offsets shifted by the prompt's length.
    expected = [prompt_only.choices[0].model_extra["prompt_logprobs"][i][str(t)]["logprob"]
                for i, t in enumerate(ids) if i > 0]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert lp.token_logprobs[len(ids):] == pytest.approx(generated.token_logprobs, abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset[len(ids):] == [o + len(PROMPT) for o in generated.text_offset]
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=3, logprobs=2, echo=True,
                                  stream=True)


def test_completion_n2_sampled_with_seed(client, server):
    kwargs = dict(model=server.model_name, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=2, seed=7,
                  extra_body={"ignore_eos": True})
    out = client.completions.create(**kwargs)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 16
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]     # seeded: reproducible
    assert out.choices[0].text != out.choices[1].text                            # children get different seeds


def test_completion_logprobs(client, server):
    out = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert token_lp <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(token_lp)   # greedy: the chosen token is the most likely


def test_stop_strings_never_reach_the_client(client, server):
    full = greedy_text(client, server.model_name, PROMPT, 16)
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip(), full
    expected = full[: full.index(stop)]
    out = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=16, temperature=0,
                                    stop=[stop])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=16, temperature=0,
                                            stop=[stop], stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == expected and stop not in streamed
    assert chunks[-1].choices[0].finish_reason == "stop"
    kept = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=16, temperature=0,
                                     stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == expected + stop


def test_completion_stream_with_usage(client, server):
    chunks = list(client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy_text(client, server.model_name, PROMPT, 6)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completion_stream_n2(client, server):
    chunks = list(client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=5, temperature=0,
                                            n=2, stream=True))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    expected = greedy_text(client, server.model_name, PROMPT, 5)
    assert texts == {0: expected, 1: expected}


def test_vllm_extras_are_accepted(client, server):
    extra = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 3,
             "stop_token_ids": [2], "skip_special_tokens": True, "priority": 0, "cache_salt": "s"}
    out = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=4, temperature=0.5, seed=1,
                                    presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"1": 5}, user="u",
                                    extra_body=extra)
    assert out.usage.completion_tokens == 4


def test_chat(client, server):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    out = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=8, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    # Greedy: SmolLM2's answer is longer than 8 tokens, so it stops at the limit.
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (8, "length")
    again = client.chat.completions.create(model=server.model_name, messages=messages, max_completion_tokens=8,
                                           temperature=0)
    assert again.choices[0].message.content == out.choices[0].message.content


def test_chat_logprobs(client, server):
    out = client.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes).decode() == entry.token


def test_chat_stream_n2_with_usage(client, server):
    messages = [{"role": "user", "content": "Name a fruit."}]
    single = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=6, temperature=0)
    expected = single.choices[0].message.content
    stream = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=6, temperature=0,
                                            n=2, stream=True, stream_options={"include_usage": True})
    texts, roles, finishes, usage = {0: "", 1: ""}, {}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            roles.setdefault(choice.index, choice.delta.role)
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert roles == {0: "assistant", 1: "assistant"}
    assert texts == {0: expected, 1: expected}
    assert set(finishes.values()) <= {"stop", "length"} and len(finishes) == 2
    assert usage is not None and usage.completion_tokens == 2 * single.usage.completion_tokens
    assert usage.prompt_tokens == single.usage.prompt_tokens
