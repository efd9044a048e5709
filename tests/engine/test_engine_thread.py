"""EngineThread, and the server's engines built on the thread that steps them (pagedllm/engine/engine_thread.py says
why: a second thread running OpenMP regions made every kernel call wake a sleeping worker)."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pagedllm.engine.data_parallel import AsyncDataParallelEngine, build_async_engine
from pagedllm.engine.engine_thread import EngineThread
from tests.models.tiny import save_tiny_model
from tests.reliability.tiny_server import TINY_CONTEXT


def test_an_engine_thread_runs_its_jobs_in_order_on_itself_and_hands_back_results_and_errors() -> None:
    thread = EngineThread("test-engine")
    order: list[tuple[int, str]] = []

    def job(index: int) -> int:
        order.append((index, threading.current_thread().name))
        return index * 10

    futures = [thread.submit(job, index) for index in range(5)]
    assert [future.result(5) for future in futures] == [0, 10, 20, 30, 40]
    assert order == [(index, "test-engine") for index in range(5)]
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 / 0)
    assert thread.call(job, 7) == 70            # an error ends the job, not the thread
    thread.stop()
    thread._thread.join(5)
    assert not thread._thread.is_alive() and thread._thread.daemon


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder, _ = save_tiny_model(tmp_path_factory.mktemp("engine-thread") / "llama", "llama-gqa")
    return folder


@pytest.mark.parametrize("data_parallel_size", [1, 2])
def test_the_server_builds_each_engine_on_the_thread_that_steps_it(tiny_dir, threads_seen, data_parallel_size):
    config = EngineConfig(model=ModelConfig(model=str(tiny_dir), dtype="float32", max_model_len=TINY_CONTEXT),
                          cache=CacheConfig(block_size=16, num_blocks=64),
                          parallel=ParallelConfig(data_parallel_size=data_parallel_size))
    engine = build_async_engine(config)
    replicas = engine.replicas if isinstance(engine, AsyncDataParallelEngine) else [engine]
    names = ["pagedllm-engine"] if data_parallel_size == 1 else ["pagedllm-engine-0", "pagedllm-engine-1"]

    async def run() -> None:
        engine.start(asyncio.get_running_loop())
        try:
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            for index in range(2 * data_parallel_size):     # the router spreads them over the replicas
                async for _ in engine.generate(f"r{index}", [1 + index, 2, 3, 4, 5] * 4, params):
                    pass
        finally:
            await asyncio.to_thread(engine.shutdown)

    asyncio.run(run())
    assert [threads_seen(replica.engine) for replica in replicas] == [(name, {name}) for name in names]


def test_the_offline_llm_says_once_that_it_runs_on_a_thread_other_than_its_builders(tiny_dir, caplog) -> None:
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=TINY_CONTEXT, block_size=16, num_kv_blocks=64)
    logging.getLogger("pagedllm").addHandler(caplog.handler)     # pagedllm's loggers do not propagate to the root
    try:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        expected = llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        results = []
        worker = threading.Thread(target=lambda: results.extend(llm.generate([[1, 2, 3]], params) for _ in range(2)))
        worker.start()
        worker.join(60)
        assert [r[0].outputs[0].token_ids for r in results] == [expected, expected]   # it works, slower
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "thread other than the one that built it" in warnings[0]
    finally:
        logging.getLogger("pagedllm").removeHandler(caplog.handler)
        llm.close()
