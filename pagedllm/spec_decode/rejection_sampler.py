"""Verification of draft tokens: rejection sampling against the target model (vLLM's RejectionSampler).

A request with k drafts d_1..d_k gets logits at k + 1 positions from one forward pass: position j (0-based) is
the target distribution p_j after the request's tokens and d_1..d_j. Draft j + 1 is accepted with probability
min(1, p_j(d) / q(d)); an n-gram draft is a point mass (q(d) = 1), so with probability p_j(d). At the first
rejection the token comes from the residual max(0, p_j - q), normalised: p_j with d removed. If all k are
accepted, a bonus token is sampled from p_k. The tokens then follow p exactly (Leviathan et al., 2023).

    rows:      d_1 d_2 d_3 bonus           accepted:  yes yes no  -           -> tokens d_1 d_2 r_2
               p_0 p_1 p_2 p_3             (r_2 ~ p_2 without d_3)

Greedy rows are the case p = one-hot(argmax): a draft is accepted iff it is the argmax, and the token after the
accepted ones is the argmax. Each position goes through the sampler's own logits processing (bias, min_tokens,
penalties over the output plus the drafts before it) and its temperature / top-k / top-p / min-p. As in the sampler,
a batch that reports no processed logprobs takes its argmax and its random rows' verdicts from the C++ kernels
(`ops.verify_rows`), reading bf16 logits as they are; processed logprobs need p itself, from torch's ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.ops import argmax_rows, rejection_sample, verify_rows
from pagedllm.sample.sampler import LogprobsTensors, Sampler, batch_logprobs, chosen_logprobs

TokenLogprobs = list[tuple[int, float, int]]   # (token_id, logprob, rank) entries of one position


@dataclass
class VerifiedTokens:
    """Per request (in the order given): how many drafts were accepted, the token sampled after them, and, for
    requests that asked for logprobs, one entry list per new token (the accepted drafts, then that token)."""

    num_accepted: list[int]
    token_ids: list[int]
    logprobs: dict[str, list[TokenLogprobs]]


def verify_drafts(logits: torch.Tensor, meta: SamplingMetadata, request_ids: list[str],
                  spec_token_ids: list[list[int]], logprobs_mode: str = "raw_logprobs") -> VerifiedTokens:
    """Verify each request's drafts.

    Args:
        logits: [R, V] float32 or the LM head's dtype, R = sum(k_i + 1): request i's k_i + 1 positions, one after
            another.
        meta: the rows' sampling metadata (row j of request i: its output tokens extended by its first j drafts).
        request_ids: the requests, in row order.
        spec_token_ids: each request's drafts.
        logprobs_mode: what the logprobs hold, as the sampler's (pagedllm.sample.sampler).
    """
    draft_ids = torch.tensor([t for drafts in spec_token_ids for t in drafts + [-1]], device=logits.device)
    uniform = draw_uniforms(meta, len(draft_ids), logits.device)
    sampled = None
    if meta.max_num_logprobs is None or logprobs_mode.startswith("raw"):
        processed = Sampler.process_logits(logits, meta)
        accepted, recovered = draft_verdicts(processed, draft_ids, uniform, meta)
    else:   # processed logprobs: p itself
        logits = logits.float()
        processed = Sampler.process_logits(logits, meta)
        sampled = None if meta.all_greedy else Sampler.compute_probs(processed, meta)
        accepted, recovered = rejection_sample(target_probs(processed, sampled, meta), draft_ids, uniform)
    accepted_list, recovered_list = accepted.tolist(), recovered.tolist()
    # Each row's token for the logprobs: its draft, then the sampled one where the run stops (later rows unused).
    num_accepted, token_ids, row_tokens = [], [], [max(t, 0) for t in draft_ids.tolist()]
    start = 0
    for drafts in spec_token_ids:
        count = 0
        while count < len(drafts) and accepted_list[start + count]:
            count += 1
        num_accepted.append(count)
        token_ids.append(recovered_list[start + count])
        row_tokens[start + count] = token_ids[-1]
        start += len(drafts) + 1
    logprobs = {}
    if meta.max_num_logprobs is not None:
        row_logprobs = batch_logprobs(logits, processed, sampled, meta, logprobs_mode,
                                      torch.tensor(row_tokens, device=logits.device))
        chosen = chosen_logprobs(logits, processed, sampled, meta, logprobs_mode)
        logprobs = _logprobs(row_logprobs, chosen, meta, request_ids, spec_token_ids, num_accepted)
    return VerifiedTokens(num_accepted, token_ids, logprobs)


def draft_verdicts(logits: torch.Tensor, draft_ids: torch.Tensor, uniform: torch.Tensor,
                   meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample`'s (accepted, recovered) on the processed `logits`, without p: a greedy row accepts its
    draft iff it is the argmax and emits the argmax (its accepted rows' recovered token is never used), a random row
    takes `verify_rows`' verdict under its temperature, top-k, top-p and min-p."""
    if meta.all_greedy:
        greedy = argmax_rows(logits)
        return draft_ids == greedy, greedy
    accepted, recovered = verify_rows(logits, meta.temperature, uniform, draft_ids, meta.top_k, meta.top_p,
                                      meta.min_p)
    if meta.all_random:
        return accepted, recovered
    greedy = argmax_rows(logits)
    return (torch.where(meta.greedy_mask, draft_ids == greedy, accepted),
            torch.where(meta.greedy_mask, greedy, recovered))


