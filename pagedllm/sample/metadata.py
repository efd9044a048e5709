"""The rows of a batch -> SamplingMetadata: each row's sampling parameters as tensors, with flags that let the
sampler skip what no row asks for. A seeded request's generator (make_generator) travels with its row."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator seeded with `seed`: one per seeded request, kept for the request's lifetime."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the batch.

    Args:
        params: the request's sampling parameters.
        prompt_token_ids: the prompt (for the repetition penalty).
        output_token_ids: tokens generated so far (penalties, min_tokens).
        generator: the request's generator if it has a seed (see make_generator), else None.
        eos_token_id: suppressed while fewer than min_tokens tokens have been generated.
        token_bitmask: [ceil(V / 32)] int32 of a structured-output row: bit j of word w allows token 32 * w + j
            (every other token is masked out); None: no constraint.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    eos_token_id: int | None = None
    token_bitmask: torch.Tensor | None = None


@dataclass
class TokenBitmask:
    """The allowed tokens of the constrained rows (structured outputs)."""

    rows: torch.Tensor      # [R] int64: the constrained rows of the batch
    bitmask: torch.Tensor   # [R, ceil(V / 32)] int32 on the CPU, one row of SamplingRow.token_bitmask each


@dataclass
class Penalties:
    """Each row's penalties and the tokens they weigh: row i's prompt is prompt_ids[prompt_starts[i]:prompt_starts[i
    + 1]], its output likewise (a row without penalties has none; ids outside [0, V) are ignored)."""

    repetition: torch.Tensor      # [B] float32, 1 = off
    frequency: torch.Tensor       # [B] float32, 0 = off
    presence: torch.Tensor        # [B] float32, 0 = off
    prompt_ids: torch.Tensor      # [P] int64
    prompt_starts: torch.Tensor   # [B + 1] int64
    output_ids: torch.Tensor      # [O] int64
    output_starts: torch.Tensor   # [B + 1] int64


@dataclass
class AllowedTokens:
    """The tokens allowed in the rows that name them (allowed_token_ids)."""

    rows: torch.Tensor      # [R] int64: the rows of the batch with allowed_token_ids
    mask: torch.Tensor      # [R, V] bool: True where the row allows the token


@dataclass
class SparseEntries:
    """(row, token) pairs, with a value each for logit_bias: scattered into [B, V] at sampling time."""

    rows: torch.Tensor      # [E] int64
    tokens: torch.Tensor    # [E] int64
    values: torch.Tensor    # [E] float32 (bias) or unused for masks


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of one batch as tensors, with flags that let common cases skip work.

    Build it with SamplingMetadata.build(rows, vocab_size, device).
    """

    vocab_size: int
    temperature: torch.Tensor              # [B] float32; greedy rows hold 1.0
    greedy_mask: torch.Tensor              # [B] bool
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None             # [B] float32; None when no random row uses top-p
    top_k: torch.Tensor | None             # [B] int64 in [1, V]; None when no random row uses top-k
    min_p: torch.Tensor | None             # [B] float32; None when no random row uses min-p
    penalties: Penalties | None            # None when no row has a penalty
    logit_bias: SparseEntries | None
    banned: SparseEntries | None           # (row, token) to set to -inf: EOS / stop ids before min_tokens, and
                                           # the tokens that would complete a bad word
    allowed: AllowedTokens | None          # None when no row has allowed_token_ids
    token_bitmask: TokenBitmask | None     # None when no row is constrained
    generators: dict[int, torch.Generator] # row index -> generator, for seeded random rows
    num_logprobs: list[int | None]         # per row: the `logprobs` it asked for (0 with logprob_token_ids alone)
    max_num_logprobs: int | None           # None: no row asked for logprobs
    logprob_token_ids: list[list[int] | None] | None = None     # per row: the ids it asked for; None: no row did
    generator: torch.Generator | None = None  # the shared draw of unseeded rows; None: torch's default RNG

    @property
    def processes_logits(self) -> bool:
        """Whether a row's logits change before its sampling: a bitmask, allowed tokens, a bias, a ban, penalties."""
        return not (self.token_bitmask is None and self.allowed is None and self.logit_bias is None
                    and self.banned is None and self.penalties is None)

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device | str = "cpu",
              generator: torch.Generator | None = None) -> SamplingMetadata:
        """Gather the rows' parameters into tensors on `device`.

        Args:
            rows: the batch, one row per sampled token.
            vocab_size: V; token ids outside [0, V) in the rows are ignored.
            device: where the logits live.
            generator: draws for the rows without a seed of their own (an engine-wide seed); None: torch's RNG.
        """
        params = [row.params for row in rows]
        greedy = [p.greedy for p in params]
        random_rows = [p for p in params if not p.greedy]
        top_k = [effective_top_k(p.top_k, vocab_size) for p in params]
        num_logprobs = [p.logprobs if p.logprobs is not None else 0 if p.logprob_token_ids else None for p in params]
        logprob_counts = [n for n in num_logprobs if n is not None]
        return cls(
            vocab_size=vocab_size,
            temperature=_floats([1.0 if g else p.temperature for p, g in zip(params, greedy)], device),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_p=(_floats([p.top_p for p in params], device) if any(p.top_p < 1.0 for p in random_rows)
                   else None),
            top_k=(torch.tensor(top_k, dtype=torch.long, device=device)
                   if any(k < vocab_size for k, g in zip(top_k, greedy) if not g) else None),
            min_p=(_floats([p.min_p for p in params], device) if any(p.min_p > 0 for p in random_rows)
                   else None),
            penalties=_build_penalties(rows, device),
            logit_bias=_build_logit_bias(rows, vocab_size, device),
            banned=_build_banned(rows, vocab_size, device),
            allowed=_build_allowed(rows, vocab_size, device),
            token_bitmask=_build_token_bitmask(rows, device),
            generators={i: row.generator for i, row in enumerate(rows)
                        if row.generator is not None and not row.params.greedy},
            num_logprobs=num_logprobs,
            max_num_logprobs=max(logprob_counts) if logprob_counts else None,
            logprob_token_ids=([p.logprob_token_ids for p in params] if any(p.logprob_token_ids for p in params)
                               else None),
            generator=generator,
        )


