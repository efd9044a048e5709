"""N-gram prompt lookup: draft tokens copied from the request's own context, no draft model.

The last n tokens of the context (n from `prompt_lookup_max` down to `prompt_lookup_min`) are looked up earlier
in the context; if they occurred before, the tokens that followed that occurrence are the draft:

    context:  the cat sat on the mat . the cat  ->  longest earlier match of the suffix "the cat" ends at 1,
    draft:    sat on the                            so the draft is what followed it (k = 3 tokens)

The longest matching n wins; among its occurrences the earliest (as vLLM), which for a prompt holding a text to
edit or summarise is that text, and whose continuation is least often cut short by the end of the context.
No torch here: the scheduler calls it while planning a step.
"""

from __future__ import annotations

import numpy as np

from pagedllm.config import SpeculativeConfig


class NgramProposer:
    """Proposes up to k draft tokens per request by prompt lookup (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.num_speculative_tokens = config.num_speculative_tokens

    def propose(self, token_ids: list[int], max_num_tokens: int) -> list[int]:
        """Draft tokens to follow `token_ids`: at most min(k, max_num_tokens), maybe none."""
        num_tokens = min(self.num_speculative_tokens, max_num_tokens)
        if num_tokens <= 0 or len(token_ids) <= self.min_n:
            return []
        end = find_ngram_match(np.asarray(token_ids), self.min_n, self.max_n)
        if end is None:
            return []
        return token_ids[end + 1:end + 1 + num_tokens]


def find_ngram_match(tokens: np.ndarray, min_n: int, max_n: int) -> int | None:
    """The index where the earliest occurrence of the longest matching suffix n-gram (min_n <= n <= max_n)
    ends, or None if no suffix of min_n tokens occurred before.

    `match_len[i]` is how many tokens ending at i (i < len - 1) equal the context's last tokens, capped at max_n;
    it grows by one comparison per n, vectorised over every i.
    """
    last = len(tokens) - 1
    candidates = tokens[:last] == tokens[last]                    # [last]: occurrence ends at i, n = 1
    match_len = candidates.astype(np.int64)
    for n in range(1, min(max_n, last)):
        idx = np.arange(n, last)                                  # i - n must be >= 0
        extend = candidates[n:] & (tokens[idx - n] == tokens[last - n])
        candidates = np.zeros_like(candidates)
        candidates[n:] = extend
        match_len[candidates] = n + 1
        if not candidates.any():
            break
    best = int(match_len.max(initial=0))
    if best < min_n:
        return None
    return int(np.argmax(match_len == best))
