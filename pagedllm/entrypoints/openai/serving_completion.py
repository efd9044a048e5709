"""POST /v1/completions: prompts (text or token ids) -> completions, whole or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, cast

from pagedllm.entrypoints.openai.protocol import CompletionRequest, OpenAIError, now, random_id
from pagedllm.entrypoints.openai.serving_base import (
    SSE_DONE,
    OpenAIServing,
    OutputStream,
    Prompt,
    clean_logprob,
    error_for,
    sse,
    token_text,
    top_entries,
    usage,
)
from pagedllm.outputs import CompletionOutput


class _ChoiceState:
    """What one choice has produced so far."""

    def __init__(self, echo: str | None) -> None:
        self.text = echo or ""
        self.echo_pending = echo           # streamed: prepended to the first chunk
        self.token_ids: list[int] = []
        self.logprobs: dict[str, list] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text_offset = len(self.text)


class OpenAIServingCompletion(OpenAIServing):
    """The legacy completions API, with vLLM's sampling extras."""

    async def create(self, request: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        """A response dict, or (stream=True) an iterator of SSE lines. Raises OpenAIError on bad input."""
        model = self.check_model(request.model)
        self.check_common(request)
        self.check_logprobs(request.logprobs, "logprobs")
        if request.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of is not supported (it must be absent or equal to n)", param="best_of")
        prompts = self._prompts(request.prompt)
        params = [self.sampling_params(request, self.resolve_max_tokens(request.max_tokens, len(p.token_ids)),
                                       request.logprobs) for p in prompts]
        request_id = random_id("cmpl")
        choices = self.make_choices(request_id, params, request.n)
        outputs = self.run_choices(choices, prompts, request.priority, request.cache_salt)
        outputs = await self.first_then_rest(outputs)
        echoes = [self._echo(p) if request.echo else None for p in prompts]
        states = [_ChoiceState(echoes[c.prompt_index]) for c in choices]
        head = {"id": request_id, "object": "text_completion", "created": now(), "model": model}
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self._stream(outputs, states, head, request.logprobs, include_usage, num_prompt_tokens)
        return await self._collect(outputs, states, head, request.logprobs, num_prompt_tokens)

    # ---- prompts ------------------------------------------------------------------------------------------------
    def _prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
        raw: list[str | list[int]]
        if isinstance(prompt, str):
            raw = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            raw = [cast(list[int], prompt)]         # one prompt as token ids
        else:
            raw = cast(list[str | list[int]], list(prompt))
        if not raw:
            raise OpenAIError("prompt must not be empty", param="prompt")
        if len(raw) > self.limits.max_prompts:
            raise OpenAIError(f"at most {self.limits.max_prompts} prompts per request", param="prompt")
        prompts = []
        for item in raw:
            token_ids = self.engine.tokenizer.encode(item) if isinstance(item, str) else list(item)
            if not token_ids:
                raise OpenAIError("prompt must not be empty", param="prompt")
            prompts.append(Prompt(item if isinstance(item, str) else None, self.validate_prompt(token_ids)))
        return prompts

    def _echo(self, prompt: Prompt) -> str:
        return prompt.text if prompt.text is not None else self.engine.tokenizer.decode(prompt.token_ids)

    # ---- responses ----------------------------------------------------------------------------------------------
    async def _collect(self, outputs: OutputStream, states: list[_ChoiceState],
                       head: dict[str, Any], num_logprobs: int | None, num_prompt_tokens: int) -> dict[str, Any]:
        async with aclosing(outputs):
            async for choice, output in outputs:
                state = states[choice.index]
                self._absorb(state, output.outputs[0], num_logprobs)
        choices = [{"index": i, "text": s.text, "logprobs": s.logprobs, "finish_reason": s.finish_reason,
                    "stop_reason": s.stop_reason} for i, s in enumerate(states)]
        num_completion_tokens = sum(len(s.token_ids) for s in states)
        return {**head, "choices": choices, "usage": usage(num_prompt_tokens, num_completion_tokens)}

    async def _stream(self, outputs: OutputStream, states: list[_ChoiceState],
                      head: dict[str, Any], num_logprobs: int | None, include_usage: bool,
                      num_prompt_tokens: int) -> AsyncIterator[str]:
        extra = {"usage": None} if include_usage else {}
        async with aclosing(outputs):
            try:
                async for choice, output in outputs:
                    state = states[choice.index]
                    delta = output.outputs[0]
                    text = (state.echo_pending or "") + delta.text
                    state.echo_pending = None
                    logprobs = self._absorb(state, delta, num_logprobs)
                    if not text and not delta.token_ids and delta.finish_reason is None:
                        continue
                    yield sse({**head, "choices": [{"index": choice.index, "text": text, "logprobs": logprobs,
                                                    "finish_reason": delta.finish_reason,
                                                    "stop_reason": delta.stop_reason}], **extra})
                if include_usage:
                    num_completion_tokens = sum(len(s.token_ids) for s in states)
                    yield sse({**head, "choices": [], "usage": usage(num_prompt_tokens, num_completion_tokens)})
            except Exception as exc:  # noqa: BLE001 - the status line is sent: report the error in the stream
                yield sse(error_for(exc).to_dict())
        yield SSE_DONE

    def _absorb(self, state: _ChoiceState, delta: CompletionOutput, num_logprobs: int | None) -> dict | None:
        """Add one delta to a choice's state; return the delta's logprobs in the legacy format."""
        state.text += delta.text
        state.token_ids.extend(delta.token_ids)
        if delta.finish_reason is not None:
            state.finish_reason, state.stop_reason = delta.finish_reason, delta.stop_reason
        if num_logprobs is None or delta.logprobs is None:
            return None
        part = self._legacy_logprobs(delta, num_logprobs, state)
        if state.logprobs is None:
            state.logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for key, values in part.items():
            state.logprobs[key].extend(values)
        return part

    def _legacy_logprobs(self, delta: CompletionOutput, num_logprobs: int, state: _ChoiceState) -> dict[str, list]:
        tokenizer = self.engine.tokenizer
        part: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, position in zip(delta.token_ids, delta.logprobs or []):
            entry = position.get(token_id)
            text = token_text(tokenizer, token_id, entry)
            part["tokens"].append(text)
            part["token_logprobs"].append(clean_logprob(entry.logprob) if entry is not None else None)
            top = {token_text(tokenizer, t, lp): clean_logprob(lp.logprob) for t, lp in top_entries(position,
                                                                                                    num_logprobs)}
            if entry is not None:
                top.setdefault(text, clean_logprob(entry.logprob))
            part["top_logprobs"].append(top)
            part["text_offset"].append(state.text_offset)
            state.text_offset += len(text)
        return part
