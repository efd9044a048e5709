"""Hostile inputs, by hand: each gets a clear 4xx in OpenAI's error shape, fast, and leaves the server healthy.

The server runs with its default limits (ServerLimits(): vLLM-like), so these tests also pin those defaults."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from pagedllm.entrypoints.openai.serving_base import ServerLimits
from tests.entrypoints.server_utils import start_server
from tests.reliability.tiny_server import build_tiny_engine, error_shape

LIMITS = ServerLimits()
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    running = start_server(build_tiny_engine(tiny_model_dir, num_blocks=128), api_key=None, limits=LIMITS)
    yield running
    running.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client
        # Whatever the request did, the server is healthy and serves the next one normally.
        assert client.get("/health").status_code == 200
        ok = client.post(COMPLETIONS, json={"prompt": "hello", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def rejected(response: httpx.Response, status: int = 400, param: str | None = "unchecked") -> dict:
    assert response.status_code == status, response.text[:500]
    error = error_shape(response)
    if param != "unchecked":
        assert error["param"] == param, error
    return error


def post_raw(http: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return http.post(path, content=content, headers={"content-type": "application/json"})


def test_the_defaults_are_vllm_like():
    assert LIMITS.max_request_body_bytes == 4 * 1024 * 1024
    assert (LIMITS.max_n, LIMITS.max_stop_strings, LIMITS.max_logprobs) == (128, 64, 20)


def test_a_body_of_several_megabytes(http):
    body = json.dumps({"prompt": "x" * (5 * 1024 * 1024)}).encode()
    error = rejected(post_raw(http, COMPLETIONS, body), 413)
    assert error["code"] == "request_too_large" and str(LIMITS.max_request_body_bytes) in error["message"]


def test_a_large_body_under_the_limit_is_refused_quickly(http):
    started = time.monotonic()
    error = rejected(http.post(COMPLETIONS, json={"prompt": "word " * 600_000, "max_tokens": 1}), 400, "prompt")
    assert "maximum context length" in error["message"] and time.monotonic() - started < 10


@pytest.mark.parametrize("depth", [100, 10_000, 200_000])
def test_deeply_nested_json(http, depth):
    for path, field in ((COMPLETIONS, "prompt"), (CHAT, "messages")):
        body = (f'{{"{field}": ' + "[" * depth + "]" * depth + "}").encode()
        rejected(post_raw(http, path, body), 400)
    nested = ('{"messages": [{"role": "user", "content": ' + "[" * depth + "]" * depth + "}]}").encode()
    rejected(post_raw(http, CHAT, nested), 400)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("fields, param", [
    ({"stop": [f"s{i}" for i in range(10_000)]}, "stop"),
    ({"n": 10_000}, "n"),
    ({"max_tokens": 10**9}, "max_tokens"),
    ({"max_tokens": 10**40}, "max_tokens"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": {"384": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"seed": 2**80}, "seed"),
    ({"top_k": -7}, "top_k"),
    ({"n": 0}, "n"),
])
def test_limits_and_out_of_range_fields(http, path, fields, param):
    body = {"prompt": "hi"} if path == COMPLETIONS else {"messages": USER}
    rejected(http.post(path, json={**body, **fields}), 400, param)


def test_logprobs_over_the_limit(http):
    rejected(http.post(COMPLETIONS, json={"prompt": "hi", "logprobs": LIMITS.max_logprobs + 1}), 400, "logprobs")
    rejected(http.post(COMPLETIONS, json={"prompt": "hi", "logprobs": 10**12}), 400, "logprobs")
    rejected(http.post(CHAT, json={"messages": USER, "logprobs": True, "top_logprobs": 10**6}), 400, "top_logprobs")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
def test_nan_and_inf_in_float_fields(http, field, literal):
    body = f'{{"prompt": "hi", "max_tokens": 2, "{field}": {literal}}}'.encode()
    rejected(post_raw(http, COMPLETIONS, body), 400, field)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_inf_in_logit_bias(http, literal):
    body = f'{{"messages": [{{"role": "user", "content": "hi"}}], "logit_bias": {{"5": {literal}}}}}'.encode()
    rejected(post_raw(http, CHAT, body), 400, "logit_bias")


@pytest.mark.parametrize("content", [b'{"prompt": "\xff\xfe\xfd"}', b'\xc3\x28',
                                     b'{"prompt": "ok", "stop": "\xed\xa0\x80"}',
                                     b'{"prompt": "a\xed\xa0\x80b", "echo": true}'])
def test_invalid_utf8(http, content):
    rejected(post_raw(http, COMPLETIONS, content), 400)


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, rb'{"prompt": "a\ud800b", "echo": true}'),
    (COMPLETIONS, rb'{"prompt": "a\ud800b", "stream": true}'),
    (COMPLETIONS, rb'{"prompt": "hi", "model": "\udfff"}'),
    (CHAT, rb'{"messages": [{"role": "user", "content": "a\udfffb"}]}'),
    ("/tokenize", rb'{"prompt": "a\ud800b"}'),
])
def test_lone_surrogates_are_not_text(http, path, body):
    assert "surrogate" in rejected(post_raw(http, path, body), 400)["message"]


@pytest.mark.parametrize("messages", [[], [{"role": "wizard", "content": "x"}], [{"content": "no role"}],
                                      [{"role": "user"}], "hi", [["user", "hi"]], [{"role": "user", "content": 5}]])
def test_bad_messages(http, messages):
    rejected(http.post(CHAT, json={"messages": messages}), 400, "messages")


@pytest.mark.parametrize("prompt", [[384], [-1], [10**20], [1, 2, 10**6], [[1, 2], [999]]])
def test_token_ids_outside_the_vocabulary(http, prompt):
    error = rejected(http.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 2}), 400, "prompt")
    assert "[0, 384)" in error["message"]


def test_detokenize_outside_the_vocabulary(http):
    for tokens in ([384], [-1], [10**30]):
        rejected(http.post("/detokenize", json={"tokens": tokens}), 400, "tokens")


def test_too_many_completions_in_one_request(http):
    prompts = ["p"] * 100
    rejected(http.post(COMPLETIONS, json={"prompt": prompts, "n": 100}), 400, "n")
    rejected(http.post(COMPLETIONS, json={"prompt": ["p"] * (LIMITS.max_prompts + 1)}), 400, "prompt")
