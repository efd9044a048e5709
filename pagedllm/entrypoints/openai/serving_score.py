"""POST /score and /rerank (vLLM's, with /v1/score, /v1/rerank and /v2/rerank): text pairs scored as
pagedllm/scoring.py says, by the cosine similarity of their embeddings, or by a cross-encoder. Not OpenAI's API:
the score shape is vLLM's, the rerank shape Jina's and Cohere's."""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.protocol import OpenAIError, RerankRequest, ScoreRequest, now, random_id
from pagedllm.entrypoints.openai.serving_base import OpenAIServing, Prompt
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagedllm.inputs import ParsedPrompt
from pagedllm.pooling_params import PoolingParams
from pagedllm.scoring import cosine_similarity, cross_encoder_prompt, pair_up


class OpenAIServingScore(OpenAIServing):
    """With an embedding model each distinct text of a request is embedded once, then every pair is scored; with a
    cross-encoder each pair runs as one prompt. Either way all at once, batched with whatever else the engine
    runs."""

    def __init__(self, pooling: OpenAIServingPooling) -> None:
        super().__init__(pooling.engine, pooling.served_model_names, pooling.limits, pooling.lora_modules,
                         pooling.options)
        self.pooling = pooling

    async def score(self, request: ScoreRequest) -> dict[str, Any]:
        """vLLM's score response: one `{"index", "object": "score", "score"}` per pair, in order."""
        model = self.check_model(request.model)
        request_id = random_id("score")
        scores, num_tokens = await self._scores(request, request_id, model, request.text_1, request.text_2,
                                                ("text_1", "text_2"))
        return {"id": request_id, "object": "list", "created": now(), "model": model,
                "data": [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}}

    async def rerank(self, request: RerankRequest) -> dict[str, Any]:
        """The documents with their `relevance_score`, best first, the first `top_n` of them (all for 0); each
        keeps its `index` in the request."""
        model = self.check_model(request.model)
        request_id = random_id("rerank")
        scores, num_tokens = await self._scores(request, request_id, model, request.query, request.documents,
                                                ("query", "documents"))
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        return {"id": request_id, "model": model,
                "results": [{"index": i, "document": {"text": request.documents[i]}, "relevance_score": scores[i]}
                            for i in order[:request.top_n or None]],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    async def _scores(self, request: ScoreRequest | RerankRequest, request_id: str, model: str,
                      data_1: str | list[str], data_2: str | list[str], params: tuple[str, str]
                      ) -> tuple[list[float], int]:
        """Each pair's score, and the prompt tokens of the pairs (with embeddings a text counts once per pair it is
        in, as vLLM counts)."""
        texts_1 = [data_1] if isinstance(data_1, str) else data_1
        texts_2 = [data_2] if isinstance(data_2, str) else data_2
        try:
            pairs = pair_up(texts_1, texts_2)
        except ValueError as exc:
            raise OpenAIError(str(exc), param=params[0] if not texts_1 else params[1]) from exc
        truncation = self.truncation(request)
        lora = self.lora_for(model)
        labels = self.engine.class_labels
        if labels is None:
            first = await self.prompts(texts_1, truncation, params[0], pooling=True)
            second = await self.prompts(texts_2, truncation, params[1], pooling=True)
            vectors = await self.pooling.pool(request_id, first + second, PoolingParams(), request.priority, lora)
            firsts, seconds = vectors[:len(first)], vectors[len(first):]
            return ([cosine_similarity(firsts[i], seconds[j]) for i, j in pairs],
                    sum(len(first[i].token_ids) + len(second[j].token_ids) for i, j in pairs))
        if len(labels) != 1:
            raise OpenAIError(f"scores need an embedding model or a cross-encoder (a classifier with one label); "
                              f"{self.engine.model_name} has {len(labels)} labels: use /classify", param="model")
        if len(pairs) > self.limits.max_prompts:
            raise OpenAIError(f"at most {self.limits.max_prompts} pairs per request", param=params[1])
        tokenizer, token_types = self.engine.tokenizer, self.engine.token_type_vocab_size > 1
        joined = await self.engine.run_on_tokenizer_thread(lambda: [
            cross_encoder_prompt(tokenizer, ParsedPrompt(texts_1[i], None), ParsedPrompt(texts_2[j], None), token_types)
            for i, j in pairs])
        prompts = []
        for pair in joined:     # cut to the truncation as prompt_token_ids cuts the ids
            types = pair.get("token_type_ids")
            prompts.append(Prompt(None, await self.prompt_token_ids(pair["prompt_token_ids"], params[1], truncation,
                                                                    pooling=True),
                                  types if types is None or truncation is None else types[truncation]))
        probs = await self.pooling.pool(request_id, prompts, PoolingParams(task="classify"), request.priority, lora)
        return [p[0] for p in probs], sum(len(p.token_ids) for p in prompts)