def target_probs(processed: torch.Tensor, sampled: torch.Tensor | None, meta: SamplingMetadata) -> torch.Tensor:
    """[R, V]: the distribution each row samples from, `sampled` (the sampler's `compute_probs` of the `processed`
    logits; None when every row is greedy), one-hot at the argmax for greedy rows."""
    greedy = torch.zeros_like(processed).scatter_(1, argmax_rows(processed).unsqueeze(1), 1.0)
    if sampled is None:
        return greedy
    return sampled if meta.all_random else torch.where(meta.greedy_mask.unsqueeze(1), greedy, sampled)


def draw_uniforms(meta: SamplingMetadata, num_rows: int, device: torch.device) -> torch.Tensor:
    """[R, 2] uniform numbers: column 0 decides acceptance, column 1 samples the residual. Greedy rows get 0 (the
    argmax: see rejection_sample); a seeded row draws both from its own generator, so its tokens do not depend on
    the batch; the unseeded rows share one draw."""
    uniform = torch.zeros(num_rows, 2, device=device)
    random_rows = ~meta.greedy_mask
    if not meta.all_greedy and len(meta.generators) < int(random_rows.sum()):
        shared = torch.rand(num_rows, 2, generator=meta.generator, device=device)
        uniform = torch.where(random_rows.unsqueeze(1), shared, uniform)
    for row, generator in meta.generators.items():
        uniform[row] = torch.rand(2, generator=generator, device=device)
    return uniform


def _logprobs(row_logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
              chosen: list[list[tuple[int, float, int]]] | None, meta: SamplingMetadata, request_ids: list[str],
              spec_token_ids: list[list[int]], num_accepted: list[int]) -> dict[str, list[TokenLogprobs]]:
    """The logprobs of each request's new tokens (the accepted drafts, then the sampled one), from `row_logprobs`
    (`batch_logprobs`' ids, values and ranks of each row's token) and each row's `chosen` (its logprob_token_ids'
    entries), as the sampler's `LogprobsTensors.to_lists` gives them for one token."""
    ids, values, ranks = row_logprobs
    per_row = LogprobsTensors(ids, values, ranks, meta.num_logprobs, chosen).to_lists(
        [str(r) for r in range(len(ids))])
    result, start = {}, 0
    for request_id, drafts, count in zip(request_ids, spec_token_ids, num_accepted):
        if str(start) in per_row:
            result[request_id] = [per_row[str(row)][0] for row in range(start, start + count + 1)]
        start += len(drafts) + 1
    return result
