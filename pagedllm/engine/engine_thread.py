"""EngineThread: the one thread that does an engine's torch work, from loading the model to its last step.

Why one thread: torch's CPU build runs its intra-op parallelism (and pagedllm's kernels, through
`at::parallel_for`) on GNU OpenMP, which gives every thread that starts a parallel region a team of worker threads
of its own. Once the teams' threads outnumber the CPUs, libgomp stops letting idle workers spin (100 spins instead
of 300,000): every parallel region then wakes a sleeping worker through a futex. A server that loads its model on
the main thread and steps it on another has two teams, and each kernel call pays that wake-up: a one-row bf16
matmul of SmolLM2's took 130 us instead of 45, and a served stream's tokens came twice as slowly as offline
(docs/benchmarks.md, "One thread for the engine"). Built and stepped on one thread, the engine has one team.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    """A daemon thread that runs the callables given to it, one at a time, in order.

    A daemon, unlike a ThreadPoolExecutor's workers (which the interpreter joins at exit): an engine loop that
    never got its stop signal, after a forced shutdown, must not keep the process from exiting.
    """

    def __init__(self, name: str = "pagedllm-engine") -> None:
        self._jobs: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn(*args)` on the thread after what was submitted before; its result or error in the future."""
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the thread, waited for; its error is raised here."""
        return self.submit(fn, *args).result()

    def stop(self) -> None:
        """End the thread once what was submitted before has run."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)
