"""vLLM's queue limits at a server's front (`max_num_queued_reqs`, `max_num_queued_tokens`): a request that would go
past one is refused at once with 503, so that a load balancer or a client's retry sends it elsewhere, rather than
waiting in a queue the server cannot drain in time.

`max_num_queued_reqs` bounds the requests in flight, waiting or running (a request of n completions counts n);
`max_num_queued_tokens` bounds the prompt tokens of the requests not yet past their prefill (until their first
output), a time-to-first-token budget: its target times the prefill rate. A request is refused only while the
backlog is already at the limit, so that one prompt longer than it still runs when the server is idle. The front
(one AsyncEngine, or the data-parallel replicas' AsyncDataParallelEngine) holds one `Admission` for all its
requests; its counts live on the event loop.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")


class QueueFullError(RuntimeError):
    """A request refused by a queue limit (`reason`: the limit's name); the server answers 503."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Admission:
    """The limits (None: none), what the front holds now, and who hears of a refusal (`on_refusal`: the metrics)."""

    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    num_requests: int = 0
    num_prefill_tokens: int = 0
    on_refusal: list[Callable[[str], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in REASONS:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be None or >= 1, got {value}")

    async def through(self, stream: AsyncGenerator[T, None], n: int, num_prompt_tokens: int
                      ) -> AsyncGenerator[T, None]:
        """`stream` (a request's outputs, not yet started), admitted when first iterated: QueueFullError then if a
        limit is reached, else counted until it ends (its prompt's tokens until its first output)."""
        async with aclosing(stream):
            self._admit(n)
            self.num_requests += n
            queued = num_prompt_tokens
            self.num_prefill_tokens += queued
            try:
                async for item in stream:
                    self.num_prefill_tokens -= queued
                    queued = 0
                    yield item
            finally:
                self.num_requests -= n
                self.num_prefill_tokens -= queued

    def _admit(self, n: int) -> None:
        if self.max_num_queued_reqs is not None and self.num_requests + n > self.max_num_queued_reqs:
            self._refuse("max_num_queued_reqs", f"the server holds {self.num_requests} requests and takes at most "
                         f"{self.max_num_queued_reqs} (max_num_queued_reqs); this one needs {n}: retry later")
        if self.max_num_queued_tokens is not None and self.num_prefill_tokens >= self.max_num_queued_tokens:
            self._refuse("max_num_queued_tokens", f"the server has {self.num_prefill_tokens} prompt tokens waiting "
                         f"for their prefill, at its limit of {self.max_num_queued_tokens} (max_num_queued_tokens): "
                         "retry later")

    def _refuse(self, reason: str, message: str) -> None:
        for listener in self.on_refusal:
            listener(reason)
        raise QueueFullError(reason, message)


def admitted(admission: Admission | None, stream: AsyncGenerator[T, None], params: Any,
             prompt_token_ids: list[int] | None) -> AsyncGenerator[T, None]:
    """A front's request `stream` under its `admission` (None: as it is), counting `params.n` requests (1 for an
    embedding's) and the given prompt's tokens."""
    if admission is None:
        return stream
    return admission.through(stream, getattr(params, "n", 1), len(prompt_token_ids or ()))
