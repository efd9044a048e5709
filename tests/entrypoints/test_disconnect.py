"""A client that goes away aborts its engine request, and its KV blocks return to the pool."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.entrypoints.server_utils import RunningServer, metric, scrape, wait_until

pytestmark = pytest.mark.slow

LONG = {"prompt": "Tell me a very long story.", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}


def _idle_and_whole(server: RunningServer, blocks_free: float) -> bool:
    values = scrape(server.base_url)
    return (metric(values, "pagedllm:num_requests_running") == 0
            and metric(values, "pagedllm:num_requests_waiting") == 0
            and metric(values, "pagedllm:num_blocks_free") == blocks_free)


def _aborts(server: RunningServer) -> float:
    return metric(scrape(server.base_url), "pagedllm:request_success_total", finished_reason="abort")


def test_many_dropped_streams_free_their_blocks(server: RunningServer):
    assert wait_until(lambda: metric(scrape(server.base_url), "pagedllm:num_requests_running") == 0)
    start = scrape(server.base_url)
    blocks_free = metric(start, "pagedllm:num_blocks_free")
    aborts = metric(start, "pagedllm:request_success_total", finished_reason="abort")

    async def open_and_drop(client: httpx.AsyncClient, path: str, body: dict) -> None:
        async with client.stream("POST", path, json={**body, "stream": True}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break       # one chunk, then hang up

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=60) as client:
            chat = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 1500,
                    "ignore_eos": True}
            await asyncio.gather(*[open_and_drop(client, "/v1/completions", LONG) for _ in range(12)],
                                 *[open_and_drop(client, "/v1/chat/completions", chat) for _ in range(4)])
    asyncio.run(run())
    assert wait_until(lambda: _idle_and_whole(server, blocks_free)), scrape(server.base_url)
    assert _aborts(server) == aborts + 16


def test_non_streaming_disconnect_aborts(server: RunningServer):
    values = scrape(server.base_url)
    blocks_free = metric(values, "pagedllm:num_blocks_free")
    aborts = metric(values, "pagedllm:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=LONG, headers=server.headers, timeout=1.5)
    assert wait_until(lambda: _aborts(server) == aborts + 1, timeout=10)
    assert wait_until(lambda: _idle_and_whole(server, blocks_free))
