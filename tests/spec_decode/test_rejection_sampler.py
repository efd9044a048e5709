"""The batched rejection sampler against a plain-Python one, and its output distribution against p."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata, SamplingRow, make_generator
from pagedllm.sample.ops import rejection_sample, verify_rows
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.rejection_sampler import verify_drafts


def plain_verify(probs: list[list[float]], drafts: list[int], uniforms: list[tuple[float, float]]) -> list[int]:
    """The oracle, one request: accept draft j with probability p_j(d_j); at the first rejection draw from p_j
    without d_j, else the bonus from p_k; inverse CDF over the unnormalised weights, as the batched one."""
    def draw(weights: list[float], u: float) -> int:
        target, total = u * sum(weights), 0.0
        for token, weight in enumerate(weights):
            total += weight
            if total > target:
                return token
        return len(weights) - 1

    tokens = []
    for j, draft in enumerate(drafts):
        if uniforms[j][0] < probs[j][draft]:
            tokens.append(draft)
            continue
        residual = list(probs[j])
        residual[draft] = 0.0
        return tokens + [draw(residual, uniforms[j][1])]
    return tokens + [draw(probs[len(drafts)], uniforms[len(drafts)][1])]


def _batched(probs: torch.Tensor, drafts: list[list[int]], uniform: torch.Tensor) -> list[list[int]]:
    draft_ids = torch.tensor([t for d in drafts for t in d + [-1]])
    accepted, recovered = rejection_sample(probs, draft_ids, uniform)
    out, start = [], 0
    for d in drafts:
        count = 0
        while count < len(d) and accepted[start + count]:
            count += 1
        out.append(d[:count] + [int(recovered[start + count])])
        start += len(d) + 1
    return out


@pytest.mark.parametrize("seed", range(20))
def test_batched_agrees_with_the_plain_oracle(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    vocab = 6
    drafts = [torch.randint(0, vocab, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
              for _ in range(3)]
    rows = sum(len(d) + 1 for d in drafts)
    probs = torch.softmax(3 * torch.randn(rows, vocab, generator=gen, dtype=torch.float64), -1)
    probs[0] = 0.0
    probs[0, drafts[0][0]] = 1.0                                   # a certain draft is always accepted
    uniform = torch.rand(rows, 2, generator=gen, dtype=torch.float64)
    expected, start = [], 0
    for d in drafts:
        rows_of = range(start, start + len(d) + 1)
        expected.append(plain_verify([probs[r].tolist() for r in rows_of], d,
                                     [tuple(uniform[r].tolist()) for r in rows_of]))
        start += len(d) + 1
    assert _batched(probs, drafts, uniform) == expected


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _torch_verdicts(p: torch.Tensor, draft_ids: torch.Tensor, uniform: torch.Tensor):
    return rejection_sample(p.repeat(len(draft_ids), 1), draft_ids, uniform)


def _kernel_verdicts(p: torch.Tensor, draft_ids: torch.Tensor, uniform: torch.Tensor):
    """verify_rows on logits log(p) at temperature 1 (the C++ kernel on the CPU): p itself, unfiltered."""
    rows = len(draft_ids)
    return verify_rows(p.log().repeat(rows, 1), torch.ones(rows), uniform, draft_ids)


@pytest.mark.parametrize("verdicts", [_torch_verdicts, _kernel_verdicts])
def test_first_token_follows_p_whatever_the_draft(verdicts) -> None:
    """With one draft at a fixed distribution p, the first new token is distributed as p. The threshold 20.5 is
    chi-square's 0.999 quantile at 4 degrees of freedom; a sampler that drew the rejection from p itself (not
    p without the draft) puts 0.55 + 0.45 * 0.55 ~ 0.80 on the draft and scores in the thousands."""
    p = torch.tensor([0.55, 0.2, 0.1, 0.1, 0.05])
    num_trials = 20_000
    gen = torch.Generator().manual_seed(0)
    for draft in (0, 3):
        draft_ids = torch.tensor([draft, -1] * num_trials)
        accepted, recovered = verdicts(p, draft_ids, torch.rand(2 * num_trials, 2, generator=gen))
        first = torch.where(accepted[0::2], draft, recovered[0::2])
        counts = torch.bincount(first, minlength=5).double()
        assert _chi_square(counts, p.double()) < 20.5, counts


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=0.8, top_p=0.9, top_k=20),
                                    dict(temperature=0.6, min_p=0.05)])
def test_verify_drafts_without_p_agrees_with_p(params: dict) -> None:
    """verify_drafts takes its verdicts from the argmax and the C++ kernel unless processed logprobs need p; with the
    same uniforms (the same seeds) both ways give the same tokens, bf16 logits read as they are (the kernel's draws
    may differ from torch's only within float rounding of a boundary, which these rows do not hit)."""
    gen = torch.Generator().manual_seed(5)
    vocab, num_requests, k = 300, 6, 3
    logits = (torch.randn(num_requests * (k + 1), vocab, generator=gen) * 3).to(torch.bfloat16)
    drafts = [[int(logits[i * (k + 1) + j].float().argmax()) if j < 2 else 7 for j in range(k)]
              for i in range(num_requests)]

    def verified(mode: str):
        rows = [SamplingRow(SamplingParams(**params, seed=i, logprobs=1), [1], [2] + drafts[i][:j], make_generator(i))
                for i in range(num_requests) for j in range(k + 1)]
        return verify_drafts(logits, SamplingMetadata.build(rows, vocab), [str(i) for i in range(num_requests)],
                             drafts, mode)

    fast, with_p = verified("raw_logprobs"), verified("processed_logprobs")
    assert (fast.num_accepted, fast.token_ids) == (with_p.num_accepted, with_p.token_ids)
    if params["temperature"] == 0:
        assert fast.num_accepted == [2] * num_requests


def test_verify_greedy_accepts_the_argmax_run_and_reports_logprobs() -> None:
    logits = torch.full((4, 5), -5.0)
    for row, top in enumerate([1, 2, 0, 4]):        # the target's argmax at each position
        logits[row, top] = 5.0
    params = SamplingParams(temperature=0, logprobs=1)
    rows = [SamplingRow(params, [0], [9] * j) for j in range(4)]
    meta = SamplingMetadata.build(rows, 5)
    out = verify_drafts(logits, meta, ["a"], [[1, 2, 3]])      # drafts 1 and 2 match, 3 does not (target 0)
    assert (out.num_accepted, out.token_ids) == ([2], [0])
    assert [entries[0][0] for entries in out.logprobs["a"]] == [1, 2, 0]
    assert all(entries[0][2] == 1 for entries in out.logprobs["a"])      # every new token was the argmax


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_verified_tokens_logprobs_are_the_samplers_in_each_mode(mode: str) -> None:
    """A bonus row (no drafts) is sampled from the distribution the sampler samples from: its logprobs are the
    sampler's, whatever the logprobs_mode; here with a penalty and a temperature that tell the raw from the
    processed values. (The random row's token may differ: the two draw their numbers differently.)"""
    logits = torch.randn(2, 7, generator=torch.Generator().manual_seed(0)) * 2
    rows = [SamplingRow(SamplingParams(temperature=0, logprobs=2, presence_penalty=1.5), [0], [3]),
            SamplingRow(SamplingParams(temperature=0.5, top_k=2, logprobs=2, seed=1), [0], [3], make_generator(1))]
    sampled = Sampler(mode)(logits, SamplingMetadata.build(rows, 7)).logprobs.to_lists(["g", "r"])
    verified = verify_drafts(logits, SamplingMetadata.build(rows, 7), ["g", "r"], [[], []], mode).logprobs
    assert verified["g"] == sampled["g"]
    (token, value, rank), *top = verified["r"][0]
    assert top == sampled["r"][0][1:] and (token, value) in [(t, v) for t, v, _ in top]


def test_verify_applies_penalties_over_the_drafts_before_each_position() -> None:
    """A repetition-style presence penalty sees draft 1 when verifying position 1: the same logits that make
    token 1 the argmax at position 0 make token 2 win at position 1 once 1 counts as generated."""
    logits = torch.tensor([[0.0, 3.0, 2.5, 0.0]] * 3)
    params = SamplingParams(temperature=0, presence_penalty=1.0)
    rows = [SamplingRow(params, [0], [1, 1][:j]) for j in range(3)]
    out = verify_drafts(logits, SamplingMetadata.build(rows, 4), ["a"], [[1, 1]])
    assert (out.num_accepted, out.token_ids) == ([1], [2])


def test_two_tokens_follow_the_target_through_verify_with_temperature_and_top_k() -> None:
    """A fake model with fixed logits per position (L0, L1) and fixed, often wrong drafts: the first two generated
    tokens, over 3 + 2 rows per trial (a run rejected at position 0 verifies a new draft for position 1), follow
    p0 x p1 after temperature 0.7 and top-k 3. Threshold: chi-square's 0.999 quantile at 8 degrees of freedom
    (the 9 cells of the top-3 x top-3 support)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 1.5, 1.4, 0.3], [0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.7, top_k=3)
    num_trials = 6000
    generator = torch.Generator().manual_seed(1)

    def verify(drafts: list[int], first_position: int, count: int):
        rows = [SamplingRow(params, [0], []) for _ in range(count * (len(drafts) + 1))]
        meta = SamplingMetadata.build(rows, 4, generator=generator)
        block = logits[first_position:first_position + len(drafts) + 1]
        return verify_drafts(block.repeat(count, 1), meta, [str(i) for i in range(count)], [drafts] * count)

    first = verify([1, 2], 0, num_trials)                   # d1 = 1 (p0's second choice), d2 = 2
    pairs = []
    rejected_at_0 = [i for i, a in enumerate(first.num_accepted) if a == 0]
    second = verify([3], 1, len(rejected_at_0))             # d = 3: p1's third choice
    second_tokens = iter([3 if a else token for a, token in zip(second.num_accepted, second.token_ids)])
    for a, token in zip(first.num_accepted, first.token_ids):
        pairs.append((token, next(second_tokens)) if a == 0 else (1, 2 if a == 2 else token))
    top3 = [torch.tensor([True, True, True, False]), torch.tensor([False, True, True, True])]
    probs = [torch.softmax((logits[j] / 0.7).masked_fill(~top3[j], -torch.inf), -1) for j in range(2)]
    expected = torch.outer(probs[0], probs[1]).flatten()
    counts = torch.bincount(torch.tensor([4 * x + y for x, y in pairs]), minlength=16).double()
    support = expected > 0
    assert counts[~support].sum() == 0
    assert _chi_square(counts[support], expected[support].double()) < 26.1, counts.view(4, 4)
