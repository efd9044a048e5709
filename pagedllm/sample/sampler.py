"""The sampler: logits of a batch -> one token per row, vectorised over the batch.

Order of operations (as in vLLM):
    raw logprobs (if requested, from the unprocessed logits)
    -> structured-output bitmask and allowed_token_ids (other tokens to -inf, so that nothing after can bring one
       back) -> logit_bias -> banned tokens (min_tokens' EOS / stop ids, bad words) to -inf
    -> penalties (repetition, frequency, presence)
    -> greedy rows: argmax
    -> random rows: temperature -> top-k -> top-p -> softmax -> min-p -> inverse-CDF sampling

Log-probabilities (vLLM's `logprobs_mode`): "raw_logprobs" (the default) are the log_softmax of the model's logits,
before any processing; "processed_logprobs" are those of the distribution each row samples from (after the
processing and, for a random row, its temperature, top-k, top-p and min-p: the tokens they filter out at -inf);
"raw_logits" and "processed_logits" are the logits themselves at those two points. A prompt position's are raw
either way (they go through no processing).

Custom logits processors (pagedllm.sample.logits_processor) run after the built-in processing, those that leave the
argmax alone after a random row's temperature.

Random rows draw one uniform number each and take the first token whose cumulative probability passes it
(see ops.inverse_cdf_sample for why not vLLM's exponential race). A row with a per-request seed draws from its own
`torch.Generator`, exactly one number per step, so its tokens do not depend on which other requests share the
batch or where the row sits; unseeded rows share one draw from the engine's generator (or torch's RNG).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.sample.logits_processor import CustomLogits
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.ops import (
    apply_penalties,
    apply_token_bitmask,
    argmax_rows,
    filtered_probs,
    gather_logprobs,
    inverse_cdf_sample,
    raw_logprobs,
    sample_rows,
)


@dataclass
class LogprobsTensors:
    """Log-probabilities of a batch (or logits, as `logprobs_mode` says).

    token_ids, logprobs: [B, 1 + max_num_logprobs]; column 0 is the sampled token, then the top tokens in order.
    ranks: [B] 1-based rank of the sampled token (1 = most likely).
    num_logprobs: per row, how many top logprobs it asked for (None: none at all). A row that asked for fewer
        than max_num_logprobs uses the first 1 + its count columns.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    num_logprobs: list[int | None]
    chosen: list[list[tuple[int, float, int]]] | None = None   # per row, its logprob_token_ids' entries

    def to_lists(self, request_ids: list[str]) -> dict[str, list[list[tuple[int, float, int]]]]:
        """Per request that asked for logprobs (request_ids in batch order): a one-element list (this step's one
        token) of (token_id, logprob, rank) entries, the sampled token first, then its top tokens, then those of
        its logprob_token_ids."""
        token_ids, logprobs, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        chosen = self.chosen or [[]] * len(request_ids)
        return {request_id: [_entries(token_ids[i], logprobs[i], ranks[i], num) + chosen[i]]
                for i, (request_id, num) in enumerate(zip(request_ids, self.num_logprobs)) if num is not None}


def _entries(token_ids: list[int], logprobs: list[float], rank: int, num: int) -> list[tuple[int, float, int]]:
    """One position's (token_id, logprob, rank): the chosen token with its rank, then the top `num` tokens."""
    return [(token_ids[0], logprobs[0], rank)] + [(token_ids[j], logprobs[j], j) for j in range(1, num + 1)]


def position_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num: int,
                      logprobs_mode: str = "raw_logprobs") -> list[list[tuple[int, float, int]]]:
    """Per row of raw `logits` [P, V]: the (token_id, logprob, rank) entries of `token_ids` [P] (the prompt token
    each row predicts) and of the row's top `num` tokens, the given token first (their logits in a *_logits mode)."""
    mode = logprobs_mode.replace("processed", "raw")     # (a prompt position's are raw either way)
    ids, values, ranks = raw_logprobs(logits, num, token_ids, mode)
    return [_entries(*row, num) for row in zip(ids.tolist(), values.tolist(), ranks.tolist())]


