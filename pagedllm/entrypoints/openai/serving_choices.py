"""How /v1/completions and /v1/chat/completions answer: fold each choice's deltas into what the choice has
produced so far, then send the whole response, or stream an SSE chunk per delta and usage at the end.

A subclass shapes the JSON that differs: a choice's body, its log-probabilities, a chunk it opens with, and where
vLLM's `return_token_ids` puts the prompt's ids (on each choice, or once on the response)."""

from __future__ import annotations

import asyncio
import json
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.entrypoints.openai.protocol import OpenAIError, _SamplingFields
from pagedllm.entrypoints.openai.serving_base import (
    ChoiceDelta,
    FrontendOptions,
    OpenAIServing,
    OutputStream,
    Prompt,
    error_for,
)
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.stats import RequestTimes
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs

# JSON has no -inf; vLLM sends this instead.
MIN_LOGPROB = -9999.0

_SSE_DONE = "data: [DONE]\n\n"


@dataclass(slots=True)
class TokenLogprob:
    """One generated token's log-probability, in neither API's shape yet.

    Args:
        token: the token's text.
        logprob: its log-probability; None if the engine did not report the sampled token.
        top: (text, log-probability) of the most likely tokens at its position, most likely first.
        text_offset: where the token's text starts in the choice's text (the legacy API reports it).
    """

    token: str
    logprob: float | None
    top: list[tuple[str, float]]
    text_offset: int


@dataclass(frozen=True, slots=True)
class ResponseOptions:
    """How a request asked to be answered, beyond its choices' bodies.

    Args:
        num_prompt_tokens: all its prompts' tokens, for usage.
        num_logprobs: top log-probabilities per token; None for no log-probabilities.
        usage: streamed only: None (no usage), "final" (a last chunk with the request's usage), or "continuous"
            (vLLM's continuous_usage_stats: each chunk also carries its choice's usage so far).
        return_token_ids: vLLM's: each choice's token ids (streamed: each chunk's), and the prompt's.
        tokens_as_ids: vLLM's return_tokens_as_token_ids: log-probabilities name tokens "token_id:{id}".
        metrics: vLLM's per-request `metrics` on the response (streamed: on its usage chunk).
    """

    num_prompt_tokens: int
    num_logprobs: int | None = None
    usage: str | None = None
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    metrics: bool = False

    @classmethod
    def of(cls, request: _SamplingFields, num_prompt_tokens: int, num_logprobs: int | None,
           frontend: FrontendOptions) -> ResponseOptions:
        """The request's options, the server's `frontend` options where it sets none."""
        options = request.stream_options
        usage = None
        if request.stream and options is not None and options.include_usage:
            usage = "continuous" if options.continuous_usage_stats else "final"
        elif request.stream and frontend.force_include_usage:
            usage = "final"
        as_ids = request.return_tokens_as_token_ids
        return cls(num_prompt_tokens, num_logprobs, usage, bool(request.return_token_ids),
                   frontend.return_tokens_as_token_ids if as_ids is None else as_ids,
                   frontend.enable_per_request_metrics)


class ChoiceState:
    """What one choice has produced so far.

    Args:
        echo: the prompt text a completion repeats, else "": it starts the text and the first streamed chunk.
        prompt_token_ids: the ids of the choice's prompt (for return_token_ids).
    """

    def __init__(self, echo: str = "", prompt_token_ids: list[int] | None = None) -> None:
        self.echo = echo
        self.prompt_token_ids = prompt_token_ids
        self.text = echo
        self.token_ids: list[int] = []
        self.prompt_index = 0
        self.num_cached_tokens = 0          # of its prompt's tokens, those the prefix cache held
        self.logprobs: list[TokenLogprob] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.started = False               # streamed: the choice's first delta went out
        self.text_offset = len(echo)       # where the next token's text starts
        self.metrics: RequestTimes | None = None    # its request's timings, with the last output


