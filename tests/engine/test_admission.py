"""vLLM's queue limits at the server's front (pagedllm.engine.admission): max_num_queued_reqs counts the requests in
flight (n completions count n), max_num_queued_tokens the prompt tokens before their first output; a request past
either is refused at once (503 on the server, counted in pagedllm:admission_rejections_total), and a request that
ends, fails or is dropped gives its place back. Offline on fake streams, then on a server whose engine is held still
so that a request stays queued, and on data-parallel replicas' front."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator
from pathlib import Path

import httpx
import pytest

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pagedllm.engine.admission import Admission, QueueFullError
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.data_parallel import build_async_engine
from pagedllm.engine.llm_engine import LLMEngine
from tests.entrypoints.server_utils import start_server
from tests.models.tiny import save_tiny_model


async def _outputs(count: int, fail: bool = False) -> AsyncGenerator[int, None]:
    for i in range(count):
        await asyncio.sleep(0)
        yield i
    if fail:
        raise RuntimeError("the step failed")


def test_the_counts_and_the_refusals() -> None:
    refused: list[str] = []
    admission = Admission(max_num_queued_reqs=3, max_num_queued_tokens=100, on_refusal=[refused.append])

    async def main() -> None:
        first = admission.through(_outputs(3), 2, 150)       # one prompt longer than the token limit: still taken
        assert await anext(first) == 0
        assert (admission.num_requests, admission.num_prefill_tokens) == (2, 0)   # past its prefill
        with pytest.raises(QueueFullError, match="max_num_queued_reqs") as full:
            await anext(admission.through(_outputs(1), 2, 10))          # 2 + 2 > 3
        assert full.value.reason == "max_num_queued_reqs"
        second = admission.through(_outputs(2), 1, 100)
        task = asyncio.ensure_future(anext(second))
        await asyncio.sleep(0)                                # admitted: the backlog was empty
        assert (admission.num_requests, admission.num_prefill_tokens) == (3, 100)
        await task
        assert admission.num_prefill_tokens == 0
        await first.aclose()                                  # dropped: its place comes back
        assert admission.num_requests == 1
        waiting = admission.through(_outputs(1), 1, 100)
        queued = asyncio.ensure_future(anext(waiting))
        await asyncio.sleep(0)                                # admitted, its prompt not yet prefilled
        assert admission.num_prefill_tokens == 100
        with pytest.raises(QueueFullError, match="max_num_queued_tokens"):
            await anext(admission.through(_outputs(1), 1, 1))
        await queued
        failing = admission.through(_outputs(0, fail=True), 1, 5)
        with pytest.raises(RuntimeError, match="the step failed"):
            await anext(failing)
        async for _ in second:
            pass
        async for _ in waiting:
            pass
        assert (admission.num_requests, admission.num_prefill_tokens) == (0, 0)
    asyncio.run(main())
    assert refused == ["max_num_queued_reqs", "max_num_queued_tokens"]
    with pytest.raises(ValueError, match="max_num_queued_reqs must be None or >= 1"):
        Admission(max_num_queued_reqs=0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("admission") / "llama")[0]


def _complete(url: str, model: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4,
                                                     "ignore_eos": True, **fields}, timeout=60)


def test_the_server_answers_503_while_a_request_waits(tiny_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_dir), dtype="float32"),
                                    cache=CacheConfig(block_size=16, num_blocks=64)))
    held, step = threading.Event(), engine.step
    engine.step = lambda: (held.wait(30), step())[1]      # the engine does nothing until `held` is set
    admission = Admission(max_num_queued_reqs=2, max_num_queued_tokens=1)
    running = start_server(AsyncEngine(engine, admission=admission), api_key=None)
    try:
        first: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: first.append(_complete(running.base_url, running.model_name)))
        sender.start()
        deadline = time.monotonic() + 30
        while admission.num_requests == 0:
            assert time.monotonic() < deadline, "the first request never came in"
            time.sleep(0.01)
        for fields, reason in (({}, "max_num_queued_tokens"), ({"n": 2}, "max_num_queued_reqs")):
            refused = _complete(running.base_url, running.model_name, **fields)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == reason, refused.text
        held.set()
        sender.join(60)
        assert first[0].status_code == 200 and first[0].json()["usage"]["completion_tokens"] == 4
        assert _complete(running.base_url, running.model_name).status_code == 200       # room again
        metrics = httpx.get(f"{running.base_url}/metrics", timeout=5).text
        for reason in ("max_num_queued_tokens", "max_num_queued_reqs"):
            assert f'pagedllm:admission_rejections_total{{model_name="{running.model_name}",reason="{reason}"}} 1.0' \
                in metrics
    finally:
        held.set()
        running.stop()


def test_data_parallel_replicas_share_one_front(tiny_dir: Path) -> None:
    admission = Admission(max_num_queued_reqs=1)
    engine = build_async_engine(EngineConfig(model=ModelConfig(model=str(tiny_dir), dtype="float32"),
                                             cache=CacheConfig(block_size=16, num_blocks=64),
                                             parallel=ParallelConfig(data_parallel_size=2)), admission=admission)
    assert engine.admission is admission and all(r.admission is None for r in engine.replicas)
    running = start_server(engine, api_key=None)
    try:
        refused = _complete(running.base_url, running.model_name, n=2)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "max_num_queued_reqs"
        assert _complete(running.base_url, running.model_name).status_code == 200
        assert admission.num_requests == 0
    finally:
        running.stop()


def test_the_flags_build_the_front(tiny_dir: Path) -> None:
    from pagedllm.entrypoints.openai.api_server import build_app_from_args, make_parser

    args = make_parser().parse_args(["--model", str(tiny_dir), "--dtype", "float32", "--kv-cache-memory", "4MiB",
                                     "--max-num-queued-reqs", "8", "--max-num-queued-tokens", "4096"])
    admission = build_app_from_args(args).state.engine.admission
    assert (admission.max_num_queued_reqs, admission.max_num_queued_tokens) == (8, 4096)
    args = make_parser().parse_args(["--model", str(tiny_dir), "--dtype", "float32", "--kv-cache-memory", "4MiB"])
    assert build_app_from_args(args).state.engine.admission is None
