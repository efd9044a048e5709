"""A model-free stand-in for the runner, and a loop that drives a scheduler with it, checking every step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.core.request import FinishReason
from pagedllm.core.sched.output import RequestUpdate, RunnerOutput, ScheduledRequest, SchedulerOutput
from pagedllm.core.sched.scheduler import DraftProposer, Scheduler

VOCAB = 50


def next_token(context: tuple[int, ...], index: int = 0) -> int:
    """The fake model: the next token is a function of the whole context (ints hash the same in every run).
    `index` > 0 is the sample of parallel-sampling child `index` (a different stream from the same context)."""
    return hash(context + ((-index,) if index else ())) % VOCAB


class FakeRunner:
    """Writes each scheduled token id into its KV slot, then reads the whole context back through the block
    table to 'attend': a wrong block table, a bad prefix hit, a lost block, a missing copy or swap changes the
    sampled tokens (or raises KeyError for a slot never written). Swaps and copies move slot contents, in the
    runner's order: swap-out, swap-in, copy.

    With a `drafter`, it stands in for a draft model too: after a step in which a request with lookahead slots
    sampled, it proposes that many drafts to follow and writes all but the last into the slots past the
    request's tokens, as a draft model writes their K/V (a table without room for them raises IndexError)."""

    def __init__(self, block_size: int, script: dict[str, list[int]] | None = None,
                 drafter: DraftProposer | None = None) -> None:
        self.block_size = block_size
        self.slots: dict[int, int] = {}
        self.swap_slots: dict[int, int] = {}
        self.script = script  # request id -> tokens to return instead of the fake model's
        self.drafter = drafter

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _move(self, src: dict[int, int], dst: dict[int, int], pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks, reading every source before writing any destination."""
        size = self.block_size
        contents = [[src.get(s * size + offset) for offset in range(size)] for s, _ in pairs]
        for (_, d), values in zip(pairs, contents):
            for offset, value in enumerate(values):
                if value is None:
                    dst.pop(d * size + offset, None)
                else:
                    dst[d * size + offset] = value

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self._move(self.slots, self.swap_slots, out.blocks_to_swap_out)
        self._move(self.swap_slots, self.slots, out.blocks_to_swap_in)
        self._move(self.slots, self.slots, out.blocks_to_copy)
        sampled: dict[str, int] = {}
        accepted: dict[str, int] = {}
        drafts: dict[str, list[int]] = {}
        for scheduled in out.scheduled:
            for offset, token_id in enumerate(scheduled.token_ids):
                self.slots[self._slot(scheduled.block_ids, scheduled.num_computed_tokens + offset)] = token_id
            if scheduled.sample:
                end = scheduled.num_computed_tokens + scheduled.num_new_tokens - len(scheduled.spec_token_ids)
                context = tuple(self.slots[self._slot(scheduled.block_ids, pos)] for pos in range(end))
                if scheduled.spec_token_ids:
                    context = self._verify(scheduled, context, accepted)
                sampled[scheduled.request_id] = (self.script[scheduled.request_id].pop(0) if self.script
                                             else next_token(context))
                for index, child_id in enumerate(scheduled.child_request_ids, start=1):
                    sampled[child_id] = next_token(context, index)
                if scheduled.num_lookahead_tokens:
                    drafts[scheduled.request_id] = self._propose(scheduled, context + (sampled[scheduled.request_id],))
        return RunnerOutput(sampled, num_accepted_draft_tokens=accepted, draft_token_ids=drafts)

    def _propose(self, scheduled: ScheduledRequest, context: tuple[int, ...]) -> list[int]:
        assert self.drafter is not None, "lookahead slots without a drafter"
        proposed = self.drafter(list(context), scheduled.num_lookahead_tokens)
        for offset, token_id in enumerate(proposed[:-1]):
            self.slots[self._slot(scheduled.block_ids, len(context) + offset)] = token_id
        return proposed

    def _verify(self, scheduled: ScheduledRequest, context: tuple[int, ...],
                accepted: dict[str, int]) -> tuple[int, ...]:
        """Greedy verification: accept drafts while each is the fake model's next token, reading each draft's
        context back from the slots (so the drafts' K/V must be where the block table says)."""
        count = 0
        for draft in scheduled.spec_token_ids:
            if draft != next_token(context):
                break
            position = len(context)
            context += (self.slots[self._slot(scheduled.block_ids, position)],)
            count += 1
        accepted[scheduled.request_id] = count
        return context


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


def check_step(scheduler: Scheduler, out: SchedulerOutput) -> None:
    config, manager = scheduler.config, scheduler.kv_cache_manager
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled) <= config.max_num_batched_tokens
    assert len(out.scheduled) <= scheduler.num_running <= config.max_num_seqs
    assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
    assert {n.request_id for n in out.new_requests} <= {s.request_id for s in out.scheduled}
    for s in out.scheduled:
        request = scheduler.requests[s.request_id]
        assert s.num_new_tokens > 0 and s.num_computed_tokens == request.num_computed_tokens
        assert s.num_computed_tokens + s.num_new_tokens <= config.max_model_len
        assert len(s.block_ids) * manager.block_size >= s.num_computed_tokens + s.num_new_tokens
        num_known = s.num_new_tokens - len(s.spec_token_ids)
        assert s.sample == (s.num_computed_tokens + num_known == request.num_tokens)
        assert not s.spec_token_ids or (s.sample and num_known == 1), "drafts only after the last known token"
        assert not s.num_lookahead_tokens or (s.sample and len(s.block_ids) * manager.block_size
                                              >= s.num_computed_tokens + s.num_new_tokens + s.num_lookahead_tokens)
    for pairs in (out.blocks_to_copy, out.blocks_to_swap_in, out.blocks_to_swap_out):
        destinations = [dst for _, dst in pairs]
        assert len(set(destinations)) == len(destinations) and 0 not in destinations
    assert not (out.blocks_to_swap_in and out.preempted_request_ids), "swap-in in a step with a preemption"
    assert scheduler.num_running + scheduler.num_swapped + scheduler.num_waiting == len(scheduler.requests)
    manager.check_integrity()


def run_steps(scheduler: Scheduler, runner: FakeRunner, results: dict[str, Result],
              before_step: Callable[[int], bool] | None = None, max_steps: int = 2000) -> list[SchedulerOutput]:
    """Step until nothing is left, checking every step. `before_step(step)` may add or abort requests; it
    returns whether it has more to do in later steps."""
    outputs: list[SchedulerOutput] = []
    for step in range(max_steps):
        more_to_come = before_step(step) if before_step is not None else False
        if not more_to_come and not scheduler.has_unfinished_requests():
            return outputs
        out = scheduler.schedule()
        check_step(scheduler, out)
        updates = scheduler.update_from_output(out, runner.execute(out))
        scheduler.kv_cache_manager.check_integrity()
        record(results, updates)
        outputs.append(out)
    raise AssertionError("the scheduler did not finish")


def record(results: dict[str, Result], updates: list[RequestUpdate]) -> None:
    for update in updates:
        result = results.setdefault(update.request_id, Result())
        assert result.finish_reason is None, "update after the finish"
        result.token_ids += update.new_token_ids
        result.finish_reason, result.stop_reason = update.finish_reason, update.stop_reason
        result.num_cached_tokens = update.num_cached_tokens


def reference(prompt: list[int], max_tokens: int, eos_token_id: int | None, index: int = 0) -> list[int]:
    """What a never-preempted, uncached run of the fake model generates (completion `index` of n > 1)."""
    context = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        token = next_token(tuple(context), index if not out else 0)
        out.append(token)
        context.append(token)
        if token == eos_token_id:
            break
    return out
