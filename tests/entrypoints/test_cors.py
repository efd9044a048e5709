"""CORS, as vLLM's --allowed-origins: off by default (a page from another origin gets no access headers); with an
origin allowed, its preflight is answered before the API key is asked for, and its requests' answers, errors
included, carry the headers that let the page read them. A tiny random model behind the real server."""

from __future__ import annotations

import httpx
import pytest

from pagedllm.entrypoints.openai.server import CorsPolicy
from tests.entrypoints.server_utils import API_KEY, start_server
from tests.models.tiny import save_tiny_model
from tests.reliability.tiny_server import build_tiny_engine

UI = "http://ui.example"
PREFLIGHT = {"Origin": UI, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}
BODY = {"prompt": "Hi", "max_tokens": 1}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa")[0]


@pytest.mark.parametrize("cors", [None, CorsPolicy()])
def test_no_origin_is_allowed_by_default(tiny_dir, cors):
    server = start_server(build_tiny_engine(tiny_dir), cors=cors)
    try:
        preflight = httpx.options(f"{server.base_url}/v1/completions", headers=PREFLIGHT)
        assert "access-control-allow-origin" not in preflight.headers
        answer = httpx.post(f"{server.base_url}/v1/completions", json=BODY,
                            headers={"Origin": UI, "Authorization": f"Bearer {API_KEY}"})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers
    finally:
        server.stop()


def test_an_allowed_origin_gets_preflight_and_headers_before_the_key(tiny_dir):
    server = start_server(build_tiny_engine(tiny_dir), cors=CorsPolicy(origins=[UI]))
    try:
        url = f"{server.base_url}/v1/completions"
        preflight = httpx.options(url, headers=PREFLIGHT)          # no API key: a browser sends none here
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == UI
        assert "POST" in preflight.headers["access-control-allow-methods"]
        answer = httpx.post(url, json=BODY, headers={"Origin": UI, "Authorization": f"Bearer {API_KEY}"})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == UI
        refused = httpx.post(url, json=BODY, headers={"Origin": UI})  # no key: a 401 the page can read
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == UI
        other = httpx.options(url, headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    finally:
        server.stop()
