"""What passes between the scheduler, the runner and the engine each step: plain data, no behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from pagedllm.core.request import FinishReason
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal import ImageInput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: scheduled for the first time, or again after a preemption.

    `output_token_ids` is empty for a fresh request; after a preemption it holds the tokens generated so far
    (the runner needs them for penalties; their K/V is recomputed from `ScheduledRequest.token_ids`).
    `pooling_params` marks an embedding request (`Request.pooling_params`); `lora_request` names its LoRA adapter;
    `token_type_ids` and `images` are its prompt's (`Request.token_type_ids`, `Request.images`).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None
    token_type_ids: list[int] | None = None
    images: tuple[ImageInput, ...] = ()


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of the step.

    Invariants: `token_ids` are the request's tokens at positions
    `num_computed_tokens : num_computed_tokens + len(token_ids)` (at least one), followed by its
    `spec_token_ids`; `block_ids` (the whole block table) has room for all of them; `sample` is True exactly when
    these tokens reach the request's last known token, so the runner samples the next one.

    `spec_token_ids` (speculative decoding) are draft tokens after the last known one: the runner verifies them
    in the same forward pass (logits at each of the last `1 + len(spec_token_ids)` positions), and reports how
    many it accepted in `RunnerOutput.num_accepted_draft_tokens`.

    `num_lookahead_tokens` (draft-model speculative decoding; 0 otherwise) is set on a request that samples: the
    runner's draft model then proposes up to that many drafts to follow the step's accepted tokens
    (`RunnerOutput.draft_token_ids`), writing their K/V into slots past the step's tokens, for which `block_ids`
    has room too.

    `child_request_ids` is set only on the first sampled token of a parallel-sampling request (n > 1): the runner
    samples that row once more for each child, child i (1-based) with its own seed stream
    (`pagedllm.core.request.child_seed`), creates their sampling state, and returns one token per id; the
    scheduler then forks the children off the request (shared blocks) in `update_from_output`.
    """

    request_id: str
    block_ids: list[int]
    num_computed_tokens: int
    token_ids: list[int]
    sample: bool
    child_request_ids: list[str] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    num_lookahead_tokens: int = 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan.

    `scheduled` is in batch order; every request in `new_requests` is also in `scheduled`.
    `num_batched_tokens` is the sum of `len(token_ids)` over `scheduled`, at most `max_num_batched_tokens`.
    `finished_request_ids` finished since the last step: the runner drops their state. `preempted_request_ids` were
    preempted in this one: the runner keeps their state (a seeded generator goes on where it stopped) and
    recognises them when they come back through `new_requests`; the engine reads the list to fail the requests
    a failed step was swapping out.
    The block lists are `(src, dst)` block-id pairs the runner applies before the forward pass, in this order:
    `blocks_to_swap_out` (device -> swap pool), `blocks_to_swap_in` (swap pool -> device), then
    `blocks_to_copy` (device -> device, copy-on-write; read all sources before writing any destination).
    Every destination is a block no one reads this step before the transfer; no block is the destination of
    two pairs.
    """

    new_requests: list[NewRequestData] = field(default_factory=list)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: set[str] = field(default_factory=set)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RunnerOutput:
    """What the runner produced: one sampled token for each request scheduled with `sample=True`, and its
    log-probabilities when asked for (their structure is the sampler's). `prompt_logprobs` holds, for each request
    with `prompt_logprobs` whose step computed prompt positions not reported before, one entry per such position
    p: the log-probabilities of prompt token p + 1 and of the top tokens there (a list of (token_id, logprob,
    rank), the prompt token first).

    For a request scheduled with draft tokens, `num_accepted_draft_tokens` says how many of them (a prefix) were
    accepted, and the sampled token comes after those: the request's new tokens are
    `spec_token_ids[:num_accepted] + [sampled]`, and its logprobs hold one entry per new token.

    `draft_token_ids` holds the drafts the draft model proposed for each request scheduled with
    `num_lookahead_tokens` (after its new tokens; maybe fewer than asked, maybe none); `draft_model_off` says
    that the draft model failed in this step and is off from now on (the scheduler stops reserving its slots).

    `embeddings` holds, for each embedding request that sampled (its prompt's last token ran this step), its
    prompt's embedding (`PoolingParams`)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, list[object]] = field(default_factory=dict)   # one entry per new token
    prompt_logprobs: dict[str, list[object]] = field(default_factory=dict)
    num_accepted_draft_tokens: dict[str, int] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_model_off: bool = False
    embeddings: dict[str, list[float]] = field(default_factory=dict)

    def merged(self, other: RunnerOutput) -> RunnerOutput:
        """The outputs of two runs of disjoint requests (one step run again in parts) as one."""
        return RunnerOutput(**{f.name: getattr(self, f.name) | getattr(other, f.name) for f in fields(self)})


@dataclass(slots=True)
class RequestUpdate:
    """What changed for one request in a step, for the engine's detokenizer and outputs.

    `finish_reason` is set once, on the request's last update; `stop_reason` is the stop token id that ended
    it (None for EOS, length or abort). `num_cached_tokens` is the prefix-cache hit at first scheduling.
    A forked sequence (a parallel-sampling child) names its group's first request in `parent_request_id` and its
    completion number in `index`. A beam (`Request.engine_appends_tokens`) gets updates with no token ids,
    only `new_logprobs`. `new_prompt_logprobs` are the prompt positions the step computed (RunnerOutput's
    `prompt_logprobs`); a chunk of the prompt that samples nothing gets an update with just those. `embedding`:
    an embedding request's, with its one token (RunnerOutput's `embeddings`).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[object] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    parent_request_id: str | None = None
    index: int = 0
    new_prompt_logprobs: list[object] | None = None
    embedding: list[float] | None = None
