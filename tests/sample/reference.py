"""The sampler's oracle: one row at a time, plain ops, no flags or fast paths. Tests compare the Sampler
against it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.sample.metadata import SamplingRow, effective_top_k, min_tokens_stop_ids
from pagedllm.sampling_params import SamplingParams


@dataclass
class ReferenceSample:
    token_id: int
    logits: torch.Tensor          # [V] after the masks, bias, banned tokens and penalties
    probs: torch.Tensor | None    # [V] the distribution sampled from; None for greedy rows
    logprobs: torch.Tensor        # [V] log_softmax of the raw logits


def sample_reference(logits_row: torch.Tensor, row: SamplingRow) -> ReferenceSample:
    """Sample one row the slow, obvious way. A random row draws from row.generator (or the global RNG)."""
    params = row.params
    vocab_size = logits_row.shape[0]
    raw_logprobs = torch.log_softmax(logits_row.float(), dim=-1)
    logits = logits_row.float().clone()
    if row.token_bitmask is not None:
        words = row.token_bitmask.tolist()
        for token_id in range(vocab_size):
            if not (words[token_id // 32] >> (token_id % 32)) & 1:
                logits[token_id] = float("-inf")
    if params.allowed_token_ids is not None:
        for token_id in range(vocab_size):
            if token_id not in params.allowed_token_ids:
                logits[token_id] = float("-inf")
    for token_id, bias in (params.logit_bias or {}).items():
        if token_id < vocab_size:
            logits[token_id] += bias
    for token_id in min_tokens_stop_ids(row):
        if token_id < vocab_size:
            logits[token_id] = float("-inf")
    for word in params.bad_words_token_ids:     # banned where the output ends with the word's other tokens
        *prefix, last = word
        if len(prefix) <= len(row.output_token_ids) and row.output_token_ids[::-1][:len(prefix)] == prefix[::-1]:
            logits[last] = float("-inf")
    logits = _reference_penalties(logits, row)
    if params.greedy:
        return ReferenceSample(int(logits.argmax()), logits, None, raw_logprobs)
    probs = _reference_probs(logits, params)
    u = float(torch.rand(1, generator=row.generator))
    cumulative = 0.0
    token_id = int(probs.nonzero().max())                           # if rounding leaves u past the end
    total = float(probs.sum())
    for i, p in enumerate(probs.tolist()):
        cumulative += p
        if p > 0 and cumulative > u * total:
            token_id = i
            break
    return ReferenceSample(token_id, logits, probs, raw_logprobs)


def _reference_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    params = row.params
    vocab_size = logits.shape[0]
    seen = {t for t in row.prompt_token_ids + row.output_token_ids if 0 <= t < vocab_size}
    for token_id in seen:
        value = logits[token_id]
        penalty = params.repetition_penalty
        logits[token_id] = value / penalty if value > 0 else value * penalty
    counts: dict[int, int] = {}
    for token_id in row.output_token_ids:
        if 0 <= token_id < vocab_size:
            counts[token_id] = counts.get(token_id, 0) + 1
    for token_id, count in counts.items():
        logits[token_id] -= params.frequency_penalty * count + params.presence_penalty
    return logits


def _reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = logits / params.temperature
    vocab_size = logits.shape[0]
    k = effective_top_k(params.top_k, vocab_size)
    kth_largest = torch.sort(logits, descending=True).values[k - 1]
    logits = torch.where(logits < kth_largest, float("-inf"), logits)
    if params.top_p < 1.0:
        probs = torch.softmax(logits, dim=-1)
        order = torch.argsort(probs, descending=True)
        mass_before = 0.0
        keep = torch.zeros(vocab_size, dtype=torch.bool)
        for token_id in order.tolist():
            if mass_before >= params.top_p:
                break
            keep[token_id] = True
            mass_before += float(probs[token_id])
        logits = torch.where(keep, logits, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        probs = torch.where(probs < params.min_p * probs.max(), 0.0, probs)
        probs = probs / probs.sum()
    return probs
