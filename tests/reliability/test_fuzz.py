"""Schema fuzzing: schemathesis drives every endpoint of the server's own /openapi.json, with bodies that fit the
schema and bodies that break it. No answer may be a 5xx or take long; every rejection is a 4xx in OpenAI's error
shape (Anthropic's on /v1/messages); afterwards the server is healthy and its KV pool whole.

CI runs a few examples per endpoint and mode; `make stress` runs many more (PAGEDLLM_FUZZ_EXAMPLES)."""

from __future__ import annotations

import os
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from pagedllm.entrypoints.openai.serving_base import ServerLimits
from tests.entrypoints.server_utils import metric, scrape, start_server, wait_until
from tests.reliability.tiny_server import STRESS, build_tiny_engine, error_shape

MAX_EXAMPLES = int(os.environ.get("PAGEDLLM_FUZZ_EXAMPLES", 400 if STRESS else 12))
MAX_SECONDS = 20.0       # "no hang": the slowest legal request here takes well under a second


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    limits = ServerLimits(max_request_body_bytes=256 * 1024, max_n=4, max_choices=8, max_prompts=8)
    server = start_server(build_tiny_engine(tiny_model_dir, num_blocks=256), api_key=None, limits=limits)
    yield server
    server.stop()


def _operations(base_url: str) -> list:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def _check(case, response, elapsed: float) -> None:
    where = f"{case.method} {case.path} body={case.body!r:.300}"
    assert elapsed < MAX_SECONDS, f"{where}: took {elapsed:.1f} s"
    assert response.status_code < 500, f"{where}: {response.status_code} {response.content[:500]!r}"
    if response.status_code >= 400 and case.path.startswith("/v1/messages"):     # Anthropic's error shape
        body = response.json()
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body
    elif response.status_code >= 400:
        error_shape(response)
    # A body that breaks the schema may still be accepted: pydantic's lax mode takes `false` for an integer, as
    # OpenAI's server does. What matters is that nothing breaks.


def _fuzz(base_url: str, operation, mode: GenerationMode) -> int:
    calls = 0

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=not STRESS,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        nonlocal calls
        started = time.monotonic()
        response = case.call(base_url=base_url, timeout=MAX_SECONDS + 10)
        calls += 1
        _check(case, response, time.monotonic() - started)

    run()
    return calls


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_every_endpoint_survives_fuzzing(fuzz_server, mode):
    base_url = fuzz_server.base_url
    operations = _operations(base_url)
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health"} <= paths, paths
    calls = 0
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not operation.get_request_payload_content_types():
            continue        # no body to break (GET, DELETE, a cancel), and a path's string parameter takes any string
        calls += _fuzz(base_url, operation, mode)
    assert calls > 0
    assert httpx.get(f"{base_url}/health", timeout=5).status_code == 200

    def idle_and_whole() -> bool:
        values = scrape(base_url)
        return (metric(values, "pagedllm:num_requests_running") == 0
                and metric(values, "pagedllm:num_requests_waiting") == 0
                and metric(values, "pagedllm:num_blocks_free") == metric(values, "pagedllm:num_blocks_total"))
    assert wait_until(idle_and_whole, timeout=30), scrape(base_url)
    ok = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
