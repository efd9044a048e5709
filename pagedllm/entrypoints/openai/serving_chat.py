"""POST /v1/chat/completions: messages -> the chat template -> an assistant reply, whole or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import jinja2

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError, now, random_id
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
from pagedllm.tokenizer.chat_template import apply_chat_template


class _ChoiceState:
    def __init__(self) -> None:
        self.text = ""
        self.num_tokens = 0
        self.logprobs: list[dict[str, Any]] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.started = False               # streamed: the role chunk went out


class OpenAIServingChat(OpenAIServing):
    """The chat completions API, with vLLM's sampling extras."""

    async def create(self, request: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        """A response dict, or (stream=True) an iterator of SSE lines. Raises OpenAIError on bad input."""
        model = self.check_model(request.model)
        self.check_common(request)
        if request.tools:
            raise OpenAIError("tools are not supported", param="tools")
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        self.check_logprobs(request.top_logprobs, "top_logprobs")
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        prompt = Prompt(None, self.validate_prompt(self.render(request), param="messages"))
        max_tokens, param = request.max_tokens, "max_tokens"
        if request.max_completion_tokens is not None:
            max_tokens, param = request.max_completion_tokens, "max_completion_tokens"
        params = self.sampling_params(request, self.resolve_max_tokens(max_tokens, len(prompt.token_ids), param),
                                      num_logprobs)
        request_id = random_id("chatcmpl")
        choices = self.make_choices(request_id, [params], request.n)
        outputs = await self.first_then_rest(self.run_choices(choices, [prompt], request.priority,
                                                              request.cache_salt))
        states = [_ChoiceState() for _ in choices]
        head = {"id": request_id, "created": now(), "model": model}
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self._stream(outputs, states, head, num_logprobs, include_usage, len(prompt.token_ids))
        return await self._collect(outputs, states, head, num_logprobs, len(prompt.token_ids))

    def render(self, request: ChatCompletionRequest) -> list[int]:
        """The conversation's prompt token ids; 400 naming `messages` on a bad message or template."""
        try:
            return apply_chat_template(self.engine.tokenizer, request.messages, request.chat_template,
                                       request.add_generation_prompt, **(request.chat_template_kwargs or {}))
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise OpenAIError(str(exc), param="messages") from exc

    # ---- responses ----------------------------------------------------------------------------------------------
    async def _collect(self, outputs: OutputStream, states: list[_ChoiceState],
                       head: dict[str, Any], num_logprobs: int | None, num_prompt_tokens: int) -> dict[str, Any]:
        async with aclosing(outputs):
            async for choice, output in outputs:
                self._absorb(states[choice.index], output.outputs[0], num_logprobs)
        choices = [{"index": i, "message": {"role": "assistant", "content": s.text},
                    "logprobs": None if s.logprobs is None else {"content": s.logprobs},
                    "finish_reason": s.finish_reason, "stop_reason": s.stop_reason} for i, s in enumerate(states)]
        num_completion_tokens = sum(s.num_tokens for s in states)
        return {**head, "object": "chat.completion", "choices": choices,
                "usage": usage(num_prompt_tokens, num_completion_tokens)}

    async def _stream(self, outputs: OutputStream, states: list[_ChoiceState],
                      head: dict[str, Any], num_logprobs: int | None, include_usage: bool,
                      num_prompt_tokens: int) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk"}
        extra = {"usage": None} if include_usage else {}

        def chunk(index: int, delta: dict[str, Any], logprobs: list | None, finish_reason: str | None,
                  stop_reason: int | str | None = None) -> str:
            return sse({**head, "choices": [{"index": index, "delta": delta,
                                             "logprobs": None if logprobs is None else {"content": logprobs},
                                             "finish_reason": finish_reason, "stop_reason": stop_reason}],
                        **extra})

        async with aclosing(outputs):
            try:
                async for choice, output in outputs:
                    state, delta = states[choice.index], output.outputs[0]
                    if not state.started:
                        state.started = True
                        yield chunk(choice.index, {"role": "assistant", "content": ""}, None, None)
                    logprobs = self._absorb(state, delta, num_logprobs)
                    if not delta.text and not delta.token_ids and delta.finish_reason is None:
                        continue
                    content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
                    yield chunk(choice.index, content, logprobs, delta.finish_reason, delta.stop_reason)
                if include_usage:
                    num_completion_tokens = sum(s.num_tokens for s in states)
                    yield sse({**head, "choices": [], "usage": usage(num_prompt_tokens, num_completion_tokens)})
            except Exception as exc:  # noqa: BLE001 - the status line is sent: report the error in the stream
                yield sse(error_for(exc).to_dict())
        yield SSE_DONE

    def _absorb(self, state: _ChoiceState, delta: CompletionOutput, num_logprobs: int | None) -> list | None:
        state.text += delta.text
        state.num_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            state.finish_reason, state.stop_reason = delta.finish_reason, delta.stop_reason
        if num_logprobs is None or delta.logprobs is None:
            return None
        part = [self._logprob_entry(t, pos, num_logprobs) for t, pos in zip(delta.token_ids, delta.logprobs)]
        if state.logprobs is None:
            state.logprobs = []
        state.logprobs.extend(part)
        return part

    def _logprob_entry(self, token_id: int, position: dict, num_logprobs: int) -> dict[str, Any]:
        tokenizer = self.engine.tokenizer
        entry = position.get(token_id)
        text = token_text(tokenizer, token_id, entry)
        top = []
        for top_id, lp in top_entries(position, num_logprobs):
            top_text = token_text(tokenizer, top_id, lp)
            top.append({"token": top_text, "logprob": clean_logprob(lp.logprob),
                        "bytes": list(top_text.encode("utf-8"))})
        return {"token": text, "logprob": clean_logprob(entry.logprob) if entry is not None else None,
                "bytes": list(text.encode("utf-8")), "top_logprobs": top}
