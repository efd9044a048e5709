"""A request as the scheduler sees it: its tokens and the two counters.

`num_tokens` is every token the request knows (prompt + generated); `num_computed_tokens` is how many of them
have K/V in the cache. Each step the scheduler schedules the difference, so there are no prefill or decode phases.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedllm.core.kv_cache.hashing import BlockHash
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


class FinishReason(str, enum.Enum):
    """Why a request ended; the value is what the OpenAI API prints as `finish_reason`."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value

    @property
    def status(self) -> RequestStatus:
        return _STATUS_OF_REASON[self]


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})
_STATUS_OF_REASON = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt; copied.
        sampling_params: how to sample (max_tokens, stop tokens, ...).
        eos_token_id: the model's end-of-sequence token, None if it has none.
        arrival_time: when it arrived (`time.monotonic()` by default); orders requests of equal priority.
        priority: lower runs first.
        cache_salt: isolates this request's prefix-cache entries from requests with another salt.

    Only `append_output_token_ids` may add output tokens: it keeps `all_token_ids` in step.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    output_token_ids: list[int] = field(init=False, default_factory=list)
    num_computed_tokens: int = field(init=False, default=0)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    num_cached_tokens: int = field(init=False, default=0)
    num_preemptions: int = field(init=False, default=0)
    finish_reason: FinishReason | None = field(init=False, default=None)
    stop_reason: int | str | None = field(init=False, default=None)
    # Chained hashes of the full blocks of all_token_ids, extended lazily by the KV cache manager.
    block_hashes: list[BlockHash] = field(init=False, default_factory=list, repr=False)
    _all_token_ids: list[int] = field(init=False, default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self._all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens. The list is shared, not copied: do not modify it."""
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        new_ids = [token_ids] if isinstance(token_ids, int) else token_ids
        self.output_token_ids.extend(new_ids)
        self._all_token_ids.extend(new_ids)
