"""POST /v1/embeddings (OpenAI's Embeddings API, vLLM's pooling parameters) and vLLM's POST /classify: prompts
(text, token ids or chat messages) -> one vector each, an embedding or a classification."""

from __future__ import annotations

import asyncio
import base64
from contextlib import aclosing
from typing import Any

import numpy as np

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    EmbeddingRequest,
    OpenAIError,
    _PromptsToPoolRequest,
    now,
    random_id,
)
from pagedllm.entrypoints.openai.serving_base import OpenAIServing, Prompt
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams


class OpenAIServingPooling(OpenAIServing):
    """Each prompt of a request runs as one engine request (`PoolingParams`), all at once, batched with whatever
    else the engine runs; the answer lists their vectors in input order. Chat messages go through the chat
    serving's template."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        super().__init__(chat.engine, chat.served_model_names, chat.limits, chat.lora_modules, chat.options)
        self.chat = chat

    async def embeddings(self, request: EmbeddingRequest) -> dict[str, Any]:
        model = self.check_model(request.model)
        try:
            params = PoolingParams(normalize=request.normalize, dimensions=request.dimensions)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="dimensions") from exc
        prompts = await self._prompts(request)
        request_id = random_id("embd")
        vectors = await self.pool(request_id, prompts, params, request.priority, self.lora_for(model))
        num_tokens = sum(len(p.token_ids) for p in prompts)
        return {"id": request_id, "object": "list", "created": now(), "model": model,
                "data": [{"index": i, "object": "embedding", "embedding": _encode(vector, request.encoding_format)}
                         for i, vector in enumerate(vectors)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    async def classify(self, request: ClassificationRequest) -> dict[str, Any]:
        """vLLM's classification response: per prompt its `probs`, `num_classes` and the likeliest class's
        `label` (the checkpoint's id2label)."""
        model = self.check_model(request.model)
        labels = self.class_labels()
        prompts = await self._prompts(request)
        request_id = random_id("classify")
        params = PoolingParams(task="classify", use_activation=request.use_activation)
        vectors = await self.pool(request_id, prompts, params, request.priority, self.lora_for(model))
        num_tokens = sum(len(p.token_ids) for p in prompts)
        return {"id": request_id, "object": "list", "created": now(), "model": model,
                "data": [{"index": i, "label": labels[int(np.argmax(probs))], "probs": probs,
                          "num_classes": len(probs)} for i, probs in enumerate(vectors)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}}

    def class_labels(self) -> list[str]:
        """The served model's class names; 400 for a model without a classification head."""
        labels = self.engine.class_labels
        if labels is None:
            raise OpenAIError(f"{self.engine.model_name} has no classification head: classification needs a "
                              "checkpoint saved as a sequence classifier (e.g. Qwen2ForSequenceClassification)",
                              param="model")
        return labels

    async def pool(self, request_id: str, prompts: list[Prompt], params: PoolingParams, priority: int,
                   lora: LoRARequest | None) -> list[list[float]]:
        """Each prompt's vector, in order: one engine request each (`{request_id}-{i}`), all at once."""
        return await asyncio.gather(*(self._pool_one(f"{request_id}-{i}", prompt, params, priority, lora)
                                      for i, prompt in enumerate(prompts)))

    async def _prompts(self, request: _PromptsToPoolRequest) -> list[Prompt]:
        if (request.input is None) == (request.messages is None):
            raise OpenAIError("give exactly one of input and messages", param="input")
        if request.messages is not None:
            tokens = await self.chat.render(ChatCompletionRequest(
                messages=request.messages, chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message))
            return await self.prompts(tokens, self.truncation(request), param="messages", pooling=True)
        return await self.prompts(request.input, self.truncation(request), param="input", pooling=True)

    async def _pool_one(self, request_id: str, prompt: Prompt, params: PoolingParams, priority: int,
                        lora: LoRARequest | None) -> list[float]:
        async with aclosing(self.engine.generate(request_id, prompt.engine_prompt(), params, priority=priority,
                                                 prompt_token_ids=prompt.token_ids, lora_request=lora)) as stream:
            async for output in stream:
                if output.finished:
                    if output.embedding is None:
                        raise RuntimeError(f"pooling request {request_id} finished without its vector")
                    return output.embedding
        raise RuntimeError(f"request {request_id} ended without an output")


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """float: the values; base64: their little-endian float32 bytes (what OpenAI's SDK decodes by default)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
