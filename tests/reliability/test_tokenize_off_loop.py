"""A huge prompt is tokenized off the event loop: while it is, another client's stream keeps getting chunks.

The byte tokenizer takes about a second for the 900 KB prompt here (the prompt then fails the context check).
On the event loop, that second would be one gap in every other stream. The check is relative, so that a slow,
busy machine does not fail it: no gap in the other stream, edges of the big request's window included, may last
half the window (on the loop, the gap is the whole window but for the request's parsing and answer). The other
stream is one long request that spans the window: a new request's own tokenizing would queue behind the big one
on the tokenizer thread, which delays its start, not a running stream.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.serving_base import ServerLimits
from tests.entrypoints.server_utils import start_server
from tests.models.tiny import save_tiny_model

CONTEXT = 8192   # room for a stream that outlasts the big request's window

BIG_PROMPT = ("The quick brown fox jumps over the lazy dog. " * 20_000)[:900_000]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder, _ = save_tiny_model(tmp_path_factory.mktemp("long") / "llama", "llama-gqa", initializer_range=0.5,
                                max_position_embeddings=CONTEXT)
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(folder), dtype="float32", max_model_len=CONTEXT),
                                    cache=CacheConfig(block_size=16, num_blocks=1024)))
    running = start_server(engine, api_key=None, limits=ServerLimits(max_request_body_bytes=1 << 20))
    yield running
    running.stop()


class _Streamer(threading.Thread):
    """Streams one long greedy completion and notes when each chunk arrives, until stopped."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.chunk_times, self.stop, self.ended = base_url, [], threading.Event(), False

    def run(self) -> None:
        body = {"prompt": "a stream beside", "max_tokens": CONTEXT - 64, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{self.base_url}/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if self.stop.is_set():
                        break
                    if line.startswith("data: {"):
                        self.chunk_times.append(time.monotonic())
                    self.ended = line == "data: [DONE]"


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
    assert not streamer.ended, "the stream ended before the big request did: make it longer"
    window = end - start
    edges = [start] + [t for t in streamer.chunk_times if start <= t < end] + [end]
    longest_gap = max(b - a for a, b in zip(edges, edges[1:]))
    assert longest_gap < window / 2, f"the other stream stalled {longest_gap:.2f} s of a {window:.2f} s window"
