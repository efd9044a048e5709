"""Tenant isolation with cache_salt: two tenants sending the same prompt never share a cached block. It shows in
the block tables (disjoint while both run) and in the metrics (the other tenant's request adds no prefix-cache
hit, while the same tenant's repeat does). Nothing of one request's prompt appears in another's output."""

from __future__ import annotations

import httpx
import pytest

from pagedllm.sampling_params import SamplingParams
from tests.entrypoints.server_utils import metric, scrape, start_server
from tests.reliability.tiny_server import build_tiny_engine

SHARED_PROMPT = "The quarterly numbers of tenant A, confidential: 1234 5678 9012 3456 7890 and more."  # 5+ blocks
SECRET = "zq-secret-77e1"


def test_salted_tenants_never_share_blocks(tiny_model_dir):
    engine = build_tiny_engine(tiny_model_dir, num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    num_full_blocks = len(engine.tokenizer.encode(SHARED_PROMPT)) // 16
    assert num_full_blocks >= 4
    engine.add_request("a1", SHARED_PROMPT, params, cache_salt="tenant-a")
    engine.step()
    blocks_a1 = engine.kv_cache_manager.get_block_ids("a1")
    while engine.has_unfinished_requests():
        engine.step()
    hits = engine.kv_cache_manager.prefix_cache_stats.num_hit_tokens

    # Tenant B, same prompt, another salt, while tenant A's repeat runs beside it.
    engine.add_request("a2", SHARED_PROMPT, params, cache_salt="tenant-a")
    engine.add_request("b1", SHARED_PROMPT, params, cache_salt="tenant-b")
    engine.add_request("nosalt", SHARED_PROMPT, params)
    engine.step()
    blocks = {r: engine.kv_cache_manager.get_block_ids(r) for r in ("a2", "b1", "nosalt")}
    a2, b1 = engine.scheduler.requests["a2"], engine.scheduler.requests["b1"]
    assert a2.num_cached_tokens == num_full_blocks * 16        # the same tenant hits its own cache...
    assert b1.num_cached_tokens == 0                           # ...the other tenant does not
    assert engine.scheduler.requests["nosalt"].num_cached_tokens == 0
    assert blocks["a2"][:num_full_blocks] == blocks_a1[:num_full_blocks]
    assert not set(blocks["b1"]) & set(blocks["a2"]) and not set(blocks["b1"]) & set(blocks_a1)
    assert not set(blocks["nosalt"]) & (set(blocks["a2"]) | set(blocks["b1"]))
    assert engine.kv_cache_manager.prefix_cache_stats.num_hit_tokens == hits + num_full_blocks * 16
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_cache_manager.check_integrity()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    running = start_server(build_tiny_engine(tiny_model_dir, num_blocks=64), api_key=None)
    yield running
    running.stop()


def _hits(server) -> float:
    return metric(scrape(server.base_url), "pagedllm:prefix_cache_hits_total")


def _complete(server, prompt: str, salt: str | None, max_tokens: int = 8) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_the_metrics_show_no_hit_across_tenants(server):
    _complete(server, SHARED_PROMPT, "tenant-a")
    before = _hits(server)
    text_b = _complete(server, SHARED_PROMPT, "tenant-b")
    assert _hits(server) == before                      # tenant B found nothing of tenant A's
    text_a = _complete(server, SHARED_PROMPT, "tenant-a")
    assert _hits(server) > before                       # tenant A finds its own blocks
    assert text_a == text_b                             # and the salt changes nothing in the output


def test_no_prompt_leaks_into_another_output(server):
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        secret = [pool.submit(_complete, server, f"{SECRET} {i} {SECRET}", f"s{i}", 64) for i in range(4)]
        others = [pool.submit(_complete, server, f"an ordinary prompt {i}", None, 64) for i in range(12)]
        texts = [f.result() for f in others]
        [f.result() for f in secret]
    assert all(SECRET not in text for text in texts)
