"""pagedllm/scoring.py against torch: the cosine similarity vLLM scores embeddings with, and the pair shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from pagedllm.scoring import cosine_similarity, pair_up

vectors = st.integers(1, 16).flatmap(lambda n: st.tuples(
    *(st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=n, max_size=n) for _ in range(2))))


@given(vectors)
@example(([1e-9, 0.0], [2.0, 0.0]))     # a norm under eps: torch clamps each norm, not their product
def test_cosine_similarity_is_torchs(pair):
    a, b = pair
    expected = torch.nn.functional.cosine_similarity(torch.tensor(a, dtype=torch.float64),
                                                     torch.tensor(b, dtype=torch.float64), dim=0).item()
    assert cosine_similarity(a, b) == pytest.approx(expected, abs=1e-9)


def test_a_zero_vector_scores_zero_and_lengths_must_match():
    assert cosine_similarity([0.0, 0.0], [1.0, 2.0]) == 0.0
    with pytest.raises(ValueError):
        cosine_similarity([1.0], [1.0, 2.0])


def test_pairs_are_one_to_one_one_to_many_or_pairwise():
    assert pair_up(["q"], ["a"]) == [(0, 0)]
    assert pair_up(["q"], ["a", "b", "c"]) == [(0, 0), (0, 1), (0, 2)]
    assert pair_up(["x", "y"], ["a", "b"]) == [(0, 0), (1, 1)]
    for first, second, message in ((["x", "y"], ["a"], "got 2:1"), ([], ["a"], "first text"),
                                   (["q"], [], "second text")):
        with pytest.raises(ValueError, match=message):
            pair_up(first, second)
