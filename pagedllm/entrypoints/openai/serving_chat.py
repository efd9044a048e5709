"""POST /v1/chat/completions: messages -> the chat template -> an assistant reply, whole or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import jinja2

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError, now, random_id
from pagedllm.entrypoints.openai.serving_base import Prompt
from pagedllm.entrypoints.openai.serving_choices import ChoiceState, GenerationServing, TokenLogprob
from pagedllm.tokenizer.chat_template import apply_chat_template


class OpenAIServingChat(GenerationServing):
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
        prompt = Prompt(None, await self.prompt_token_ids(await self.render(request), param="messages"))
        max_tokens, param = request.max_tokens, "max_tokens"
        if request.max_completion_tokens is not None:
            max_tokens, param = request.max_completion_tokens, "max_completion_tokens"
        params = self.sampling_params(request, self.resolve_max_tokens(max_tokens, len(prompt.token_ids), param),
                                      num_logprobs)
        request_id = random_id("chatcmpl")
        choices = self.make_choices(request_id, [params], request.n)
        outputs = await self.first_then_rest(self.run_choices(choices, [prompt], request.priority,
                                                              request.cache_salt))
        head = {"id": request_id, "created": now(), "model": model,
                "object": "chat.completion.chunk" if request.stream else "chat.completion"}
        return await self.respond(request, outputs, [ChoiceState() for _ in choices], head, num_logprobs,
                                  len(prompt.token_ids))

    async def render(self, request: ChatCompletionRequest) -> list[int]:
        """The conversation's prompt token ids, templated off the event loop; 400 naming `messages` on a bad
        message or template."""
        try:
            return await self.engine.run_on_tokenizer_thread(
                apply_chat_template, self.engine.tokenizer, request.messages, request.chat_template,
                request.add_generation_prompt, **(request.chat_template_kwargs or {}))
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise OpenAIError(str(exc), param="messages") from exc

    # ---- response shape -----------------------------------------------------------------------------------------
    def _opening(self) -> dict[str, Any]:
        return {"delta": {"role": "assistant", "content": ""}}

    def _message(self, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}}

    def _delta(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"delta": {"content": text} if text or finish_reason is None else {}}

    def _logprobs_json(self, tokens: list[TokenLogprob]) -> dict[str, Any]:
        return {"content": [{**_token_json(t.token, t.logprob),
                             "top_logprobs": [_token_json(text, logprob) for text, logprob in t.top]}
                            for t in tokens]}


def _token_json(text: str, logprob: float | None) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