def _floats(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def effective_top_k(top_k: int, vocab_size: int) -> int:
    """0 and -1 mean off, which is the same as keeping the whole vocabulary."""
    return vocab_size if top_k <= 0 else min(top_k, vocab_size)


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _flat(lists: list[list[int]], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged lists -> (their ids one after another [sum of lengths] int64, each list's start and the end [B + 1])."""
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    starts = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(starts[-1]))
    return torch.from_numpy(ids).to(device), torch.from_numpy(starts).to(device)


def _build_penalties(rows: list[SamplingRow], device: torch.device | str) -> Penalties | None:
    penalised = [_has_penalties(row.params) for row in rows]
    if not any(penalised):
        return None
    prompt_ids, prompt_starts = _flat([r.prompt_token_ids if on else [] for r, on in zip(rows, penalised)], device)
    output_ids, output_starts = _flat([r.output_token_ids if on else [] for r, on in zip(rows, penalised)], device)
    params = [r.params for r in rows]
    return Penalties(
        repetition=_floats([p.repetition_penalty for p in params], device),
        frequency=_floats([p.frequency_penalty for p in params], device),
        presence=_floats([p.presence_penalty for p in params], device),
        prompt_ids=prompt_ids, prompt_starts=prompt_starts, output_ids=output_ids, output_starts=output_starts,
    )


def _sparse(entries: list[tuple[int, int, float]], device: torch.device | str) -> SparseEntries | None:
    if not entries:
        return None
    rows, tokens, values = zip(*entries)
    return SparseEntries(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        values=_floats(list(values), device),
    )


def _build_logit_bias(rows: list[SamplingRow], vocab_size: int,
                      device: torch.device | str) -> SparseEntries | None:
    entries = [(i, token_id, bias) for i, row in enumerate(rows)
               for token_id, bias in (row.params.logit_bias or {}).items() if token_id < vocab_size]
    return _sparse(entries, device)


def min_tokens_stop_ids(row: SamplingRow) -> set[int]:
    """Token ids to suppress for this row now: its stop ids and EOS while fewer than min_tokens were generated."""
    params = row.params
    if len(row.output_token_ids) >= params.min_tokens:
        return set()
    stop_ids = set(params.stop_token_ids or [])
    if row.eos_token_id is not None and not params.ignore_eos:
        stop_ids.add(row.eos_token_id)
    return stop_ids


def bad_word_ids(row: SamplingRow) -> set[int]:
    """Token ids to ban for this row now: the last token of each bad word whose other tokens end the output (as
    vLLM, only the generated tokens count)."""
    banned = set()
    output = row.output_token_ids
    for word in row.params.bad_words_token_ids:
        prefix = len(word) - 1
        if prefix <= len(output) and output[len(output) - prefix:] == word[:prefix]:
            banned.add(word[-1])
    return banned


def _build_banned(rows: list[SamplingRow], vocab_size: int, device: torch.device | str) -> SparseEntries | None:
    entries = [(i, token_id, 0.0) for i, row in enumerate(rows)
               for token_id in sorted(min_tokens_stop_ids(row) | bad_word_ids(row)) if token_id < vocab_size]
    return _sparse(entries, device)


def thinking_end_due(row: SamplingRow) -> int | None:
    """The </think> id this row must take now: it thinks (its output's last think token is <think>, or it has none
    and its prompt's is: the chat template opened the thought) and has thought thinking_token_budget tokens since;
    None otherwise."""
    params = row.params
    if params.thinking_token_budget is None or params.thinking_token_ids is None:
        return None
    start, end = params.thinking_token_ids
    output = row.output_token_ids
    last_start, last_end = _last_index(output, start), _last_index(output, end)
    if last_start < 0 and last_end < 0:         # no marker of its own: thinking if the prompt left it so
        thinking = _last_index(row.prompt_token_ids, start) > _last_index(row.prompt_token_ids, end)
    else:
        thinking = last_start > last_end
    return end if thinking and len(output) - last_start - 1 >= params.thinking_token_budget else None


def _last_index(tokens: list[int], token: int) -> int:
    """Where `token` last stands in `tokens`; -1 if nowhere."""
    try:
        return len(tokens) - 1 - tokens[::-1].index(token)
    except ValueError:
        return -1


def _build_allowed(rows: list[SamplingRow], vocab_size: int, device: torch.device | str) -> AllowedTokens | None:
    """The rows' allowed_token_ids, and the row whose thinking budget is spent: its </think> alone."""
    allowed = [[end] if (end := thinking_end_due(row)) is not None else row.params.allowed_token_ids for row in rows]
    limited = [i for i, ids in enumerate(allowed) if ids is not None]
    if not limited:
        return None
    mask = torch.zeros(len(limited), vocab_size, dtype=torch.bool)
    for j, i in enumerate(limited):
        mask[j, [t for t in allowed[i] if t < vocab_size]] = True
    return AllowedTokens(rows=torch.tensor(limited, dtype=torch.long, device=device), mask=mask.to(device))


def _build_token_bitmask(rows: list[SamplingRow], device: torch.device | str) -> TokenBitmask | None:
    constrained = [i for i, row in enumerate(rows) if row.token_bitmask is not None]
    if not constrained:
        return None
    return TokenBitmask(rows=torch.tensor(constrained, dtype=torch.long, device=device),
                        bitmask=torch.stack([rows[i].token_bitmask for i in constrained]))
