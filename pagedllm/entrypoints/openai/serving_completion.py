"""POST /v1/completions: prompts (text or token ids) -> completions, whole or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

from pagedllm.entrypoints.openai.protocol import CompletionRequest, OpenAIError, now, random_id
from pagedllm.entrypoints.openai.serving_base import Prompt
from pagedllm.entrypoints.openai.serving_choices import ChoiceState, GenerationServing, TokenLogprob


class OpenAIServingCompletion(GenerationServing):
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
        prompts = await self._prompts(request.prompt)
        params = [self.sampling_params(request, self.resolve_max_tokens(request.max_tokens, len(p.token_ids)),
                                       request.logprobs) for p in prompts]
        request_id = random_id("cmpl")
        choices = self.make_choices(request_id, params, request.n)
        outputs = self.run_choices(choices, prompts, request.priority, request.cache_salt)
        outputs = await self.first_then_rest(outputs)
        echoes = [self._echo(p) if request.echo else "" for p in prompts]
        states = [ChoiceState(echoes[c.prompt_index]) for c in choices]
        head = {"id": request_id, "object": "text_completion", "created": now(), "model": model}
        return await self.respond(request, outputs, states, head, request.logprobs,
                                  sum(len(p.token_ids) for p in prompts))

    # ---- prompts ------------------------------------------------------------------------------------------------
    async def _prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
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
        return [Prompt(item if isinstance(item, str) else None, await self.prompt_token_ids(item)) for item in raw]

    def _echo(self, prompt: Prompt) -> str:
        return prompt.text if prompt.text is not None else self.engine.tokenizer.decode(prompt.token_ids)

    # ---- response shape -----------------------------------------------------------------------------------------
    def _message(self, text: str) -> dict[str, Any]:
        return {"text": text}

    def _delta(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"text": text}

    def _logprobs_json(self, tokens: list[TokenLogprob]) -> dict[str, Any]:
        """The legacy format: one list per field, and top log-probabilities as {text: logprob}."""
        return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [_top_json(t) for t in tokens], "text_offset": [t.text_offset for t in tokens]}


def _top_json(token: TokenLogprob) -> dict[str, float]:
    """The top log-probabilities, with the sampled token's added if it is not among them."""
    top = dict(token.top)
    if token.logprob is not None:
        top.setdefault(token.token, token.logprob)
    return top
