"""A dead engine loop: waiting requests fail, /health says 503, new requests get 503 at once.
And a request the engine refuses at add time fails alone."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.sched.scheduler import Scheduler
from tests.entrypoints.server_utils import RunningServer, start_server

pytestmark = pytest.mark.slow


class ExplodingEngine:
    """Looks like an LLMEngine (the real tokenizer and limits) whose step() raises once `gate` is set."""

    def __init__(self, real, gate: threading.Event) -> None:
        self.real, self.gate = real, gate
        self.tokenizer, self.max_model_len, self.model_name = real.tokenizer, real.max_model_len, real.model_name
        self.vocab_size, self.swap_space_bytes = real.vocab_size, real.swap_space_bytes
        self.default_sampling, self.config = real.default_sampling, real.config
        # An idle core of its own, for the metrics (the real engine's belongs to the shared server's thread).
        self.scheduler = Scheduler(SchedulerConfig(), KVCacheManager(num_blocks=16, block_size=16))
        self.pending: set[str] = set()

    def add_request(self, request_id, *args, **kwargs) -> None:
        self.pending.add(request_id)

    def abort_request(self, request_ids, stop_reason=None) -> list:
        self.pending.difference_update(request_ids)
        return []

    def close(self) -> None:
        """Nothing to release: the real engine belongs to the shared server."""

    def make_stats(self):
        return self.scheduler.make_stats()

    def is_healthy(self) -> bool:
        return True

    def is_sleeping(self) -> bool:
        return False

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self):
        self.gate.wait(30)
        raise RuntimeError("injected engine failure")


def test_engine_loop_failure_fails_everyone_fast(server: RunningServer):
    gate = threading.Event()
    broken = start_server(ExplodingEngine(server.engine.engine, gate), api_key=None)
    try:
        body = {"prompt": "Hello", "max_tokens": 4}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(httpx.post, f"{broken.base_url}/v1/completions", json=b, timeout=30)
                       for b in (body, {**body, "stream": True})]
            time.sleep(0.5)
            assert not any(f.done() for f in waiting)      # both are stuck in the engine
            gate.set()
            for future in waiting:
                response = future.result(timeout=10)
                assert response.status_code == 503, response.text
                assert "injected engine failure" in response.json()["error"]["message"]
        health = httpx.get(f"{broken.base_url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        started = time.monotonic()
        response = httpx.post(f"{broken.base_url}/v1/chat/completions", timeout=5,
                              json={"messages": [{"role": "user", "content": "Hi"}], "stream": True})
        assert response.status_code == 503 and time.monotonic() - started < 2
    finally:
        gate.set()
        broken.stop()


def test_a_request_refused_by_the_engine_fails_alone(server: RunningServer):
    url, headers = server.base_url, server.headers
    refused = httpx.post(f"{url}/v1/completions", headers=headers, timeout=30,
                         json={"prompt": "Hi", "max_tokens": 2, "stop_token_ids": [10**7]})
    assert refused.status_code == 400 and "token ids" in refused.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200
    ok = httpx.post(f"{url}/v1/completions", headers=headers, timeout=30, json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200
