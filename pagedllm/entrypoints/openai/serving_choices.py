"""How /v1/completions and /v1/chat/completions answer: fold each choice's deltas into what the choice has
produced so far, then send the whole response, or stream an SSE chunk per delta and usage at the end.

A subclass shapes the JSON that differs: a choice's body, its log-probabilities, and a chunk it opens with."""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.protocol import _SamplingFields
from pagedllm.entrypoints.openai.serving_base import OpenAIServing, OutputStream, error_for
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


class ChoiceState:
    """What one choice has produced so far.

    Args:
        echo: the prompt text a completion repeats, else "": it starts the text and the first streamed chunk.
    """

    def __init__(self, echo: str = "") -> None:
        self.echo = echo
        self.text = echo
        self.num_tokens = 0
        self.logprobs: list[TokenLogprob] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.started = False               # streamed: the choice's first delta went out
        self.text_offset = len(echo)       # where the next token's text starts


class GenerationServing(OpenAIServing, ABC):
    """Base of the serving classes that generate (chat and completion): their choices' outputs -> a response or SSE."""

    async def respond(self, request: _SamplingFields, outputs: OutputStream, states: list[ChoiceState],
                      head: dict[str, Any], num_logprobs: int | None,
                      num_prompt_tokens: int) -> dict[str, Any] | AsyncIterator[str]:
        """The whole response, or (stream=True) an iterator of SSE lines.

        Args:
            head: the response's first fields (id, object, created, model), in the API's order.
            num_logprobs: top log-probabilities per token; None for no log-probabilities.
        """
        if request.stream:
            options = request.stream_options
            usage = "continuous" if options and options.include_usage and options.continuous_usage_stats else (
                "final" if options and options.include_usage else None)
            return self._stream(outputs, states, head, num_logprobs, usage, num_prompt_tokens)
        return await self._collect(outputs, states, head, num_logprobs, num_prompt_tokens)

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

    def _opening(self) -> dict[str, Any] | None:
        """The body of a chunk streamed before a choice's first delta, if any."""
        return None

    # ---- the shared loop ----------------------------------------------------------------------------------------
    async def _collect(self, outputs: OutputStream, states: list[ChoiceState], head: dict[str, Any],
                       num_logprobs: int | None, num_prompt_tokens: int) -> dict[str, Any]:
        async with aclosing(outputs):
            async for choice in outputs:
                self._absorb(states[choice.index], choice.delta, num_logprobs)
        bodies = [self._message(s) for s in states]   # first: a body may set its state's finish_reason
        choices = [self._choice(i, body, s.logprobs, s.finish_reason, s.stop_reason)
                   for i, (body, s) in enumerate(zip(bodies, states))]
        return {**head, "choices": choices, "usage": _usage(states, num_prompt_tokens)}

    async def _stream(self, outputs: OutputStream, states: list[ChoiceState], head: dict[str, Any],
                      num_logprobs: int | None, usage: str | None, num_prompt_tokens: int) -> AsyncIterator[str]:
        """`usage`: None (none), "final" (a last chunk with the whole request's), or "continuous" (vLLM's
        continuous_usage_stats: each chunk also carries its choice's usage so far)."""
        async with aclosing(outputs):
            try:
                async for choice in outputs:
                    state = states[choice.index]
                    for part in self._chunks(choice.index, state, choice.delta, num_logprobs):
                        extra = {} if usage is None else {
                            "usage": _usage([state], num_prompt_tokens) if usage == "continuous" else None}
                        yield _sse({**head, "choices": [part], **extra})
                if usage is not None:
                    yield _sse({**head, "choices": [], "usage": _usage(states, num_prompt_tokens)})
            except Exception as exc:  # noqa: BLE001 - the status line is sent: report the error in the stream
                yield _sse(error_for(exc).to_dict())
        yield _SSE_DONE

    def _chunks(self, index: int, state: ChoiceState, delta: CompletionOutput,
                num_logprobs: int | None) -> Iterator[dict[str, Any]]:
        """The streamed choices of one delta: the opening one before a choice's first delta, then the delta's own
        unless it carries nothing."""
        text = delta.text
        if not state.started:
            state.started = True
            text = state.echo + text
            opening = self._opening()
            if opening is not None:
                yield self._choice(index, opening, None, None, None)
        tokens = self._absorb(state, delta, num_logprobs)
        if text or delta.token_ids or delta.finish_reason is not None:
            body = self._delta(state, text)
            finish_reason = state.finish_reason if delta.finish_reason is not None else None
            yield self._choice(index, body, tokens, finish_reason, delta.stop_reason)

    def _choice(self, index: int, body: dict[str, Any], tokens: list[TokenLogprob] | None,
                finish_reason: str | None, stop_reason: int | str | None) -> dict[str, Any]:
        return {"index": index, **body, "logprobs": None if tokens is None else self._logprobs_json(tokens),
                "finish_reason": finish_reason, "stop_reason": stop_reason}

    def _absorb(self, state: ChoiceState, delta: CompletionOutput,
                num_logprobs: int | None) -> list[TokenLogprob] | None:
        """Add one delta to its choice's state; return the log-probabilities of its tokens, if asked for."""
        state.text += delta.text
        state.num_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            state.finish_reason, state.stop_reason = delta.finish_reason, delta.stop_reason
        if num_logprobs is None or delta.logprobs is None:
            return None
        tokens = [self._token_logprob(state, t, position, num_logprobs)
                  for t, position in zip(delta.token_ids, delta.logprobs)]
        if state.logprobs is None:
            state.logprobs = []
        state.logprobs.extend(tokens)
        return tokens

    def _token_logprob(self, state: ChoiceState, token_id: int, position: dict[int, Logprob],
                       num_logprobs: int) -> TokenLogprob:
        tokenizer = self.engine.tokenizer
        entry = position.get(token_id)
        text = _token_text(tokenizer, token_id, entry)
        top = [(_token_text(tokenizer, top_id, lp), clean_logprob(lp.logprob))
               for top_id, lp in _top_entries(position, num_logprobs)]
        token = TokenLogprob(text, None if entry is None else clean_logprob(entry.logprob), top, state.text_offset)
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


def _usage(states: list[ChoiceState], num_prompt_tokens: int) -> dict[str, int]:
    num_completion_tokens = sum(s.num_tokens for s in states)
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


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
