"""Graceful shutdown: uvicorn's server, with SIGTERM (and a first Ctrl-C) draining the engine before it stops.

```
SIGTERM --> draining: /health and new /v1 requests get 503 (the socket stays open, so clients get an answer)
        --> running requests go on, up to --shutdown-timeout seconds
        --> the rest are aborted: finish_reason "abort", stop_reason "server_shutdown"
        --> uvicorn closes the connections, the lifespan stops the engine, and the process exits 0
a second SIGTERM or Ctrl-C: stop at once (requests still waiting get an error, never a hang)
```
uvicorn on its own would stop accepting connections at once and, once done, re-raise the signal, so that the
process would end with status 143 rather than 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from pagedllm.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains `engine` for up to `shutdown_timeout` seconds."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Future | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in uvicorn's captured signals: a graceful stop is a normal exit (status 0).
        if self._draining or self._loop is None or not self.started:
            self.should_exit = True
            self.force_exit = self._draining and sig == signal.SIGINT
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, signal_name: str) -> None:
        self._drain_task = asyncio.ensure_future(self._drain(signal_name))

    async def _drain(self, signal_name: str) -> None:
        logger.info("%s: shutting down; new requests get 503; running requests have %.1f s to finish",
                    signal_name, self.shutdown_timeout)
        try:
            aborted = await self.engine.drain(self.shutdown_timeout)
            logger.info("drained: %d request(s) aborted at the deadline", aborted)
        finally:
            self.should_exit = True