class GenerationServing(OpenAIServing, ABC):
    """Base of the serving classes that generate (chat and completion): their choices' outputs -> a response or SSE."""

    # return_token_ids: the prompt's ids on each choice (completions: each choice has its prompt), or else once,
    # on the response (chat: on its first chunk when streamed)
    prompt_token_ids_on_choices = True

    async def respond(self, request: _SamplingFields, outputs: OutputStream, states: list[ChoiceState],
                      head: dict[str, Any], options: ResponseOptions,
                      sse: bool = True) -> dict[str, Any] | AsyncIterator[str] | AsyncIterator[dict[str, Any]]:
        """The whole response, or (stream=True) an iterator of SSE lines (`sse`), or of the chunks as dicts.

        Args:
            head: the response's first fields (id, object, created, model), in the API's order.
        """
        if request.stream:
            chunks = self._stream(outputs, states, head, options)
            return _as_sse(chunks) if sse else chunks
        return await self._collect(outputs, states, head, options)

    async def beam_search(self, request: _SamplingFields, request_id: str, prompts: list[Prompt],
                          max_tokens: list[int], head: dict[str, Any], lora: LoRARequest | None,
                          role: str | None = None) -> dict[str, Any]:
        """vLLM's use_beam_search: each prompt's `n` best sequences of a beam search `n` wide, whole (choices
        prompt by prompt, best first); as a chat's messages under `role`, else as completions' texts. 400 for what
        beam search does not take."""
        refused = [name for name, given in (
            ("stream", request.stream), ("logprobs", request.logprobs not in (None, False)),
            ("prompt_logprobs", request.prompt_logprobs is not None), ("stop", bool(request.stop)),
            ("response_format", request.response_format is not None),
            ("structured_outputs", request.structured_outputs is not None),
            ("tools", bool(getattr(request, "tools", None))), ("echo", bool(getattr(request, "echo", False))),
            ("images", any(p.images for p in prompts))) if given]
        if refused:
            raise OpenAIError(f"use_beam_search answers whole texts: not with {refused[0]}", param=refused[0])
        searches = [self.engine.beam_search(f"{request_id}-{i}", {"prompt_token_ids": prompt.token_ids},
                                            BeamSearchParams(request.n, tokens, request.ignore_eos,
                                                             request.temperature or 0.0, request.length_penalty),
                                            lora)
                    for i, (prompt, tokens) in enumerate(zip(prompts, max_tokens))]
        outputs = await asyncio.gather(*searches)
        choices = []
        for output in outputs:
            for sequence in output.sequences:
                body = {"text": sequence.text} if role is None else \
                    {"message": {"role": role, "content": sequence.text}}
                choices.append({"index": len(choices), **body, "logprobs": None,
                                "finish_reason": sequence.finish_reason, "stop_reason": None})
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        num_generated = sum(len(s.output_token_ids) for output in outputs for s in output.sequences)
        return {**head, "choices": choices, "usage": {"prompt_tokens": num_prompt_tokens,
                                                      "completion_tokens": num_generated,
                                                      "total_tokens": num_prompt_tokens + num_generated}}

    # ---- what differs between the APIs --------------------------------------------------------------------------
    @abstractmethod
    def _message(self, state: ChoiceState) -> dict[str, Any]:
        """A whole response's choice body, the fields between `index` and `logprobs` (it may set the state's
        finish_reason, e.g. to "tool_calls")."""

    @abstractmethod
    def _delta(self, state: ChoiceState, text: str) -> dict[str, Any]:
        """A streamed choice body for `text`, the fields between `index` and `logprobs` (it may set the state's
        finish_reason)."""

    @abstractmethod
    def _logprobs_json(self, tokens: list[TokenLogprob]) -> dict[str, Any]:
        """The `logprobs` of a choice."""

    def _opening(self, state: ChoiceState) -> dict[str, Any] | None:
        """The body of a chunk streamed before the first delta of `state`'s choice, if any."""
        return None

    # ---- the shared loop ----------------------------------------------------------------------------------------
    async def _collect(self, outputs: OutputStream, states: list[ChoiceState], head: dict[str, Any],
                       options: ResponseOptions) -> dict[str, Any]:
        async with aclosing(outputs):
            async for choice in outputs:
                self._absorb(_noted(states[choice.index], choice), choice.delta, options)
        bodies = [self._message(s) for s in states]   # first: a body may set its state's finish_reason
        choices = [self._choice(i, body, s.logprobs, s.finish_reason, s.stop_reason,
                                self._token_ids(s, s.token_ids, options, with_prompt=True))
                   for i, (body, s) in enumerate(zip(bodies, states))]
        response = {**head, "choices": choices, "usage": _usage(states, options.num_prompt_tokens)}
        return response | self._prompt_token_ids(states, options) | _metrics(states, options)

    async def _stream(self, outputs: OutputStream, states: list[ChoiceState], head: dict[str, Any],
                      options: ResponseOptions) -> AsyncIterator[dict[str, Any]]:
        """The chunks; an error after the first ends the stream with an OpenAI error dict (the status line is
        sent by then)."""
        first = self._prompt_token_ids(states, options)      # on the stream's first chunk
        async with aclosing(outputs):
            try:
                async for choice in outputs:
                    state = _noted(states[choice.index], choice)
                    for part in self._chunks(choice.index, state, choice.delta, options):
                        extra = {} if options.usage is None else {"usage": _usage(
                            [state], options.num_prompt_tokens) if options.usage == "continuous" else None}
                        yield {**head, "choices": [part], **extra, **first}
                        first = {}
                if options.usage is not None:
                    yield {**head, "choices": [], "usage": _usage(states, options.num_prompt_tokens),
                           **_metrics(states, options)}
            except Exception as exc:  # noqa: BLE001 - the status line is sent: report the error in the stream
                yield error_for(exc).to_dict()

    def _chunks(self, index: int, state: ChoiceState, delta: CompletionOutput,
                options: ResponseOptions) -> Iterator[dict[str, Any]]:
        """The streamed choices of one delta: the opening one before a choice's first delta, then the delta's own
        unless it carries nothing."""
        text = delta.text
        first = not state.started
        if first:
            state.started = True
            text = state.echo + text
            opening = self._opening(state)
            if opening is not None:
                yield self._choice(index, opening, None, None, None)
        tokens = self._absorb(state, delta, options)
        if text or delta.token_ids or delta.finish_reason is not None:
            body = self._delta(state, text)
            finish_reason = state.finish_reason if delta.finish_reason is not None else None
            yield self._choice(index, body, tokens, finish_reason, delta.stop_reason,
                               self._token_ids(state, delta.token_ids, options, with_prompt=first))

    def _choice(self, index: int, body: dict[str, Any], tokens: list[TokenLogprob] | None,
                finish_reason: str | None, stop_reason: int | str | None,
                token_ids: dict[str, list[int] | None] | None = None) -> dict[str, Any]:
        return {"index": index, **body, "logprobs": None if tokens is None else self._logprobs_json(tokens),
                "finish_reason": finish_reason, "stop_reason": stop_reason, **(token_ids or {})}

    def _token_ids(self, state: ChoiceState, token_ids: list[int], options: ResponseOptions,
                   with_prompt: bool) -> dict[str, list[int] | None]:
        """return_token_ids' fields on a choice: its prompt's ids (where they go on choices), then `token_ids`."""
        if not options.return_token_ids:
            return {}
        if with_prompt and self.prompt_token_ids_on_choices:
            return {"prompt_token_ids": state.prompt_token_ids, "token_ids": list(token_ids)}
        return {"token_ids": list(token_ids)}

    def _prompt_token_ids(self, states: list[ChoiceState], options: ResponseOptions) -> dict[str, list[int] | None]:
        """return_token_ids' field on a response whose choices share one prompt."""
        if not options.return_token_ids or self.prompt_token_ids_on_choices:
            return {}
        return {"prompt_token_ids": states[0].prompt_token_ids}

    def _absorb(self, state: ChoiceState, delta: CompletionOutput,
                options: ResponseOptions) -> list[TokenLogprob] | None:
        """Add one delta to its choice's state; return the log-probabilities of its tokens, if asked for."""
        state.text += delta.text
        state.token_ids += delta.token_ids
        if delta.finish_reason is not None:
            state.finish_reason, state.stop_reason = delta.finish_reason, delta.stop_reason
        if options.num_logprobs is None or delta.logprobs is None:
            return None
        tokens = [self._token_logprob(state, t, position, options.num_logprobs, options.tokens_as_ids)
                  for t, position in zip(delta.token_ids, delta.logprobs)]
        if state.logprobs is None:
            state.logprobs = []
        state.logprobs.extend(tokens)
        return tokens

    def _token_logprob(self, state: ChoiceState, token_id: int, position: dict[int, Logprob],
                       num_logprobs: int, as_ids: bool) -> TokenLogprob:
        """One token's entry; `as_ids` (or a server without a tokenizer): tokens named "token_id:{id}" (their text
        offsets still count text, where there is some)."""
        tokenizer = self.engine.tokenizer
        as_ids = as_ids or tokenizer is None
        entry = position.get(token_id)
        text = "" if tokenizer is None else _token_text(tokenizer, token_id, entry)
        top = [(f"token_id:{top_id}" if as_ids else _token_text(tokenizer, top_id, lp), clean_logprob(lp.logprob))
               for top_id, lp in _top_entries(position, num_logprobs)]
        token = TokenLogprob(f"token_id:{token_id}" if as_ids else text,
                             None if entry is None else clean_logprob(entry.logprob), top, state.text_offset)
        state.text_offset += len(text)
        return token


