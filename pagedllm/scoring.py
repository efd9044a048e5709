"""Scores of text pairs for an embedding model (vLLM's `LLM.score`, `/score` and `/rerank` when the model is not a
cross-encoder): each text is embedded on its own and a pair's score is the cosine similarity of its two
embeddings. Pure Python: the offline API and the server share it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

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
    """a.b / max(|a| |b|, eps), as torch's `CosineSimilarity` (what vLLM scores embeddings with)."""
    norms = math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / max(norms, eps)
