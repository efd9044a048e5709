"""A huge prompt is tokenized off the event loop: while it is, another client's stream keeps getting chunks.

The byte tokenizer takes about a second for the 400 KB prompt here (the prompt then fails the context check).
On the event loop, that second would be one gap in every other stream. The check is relative, so that a slow,
busy machine does not fail it: the other stream must get a chunk in every quarter of the big request's window.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pagedllm.entrypoints.openai.serving_base import ServerLimits
from tests.entrypoints.server_utils import start_server
from tests.reliability.tiny_server import build_tiny_engine

BIG_PROMPT = ("The quick brown fox jumps over the lazy dog. " * 10_000)[:400_000]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    running = start_server(build_tiny_engine(tiny_model_dir), api_key=None,
                           limits=ServerLimits(max_request_body_bytes=1 << 20))
    yield running
    running.stop()


class _Streamer(threading.Thread):
    """Streams greedy completions, one after another, and notes when each chunk arrives, until stopped."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.chunk_times, self.stop = base_url, [], threading.Event()

    def run(self) -> None:
        body = {"prompt": "a stream beside", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                with client.stream("POST", f"{self.base_url}/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            self.chunk_times.append(time.monotonic())


def _big_request(endpoint: str) -> dict:
    if endpoint == "completions":
        return {"prompt": BIG_PROMPT, "max_tokens": 4}
    return {"messages": [{"role": "user", "content": BIG_PROMPT}], "max_tokens": 4}


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_huge_prompt_does_not_stall_another_stream(server, endpoint):
    streamer = _Streamer(server.base_url)
    streamer.start()
    try:
        while len(streamer.chunk_times) < 20:       # the stream is flowing
            time.sleep(0.01)
        start = time.monotonic()
        response = httpx.post(f"{server.base_url}/v1/{endpoint}", json=_big_request(endpoint), timeout=60)
        end = time.monotonic()
    finally:
        streamer.stop.set()
        streamer.join(60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    window = end - start
    quarters = {int(4 * (t - start) / window) for t in streamer.chunk_times if start <= t < end}
    assert quarters == {0, 1, 2, 3}, f"the other stream got no chunk in some quarter of a {window:.2f} s window"
