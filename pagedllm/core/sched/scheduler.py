"""The token-budget scheduler.

One rule: each step a request gets `num_tokens - num_computed_tokens` tokens, capped by what is left of the
step's token budget (and by `max_model_len`). Chunked prefill, prefix-cache hits, recompute after preemption
and decode all follow from it. Running requests are served first, in order; then waiting ones, in
(priority, arrival_time) order, while there is budget, a free sequence slot and blocks.

When a running request cannot get blocks, the lowest-priority, latest-arriving running request (maybe itself)
is preempted by recompute: its blocks are freed (their hashes stay in the prefix cache), its computed tokens
are forgotten, and it waits again with its original priority and arrival time.

A request that needs more blocks than the whole pool holds can never run. `schedule()` finishes it instead of
waiting forever: with `FinishReason.ABORT` when its prompt alone is too long, with `FinishReason.LENGTH` when
its generated tokens made it too long. Its `RequestUpdate` comes with the next `update_from_output`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache.manager import KVCacheManager, cdiv
from pagedllm.core.request import FinishReason, Request, RequestStatus
from pagedllm.core.sched.output import (NewRequestData, RequestUpdate, RunnerOutput, ScheduledRequest,
                                        SchedulerOutput)


def _waiting_order(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


@dataclass(slots=True)
class _StepPlan:
    """The step being built: tokens per scheduled request id, in batch order."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)

    def add(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens

    def remove(self, request: Request) -> None:
        self.token_budget += self.num_scheduled_tokens.pop(request.request_id, 0)


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    Args:
        config: max_num_seqs, max_num_batched_tokens, max_model_len.
        kv_cache_manager: the block tables; the scheduler is its only writer.

    Each `schedule()` must be followed by `update_from_output()` with the runner's result, even when the
    output is empty: that is where updates for requests finished inside `schedule()` are delivered.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: list[Request] = []  # sorted by (priority, arrival_time); new and preempted
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self._finished_req_ids: set[str] = set()
        self._pending_updates: list[RequestUpdate] = []

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError for a duplicate id, an empty prompt, or a prompt longer than
        max_model_len."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not 0 < request.num_prompt_tokens <= self.config.max_model_len:
            raise ValueError(f"the prompt has {request.num_prompt_tokens} tokens; it must have between 1 and "
                             f"max_model_len ({self.config.max_model_len})")
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=_waiting_order)

    def finish_requests(self, request_ids: str | Iterable[str], reason: FinishReason) -> None:
        """Finish requests wherever they are (waiting, running, preempted), freeing their blocks; unknown or
        already finished ids are ignored. For aborts and stop strings."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, reason)

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        # Admitting anyone right after a preemption would just take the blocks that were freed for others.
        if not plan.preempted_req_ids:
            self._schedule_waiting(plan)
        return self._make_output(plan)

    def _schedule_running(self, plan: _StepPlan) -> None:
        for request in list(self.running):
            if plan.token_budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, plan.token_budget)
            if self._allocate_or_preempt(request, num_new_tokens, plan):
                plan.add(request, num_new_tokens)

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
        """Preempt by recompute: free the blocks (hashes kept), forget the computed tokens, wait again."""
        self.running.remove(request)
        plan.remove(request)
        plan.preempted_req_ids.add(request.request_id)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=_waiting_order)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self._fits_in_pool(request.num_tokens):
                self._finish_unschedulable(request)
            elif not self._admit(request, plan):
                break

    def _admit(self, request: Request, plan: _StepPlan) -> bool:
        """Start (or restart) the first waiting request, after a prefix-cache lookup. False if out of blocks."""
        computed = self.kv_cache_manager.get_computed_blocks(request)
        num_new_tokens = self._num_new_tokens(request, computed.num_computed_tokens, plan.token_budget)
        if self.kv_cache_manager.allocate_slots(request, num_new_tokens, computed) is None:
            return False
        self.waiting.pop(0)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = computed.num_computed_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = computed.num_computed_tokens
        self.running.append(request)
        plan.add(request, num_new_tokens)
        plan.new_req_ids.append(request.request_id)
        return True

    def _fits_in_pool(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.kv_cache_manager.block_size) <= self.kv_cache_manager.num_usable_blocks

    def _finish_unschedulable(self, request: Request) -> None:
        reason = FinishReason.LENGTH if self._fits_in_pool(request.num_prompt_tokens) else FinishReason.ABORT
        self._finish(request, reason)
        self._pending_updates.append(RequestUpdate(request.request_id, [], finish_reason=reason,
                                                   num_cached_tokens=request.num_cached_tokens))

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        num_new_tokens = min(request.num_tokens - num_computed_tokens, token_budget,
                             self.config.max_model_len - num_computed_tokens)
        assert num_new_tokens > 0, f"request {request.request_id} has nothing to compute"
        return num_new_tokens

    def _make_output(self, plan: _StepPlan) -> SchedulerOutput:
        scheduled = [self._scheduled_request(self.requests[request_id], num_tokens)
                     for request_id, num_tokens in plan.num_scheduled_tokens.items()]
        new_requests = []
        for request_id in plan.new_req_ids:
            request = self.requests[request_id]
            new_requests.append(NewRequestData(request_id, request.prompt_token_ids, request.sampling_params,
                                               list(request.output_token_ids)))
        finished_req_ids, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(new_requests=new_requests, scheduled=scheduled,
                               num_batched_tokens=sum(plan.num_scheduled_tokens.values()),
                               finished_req_ids=finished_req_ids, preempted_req_ids=plan.preempted_req_ids)

    def _scheduled_request(self, request: Request, num_tokens: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(req_id=request.request_id,
                                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                                num_computed_tokens=start,
                                token_ids=request.all_token_ids[start:start + num_tokens],
                                sample=start + num_tokens == request.num_tokens)

    def update_from_output(self, out: SchedulerOutput, res: RunnerOutput) -> list[RequestUpdate]:
        """Apply a step's result: advance the counters, append sampled tokens, cache newly full blocks, check
        stop conditions and free finished requests. Returns an update per request that got a token or
        finished."""
        updates, self._pending_updates = self._pending_updates, []
        for scheduled in out.scheduled:
            request = self.requests.get(scheduled.req_id)
            if request is None:  # finished (aborted) after schedule()
                continue
            update = self._update_request(request, scheduled, res)
            if update is not None:
                updates.append(update)
        return updates

    def _update_request(self, request: Request, scheduled: ScheduledRequest,
                        res: RunnerOutput) -> RequestUpdate | None:
        assert request.num_computed_tokens == scheduled.num_computed_tokens, "output does not match the state"
        request.num_computed_tokens += scheduled.num_new_tokens
        self.kv_cache_manager.cache_full_blocks(request)
        if not scheduled.sample:
            return None
        token_id = res.sampled_token_ids[request.request_id]
        request.append_output_token_ids(token_id)
        reason = self._check_stop(request)
        if reason is not None:
            self._finish(request, reason)
        return RequestUpdate(request.request_id, [token_id], res.logprobs.get(request.request_id), reason,
                             request.stop_reason, request.num_cached_tokens)

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
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        request.status = reason.status
        request.finish_reason = reason
        del self.requests[request.request_id]
        self._finished_req_ids.add(request.request_id)
