"""The token-budget scheduler.

One rule: each step a request gets `num_tokens - num_computed_tokens` tokens, capped by what is left of the
step's token budget (and by `max_model_len`). Chunked prefill, prefix-cache hits, recompute after preemption
and decode all follow from it. Running requests are served first, in order; then swapped-out ones, in
(priority, arrival_time) order; then, once none is left swapped out, waiting ones, in the same order, while
there is budget, a free sequence slot and blocks.

When a running request cannot get blocks, the lowest-priority, latest-arriving running request (maybe itself)
is preempted, by recompute or by swap (`SchedulerConfig.preemption_mode`):
  - recompute: its blocks are freed (their hashes stay in the prefix cache), its computed tokens are
    forgotten, and it waits again with its original priority and arrival time;
  - swap: its computed blocks move to the swap pool (`blocks_to_swap_out`) and it waits in `swapped`; it
    comes back into fresh device blocks (`blocks_to_swap_in`) before any waiting request is admitted;
  - auto: swap when moving the blocks out and back costs less than recomputing them:
        2 x num_blocks x swap_seconds_per_block  <  num_computed_tokens x recompute_seconds_per_token.
    The two costs are measured, not assumed: the engine times a short prefill and a block copy to the swap
    pool and back at start-up, then follows its own steps on a CPU with an exponential moving average (weight
    0.2 for the newest) of the seconds per token of steps of at least 64 tokens and of the seconds per block
    of steps that swapped (`pagedllm.engine.llm_engine.follow_step_costs`). The scheduler only reads them.
A request falls back to recompute when the swap pool has no room, when it has nothing computed, when it is a
beam waiting for its next token, or when a block of it was copied (copy-on-write) this very step.
No admission happens in a step with a preemption.

Parallel sampling (n > 1): the request runs alone until its first sampled token. That step asks the runner
for n samples of its last row (`ScheduledRequest.child_request_ids`); `update_from_output` then forks n - 1
children off it (`KVCacheManager.fork`: shared blocks), and each sequence goes on by itself. A group reserves
`group_size` (n, or the beam width) of the `max_num_seqs` seats when its first request is admitted.

Speculative decoding (with a `propose` function, or drafts from the runner): a running request whose only token
left to compute is its last one is scheduled with that token plus up to k draft tokens
(`ScheduledRequest.spec_token_ids`), and the KV manager allocates slots for all of them. With a draft model
(`num_lookahead_tokens` k > 0) the runner proposes the drafts after a step in which a request sampled, writing
their K/V into k slots past the step's tokens, which the scheduler allocated with the step
(`ScheduledRequest.num_lookahead_tokens`); `update_from_output` keeps them on the request (`draft_token_ids`)
for its next step. The runner verifies the drafts; `update_from_output` appends the
accepted ones and the token sampled after them, and advances `num_computed_tokens` only over the accepted
tokens. The rejected drafts' slots stay allocated and are overwritten by the next step's tokens; since block
hashes are computed from `all_token_ids` and `cache_full_blocks` stops at `num_computed_tokens`, the prefix cache
only ever sees accepted tokens. No drafts for beams, for a structured-output request, or for a parallel-sampling
request before its fork.

Beam search: beams are requests with `engine_appends_tokens`. Their updates carry logprobs but no token; the
engine picks the continuations and calls `append_token`, `fork_request` and `finish_requests`.

Images: a prompt's chunk stops before an image whose encoding the step's encoder budget has no room left for
(`max_num_encoder_input_tokens`, in placeholders; the step's first image runs whatever its size), so that the
encoder's work is spread over steps.

A request that needs more blocks than the whole pool holds can never run. `schedule()` finishes it instead of
waiting forever: with `FinishReason.ABORT` when its prompt alone is too long, with `FinishReason.LENGTH` when
its generated tokens made it too long. Its `RequestUpdate` comes with the next `update_from_output`.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache.block_map import BlockMap
from pagedllm.core.kv_cache.manager import ComputedBlocks, KVCacheManager, cdiv
from pagedllm.core.request import FinishReason, Request, RequestStatus, child_request_id
from pagedllm.core.sched.output import NewRequestData, RequestUpdate, RunnerOutput, ScheduledRequest, SchedulerOutput
from pagedllm.metrics.stats import SchedulerStats, SpecDecodingStats
from pagedllm.multimodal import ImageInput

# (token_ids, max_num_tokens) -> draft tokens to follow token_ids, at most max_num_tokens of them.
DraftProposer = Callable[[list[int], int], list[int]]


def _lora_names(requests: list[Request]) -> list[str]:
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})


def _waiting_order(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


def _group_seats(group_size: int, num_running: int) -> int:
    """A group with running members holds group_size seats (more if it ever had more members running)."""
    return max(group_size, num_running) if num_running else 0


def _images_reached(request: Request, start: int, num_tokens: int) -> list[ImageInput]:
    """The request's images whose first placeholder is among tokens [start, start + num_tokens): the step that
    computes it encodes the image (the runner keeps its rows until the request ends). Prompt embeddings, which
    take no encoder, are none."""
    return [image for image in request.images if start <= image.offset < start + num_tokens and not image.embeds]


@dataclass(slots=True)
class _StepPlan:
    """The step being built: tokens per scheduled request id, in batch order, and the blocks to move."""

    token_budget: int
    encoder_budget: int     # image placeholders whose images the step may still encode
    prefill_cap: int = 0    # the most tokens one request's prefill chunk takes (0: no cap): `_prefill_cap`
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)   # draft tokens included
    num_encoder_tokens: dict[str, int] = field(default_factory=dict)     # those each request's chunk encodes
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)   # draft slots past the step's tokens
    new_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: set[str] = field(default_factory=set)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    def add(self, request: Request, num_tokens: int, spec_token_ids: list[int] | None = None) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens
        if request.images:
            encoded = sum(image.length for image in _images_reached(request, request.num_computed_tokens, num_tokens))
            self.num_encoder_tokens[request.request_id] = encoded
            self.encoder_budget -= encoded
        if spec_token_ids:
            self.spec_token_ids[request.request_id] = spec_token_ids

    def remove(self, request: Request) -> None:
        self.token_budget += self.num_scheduled_tokens.pop(request.request_id, 0)
        self.encoder_budget += self.num_encoder_tokens.pop(request.request_id, 0)
        self.spec_token_ids.pop(request.request_id, None)
        self.num_lookahead_tokens.pop(request.request_id, None)


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    Args:
        config: max_num_seqs, max_num_batched_tokens, max_model_len, the preemption mode and its costs.
        kv_cache_manager: the block tables; the scheduler is its only writer.
        propose: speculative decoding's draft proposer (e.g. `NgramProposer.propose`); None: no drafts, unless
            num_lookahead_tokens > 0.
        max_batch_for_drafts: no drafts while more requests than this run; None: no limit.
        max_loras: most distinct LoRA adapters among the running requests; a waiting request of another adapter is
            passed over (those after it may start) until one of theirs finishes. None: LoRA off.
        num_lookahead_tokens: draft-model speculative decoding: the runner's draft model proposes up to this many
            drafts after each step in which a request samples, into slots allocated past the step's tokens; 0: off.

    Each `schedule()` must be followed by `update_from_output()` with the runner's result, even when the
    output is empty: that is where updates for requests finished inside `schedule()` are delivered.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 propose: DraftProposer | None = None, max_batch_for_drafts: int | None = None,
                 max_loras: int | None = None, num_lookahead_tokens: int = 0) -> None:
        self.config = config
        # image placeholders a step may encode the images of (`_num_new_tokens`)
        self.encoder_budget = config.max_num_encoder_input_tokens or config.max_num_batched_tokens
        self.max_loras = max_loras
        self.kv_cache_manager = kv_cache_manager
        self.propose = propose
        self.max_batch_for_drafts = max_batch_for_drafts
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_decoding_stats = SpecDecodingStats()
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: list[Request] = []  # sorted by (priority, arrival_time); new and preempted
        self.running: list[Request] = []  # in admission order
        self.swapped: list[Request] = []  # sorted by (priority, arrival_time); blocks in the swap pool
        self.num_preemptions = 0
        self.num_preemptions_by_mode: dict[str, int] = {"recompute": 0, "swap": 0}
        self._finished_request_ids: set[str] = set()
        self._last_scheduled_request_ids: list[str] = []  # the requests of the last schedule(), for make_stats
        self._last_num_scheduled_tokens = 0  # and their tokens
        self._pending_updates: list[RequestUpdate] = []
        self._unannounced_request_ids: set[str] = set()  # forked beams the runner has not seen yet
        # Seats (of max_num_seqs) held by the running requests: each group holds max(group_size, its count).
        self._num_running_in_group: Counter[str] = Counter()
        self._num_seats = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def make_stats(self) -> SchedulerStats:
        """A snapshot of the queues, the KV pool and the counters, for metrics (from the stepping thread)."""
        kv = self.kv_cache_manager
        prefix = kv.prefix_cache_stats
        num_slots = sum(kv.num_blocks_held(r.request_id) for r in self.running) * kv.block_size
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_swapped=len(self.swapped),
            num_blocks_free=kv.num_free_blocks, num_blocks_total=kv.num_usable_blocks,
            num_swap_blocks_free=kv.num_free_swap_blocks, num_swap_blocks_total=kv.num_usable_swap_blocks,
            num_preemptions_total=dict(self.num_preemptions_by_mode),
            prefix_cache_queries_total=prefix.num_query_tokens, prefix_cache_hits_total=prefix.num_hit_tokens,
            num_kv_slots_running=num_slots,
            num_kv_slots_filled=sum(r.num_computed_tokens for r in self.running),
            scheduled_request_ids=list(self._last_scheduled_request_ids),
            num_scheduled_tokens=self._last_num_scheduled_tokens,
            spec_decoding=self.spec_decoding_stats.copy() if self.speculates else None,
            max_loras=self.max_loras,      # with LoRA off, the queues are not walked for adapters
            running_lora_adapters=_lora_names(self.running) if self.max_loras is not None else [],
            waiting_lora_adapters=_lora_names([*self.waiting, *self.swapped]) if self.max_loras is not None else [],
            kv_block_residencies=kv.take_residencies())

    def make_block_map(self) -> BlockMap:
        """A snapshot of the KV pools and of the block tables of every unfinished request (for the dashboard;
        from the stepping thread)."""
        return self.kv_cache_manager.make_block_map(self.requests.values())

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError for a duplicate id, an empty prompt, a prompt longer than
        max_model_len, or a group (n or beam width) larger than max_num_seqs (or max_num_active_seqs)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not 0 < request.num_prompt_tokens <= self.config.max_model_len:
            raise ValueError(f"the prompt has {request.num_prompt_tokens} tokens; it must have between 1 and "
                             f"max_model_len ({self.config.max_model_len})")
        if request.num_pending_children:
            request.group_size = max(request.group_size, request.sampling_params.n)
        if request.group_size > self.config.max_running_seqs:
            raise ValueError(f"n (or the beam width) is {request.group_size}, more than the sequences that may run "
                             f"at once (max_num_seqs, max_num_active_seqs: {self.config.max_running_seqs})")
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=_waiting_order)

    def finish_requests(self, request_ids: str | Iterable[str], reason: FinishReason) -> None:
        """Finish requests wherever they are (waiting, running, preempted, swapped), freeing their blocks;
        unknown or already finished ids are ignored. For aborts and stop strings."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, reason)

    # ---- beam search: the engine picks the tokens ----------------------------------------------------------------
    def append_token(self, request_id: str, token_id: int) -> None:
        """Append a token the engine chose to a beam (a request with `engine_appends_tokens`)."""
        request = self.requests[request_id]
        assert request.engine_appends_tokens and request.num_tokens < self.config.max_model_len
        request.append_output_token_ids(token_id)

    def fork_request(self, parent_id: str, child_id: str, token_id: int) -> Request:
        """A new beam: the parent's tokens plus `token_id`, sharing the parent's blocks (copy-on-write).

        Call between steps, before appending to the parent. The child runs (or waits) where the parent is.
        """
        parent = self.requests[parent_id]
        assert parent.engine_appends_tokens and parent.status is not RequestStatus.SWAPPED
        if child_id in self.requests:
            raise ValueError(f"request id {child_id!r} is already in use")
        child = parent.fork(child_id, index=0)
        self._add_forked(parent, child)
        self._unannounced_request_ids.add(child_id)
        child.append_output_token_ids(token_id)
        return child

    def _add_forked(self, parent: Request, child: Request) -> None:
        self.requests[child.request_id] = child
        self.kv_cache_manager.fork(parent, child)
        if child.status is RequestStatus.RUNNING:
            self._add_running(child)
        else:
            bisect.insort(self.waiting, child, key=_waiting_order)

    # ---- schedule ---------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(self.config.max_num_batched_tokens, self.encoder_budget, self._prefill_cap())
        self.kv_cache_manager.start_step()
        self._schedule_running(plan)
        # Admitting anyone right after a preemption would just take the blocks that were freed for others.
        if not plan.preempted_request_ids:
            if self.swapped:    # the swapped go first, but for waiting requests of a strictly higher priority
                self._schedule_waiting(plan, better_than=self.swapped[0].priority)
            self._schedule_swapped(plan)
            if not self.swapped:
                self._schedule_waiting(plan)
        if self.num_lookahead_tokens:
            self._allocate_lookahead(plan)
        return self._make_output(plan)

    def _schedule_running(self, plan: _StepPlan) -> None:
        for request in list(self.running):
            if plan.token_budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if request.num_computed_tokens == request.num_tokens:  # a beam waiting for the engine's token
                continue
            num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, plan)
            if num_new_tokens == 0:     # its next image waits for a step with room to encode it
                continue
            spec_token_ids = self._propose_drafts(request, plan.token_budget - num_new_tokens)
            # Drafts never cost a preemption: without free blocks for them, the request runs without drafts.
            if spec_token_ids and self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens + len(spec_token_ids)) is None:
                spec_token_ids = []
            if spec_token_ids or self._allocate_or_preempt(request, num_new_tokens, plan):
                plan.add(request, num_new_tokens + len(spec_token_ids), spec_token_ids)

    @property
    def speculates(self) -> bool:
        return self.propose is not None or self.num_lookahead_tokens > 0

    def _may_draft(self, request: Request, num_output_tokens: int) -> bool:
        """Whether a request may get drafts at a step after which it has `num_output_tokens`: not a beam, a
        parallel-sampling request before its fork, an embedding, or a structured-output request (its grammar
        decides which tokens may follow; verifying drafts under a grammar is not built); not while more than
        `max_batch_for_drafts` requests run; and only with room for a draft before max_tokens."""
        max_tokens = request.sampling_params.max_tokens
        return (self.speculates and not request.engine_appends_tokens and not request.num_pending_children
                and request.pooling_params is None and request.sampling_params.structured_outputs is None
                and (self.max_batch_for_drafts is None or len(self.running) <= self.max_batch_for_drafts)
                and (max_tokens is None or num_output_tokens < max_tokens - 1))

    def _propose_drafts(self, request: Request, token_budget: int) -> list[int]:
        """Draft tokens for a request about to compute its last token (`_may_draft`), so many that the drafts and
        the token sampled after them stay within the budget, max_tokens and max_model_len: from `propose`, or those
        the runner's draft model proposed after the request's last step."""
        if request.num_computed_tokens != request.num_tokens - 1 or not self._may_draft(request,
                                                                                         request.num_output_tokens):
            return []
        max_num_tokens = min(token_budget, self.config.max_model_len - request.num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            max_num_tokens = min(max_num_tokens, max_tokens - request.num_output_tokens - 1)
        if max_num_tokens <= 0:
            return []
        if self.propose is not None:
            return self.propose(request.all_token_ids, max_num_tokens)
        return request.draft_token_ids[:max_num_tokens]     # set by every update in which the request sampled

    def _allocate_lookahead(self, plan: _StepPlan) -> None:
        """With a draft model, slots for the drafts it proposes after this step for each request that samples in
        it: k past the step's tokens, from the blocks the step left free (never at the cost of a preemption or
        an admission); the step then asks the runner for drafts (`ScheduledRequest.num_lookahead_tokens`)."""
        k = self.num_lookahead_tokens
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests[request_id]
            num_new_tokens = num_tokens - len(plan.spec_token_ids.get(request_id, ()))
            if (request.num_computed_tokens + num_new_tokens == request.num_tokens
                    and self._may_draft(request, request.num_output_tokens + 1)
                    and self.kv_cache_manager.allocate_slots(request, num_tokens + k) is not None):
                plan.num_lookahead_tokens[request_id] = k

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, plan: _StepPlan) -> bool:
        """Get blocks for a running request, preempting others (or itself) until they fit.
        False if the request itself was preempted."""
        while self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
            # reversed: among equal keys, max() then picks the latest admitted.
            victim = max(reversed(self.running), key=_waiting_order)
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """Preempt by swap or by recompute (see the module docstring); the request leaves `running`."""
        self._remove_running(request)
        plan.remove(request)
        plan.preempted_request_ids.add(request.request_id)
        mode = self._preemption_mode(request)
        if mode == "swap":
            plan.blocks_to_swap_out += self.kv_cache_manager.swap_out(request)
            request.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, request, key=_waiting_order)
        else:
            self._wait_to_recompute(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preemptions_by_mode[mode] += 1

    def undo_step_sharing(self, scheduled: list[ScheduledRequest]) -> set[str]:
        """The step planned last failed (raised): take back its blocks cached ahead
        (`KVCacheManager.undo_blocks_ahead`), and send each request that hit one back to wait, to be recomputed
        (the blocks it read may hold no K/V); returns their ids, which must not run in this step again. Their
        counters are as schedule() left them: `update_from_output` must not see them."""
        requeued = self.kv_cache_manager.undo_blocks_ahead() & {s.request_id for s in scheduled}
        for request_id in requeued:
            self._remove_running(self.requests[request_id])
            self._wait_to_recompute(self.requests[request_id])
        return requeued

    def requeue_running(self) -> list[str]:
        """Every running request drops its blocks and waits to be recomputed (the KV pool's memory is about to be
        released: `LLMEngine.sleep`); their ids. Not counted as preemptions, which measure a full pool."""
        requeued = [request.request_id for request in self.running]
        for request in list(self.running):
            self._remove_running(request)
            self._wait_to_recompute(request)
        return requeued

    def _wait_to_recompute(self, request: Request) -> None:
        """A request out of `running` drops its blocks (their hashes stay cached) and its computed tokens, and
        waits again with its original priority and arrival time."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        bisect.insort(self.waiting, request, key=_waiting_order)

    def _preemption_mode(self, request: Request) -> str:
        config = self.config
        if (config.preemption_mode == "recompute" or request.num_computed_tokens == request.num_tokens
                or not self.kv_cache_manager.can_swap_out(request)):
            return "recompute"
        if config.preemption_mode == "swap":
            return "swap"
        num_blocks = cdiv(request.num_computed_tokens, self.kv_cache_manager.block_size)
        swap_cost = 2 * num_blocks * config.swap_seconds_per_block
        recompute_cost = request.num_computed_tokens * config.recompute_seconds_per_token
        return "swap" if swap_cost < recompute_cost else "recompute"

    def _schedule_swapped(self, plan: _StepPlan) -> None:
        """Swap requests back in, best first, while they fit; never preempts."""
        while self.swapped and plan.token_budget > 0:
            request = self.swapped[0]
            if not self._fits_in_pool(request.num_tokens):
                self._finish_unschedulable(request)
                continue
            num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, plan)
            if num_new_tokens == 0 or not self._has_seat_for(request) or \
                    not self.kv_cache_manager.can_swap_in(request, num_new_tokens):
                return
            self.swapped.pop(0)
            plan.blocks_to_swap_in += self.kv_cache_manager.swap_in(request)
            allocated = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            assert allocated is not None, "can_swap_in promised room"
            self._start(request, num_new_tokens, plan)

    def _schedule_waiting(self, plan: _StepPlan, better_than: int | None = None) -> None:
        """Admit waiting requests, first in line first, while they fit (`better_than`: only those of a priority
        below it, which go before the swapped requests)."""
        passed_over: list[Request] = []      # of a LoRA adapter that would be one too many
        running_loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None} \
            if self.max_loras is not None else set()
        if self.waiting:    # the blocks this step fills, for the admissions to hit (no preemption follows now)
            for request_id, num_tokens in plan.num_scheduled_tokens.items():
                self.kv_cache_manager.cache_blocks_ahead(
                    self.requests[request_id], num_tokens - len(plan.spec_token_ids.get(request_id, ())))
        while self.waiting and plan.token_budget > 0 and self._has_seat_for(self.waiting[0]) and \
                (better_than is None or self.waiting[0].priority < better_than):
            request = self.waiting[0]
            if not self._lora_fits(request, running_loras):
                passed_over.append(self.waiting.pop(0))
            elif not self._fits_in_pool(request.num_tokens):
                self._finish_unschedulable(request)
            elif not self._admit(request, plan):
                break
            elif request.lora_request is not None:
                running_loras.add(request.lora_request.lora_int_id)
        self.waiting[:0] = passed_over       # they were first in line, and stay so

    def _lora_fits(self, request: Request, running_loras: set[int]) -> bool:
        """Whether the request's adapter runs already, or one more adapter fits under max_loras."""
        if self.max_loras is None or request.lora_request is None:
            return True
        return request.lora_request.lora_int_id in running_loras or len(running_loras) < self.max_loras

    def _admit(self, request: Request, plan: _StepPlan) -> bool:
        """Start (or restart) the first waiting request, after a prefix-cache lookup. False if out of blocks (for its
        whole sequence, with scheduler_reserve_full_isl, and the watermark), or, without chunked prefill, if what is
        left of the step's budget cannot hold the rest of its tokens."""
        computed = self.kv_cache_manager.get_computed_blocks(request)
        num_new_tokens = self._num_new_tokens(request, computed.num_computed_tokens, plan)
        if num_new_tokens == 0 or not self.config.enable_chunked_prefill and \
                computed.num_computed_tokens + num_new_tokens < request.num_tokens:
            return False        # it runs whole, in a step with room for all of it (and its images)
        if not self._room_to_admit(request, computed, num_new_tokens) or \
                self.kv_cache_manager.allocate_slots(request, num_new_tokens, computed) is None:
            return False
        self.waiting.pop(0)
        request.num_computed_tokens = computed.num_computed_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = computed.num_computed_tokens
        self.kv_cache_manager.cache_blocks_ahead(request, num_new_tokens)
        self._start(request, num_new_tokens, plan)
        return True

    def _room_to_admit(self, request: Request, computed: ComputedBlocks, num_new_tokens: int) -> bool:
        """vLLM's admission gate: the free blocks hold, beyond the watermark (while others run), the blocks the
        request takes (`KVCacheManager.has_room_to_admit`): for its whole sequence with scheduler_reserve_full_isl,
        else for this step's tokens."""
        kv, config = self.kv_cache_manager, self.config
        num_tokens = request.num_tokens if config.scheduler_reserve_full_isl else \
            computed.num_computed_tokens + num_new_tokens
        watermark = int(config.watermark * kv.num_usable_blocks) if self.running else 0
        return kv.has_room_to_admit(computed, num_tokens, config.max_num_batched_tokens, watermark)

    def _start(self, request: Request, num_new_tokens: int, plan: _StepPlan) -> None:
        request.status = RequestStatus.RUNNING
        self._add_running(request)
        plan.add(request, num_new_tokens)
        plan.new_request_ids.append(request.request_id)

    # ---- seats: max_num_seqs counts every sequence a running group may fork into -------------------------------
    def _seats_after(self, request: Request, change: int) -> int:
        """Seats held by the running requests if the request's group had `change` more running members."""
        count = self._num_running_in_group[request.group_id]
        return self._num_seats - _group_seats(request.group_size, count) + \
            _group_seats(request.group_size, count + change)

    def _has_seat_for(self, request: Request) -> bool:
        return self._seats_after(request, +1) <= self.config.max_running_seqs

    def _add_running(self, request: Request) -> None:
        self._num_seats = self._seats_after(request, +1)
        self._num_running_in_group[request.group_id] += 1
        self.running.append(request)

    def _remove_running(self, request: Request) -> None:
        self.running.remove(request)
        self._num_seats = self._seats_after(request, -1)
        self._num_running_in_group[request.group_id] -= 1
        if not self._num_running_in_group[request.group_id]:
            del self._num_running_in_group[request.group_id]

    def _fits_in_pool(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens, run alone, fits in the pool (`KVCacheManager.fits`)."""
        return self.kv_cache_manager.fits(num_tokens, self.config.max_num_batched_tokens)

    def _finish_unschedulable(self, request: Request) -> None:
        reason = FinishReason.LENGTH if self._fits_in_pool(request.num_prompt_tokens) else FinishReason.ABORT
        self._finish(request, reason)
        self._pending_updates.append(RequestUpdate(request.request_id, [], finish_reason=reason,
                                                   num_cached_tokens=request.num_cached_tokens,
                                                   parent_request_id=request.parent_id, index=request.index))

    def _prefill_cap(self) -> int:
        """The most tokens one request computes in a step (vLLM's long_prefill_token_threshold; 0: no cap), so
        that one long prompt does not take a whole step's budget from the others: none for a request alone, which
        starves nobody, nor without chunked prefill; adaptive, at least a fair share of the step's budget."""
        threshold, num_requests = self.config.long_prefill_token_threshold, len(self.running) + len(self.waiting)
        if not threshold or num_requests < 2 or not self.config.enable_chunked_prefill:
            return 0
        if self.config.long_prefill_token_threshold_adaptive:
            return max(threshold, self.config.max_num_batched_tokens // num_requests)
        return threshold

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, plan: _StepPlan) -> int:
        """The tokens the request computes this step: what it has left, within the step's token budget and its
        prefill cap (not for an image that must be computed whole), and cut before the first image its chunk
        reaches that the encoder budget has no room left for (the step's first image runs whatever its size). 0:
        none this step."""
        num_new_tokens = min(request.num_tokens - num_computed_tokens, plan.token_budget,
                             self.config.max_model_len - num_computed_tokens)
        assert num_new_tokens > 0, f"request {request.request_id} has nothing to compute"
        if plan.prefill_cap and not (self.config.whole_images and request.images):
            num_new_tokens = min(num_new_tokens, plan.prefill_cap)
        if not request.images:
            return num_new_tokens
        left, fresh = plan.encoder_budget, plan.encoder_budget == self.encoder_budget
        for image in _images_reached(request, num_computed_tokens, num_new_tokens):
            if image.length > left and not fresh:
                return image.offset - num_computed_tokens
            left, fresh = left - image.length, False
        if self.config.whole_images:    # and no chunk ends inside an image (none begins in one but where it hit)
            end = num_computed_tokens + num_new_tokens
            cut = [image.offset for image in request.images if image.offset < end < image.offset + image.length]
            if cut:
                return max(cut[0] - num_computed_tokens, 0)
        return num_new_tokens

    def _make_output(self, plan: _StepPlan) -> SchedulerOutput:
        scheduled = [self._scheduled_request(self.requests[request_id], num_tokens,
                                             plan.spec_token_ids.get(request_id, []),
                                             plan.num_lookahead_tokens.get(request_id, 0))
                     for request_id, num_tokens in plan.num_scheduled_tokens.items()]
        new_request_ids = plan.new_request_ids + [request_id for request_id in plan.num_scheduled_tokens
                                          if request_id in self._unannounced_request_ids
                                          and request_id not in plan.new_request_ids]
        self._unannounced_request_ids.difference_update(plan.num_scheduled_tokens)
        self._last_scheduled_request_ids = list(plan.num_scheduled_tokens)
        self._last_num_scheduled_tokens = num_batched_tokens = sum(plan.num_scheduled_tokens.values())
        new_requests = []
        for request_id in new_request_ids:
            request = self.requests[request_id]
            new_requests.append(NewRequestData(request_id, request.prompt_token_ids, request.sampling_params,
                                               list(request.output_token_ids), request.pooling_params,
                                               request.lora_request, request.token_type_ids, request.images))
        finished_request_ids, self._finished_request_ids = self._finished_request_ids, set()
        return SchedulerOutput(new_requests=new_requests, scheduled=scheduled,
                               num_batched_tokens=num_batched_tokens,
                               finished_request_ids=finished_request_ids,
                               preempted_request_ids=plan.preempted_request_ids,
                               blocks_to_copy=self.kv_cache_manager.take_blocks_to_copy(),
                               blocks_to_swap_out=plan.blocks_to_swap_out,
                               blocks_to_swap_in=plan.blocks_to_swap_in)

    def _scheduled_request(self, request: Request, num_tokens: int, spec_token_ids: list[int],
                           num_lookahead_tokens: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_tokens - len(spec_token_ids)
        sample = end == request.num_tokens
        child_request_ids = ([child_request_id(request.request_id, i)
                          for i in range(1, request.num_pending_children + 1)] if sample else [])
        return ScheduledRequest(request_id=request.request_id,
                                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                                num_computed_tokens=start,
                                token_ids=request.all_token_ids[start:end] + spec_token_ids,
                                sample=sample, child_request_ids=child_request_ids, spec_token_ids=spec_token_ids,
                                num_lookahead_tokens=num_lookahead_tokens)

    # ---- update -----------------------------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: RunnerOutput) -> list[RequestUpdate]:
        """Apply a step's result: advance the counters, fork parallel-sampling children, append sampled
        tokens, cache newly full blocks, check stop conditions and free finished requests. Returns an update
        per sequence that got a token (or, for beams, logprobs) or finished."""
        updates, self._pending_updates = self._pending_updates, []
        if runner_output.draft_model_off:
            self.num_lookahead_tokens = 0
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None:  # finished (aborted) after schedule()
                continue
            updates += self._update_request(request, scheduled, runner_output)
        return updates

    def _update_request(self, request: Request, scheduled: ScheduledRequest,
                        runner_output: RunnerOutput) -> list[RequestUpdate]:
        assert request.num_computed_tokens == scheduled.num_computed_tokens, "output does not match the state"
        # Draft tokens are not the request's tokens yet: the accepted ones count once appended.
        request.num_computed_tokens += scheduled.num_new_tokens - len(scheduled.spec_token_ids)
        self.kv_cache_manager.cache_full_blocks(request)
        prompt_logprobs = runner_output.prompt_logprobs.get(request.request_id)
        if not scheduled.sample:
            return [RequestUpdate(request.request_id, [], num_cached_tokens=request.num_cached_tokens,
                                  parent_request_id=request.parent_id, index=request.index,
                                  new_prompt_logprobs=prompt_logprobs)] if prompt_logprobs else []
        request.draft_token_ids = runner_output.draft_token_ids.get(request.request_id, [])
        if request.engine_appends_tokens:
            return [RequestUpdate(request.request_id, [], runner_output.logprobs.get(request.request_id),
                                  num_cached_tokens=request.num_cached_tokens, parent_request_id=request.parent_id)]
        sequences = [request]
        for index, child_id in enumerate(scheduled.child_request_ids, start=1):
            sequences.append(request.fork(child_id, index))
            self._add_forked(request, sequences[-1])
        if scheduled.spec_token_ids:
            updates = [self._append_verified(request, scheduled.spec_token_ids, runner_output)]
        else:
            updates = [self._append_sampled(sequence, [runner_output.sampled_token_ids[sequence.request_id]],
                                            runner_output) for sequence in sequences]
        updates[0].new_prompt_logprobs = prompt_logprobs
        updates[0].embedding = runner_output.embeddings.get(request.request_id)
        return updates

    def _append_verified(self, request: Request, spec_token_ids: list[int],
                         runner_output: RunnerOutput) -> RequestUpdate:
        """Append the accepted drafts and the token sampled after them; the verify pass wrote the drafts' K/V,
        so each accepted draft advances num_computed_tokens."""
        num_accepted = runner_output.num_accepted_draft_tokens[request.request_id]
        self.spec_decoding_stats.observe(len(spec_token_ids), num_accepted)
        token_ids = spec_token_ids[:num_accepted] + [runner_output.sampled_token_ids[request.request_id]]
        return self._append_sampled(request, token_ids, runner_output, num_computed=num_accepted)

    def _append_sampled(self, request: Request, token_ids: list[int], runner_output: RunnerOutput,
                        num_computed: int = 0) -> RequestUpdate:
        """Append tokens one by one, stopping at the first that finishes the request (the rest are dropped).
        The first `num_computed` of them already have their K/V in the cache: the blocks they fill are cached."""
        reason = None
        for index, token_id in enumerate(token_ids):
            request.append_output_token_ids(token_id)
            request.num_computed_tokens += int(index < num_computed)
            reason = self._check_stop(request)
            if reason is not None:
                token_ids = token_ids[:index + 1]
                break
        if num_computed:
            self.kv_cache_manager.cache_full_blocks(request)
        if reason is not None:
            self._finish(request, reason)
        logprobs = runner_output.logprobs.get(request.request_id)
        return RequestUpdate(request.request_id, token_ids, logprobs[:len(token_ids)] if logprobs is not None else None,
                             reason, request.stop_reason, request.num_cached_tokens, request.parent_id, request.index)

    def _check_stop(self, request: Request) -> FinishReason | None:
        """Stop on EOS or a stop token (once min_tokens are out), else on max_tokens or max_model_len.
        A stop token is recorded as the request's stop_reason."""
        params = request.sampling_params
        token_id = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                return FinishReason.STOP
            if token_id in (params.stop_token_ids or ()):
                request.stop_reason = token_id
                return FinishReason.STOP
        max_tokens = params.max_tokens
        if (max_tokens is not None and request.num_output_tokens >= max_tokens) or \
                request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self._remove_running(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        request.status = reason.status
        request.finish_reason = reason
        del self.requests[request.request_id]
        self._unannounced_request_ids.discard(request.request_id)
        self._finished_request_ids.add(request.request_id)
