"""N-gram prompt lookup: longest suffix match first, earliest occurrence, capped draft lengths."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.ngram_proposer import NgramProposer, find_ngram_match


def _proposer(k: int = 3, lookup_min: int = 1, lookup_max: int = 3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lookup_min,
                                           prompt_lookup_max=lookup_max))


def _plain_match(tokens: list[int], min_n: int, max_n: int) -> int | None:
    """The oracle: for n from max_n down, the first i < len - 1 where tokens[i-n+1:i+1] is the suffix."""
    last = len(tokens) - 1
    for n in range(min(max_n, last), min_n - 1, -1):
        for i in range(n - 1, last):
            if tokens[i - n + 1:i + 1] == tokens[last - n + 1:]:
                return i
    return None


@pytest.mark.parametrize("seed", range(40))
def test_vectorised_match_agrees_with_the_plain_search(seed: int) -> None:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 3, size=int(rng.integers(2, 40))).tolist()
    min_n = int(rng.integers(1, 3))
    max_n = min_n + int(rng.integers(0, 4))
    assert find_ngram_match(np.asarray(tokens), min_n, max_n) == _plain_match(tokens, min_n, max_n)


def test_longest_match_wins_then_the_earliest() -> None:
    proposer = _proposer()
    #                 x  1  2  3  y  2  3  z  1  2  3: "1 2 3" (n=3) beats the later "2 3"
    assert proposer.propose([9, 1, 2, 3, 7, 2, 3, 8, 1, 2, 3], 10) == [7, 2, 3]
    assert proposer.propose([1, 5, 6, 1, 7, 8, 1], 10) == [5, 6, 1]           # n = 1, the earliest "1"
    assert proposer.propose([1, 2, 3, 4], 10) == []                              # no repeat
    assert proposer.propose([4, 4, 4, 4], 10) == [4]                             # continuation cut by the end


def test_draft_length_is_capped() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert _proposer(k=3).propose(tokens, 10) == [3, 4, 5]
    assert _proposer(k=3).propose(tokens, 2) == [3, 4]
    assert _proposer(k=3).propose(tokens, 0) == []
    assert _proposer(k=3, lookup_min=3).propose(tokens, 10) == []               # only a 2-gram matches


def test_config_validation() -> None:
    assert SpeculativeConfig.from_dict(None) is None
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5,
                                          "prompt_lookup_min": 2})
    assert (config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == (4, 5, 2)
    for bad, match in [({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative"),
                       ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_max"),
                       ({"num_lookahead": 3}, "unknown keys"), ("ngram", "must be a dict")]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.from_dict(bad)
