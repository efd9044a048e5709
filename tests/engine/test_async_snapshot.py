"""The dashboard's snapshot through the async engine: made on the engine thread only when asked, once for callers
that ask together, and never a hang when the engine dies."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.engine.async_engine import AsyncEngine, EngineDeadError


class CountingEngine:
    """Looks like an LLMEngine with `num_steps` steps of work; counts the block maps made, and on which thread."""

    def __init__(self, num_steps: int) -> None:
        self.scheduler = Scheduler(SchedulerConfig(), KVCacheManager(num_blocks=16, block_size=4))
        self.steps_left = num_steps
        self.block_map_threads: list[str] = []
        self.release = threading.Event()        # a step waits for it once steps_left reaches `hold_at`
        self.hold_at: int | None = None
        self.fail = False

    def make_stats(self):
        return self.scheduler.make_stats()

    def make_block_map(self):
        self.block_map_threads.append(threading.current_thread().name)
        return self.scheduler.make_block_map()

    def is_healthy(self) -> bool:
        return True

    def is_sleeping(self) -> bool:
        return False

    def has_unfinished_requests(self) -> bool:
        return self.steps_left > 0

    def step(self) -> list:
        if self.steps_left == self.hold_at:
            self.release.wait(10)
        if self.fail:
            raise RuntimeError("injected engine failure")
        self.steps_left -= 1
        return []

    def close(self) -> None:   # the async engine closes its engine (the swap file) once its thread stopped
        self.closed = True


async def _wait_idle(engine: CountingEngine) -> None:
    while engine.steps_left:
        await asyncio.sleep(0.01)


def test_no_snapshot_unless_asked_and_one_for_callers_asking_together() -> None:
    async def run() -> None:
        fake = CountingEngine(num_steps=50)
        fake.hold_at = 10
        engine = AsyncEngine(fake)
        engine.start()
        try:
            while fake.steps_left > 10:
                await asyncio.sleep(0.01)
            assert fake.block_map_threads == []        # 40 steps, nobody asked: no block map
            asking = [asyncio.ensure_future(engine.kv_cache_snapshot()) for _ in range(3)]
            await asyncio.sleep(0.05)
            assert not any(task.done() for task in asking)     # taken after the step now running
            fake.release.set()
            first, second, third = await asyncio.gather(*asking)
            assert first is second is third and fake.block_map_threads == ["pagedllm-engine"]
            await _wait_idle(fake)
            assert len(fake.block_map_threads) == 1
            idle = await engine.kv_cache_snapshot()    # an idle engine answers at once
            assert idle is not first and idle.stats.num_blocks_total == 15 and len(idle.block_map.states) == 16
        finally:
            await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError):
            await engine.kv_cache_snapshot()
    asyncio.run(run())


def test_a_caller_waiting_for_a_snapshot_fails_when_the_engine_dies() -> None:
    async def run() -> None:
        fake = CountingEngine(num_steps=5)
        fake.hold_at, fake.fail = 5, True
        engine = AsyncEngine(fake)
        engine.start()
        try:
            asking = asyncio.ensure_future(engine.kv_cache_snapshot())
            await asyncio.sleep(0.05)
            fake.release.set()
            with pytest.raises(EngineDeadError, match="injected engine failure"):
                await asyncio.wait_for(asking, 5)
        finally:
            await asyncio.to_thread(engine.shutdown)
    asyncio.run(run())


def test_a_call_runs_on_the_engine_thread_and_fails_when_the_engine_dies() -> None:
    """`call_in_engine` (what loads LoRA adapters while serving): its function runs on the engine thread, its
    exception reaches the caller, and a caller waiting when the engine dies gets EngineDeadError, not a hang."""
    async def run() -> None:
        fake = CountingEngine(num_steps=0)
        engine = AsyncEngine(fake)
        engine.start()
        try:
            here = threading.current_thread().name
            there = await asyncio.wait_for(engine.call_in_engine(lambda _: threading.current_thread().name), 5)
            assert there != here
            with pytest.raises(ValueError, match="refused"):
                await engine.call_in_engine(lambda _: (_ for _ in ()).throw(ValueError("refused")))
            fake.hold_at, fake.fail = 5, True
            fake.steps_left = 5     # last: a loop still awake after the call above holds in its failing step too
            wake = asyncio.ensure_future(engine.call_in_engine(lambda _: None))   # else this wakes it to step
            await asyncio.sleep(0.05)
            waiting = asyncio.ensure_future(engine.call_in_engine(lambda _: "never"))
            await asyncio.sleep(0.05)
            fake.release.set()
            with pytest.raises(EngineDeadError, match="injected engine failure"):
                await asyncio.wait_for(waiting, 5)
            with contextlib.suppress(EngineDeadError):     # answered before the step, or failed with it
                await wake
        finally:
            await asyncio.to_thread(engine.shutdown)
    asyncio.run(run())