async def keep_prompt_logprobs(outputs: OutputStream, kept: dict[int, PromptLogprobs]) -> OutputStream:
    """Pass the choices' deltas on, keeping each prompt's log-probabilities (by prompt index) as they pass."""
    async with aclosing(outputs):
        async for choice in outputs:
            if choice.prompt_logprobs is not None:
                kept[choice.prompt_index] = choice.prompt_logprobs
            yield choice


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> list[dict[str, Any] | None] | None:
    """vLLM's shape: None for the first token, then {token id: {logprob, rank, decoded_token}} per position."""
    if prompt_logprobs is None:
        return None
    return [None if position is None else
            {str(token_id): {"logprob": clean_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token_id, lp in position.items()} for position in prompt_logprobs]


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _as_sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """The chunks as SSE lines, then OpenAI's end marker. Closing it closes `chunks` (and so aborts the requests)."""
    async with aclosing(chunks):
        async for chunk in chunks:
            yield _sse(chunk)
    yield _SSE_DONE


def _noted(state: ChoiceState, choice: ChoiceDelta) -> ChoiceState:
    """The choice's state, told which prompt it completes, how much of that the prefix cache held, and its request's
    timings once they come."""
    state.prompt_index, state.num_cached_tokens = choice.prompt_index, choice.num_cached_tokens
    state.metrics = choice.metrics or state.metrics
    return state


def _metrics(states: list[ChoiceState], options: ResponseOptions) -> dict[str, Any]:
    """vLLM's per-request `metrics`, where asked for: a response of one choice's timings; None for several (each
    prompt and completion has its own)."""
    if not options.metrics:
        return {}
    times = states[0].metrics if len(states) == 1 else None
    return {"metrics": None if times is None else times.response_metrics()}


def _usage(states: list[ChoiceState], num_prompt_tokens: int) -> dict[str, Any]:
    """Usage, with OpenAI's prompt_tokens_details.cached_tokens: the prompts' tokens the prefix cache held."""
    num_completion_tokens = sum(len(s.token_ids) for s in states)
    cached = sum({s.prompt_index: s.num_cached_tokens for s in states}.values())     # once per prompt
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def clean_logprob(value: float) -> float:
    """A log-probability JSON can carry."""
    return value if value > MIN_LOGPROB else MIN_LOGPROB     # also maps -inf and nan


def _top_entries(position: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The `num` most likely tokens at one position (by rank, else by log-probability)."""
    ordered = sorted(position.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else math.inf,
                                                       -kv[1].logprob))
    return ordered[:num]


def _token_text(tokenizer: Any, token_id: int, entry: Logprob | None) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id])
