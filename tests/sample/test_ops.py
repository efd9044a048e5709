"""The sampler's tensor ops on their own: the fast paths against the plain ones."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample.ops import argmax_rows, inverse_cdf_sample, top_k_top_p_candidates, top_k_top_p_sorted


@pytest.mark.parametrize("seed", range(4))
def test_top_p_candidates_agree_with_full_sort(seed: int) -> None:
    torch.manual_seed(seed)
    vocab = 500
    logits = torch.randn(6, vocab) * torch.tensor([[8.0], [8.0], [0.5], [3.0], [8.0], [1.0]])
    top_k = torch.tensor([vocab, 20, 7, vocab, vocab, vocab])
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.3, 1.0, 0.05])
    expected = top_k_top_p_sorted(logits, top_k, top_p)
    fast = top_k_top_p_candidates(logits, top_k, top_p, num_candidates=vocab)
    torch.testing.assert_close(fast.softmax(-1), expected.softmax(-1))
    assert torch.equal(fast.softmax(-1) > 1e-6, expected.softmax(-1) > 1e-6)
    peaked = top_k_top_p_candidates(logits[[0, 1, 2, 5]], top_k[[0, 1, 2, 5]], top_p[[0, 1, 2, 5]], 32)
    assert peaked is not None                                      # peaked rows and top-k rows fit
    torch.testing.assert_close(peaked.softmax(-1), expected[[0, 1, 2, 5]].softmax(-1))
    flat = torch.randn(1, vocab) * 0.1
    assert top_k_top_p_candidates(flat, None, torch.tensor([0.9]), 32) is None  # a flat row needs the sort
    assert top_k_top_p_candidates(logits, None, top_p, num_candidates=vocab) is not None


def test_inverse_cdf_never_picks_zero_probability_tokens() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 5)
    uniform = torch.tensor([0.0, 0.4999, 0.5, 0.999999, 1.0 - 2 ** -24])
    assert inverse_cdf_sample(probs, uniform).tolist() == [1, 1, 3, 3, 3]


@pytest.mark.parametrize("vocab", [49152, 1024, 1000])     # 1000: not a multiple of the chunk, torch's argmax
def test_argmax_rows_is_torch_argmax_with_ties_and_nan(vocab: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(9, vocab)
    logits[1, [5, 700, vocab - 1]] = 50.0          # ties across chunks: the first index
    logits[2, [130, 131]] = 50.0                   # ties in one chunk
    logits[3, [vocab - 1, 3]] = float("nan")       # NaN counts as the largest, the first one wins
    logits[4] = float("-inf")                      # a row masked out entirely (a grammar, min_tokens)
    logits[5, vocab - 1] = float("inf")
    logits[6] = 0.0                                # all equal
    logits[7, 0] = 1e30
    for rows in (logits, logits.to(torch.bfloat16).float(), logits[:1]):
        assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))
