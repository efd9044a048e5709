"""Every error comes back in OpenAI's shape with the right status, naming the field at fault."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.server_utils import API_KEY, MAX_BODY_BYTES, RunningServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def http(server: RunningServer):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=30) as client:
        yield client


def error_of(response: httpx.Response, status: int, param: str | None = "unchecked") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if param != "unchecked":
        assert body["error"]["param"] == param, body
    return body["error"]


def complete(http, **body) -> httpx.Response:
    return http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, **body})


def test_malformed_json(http):
    response = http.post("/v1/completions", content=b'{"prompt": "Hi", ', headers={"content-type": "application/json"})
    assert "JSON" in error_of(response, 400)["message"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": 3}, "prompt"),
    ({"max_tokens": 2}, "prompt"),
    ({"prompt": "Hi", "n": "two"}, "n"),
])
def test_schema_errors_are_400_not_422(http, body, param):
    error_of(http.post("/v1/completions", json=body), 400, param)


def test_chat_schema_error(http):
    error_of(http.post("/v1/chat/completions", json={"messages": "hi"}), 400, "messages")
    error_of(http.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}), 400,
             "messages")


@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("top_p", 0), ("top_k", -5), ("min_p", 2), ("presence_penalty", 5),
    ("frequency_penalty", -3), ("repetition_penalty", 0), ("max_tokens", 0), ("min_tokens", 10),
    ("logit_bias", {"5": 500}),
])
def test_sampling_param_errors_name_the_field(http, field, value):
    error = error_of(complete(http, **{field: value}), 400, field)
    assert field in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"n": 1000}, "n"), ({"logprobs": 21}, "logprobs"), ({"stop": ["x"] * 100}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"prompt": ""}, "prompt"),
    ({"prompt": [999999]}, "prompt"), ({"prompt": []}, "prompt"), ({"logit_bias": {"abc": 1}}, "logit_bias"),
])
def test_limits_and_bad_prompts(http, body, param):
    error_of(complete(http, **body), 400, param)


def test_chat_logprob_limits(http):
    messages = [{"role": "user", "content": "Hi"}]
    error_of(http.post("/v1/chat/completions", json={"messages": messages, "top_logprobs": 2}), 400, "top_logprobs")
    error_of(http.post("/v1/chat/completions", json={"messages": messages, "logprobs": True, "top_logprobs": 21}),
             400, "top_logprobs")


def test_context_overflow_uses_vllms_words(http, server):
    prompt_tokens = len(server.engine.tokenizer.encode("Hello"))
    error = error_of(complete(http, max_tokens=5000), 400, "max_tokens")
    assert error["message"].startswith(
        f"This model's maximum context length is 2048 tokens. However, you requested {prompt_tokens + 5000} tokens "
        f"({prompt_tokens} in the messages, 5000 in the completion).")
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                  "max_completion_tokens": 4000})
    assert "maximum context length is 2048 tokens" in error_of(chat, 400, "max_completion_tokens")["message"]


def test_prompt_longer_than_the_context(http):
    error = error_of(complete(http, prompt=[1] * 2100), 400, "prompt")
    assert "maximum context length is 2048 tokens" in error["message"] and "2100" in error["message"]


def test_unknown_model_is_404(http):
    error = error_of(complete(http, model="gpt-9"), 404, "model")
    assert error["code"] == "model_not_found"
    chat = http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
    error_of(chat, 404, "model")


def test_api_key_guards_the_routes_that_run_the_model(server):
    url = server.base_url
    assert error_of(httpx.get(f"{url}/v1/models"), 401)["code"] == "invalid_api_key"
    error_of(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    error_of(httpx.post(f"{url}/v1/completions", json={"prompt": "x"}), 401)
    for path in ("/score", "/rerank", "/v2/rerank"):     # vLLM's routes outside /v1
        error_of(httpx.post(f"{url}{path}", json={"query": "x", "documents": ["y"]}), 401)
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    for path in ("/health", "/ping", "/metrics", "/version"):
        assert httpx.get(f"{url}{path}").status_code == 200, path
    assert httpx.post(f"{url}/ping").status_code == 200      # SageMaker's, as vLLM answers it


def test_body_too_large(http):
    big = {"prompt": "x" * (MAX_BODY_BYTES + 10)}
    error = error_of(http.post("/v1/completions", json=big), 413)
    assert str(MAX_BODY_BYTES) in error["message"]

    def chunked():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 4096 + 2):
            yield b"x" * 4096
        yield b'"}'
    error_of(http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"}), 413)


def test_unknown_route_has_the_same_shape(http):
    error_of(http.get("/v1/nothing"), 404)


def test_utility_endpoints(http, server):
    assert http.get("/version").json()["version"]
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["tokens"] == server.engine.tokenizer.encode("Hello world")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 2048
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 2
    error_of(http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    error_of(http.post("/tokenize", json={"prompt": "x", "model": "nope"}), 404, "model")
