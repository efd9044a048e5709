"""A real server process (`python -m pagedllm.entrypoints.openai.api_server`), stopped with SIGTERM under load.

Graceful shutdown: from SIGTERM on, /health and new requests get 503; running requests go on until
--shutdown-timeout, then the rest end with finish_reason "abort" and stop_reason "server_shutdown"; every client
gets a complete answer; the process exits 0 and its swap file is gone. Privacy: nothing of a prompt reaches the
server's log by default."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.server_utils import wait_until
from tests.models.tiny import build_byte_tokenizer, save_tiny_model
from tests.reliability.tiny_server import error_shape, prompt_traces

SECRET = "tenant-secret-9c2e51"
SHUTDOWN_TIMEOUT = 2.0
NUM_CLIENTS = 24
# One request at a time: the one running at SIGTERM finishes well inside the timeout, and the queue's 24 x 600 tokens
# outlast it (24 x 200 took about the 2 s on a Zen 5, which left nothing to abort in one run of four).
MAX_TOKENS = 600
MAX_MODEL_LEN = 640


@pytest.fixture(scope="module")
def long_context_model_dir(tmp_path_factory) -> Path:
    """The reliability tests' tiny model (tiny_model_dir's) with room for MAX_MODEL_LEN tokens."""
    folder, _ = save_tiny_model(tmp_path_factory.mktemp("tiny-long") / "llama", "llama-gqa", initializer_range=0.5,
                                max_position_embeddings=MAX_MODEL_LEN)
    return folder


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(folder, port: int, log_path, swap_path) -> subprocess.Popen:
    command = [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--model", str(folder),
               "--port", str(port), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
               "--kv-cache-memory", "4MiB", "--max-num-seqs", "1", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
               "--swap-space", "0.001", "--swap-path", str(swap_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)


async def _stream(client: httpx.AsyncClient, i: int) -> dict:
    body = {"prompt": f"{SECRET} client {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    last = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, i
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
            elif line == "data: [DONE]":
                return last["choices"][0]
    raise AssertionError(f"client {i}: the stream ended without [DONE]")


def _metric(text: str, name: str) -> float:
    """The sum of pagedllm:`name` over its labels in a /metrics text, 0 before it is first set."""
    return sum(float(value) for value in re.findall(rf"^pagedllm:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))


async def _load_then_sigterm(url: str, process: subprocess.Popen) -> tuple[list, list]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        streams = [asyncio.ensure_future(_stream(client, i)) for i in range(NUM_CLIENTS)]
        # Wait (up to a minute) until all the requests are in and some still wait. The ones that already finished
        # count as in: a loaded machine can take longer to send the last request than the server takes for the first.
        for _ in range(1200):
            await asyncio.sleep(0.05)
            metrics = (await client.get("/metrics")).text
            waiting = _metric(metrics, "num_requests_waiting")
            finished = _metric(metrics, "request_success_total") - 1           # less the first, plain request
            if waiting + _metric(metrics, "num_requests_running") + finished == NUM_CLIENTS:
                break
        else:
            raise AssertionError(f"the {NUM_CLIENTS} requests were not all in after a minute:\n{metrics}")
        assert waiting > 0, f"the queue ran dry before SIGTERM: nothing left to abort\n{metrics}"
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        during = [await client.get("/health"),
                  await client.post("/v1/completions", json={"prompt": "new", "max_tokens": 2})]
        return await asyncio.gather(*streams), during


def test_sigterm_drains_then_exits_0_and_logs_no_prompt(long_context_model_dir, tmp_path, disk_tmp_path):
    port, log_path, swap_path = _free_port(), tmp_path / "server.log", disk_tmp_path / "swap.bin"
    process = _start(long_context_model_dir, port, log_path, swap_path)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert process.poll() is None, log_path.read_text()
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        assert wait_until(up, timeout=120, interval=0.2)
        assert swap_path.exists()
        # A normal request first: its prompt must not be logged either.
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": f"{SECRET} hello", "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200
        signalled = time.monotonic()
        endings, during = asyncio.run(_load_then_sigterm(url, process))
        exit_code = process.wait(timeout=SHUTDOWN_TIMEOUT + 30)
        elapsed = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log = log_path.read_text()
    assert exit_code == 0, log[-3000:]
    health, new = during
    assert health.status_code == 503 and error_shape(health)["code"] == "server_shutting_down"
    assert new.status_code == 503 and error_shape(new)["code"] == "server_shutting_down"
    reasons = [(e["finish_reason"], e["stop_reason"]) for e in endings]
    assert ("length", None) in reasons, reasons                          # running requests were let finish
    assert ("abort", "server_shutdown") in reasons, reasons              # the rest were aborted at the deadline
    assert set(reasons) <= {("length", None), ("abort", "server_shutdown")}, reasons
    assert elapsed < SHUTDOWN_TIMEOUT + 15, elapsed
    assert "SIGTERM" in log and "aborting" in log
    assert re.search(rf"swap pool: \d+ blocks of 8 tokens .* in the file {re.escape(str(swap_path))}", log), log
    assert not swap_path.exists()                                         # closed and deleted
    # Neither as text nor as token ids (test_isolation.py shows the check sees a logged prompt).
    assert not any(trace in log for trace in prompt_traces(build_byte_tokenizer(), SECRET)), "a prompt was logged"