def batch_logprobs(raw: torch.Tensor, processed: torch.Tensor, probs: torch.Tensor | None, meta: SamplingMetadata,
                   logprobs_mode: str, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gather_logprobs` of `token_ids` [B] and each row's top `meta.max_num_logprobs` in what a batch's logprobs
    report in `logprobs_mode` (the module docstring), from its `raw` logits, its `processed` float32 ones and the
    distribution its random rows sample from (`probs`; None: all greedy)."""
    assert meta.max_num_logprobs is not None
    if logprobs_mode.startswith("raw"):
        return raw_logprobs(raw, meta.max_num_logprobs, token_ids, logprobs_mode)
    return gather_logprobs(processed_scores(processed, probs, meta, logprobs_mode), meta.max_num_logprobs, token_ids)


def chosen_logprobs(raw: torch.Tensor, processed: torch.Tensor, probs: torch.Tensor | None, meta: SamplingMetadata,
                    logprobs_mode: str) -> list[list[tuple[int, float, int]]] | None:
    """Per row, the (token_id, logprob, rank) entries of its `logprob_token_ids` (none for a row without), in what
    `logprobs_mode` reports (batch_logprobs' scores); a rank counts the tokens scored higher, plus one. None when
    no row asked for any."""
    if meta.logprob_token_ids is None:
        return None
    if logprobs_mode.startswith("raw"):
        scores = raw.float() if logprobs_mode == "raw_logits" else torch.log_softmax(raw.float(), dim=-1)
    else:
        scores = processed_scores(processed, probs, meta, logprobs_mode)
    result = []
    for row, ids in enumerate(meta.logprob_token_ids):
        if not ids:
            result.append([])
            continue
        values = scores[row, torch.tensor(ids, device=scores.device)]
        ranks = (scores[row].unsqueeze(0) > values.unsqueeze(1)).sum(1) + 1
        result.append(list(zip(ids, values.tolist(), ranks.tolist(), strict=True)))
    return result


def processed_scores(processed: torch.Tensor, probs: torch.Tensor | None, meta: SamplingMetadata,
                     logprobs_mode: str) -> torch.Tensor:
    """What a processed mode reports: per row, the log-probabilities of the distribution it samples from (a greedy
    row: of its `processed` logits, whose argmax it takes; a random row: log `probs`), or in "processed_logits" the
    logits behind them (a random row's after its temperature, -inf where its filters zeroed `probs`)."""
    greedy = processed if logprobs_mode == "processed_logits" else torch.log_softmax(processed, dim=-1)
    if probs is None:
        return greedy
    if logprobs_mode == "processed_logits":
        random = torch.where(probs > 0, processed / meta.temperature.unsqueeze(1), float("-inf"))
    else:
        random = torch.log(probs)
    return random if meta.all_random else torch.where(meta.greedy_mask.unsqueeze(1), greedy, random)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor               # [B] int64
    logprobs: LogprobsTensors | None      # None when no row asked for logprobs


class Sampler(nn.Module):
    """Samples one token per row: `Sampler()(logits [B, V], meta) -> SamplerOutput`, the logits in float32 or the LM
    head's dtype (widened where torch's ops compute: the processing, custom processors, processed logprobs; the C++
    draw and raw logprobs read them as they are); its logprobs are as `logprobs_mode` says
    (pagedllm.config.LOGPROBS_MODES; see the module docstring)."""

    def __init__(self, logprobs_mode: str = "raw_logprobs", custom: CustomLogits | None = None) -> None:
        super().__init__()
        self.logprobs_mode = logprobs_mode
        self.custom = custom    # custom logits processors, the rows in their batch order (the runner's to arrange)

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # logits: [B, V]
        if self.custom is None and (meta.max_num_logprobs is None or self.logprobs_mode.startswith("raw")):
            processed = self.process_logits(logits, meta)
            token_ids = self._draw(processed, meta)
            return SamplerOutput(token_ids=token_ids, logprobs=self._logprobs(logits, processed, None, meta, token_ids))
        raw = logits.float()
        logits = self.process_logits(raw, meta)
        if self.custom is not None:
            logits = self.custom.apply_full(logits.clone())     # (a processor may change it in place)
        probs = None
        if meta.all_greedy:
            token_ids = argmax_rows(logits)
        else:
            probs = self.compute_probs(logits, meta, self.custom)
            token_ids = inverse_cdf_sample(probs, self._uniforms(meta, probs.shape[0], probs.device))
            if not meta.all_random:
                token_ids = torch.where(meta.greedy_mask, argmax_rows(logits), token_ids)
        return SamplerOutput(token_ids=token_ids, logprobs=self._logprobs(raw, logits, probs, meta, token_ids))

    def _logprobs(self, raw: torch.Tensor, processed: torch.Tensor, probs: torch.Tensor | None,
                  meta: SamplingMetadata, token_ids: torch.Tensor) -> LogprobsTensors | None:
        """The batch's `batch_logprobs`, None when no row asked for them."""
        if meta.max_num_logprobs is None:
            return None
        ids, values, ranks = batch_logprobs(raw, processed, probs, meta, self.logprobs_mode, token_ids)
        return LogprobsTensors(token_ids=ids, logprobs=values, ranks=ranks, num_logprobs=meta.num_logprobs,
                               chosen=chosen_logprobs(raw, processed, probs, meta, self.logprobs_mode))

    @staticmethod
    def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Apply the token bitmask, allowed_token_ids, logit_bias, banned tokens and penalties to a float32 copy of
        `logits` (the caller's tensor as it is where nothing changes it)."""
        if not meta.processes_logits:
            return logits
        logits = logits.to(torch.float32, copy=True)
        if meta.token_bitmask is not None:
            apply_token_bitmask(logits, meta.token_bitmask)
        if meta.allowed is not None:
            allowed = meta.allowed
            logits[allowed.rows] = logits[allowed.rows].masked_fill(~allowed.mask, float("-inf"))
        if meta.logit_bias is not None:
            bias = meta.logit_bias
            logits.index_put_((bias.rows, bias.tokens), bias.values, accumulate=True)
        if meta.banned is not None:
            banned = meta.banned
            logits[banned.rows, banned.tokens] = float("-inf")
        if meta.penalties is not None:
            apply_penalties(logits, meta.penalties)
        return logits

    @staticmethod
    def compute_probs(logits: torch.Tensor, meta: SamplingMetadata, custom: CustomLogits | None = None
                      ) -> torch.Tensor:
        """Processed logits -> the distribution random rows sample from: temperature, the `custom` processors that
        leave the argmax alone, top-k, top-p, min-p."""
        logits = logits / meta.temperature.unsqueeze(1)
        if custom is not None:
            logits = custom.apply_invariant(logits)
        return filtered_probs(logits, meta.top_k, meta.top_p, meta.min_p)

    def _draw(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The tokens of a batch: each greedy row's argmax, each random row's draw from
        its processed logits in one `sample_rows` (softmax, top-k, top-p, min-p and the inverse CDF at once; bf16
        logits unwidened), where the torch ops took ~4 ms for 32 rows of SmolLM2's vocabulary at a plain
        temperature and ~16 ms with top-p."""
        if meta.all_greedy:
            return argmax_rows(logits)      # (widening keeps the argmax)
        token_ids = sample_rows(logits, meta.temperature, self._uniforms(meta, logits.shape[0], logits.device),
                                meta.top_k, meta.top_p, meta.min_p)
        return token_ids if meta.all_random else torch.where(meta.greedy_mask, argmax_rows(logits), token_ids)

    @staticmethod
    def _uniforms(meta: SamplingMetadata, batch: int, device: torch.device) -> torch.Tensor:
        """One uniform number per row, from the row's own generator if it has one."""
        if len(meta.generators) < batch:
            uniform = torch.rand(batch, generator=meta.generator, device=device)  # shared by unseeded rows
        else:
            uniform = torch.empty(batch, device=device)
        for i, generator in meta.generators.items():
            uniform[i] = torch.rand(1, generator=generator, device=device)
        return uniform
