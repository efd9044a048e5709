"""A request as the scheduler sees it: its tokens and the two counters.

`num_tokens` is every token the request knows (prompt + generated); `num_computed_tokens` is how many of them
have K/V in the cache. Each step the scheduler schedules the difference, so there are no prefill or decode phases.
"""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field

from pagedllm.core.kv_cache.hashing import BlockHash, ExtraKey, ImageKey, request_extra_keys
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal import ImageInput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    SWAPPED = enum.auto()      # preempted by swap: its computed blocks wait in the swap pool
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
        parent_id: for a forked sequence (a parallel-sampling child or a beam), the id of its group's first
            request; None for a request the user added.
        index: which of its group's `n` completions this is (0 for the first request).
        group_size: most sequences its group may run at once (`n`, or the beam width); the scheduler reserves
            that many of `max_num_seqs` when it admits the group's first request.
        engine_appends_tokens: beam search: the runner's logprobs are reported, but no sampled token is
            appended and no stop condition checked; the engine picks the next token (`Scheduler.append_token`,
            `Scheduler.fork_request`).
        pooling_params: an embedding request: the runner reports the prompt's embedding with its first (and, as
            the engine sets max_tokens=1, only) sampled token.
        lora_request: the LoRA adapter it runs with; None: the base model.
        token_type_ids: one per prompt token, for a model that adds token type embeddings (a BERT cross-encoder's
            pair); None: all 0.
        images: its prompt's images (`pagedllm.multimodal.ImageInput`), whose placeholders' rows the runner's
            image encoder gives.

    Only `append_output_token_ids` may add output tokens: it keeps `all_token_ids` in step.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    parent_id: str | None = None
    index: int = 0
    group_size: int = 1
    engine_appends_tokens: bool = False
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None
    token_type_ids: list[int] | None = None
    images: tuple[ImageInput, ...] = ()
    output_token_ids: list[int] = field(init=False, default_factory=list)
    num_computed_tokens: int = field(init=False, default=0)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    num_cached_tokens: int = field(init=False, default=0)
    num_preemptions: int = field(init=False, default=0)
    # whether its prefix-cache query was counted (at its first admission: KVCacheManager.allocate_slots)
    prefix_query_counted: bool = field(init=False, default=False)
    finish_reason: FinishReason | None = field(init=False, default=None)
    stop_reason: int | str | None = field(init=False, default=None)
    # draft-model speculative decoding: the tokens the runner's draft model proposed to follow all_token_ids
    draft_token_ids: list[int] = field(init=False, default_factory=list, repr=False)
    # Chained hashes of the full blocks of all_token_ids, extended lazily by the KV cache manager.
    block_hashes: list[BlockHash] = field(init=False, default_factory=list, repr=False)
    _all_token_ids: list[int] = field(init=False, default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self._all_token_ids = list(self.prompt_token_ids)

    @property
    def lora_int_id(self) -> int | None:
        return self.lora_request.lora_int_id if self.lora_request is not None else None

    @property
    def block_extra_keys(self) -> tuple[ExtraKey, ...]:
        """What its blocks' hashes carry beside the tokens: the cache salt and the LoRA adapter."""
        return request_extra_keys(self.cache_salt, self.lora_int_id)

    @property
    def image_keys(self) -> tuple[ImageKey, ...]:
        """Where each image's placeholders start, and its pixels' hash: what its blocks' hashes carry too."""
        return tuple((image.offset, image.content_hash) for image in self.images)

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

    @property
    def group_id(self) -> str:
        """The id shared by a request and every sequence forked from it."""
        return self.parent_id if self.parent_id is not None else self.request_id

    @property
    def num_pending_children(self) -> int:
        """Children a parallel-sampling request (n > 1) forks at its first sampled token: n - 1 until then."""
        n = self.sampling_params.n
        if n == 1 or self.parent_id is not None or self.output_token_ids or self.engine_appends_tokens:
            return 0
        return n - 1

    def fork(self, child_id: str, index: int) -> Request:
        """A copy of this sequence under a new id: same tokens, counters and block hashes (not its blocks:
        `KVCacheManager.fork` shares those)."""
        child = Request(child_id, self.prompt_token_ids, self.sampling_params, self.eos_token_id,
                        self.arrival_time, self.priority, self.cache_salt, parent_id=self.group_id, index=index,
                        group_size=self.group_size, engine_appends_tokens=self.engine_appends_tokens,
                        lora_request=self.lora_request, images=self.images)
        child.output_token_ids = list(self.output_token_ids)
        child._all_token_ids = list(self._all_token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        child.block_hashes = list(self.block_hashes)
        return child

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        new_ids = [token_ids] if isinstance(token_ids, int) else token_ids
        self.output_token_ids.extend(new_ids)
        self._all_token_ids.extend(new_ids)


def child_request_id(parent_id: str, index: int) -> str:
    """The id of completion `index` (>= 1) of a parallel-sampling request."""
    return f"{parent_id}#{index}"


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed of completion `index` of a request seeded with `seed`: completion 0 keeps `seed` (so n=1 and
    outputs[0] of n>1 agree); the others get a 63-bit seed derived from (seed, index), so that requests seeded
    s and s+1 do not share streams. None (unseeded) stays None."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
