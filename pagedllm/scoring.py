"""Scores of text pairs (vLLM's `LLM.score`, `/score` and `/rerank`), two ways, by the model:
- an embedding model: each text is embedded on its own and a pair scores the cosine similarity of its two
  embeddings;
- a cross-encoder (a classifier checkpoint with one label, as rerankers are saved): the pair is one prompt, the two
  texts joined by the tokenizer as a text pair, and scores the probability the classifier gives it.
Pure Python: the offline API and the server share it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

from pagedllm.inputs import ParsedPrompt, TokensPrompt

T = TypeVar("T")


def pair_up(data_1: Sequence[T], data_2: Sequence[T]) -> list[tuple[int, int]]:
    """The (index into data_1, index into data_2) of each pair to score, in order, for vLLM's three shapes: 1:1,
    1:N (the one first text against each second) and N:N (pairwise). ValueError for any other."""
    if not data_1:
        raise ValueError("at least one first text (text_1, query) must be given")
    if not data_2:
        raise ValueError("at least one second text (text_2, documents) must be given")
    if len(data_1) == 1:
        return [(0, j) for j in range(len(data_2))]
    if len(data_1) != len(data_2):
        raise ValueError(f"input lengths must be either 1:1, 1:N or N:N, got {len(data_1)}:{len(data_2)}")
    return [(i, i) for i in range(len(data_1))]


def cosine_similarity(a: Sequence[float], b: Sequence[float], eps: float = 1e-8) -> float:
    """a.b / (max(|a|, eps) max(|b|, eps)), as torch's `CosineSimilarity` (what vLLM scores embeddings with)."""
    norm_a, norm_b = math.sqrt(math.fsum(x * x for x in a)), math.sqrt(math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / (max(norm_a, eps) * max(norm_b, eps))


def cross_encoder_prompt(tokenizer: Any, first: ParsedPrompt, second: ParsedPrompt, token_types: bool
                         ) -> TokensPrompt:
    """A pair's prompt for a cross-encoder: two texts as the tokenizer encodes a text pair (vLLM's, with its special
    tokens); a prompt given as token ids joins as it is. `token_types`: the model tells a pair's texts apart by token
    type (BERT's), so the prompt carries the types where the tokenizer gives them (BERT's does, 1 for the second
    text; one that gives none leaves them all 0, as vLLM and sentence-transformers run it), for two prompts of token
    ids 0 for the first's and 1 for the second's."""
    token_types = token_types and "token_type_ids" in tokenizer.model_input_names
    if first.text is not None and second.text is not None:
        encoded = tokenizer(first.text, second.text)
        ids, types = list(encoded["input_ids"]), encoded.get("token_type_ids")
    else:
        ids_1, ids_2 = _token_ids(tokenizer, first), _token_ids(tokenizer, second)
        ids, types = ids_1 + ids_2, [0] * len(ids_1) + [1] * len(ids_2)
    prompt = TokensPrompt(prompt_token_ids=ids)
    if token_types and types is not None:
        prompt["token_type_ids"] = list(types)
    return prompt


def _token_ids(tokenizer: Any, prompt: ParsedPrompt) -> list[int]:
    return prompt.token_ids if prompt.token_ids is not None else tokenizer.encode(prompt.text)
