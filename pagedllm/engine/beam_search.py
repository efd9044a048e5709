"""Beam search inside the engine, on the scheduler's copy-on-write forks.

Each beam is a request with `engine_appends_tokens`: the runner computes it greedily with the top
`2 * beam_width` logprobs of its next token, and the scheduler reports them without appending a token. Once
every live beam of a group has its candidates, `BeamSearchGroup.advance` ranks all (beam, token) pairs by
cumulative logprob and keeps the best `beam_width`:

    beam b kept with 1 continuation   -> scheduler.append_token(b, token)
    beam b kept with k continuations  -> scheduler.fork_request(b, new_id, token) k - 1 times (shared blocks),
                                         then append_token(b, first token)
    beam b with no continuation       -> scheduler.finish_requests(b, ABORT) (its blocks are freed)

A candidate that is EOS (unless ignore_eos) and ranks before the `beam_width`-th kept one becomes a finished
hypothesis. At `max_tokens` the live beams become hypotheses too, and the best `beam_width` hypotheses by
`cum_logprob / num_generated_tokens ** length_penalty` are returned, best first (a final EOS counts as a
generated token, as in Hugging Face transformers).
See docs/architecture.md for how this compares with Hugging Face transformers' beam search.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pagedllm.core.request import FinishReason, Request
from pagedllm.core.sched.output import RequestUpdate
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    """Beam search settings (vLLM's names).

    Args:
        beam_width: beams kept each step, and sequences returned.
        max_tokens: tokens generated per beam.
        ignore_eos: keep extending beams past EOS (then every beam runs to max_tokens).
        temperature: accepted for vLLM compatibility; candidates are ranked by the model's raw logprobs.
        length_penalty: the score is cum_logprob / num_generated_tokens ** length_penalty.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1 or self.max_tokens < 1:
            raise ValueError("beam_width and max_tokens must be >= 1")


@dataclass
class BeamSearchSequence:
    """One finished hypothesis. `tokens` holds the prompt and the generated tokens, as in vLLM; `text` is
    the decoded generated tokens."""

    tokens: list[int]
    cum_logprob: float
    num_prompt_tokens: int
    finish_reason: str
    text: str = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def beam_score(num_generated_tokens: int, cum_logprob: float, length_penalty: float) -> float:
    return cum_logprob / max(num_generated_tokens, 1) ** length_penalty


@dataclass
class _Beam:
    request_id: str
    output_token_ids: list[int]
    cum_logprob: float
    candidates: list[tuple[int, float]] | None = None  # (token, logprob), best first; None: not computed yet


@dataclass
class _Hypothesis:
    output_token_ids: list[int]
    cum_logprob: float
    finish_reason: str


@dataclass
class BeamSearchGroup:
    """The beams of one prompt."""

    group_id: str
    prompt_token_ids: list[int]
    params: BeamSearchParams
    eos_token_ids: frozenset[int]         # the tokenizer's EOS and the generation config's others
    live: dict[str, _Beam] = field(default_factory=dict)
    hypotheses: list[_Hypothesis] = field(default_factory=list)
    _ids: itertools.count = field(default_factory=itertools.count)

    def new_beam_id(self) -> str:
        return f"{self.group_id}#beam{next(self._ids)}"

    def on_update(self, update: RequestUpdate) -> None:
        beam = self.live.get(update.request_id)
        if beam is None:
            return
        if update.finish_reason is not None:  # the scheduler gave up on it (it cannot fit in the pool)
            del self.live[update.request_id]
            return
        (entries,) = update.new_logprobs  # one position: (token, logprob, rank), sampled first, then the top
        best: dict[int, float] = {}
        for token_id, logprob, _ in entries[1:]:
            best.setdefault(token_id, logprob)
        beam.candidates = list(best.items())

    @property
    def is_ready(self) -> bool:
        return bool(self.live) and all(beam.candidates is not None for beam in self.live.values())

    @property
    def is_done(self) -> bool:
        return not self.live

    def advance(self, scheduler: Scheduler) -> None:
        """One beam-search step for the group (all live beams have their candidates)."""
        width = self.params.beam_width
        ranked = sorted(((beam.cum_logprob + logprob, beam, token_id) for beam in self.live.values()
                         for token_id, logprob in beam.candidates or ()), key=lambda c: -c[0])
        kept: list[tuple[float, _Beam, int]] = []
        for cum_logprob, beam, token_id in ranked:
            if len(kept) == width:
                break
            if token_id in self.eos_token_ids and not self.params.ignore_eos:
                self.hypotheses.append(_Hypothesis(beam.output_token_ids + [token_id], cum_logprob, "stop"))
            else:
                kept.append((cum_logprob, beam, token_id))
        last_step = not kept or len(kept[0][1].output_token_ids) + 1 >= self.params.max_tokens
        if last_step:
            self.hypotheses += [_Hypothesis(b.output_token_ids + [t], c, "length") for c, b, t in kept]
            scheduler.finish_requests(list(self.live), FinishReason.ABORT)
            self.live.clear()
            return
        self._extend(scheduler, kept)

    def _extend(self, scheduler: Scheduler, kept: list[tuple[float, _Beam, int]]) -> None:
        live: dict[str, _Beam] = {}
        for beam in self.live.values():
            continuations = [(c, t) for c, b, t in kept if b is beam]
            if not continuations:
                scheduler.finish_requests(beam.request_id, FinishReason.ABORT)
                continue
            for cum_logprob, token_id in continuations[1:]:  # fork before the parent gets its own token
                child_id = self.new_beam_id()
                scheduler.fork_request(beam.request_id, child_id, token_id)
                live[child_id] = _Beam(child_id, beam.output_token_ids + [token_id], cum_logprob)
            cum_logprob, token_id = continuations[0]
            scheduler.append_token(beam.request_id, token_id)
            live[beam.request_id] = _Beam(beam.request_id, beam.output_token_ids + [token_id], cum_logprob)
        self.live = live

    def output(self, tokenizer) -> BeamSearchOutput:
        def score(h: _Hypothesis) -> float:
            return beam_score(len(h.output_token_ids), h.cum_logprob, self.params.length_penalty)

        best = sorted(self.hypotheses, key=score, reverse=True)[:self.params.beam_width]
        return BeamSearchOutput([
            BeamSearchSequence(self.prompt_token_ids + h.output_token_ids, h.cum_logprob,
                               len(self.prompt_token_ids), h.finish_reason,
                               tokenizer.decode(h.output_token_ids, skip_special_tokens=True) if tokenizer else "")
            for h in best])


class BeamSearchDriver:
    """The engine's beam-search groups: routes beam updates and advances groups after each step."""

    def __init__(self, scheduler: Scheduler, tokenizer) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.groups: dict[str, BeamSearchGroup] = {}
        self.outputs: dict[str, BeamSearchOutput] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
            eos_token_ids: frozenset[int], max_model_len: int, lora_request: LoRARequest | None = None) -> None:
        max_tokens = min(params.max_tokens, max_model_len - len(prompt_token_ids))
        group = BeamSearchGroup(request_id, list(prompt_token_ids), params, eos_token_ids)
        group.params = BeamSearchParams(params.beam_width, max_tokens, params.ignore_eos, params.temperature,
                                        params.length_penalty)
        sampling = SamplingParams(temperature=0.0, logprobs=2 * params.beam_width, max_tokens=max_tokens,
                                  ignore_eos=True)
        root_id = group.new_beam_id()
        # no EOS for the scheduler (ignore_eos): a beam ends in advance(), on any of eos_token_ids
        self.scheduler.add_request(Request(root_id, prompt_token_ids, sampling, group_size=params.beam_width,
                                           engine_appends_tokens=True, lora_request=lora_request))
        group.live[root_id] = _Beam(root_id, [], 0.0)
        self.groups[request_id] = group

    def on_update(self, update: RequestUpdate) -> bool:
        """Take a beam's update; False if it is not a beam."""
        group = self.groups.get(update.request_id.rsplit("#beam", 1)[0])
        if group is None or update.request_id not in group.live:
            return False
        group.on_update(update)
        return True

    def advance(self) -> None:
        for request_id, group in list(self.groups.items()):
            if group.is_ready:
                group.advance(self.scheduler)
            if group.is_done:
                self.outputs[request_id] = group.output(self.tokenizer)
                del self.groups[request_id]

    def abort(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is not None:
            self.scheduler.finish_requests(list(group.live), FinishReason.ABORT)
