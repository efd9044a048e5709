"""POST /v1/completions: prompts (text, token ids, or vLLM's prompt_embeds) -> completions, whole or streamed."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator
from typing import Any, cast

import torch

from pagedllm.entrypoints.openai.protocol import CompletionRequest, OpenAIError, now
from pagedllm.entrypoints.openai.serving_base import Prompt
from pagedllm.entrypoints.openai.serving_choices import (
    ChoiceState,
    GenerationServing,
    ResponseOptions,
    TokenLogprob,
    keep_prompt_logprobs,
    prompt_logprobs_json,
)
from pagedllm.inputs import ParsedPrompt
from pagedllm.outputs import PromptLogprobs


class OpenAIServingCompletion(GenerationServing):
    """The legacy completions API, with vLLM's sampling extras."""

    async def create(self, request: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        """A response dict, or (stream=True) an iterator of SSE lines. Raises OpenAIError on bad input."""
        model = self.check_model(request.model)
        self.check_common(request)
        self.check_logprobs(request.logprobs, "logprobs")
        self.check_prompt_logprobs(request)
        # echo with logprobs reports the prompt tokens' log-probabilities too (OpenAI's legacy API, as vLLM)
        echo_logprobs = request.echo and request.logprobs is not None
        if echo_logprobs and request.stream:
            raise OpenAIError("echo with logprobs is not available when stream is true", param="echo")
        num_prompt_logprobs = (max(request.prompt_logprobs or 0, cast(int, request.logprobs)) if echo_logprobs
                               else request.prompt_logprobs)
        if request.echo:     # the prompt's text
            self.tokenizer_for("echo")
        if request.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of is not supported (it must be absent or equal to n)", param="best_of")
        prompts = [] if request.prompt is None else await self.prompts(request.prompt, self.truncation(request))
        if request.prompt_embeds is not None:
            if request.echo or request.prompt_logprobs is not None or request.truncate_prompt_tokens is not None:
                raise OpenAIError("prompt_embeds have no tokens to echo, to give log-probabilities of, or to cut",
                                  param="prompt_embeds")
            prompts += await self._embeds_prompts(request.prompt_embeds)
        if not prompts:
            raise OpenAIError("give a prompt (or prompt_embeds)", param="prompt")
        max_tokens = [self.resolve_max_tokens(request.max_tokens, len(p.token_ids)) for p in prompts]
        self.check_num_choices(len(prompts), request.n)
        request_id = self.request_id_for("cmpl", request.request_id)
        if request.use_beam_search:
            return await self.beam_search(request, request_id, prompts, max_tokens, {
                "id": request_id, "object": "text_completion", "created": now(), "model": model}, self.lora_for(model))
        params = [self.sampling_params(request, tokens, request.logprobs, num_prompt_logprobs) for tokens in max_tokens]
        prompt_logprobs: dict[int, PromptLogprobs] = {}
        outputs = keep_prompt_logprobs(self.run_prompts(request_id, prompts, params, request.priority,
                                                         request.cache_salt, self.lora_for(model)), prompt_logprobs)
        outputs = await self.first_then_rest(outputs)
        echoes = [self._echo(p) if request.echo else "" for p in prompts]
        states = [ChoiceState(echo, p.token_ids) for echo, p in zip(echoes, prompts) for _ in range(request.n)]
        head = {"id": request_id, "object": "text_completion", "created": now(), "model": model}
        options = ResponseOptions.of(request, sum(len(p.token_ids) for p in prompts), request.logprobs, self.options)
        response = await self.respond(request, outputs, states, head, options)
        if echo_logprobs:                           # never streamed (refused above): a whole response
            self._add_echo_logprobs(cast(dict[str, Any], response), prompts, prompt_logprobs, request.n,
                                    cast(int, request.logprobs), options.tokens_as_ids)
        if request.prompt_logprobs is not None:     # never streamed either
            for choice in cast(dict[str, Any], response)["choices"]:    # on each choice, after stop_reason (vLLM)
                choice["prompt_logprobs"] = prompt_logprobs_json(prompt_logprobs.get(choice["index"] // request.n))
        return response

    async def _embeds_prompts(self, encoded: str | list[str]) -> list[Prompt]:
        """Each base64 torch.save'd tensor of `prompt_embeds` as a prompt (`LLMEngine.embeds_prompt`), read off the
        event loop (tensors only: weights_only); 400 naming prompt_embeds for one that is not such a tensor."""
        def read(text: str) -> Prompt:
            try:
                tensor = torch.load(io.BytesIO(base64.b64decode(text, validate=True)), weights_only=True,
                                    map_location="cpu")
            except Exception as exc:    # noqa: BLE001 - torch has no one error for bytes that are no tensor file
                raise OpenAIError(f"prompt_embeds could not be read as a torch.save'd tensor: {str(exc)[:200]}",
                                  param="prompt_embeds") from None
            try:
                parsed = self.engine.embeds_prompt(ParsedPrompt(None, None, prompt_embeds=tensor))
            except ValueError as exc:
                raise OpenAIError(str(exc), param="prompt_embeds") from exc
            return Prompt(None, cast(list[int], parsed.token_ids), images=parsed.image_inputs)

        items = [encoded] if isinstance(encoded, str) else encoded
        if not items or len(items) > self.limits.max_prompts:
            raise OpenAIError(f"prompt_embeds takes 1 to {self.limits.max_prompts} tensors", param="prompt_embeds")
        return [await self.engine.run_on_tokenizer_thread(read, text) for text in items]

    def _add_echo_logprobs(self, response: dict[str, Any], prompts: list[Prompt], kept: dict[int, PromptLogprobs],
                           n: int, num_logprobs: int, as_ids: bool) -> None:
        """Put each prompt token's entry before the choice's generated ones: its text, log-probability and top
        `num_logprobs`, with text offsets from 0. The first token has no log-probability (nothing predicts it)
        and, as in OpenAI's and vLLM's answers, None for its top log-probabilities."""
        for choice in response["choices"]:
            index = choice["index"] // n
            token_ids, positions = prompts[index].token_ids, kept[index]
            state = ChoiceState()
            first = self.engine.tokenizer.decode(token_ids[:1])
            state.text_offset = len(first)
            tokens = [TokenLogprob(f"token_id:{token_ids[0]}" if as_ids else first, None, [], 0)] + [
                self._token_logprob(state, token_id, cast(dict, position), num_logprobs, as_ids)
                for token_id, position in zip(token_ids[1:], positions[1:])]
            prompt_part = self._logprobs_json(tokens)
            prompt_part["top_logprobs"][0] = None
            choice["logprobs"] = {field: prompt_part[field] + choice["logprobs"][field] for field in prompt_part}

    # ---- prompts ------------------------------------------------------------------------------------------------
    def _echo(self, prompt: Prompt) -> str:
        return prompt.text if prompt.text is not None else self.engine.tokenizer.decode(prompt.token_ids)

    # ---- response shape -----------------------------------------------------------------------------------------
    def _message(self, state: ChoiceState) -> dict[str, Any]:
        return {"text": state.text}

    def _delta(self, state: ChoiceState, text: str) -> dict[str, Any]:
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
