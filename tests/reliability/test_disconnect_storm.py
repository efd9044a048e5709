"""Disconnect storm: 200 streaming clients vanish at random points (before the answer, after a few chunks, in the
middle of a long stream). Afterwards every KV block is free, nothing runs or waits, every vanished request was
aborted, and the next request is served normally (the same greedy tokens as before the storm)."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from tests.entrypoints.server_utils import metric, scrape, start_server, wait_until
from tests.reliability.tiny_server import STRESS, build_tiny_engine, random_prompts, served_alone

NUM_CLIENTS = 1000 if STRESS else 200
MAX_TOKENS = 150


@pytest.fixture(scope="module")
def storm_server(tiny_model_dir):
    engine = build_tiny_engine(tiny_model_dir, num_blocks=384)
    reference = served_alone(engine, ["the next request"], 12)
    server = start_server(engine, api_key=None)
    server.reference = reference
    yield server
    server.stop()


async def _vanish(client: httpx.AsyncClient, prompt: str, rng: random.Random) -> str:
    """One client that hangs up at a random point; returns where it stopped."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": rng.choice([0, 0.8]), "ignore_eos": True,
            "stream": True}
    path = "/v1/completions"
    if rng.random() < 0.3:
        body = {**{k: v for k, v in body.items() if k != "prompt"}, "messages": [{"role": "user", "content": prompt}]}
        path = "/v1/chat/completions"
    how = rng.choice(["timer", "chunks"])
    chunks_wanted = rng.randint(1, MAX_TOKENS // 2)

    got_headers = False

    async def run() -> str:
        nonlocal got_headers
        async with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            got_headers = True      # the server answers once the engine has the request
            seen = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if how == "chunks" and seen >= chunks_wanted:
                        return "after chunks"
        return "completed"
    if how == "timer":
        try:
            return await asyncio.wait_for(run(), timeout=rng.uniform(0.0, 1.5))
        except asyncio.TimeoutError:
            return "timer" if got_headers else "timer, before the answer"
    return await run()


async def _storm(base_url: str, prompts: list[str], seed: int) -> list[str]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        return await asyncio.gather(*(_vanish(client, p, random.Random(rng.random())) for p in prompts))


def _idle_and_whole(base_url: str) -> bool:
    values = scrape(base_url)
    return (metric(values, "pagedllm:num_requests_running") == 0
            and metric(values, "pagedllm:num_requests_waiting") == 0
            and metric(values, "pagedllm:num_blocks_free") == metric(values, "pagedllm:num_blocks_total"))


def test_disconnect_storm_leaks_nothing(storm_server):
    base_url = storm_server.base_url
    before = scrape(base_url)
    aborts = metric(before, "pagedllm:request_success_total", finished_reason="abort")
    finished = sum(metric(before, "pagedllm:request_success_total", finished_reason=r) for r in ("stop", "length"))
    outcomes = asyncio.run(_storm(base_url, random_prompts(NUM_CLIENTS, seed=1, max_len=64), seed=2))
    assert outcomes.count("completed") < NUM_CLIENTS // 4, outcomes      # nearly everyone hung up
    assert wait_until(lambda: _idle_and_whole(base_url), timeout=60), scrape(base_url)
    after = scrape(base_url)
    num_completed = sum(metric(after, "pagedllm:request_success_total", finished_reason=r)
                        for r in ("stop", "length")) - finished
    num_aborted = metric(after, "pagedllm:request_success_total", finished_reason="abort") - aborts
    # Every request the engine took is accounted for, none lost; a client may hang up before the engine sees it.
    num_in_engine = NUM_CLIENTS - outcomes.count("timer, before the answer")
    assert num_in_engine <= num_aborted + num_completed <= NUM_CLIENTS, outcomes
    # Every stream a client read to the end finished in the engine. A timed-out client may also have hung up just
    # after the engine finished its request (before it read the last chunk), so the engine can count a few more.
    completed_clients = outcomes.count("completed")
    assert completed_clients <= num_completed <= completed_clients + outcomes.count("timer"), outcomes
    manager = storm_server.engine.engine.kv_cache_manager
    manager.check_integrity()           # the engine is idle: reading it from this thread is safe
    assert not storm_server.engine.engine.scheduler.requests

    response = httpx.post(f"{base_url}/v1/completions", timeout=30,
                          json={"prompt": "the next request", "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200
    tokenizer = storm_server.engine.tokenizer
    expected = tokenizer.decode(storm_server.reference["the next request"])
    assert response.json()["choices"][0]["text"] == expected
