"""The sampler: logits of a batch -> one token per row, vectorised over the batch.

Order of operations (as in vLLM):
    raw logprobs (if requested, from the unprocessed logits)
    -> logit_bias -> min_tokens (EOS / stop ids to -inf) -> penalties (repetition, frequency, presence)
    -> greedy rows: argmax
    -> random rows: temperature -> top-k -> top-p -> softmax -> min-p -> inverse-CDF sampling

Random rows draw one uniform number each and take the first token whose cumulative probability passes it
(see inverse_cdf_sample for why not vLLM's exponential race). A row with a per-request seed draws from its own
`torch.Generator`, exactly one number per step, so its tokens do not depend on which other requests share the
batch or where the row sits; unseeded rows share one draw from the engine's generator (or torch's RNG).

`sample_reference` at the bottom processes one row with plain ops; it is the oracle the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.sampling_params import SamplingParams

# Top-p looks at each row's largest logits first (see top_k_top_p_candidates).
_TOP_P_CANDIDATES = 1024


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
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    eos_token_id: int | None = None


@dataclass
class LogprobsTensors:
    """Log-probabilities of a batch, from the raw logits.

    token_ids, logprobs: [B, 1 + max_num_logprobs]; column 0 is the sampled token, then the top tokens in order.
    ranks: [B] 1-based rank of the sampled token (1 = most likely).
    num_logprobs: per row, how many top logprobs it asked for (None: none at all). A row that asked for fewer
        than max_num_logprobs uses the first 1 + its count columns.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    num_logprobs: list[int | None]

    def to_lists(self, req_ids: list[str]) -> dict[str, list[list[tuple[int, float, int]]]]:
        """Per request that asked for logprobs (req_ids in batch order): a one-element list (this step's one
        token) of (token_id, logprob, rank) entries, the sampled token first, then its top tokens."""
        token_ids, logprobs, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        out = {}
        for i, (req_id, num) in enumerate(zip(req_ids, self.num_logprobs)):
            if num is None:
                continue
            entries = [(token_ids[i][0], logprobs[i][0], ranks[i])]
            entries += [(token_ids[i][j], logprobs[i][j], j) for j in range(1, num + 1)]
            out[req_id] = [entries]
        return out


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor               # [B] int64
    logprobs: LogprobsTensors | None      # None when no row asked for logprobs


@dataclass
class _Penalties:
    repetition: torch.Tensor      # [B] float, 1 = off
    frequency: torch.Tensor       # [B] float, 0 = off
    presence: torch.Tensor        # [B] float, 0 = off
    seen_mask: torch.Tensor       # [B, V] bool: token is in the prompt or the output
    output_counts: torch.Tensor   # [B, V] float: times each token was generated


@dataclass
class _SparseEntries:
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
    top_p: torch.Tensor | None             # [B] float32; None when no_top_p
    top_k: torch.Tensor | None             # [B] int64 in [1, V]; None when no_top_k
    min_p: torch.Tensor | None             # [B] float32; None when no_min_p
    penalties: _Penalties | None           # None when no_penalties
    logit_bias: _SparseEntries | None
    min_tokens_mask: _SparseEntries | None # (row, token) to set to -inf: EOS / stop ids before min_tokens
    generators: dict[int, torch.Generator] # row index -> generator, for seeded random rows
    num_logprobs: list[int | None]         # per row: the `logprobs` it asked for
    max_num_logprobs: int | None           # None: no row asked for logprobs
    generator: torch.Generator | None = None  # the shared draw of unseeded rows; None: torch's default RNG

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @property
    def no_penalties(self) -> bool:
        return self.penalties is None

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

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
        top_k = [_effective_top_k(p.top_k, vocab_size) for p in params]
        logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
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
            penalties=_build_penalties(rows, vocab_size, device),
            logit_bias=_build_logit_bias(rows, vocab_size, device),
            min_tokens_mask=_build_min_tokens_mask(rows, vocab_size, device),
            generators={i: row.generator for i, row in enumerate(rows)
                        if row.generator is not None and not row.params.greedy},
            num_logprobs=[p.logprobs for p in params],
            max_num_logprobs=max(logprob_counts) if logprob_counts else None,
            generator=generator,
        )


def _floats(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _effective_top_k(top_k: int, vocab_size: int) -> int:
    """0 and -1 mean off, which is the same as keeping the whole vocabulary."""
    return vocab_size if top_k <= 0 else min(top_k, vocab_size)


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _pad(lists: list[list[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    """[B, max_len] int64, padded with `pad`."""
    width = max((len(ids) for ids in lists), default=0)
    out = torch.full((len(lists), width), pad, dtype=torch.long)
    for i, ids in enumerate(lists):
        if ids:
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out.to(device)


def _in_vocab(ids: list[int], vocab_size: int) -> list[int]:
    return [t if 0 <= t < vocab_size else vocab_size for t in ids]


def _build_penalties(rows: list[SamplingRow], vocab_size: int, device: torch.device | str) -> _Penalties | None:
    if not any(_has_penalties(row.params) for row in rows):
        return None
    # Pad with an extra column (index vocab_size) that is sliced off, so ragged rows scatter in one op.
    shape = (len(rows), vocab_size + 1)
    prompt = _pad([_in_vocab(r.prompt_token_ids, vocab_size) for r in rows], vocab_size, device)
    output = _pad([_in_vocab(r.output_token_ids, vocab_size) for r in rows], vocab_size, device)
    prompt_mask = torch.zeros(shape, dtype=torch.bool, device=device).scatter_(1, prompt, True)
    counts = torch.zeros(shape, dtype=torch.float32, device=device)
    counts.scatter_add_(1, output, torch.ones_like(output, dtype=torch.float32))
    counts = counts[:, :vocab_size]
    params = [r.params for r in rows]
    return _Penalties(
        repetition=_floats([p.repetition_penalty for p in params], device),
        frequency=_floats([p.frequency_penalty for p in params], device),
        presence=_floats([p.presence_penalty for p in params], device),
        seen_mask=prompt_mask[:, :vocab_size] | (counts > 0),
        output_counts=counts,
    )


def _sparse(entries: list[tuple[int, int, float]], device: torch.device | str) -> _SparseEntries | None:
    if not entries:
        return None
    rows, tokens, values = zip(*entries)
    return _SparseEntries(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        values=_floats(list(values), device),
    )


def _build_logit_bias(rows: list[SamplingRow], vocab_size: int,
                      device: torch.device | str) -> _SparseEntries | None:
    entries = [(i, token_id, bias) for i, row in enumerate(rows)
               for token_id, bias in (row.params.logit_bias or {}).items() if token_id < vocab_size]
    return _sparse(entries, device)


def _min_tokens_stop_ids(row: SamplingRow) -> set[int]:
    """Token ids to suppress for this row now: its stop ids and EOS while fewer than min_tokens were generated."""
    params = row.params
    if len(row.output_token_ids) >= params.min_tokens:
        return set()
    stop_ids = set(params.stop_token_ids or [])
    if row.eos_token_id is not None and not params.ignore_eos:
        stop_ids.add(row.eos_token_id)
    return stop_ids


def _build_min_tokens_mask(rows: list[SamplingRow], vocab_size: int,
                           device: torch.device | str) -> _SparseEntries | None:
    entries = [(i, token_id, 0.0) for i, row in enumerate(rows)
               for token_id in sorted(_min_tokens_stop_ids(row)) if token_id < vocab_size]
    return _sparse(entries, device)


class Sampler(nn.Module):
    """Samples one token per row: `Sampler()(logits [B, V] float32, meta) -> SamplerOutput`."""

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # logits: [B, V]
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        logits = self.process_logits(logits, meta)
        if meta.all_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample_random(self.compute_probs(logits, meta), meta)
            if not meta.all_random:
                token_ids = torch.where(meta.greedy_mask, logits.argmax(dim=-1), token_ids)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, meta.max_num_logprobs, token_ids)
            logprobs.num_logprobs = meta.num_logprobs
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    @staticmethod
    def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Apply logit_bias, min_tokens and penalties. Never modifies the caller's tensor."""
        if meta.logit_bias is None and meta.min_tokens_mask is None and meta.penalties is None:
            return logits
        logits = logits.clone()
        if meta.logit_bias is not None:
            bias = meta.logit_bias
            logits.index_put_((bias.rows, bias.tokens), bias.values, accumulate=True)
        if meta.min_tokens_mask is not None:
            mask = meta.min_tokens_mask
            logits[mask.rows, mask.tokens] = float("-inf")
        if meta.penalties is not None:
            logits = apply_penalties(logits, meta.penalties)
        return logits

    @staticmethod
    def compute_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Processed logits -> the distribution random rows sample from: temperature, top-k, top-p, min-p."""
        logits = logits / meta.temperature.unsqueeze(1)
        if meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        elif meta.top_k is not None:
            logits = apply_top_k_only(logits, meta.top_k)
        probs = torch.softmax(logits, dim=-1)
        if meta.min_p is not None:
            probs = apply_min_p(probs, meta.min_p)
        return probs

    @staticmethod
    def _sample_random(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """One uniform number per row, from the row's own generator if it has one."""
        batch = probs.shape[0]
        if len(meta.generators) < batch:
            uniform = torch.rand(batch, generator=meta.generator, device=probs.device)  # shared by unseeded rows
        else:
            uniform = torch.empty(batch, device=probs.device)
        for i, generator in meta.generators.items():
            uniform[i] = torch.rand(1, generator=generator, device=probs.device)
        return inverse_cdf_sample(probs, uniform)


def inverse_cdf_sample(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds u * total: token i with probability probs[i].

    Chosen over vLLM's exponential race (argmax of probs / q, q ~ Exp(1)) because on a CPU drawing V exponentials
    per row costs about 9 ms for [8, 49152] on one core, while this draws one number per row (about 0.6 ms in
    all). Zero-probability tokens are never picked: their cumulative sum equals their predecessor's.
    """
    cdf = probs.cumsum(dim=-1)                                      # [B, V]
    target = (uniform.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)      # [B, 1], in [0, total)
    token_ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return token_ids.clamp_(max=probs.shape[1] - 1)


def apply_penalties(logits: torch.Tensor, penalties: _Penalties) -> torch.Tensor:
    """Repetition (HF/vLLM: divide positive logits, multiply negative ones) on prompt and output tokens;
    frequency and presence (OpenAI) on output tokens."""
    repetition = torch.where(penalties.seen_mask, penalties.repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - penalties.frequency.unsqueeze(1) * penalties.output_counts
    return logits - penalties.presence.unsqueeze(1) * (penalties.output_counts > 0)


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's logits >= its k-th largest (ties at the boundary are kept); no full sort."""
    max_k = int(top_k.max())
    top_values = logits.topk(max_k, dim=-1).values                  # [B, max_k], descending
    threshold = top_values.gather(1, (top_k - 1).unsqueeze(1))      # [B, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p. Top-p keeps the smallest set of the most likely tokens whose probability reaches p
    (always at least one token). Tries the row's largest logits first; sorts the whole vocabulary only when
    some row's top-p set may reach past them (a full sort of [8, 49152] costs about 25 ms on one CPU core)."""
    fast = top_k_top_p_candidates(logits, top_k, top_p)
    return fast if fast is not None else top_k_top_p_sorted(logits, top_k, top_p)


def top_k_top_p_candidates(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor,
                           num_candidates: int = _TOP_P_CANDIDATES) -> torch.Tensor | None:
    """Top-k and top-p computed on each row's largest logits only; None if that cannot be exact.

    It is exact for a row whose top-k fits in the candidates, or whose candidates hold at least p of the
    probability: every token past them then has at least p of the mass before it, so top-p drops it.
    """
    batch, vocab_size = logits.shape
    k = top_k if top_k is not None else torch.full((batch,), vocab_size, device=logits.device)
    bounded_ks = k[k < vocab_size]
    num = min(vocab_size, max(num_candidates, int(bounded_ks.max()) if bounded_ks.numel() else 0))
    values, indices = logits.topk(num, dim=-1)                      # [B, num], descending
    bounded = k <= num                                              # top-k support inside the candidates
    kth = values.gather(1, (k.clamp(max=num) - 1).unsqueeze(1))
    values = values.masked_fill(bounded.unsqueeze(1) & (values < kth), float("-inf"))
    log_total = torch.where(bounded, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (values - log_total.unsqueeze(1)).exp()
    cumulative = probs.cumsum(dim=-1)
    if not bool((bounded | (cumulative[:, -1] >= top_p)).all()):
        return None
    keep = (cumulative - probs) < top_p.unsqueeze(1)                # probability mass before the token < p
    keep |= (top_p >= 1.0).unsqueeze(1)                             # rounding must not drop tokens when p = 1
    values = values.masked_fill(~keep, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, indices, values)


def top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p with one ascending sort of the whole vocabulary (as vLLM)."""
    vocab_size = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        threshold = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p.unsqueeze(1))
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens less likely than min_p times the row's top probability, and renormalise."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """The sampled tokens' logprobs and ranks, and the top `num_logprobs` of each row."""
    sampled = logprobs.gather(1, token_ids.unsqueeze(1))           # [B, 1]
    ranks = (logprobs > sampled).sum(dim=-1) + 1                    # [B]
    top = logprobs.topk(num_logprobs, dim=-1) if num_logprobs > 0 else None
    ids = token_ids.unsqueeze(1) if top is None else torch.cat([token_ids.unsqueeze(1), top.indices], dim=1)
    values = sampled if top is None else torch.cat([sampled, top.values], dim=1)
    return LogprobsTensors(token_ids=ids, logprobs=values, ranks=ranks, num_logprobs=[num_logprobs] * len(ranks))


# ---------------------------------------------------------------------------------------------------------
# The reference: one row at a time, plain ops, no flags or fast paths. Tests compare the Sampler against it.


@dataclass
class ReferenceSample:
    token_id: int
    logits: torch.Tensor          # [V] after bias, min_tokens and penalties
    probs: torch.Tensor | None    # [V] the distribution sampled from; None for greedy rows
    logprobs: torch.Tensor        # [V] log_softmax of the raw logits


def sample_reference(logits_row: torch.Tensor, row: SamplingRow) -> ReferenceSample:
    """Sample one row the slow, obvious way. A random row draws from row.generator (or the global RNG)."""
    params = row.params
    vocab_size = logits_row.shape[0]
    raw_logprobs = torch.log_softmax(logits_row.float(), dim=-1)
    logits = logits_row.float().clone()
    for token_id, bias in (params.logit_bias or {}).items():
        if token_id < vocab_size:
            logits[token_id] += bias
    for token_id in _min_tokens_stop_ids(row):
        if token_id < vocab_size:
            logits[token_id] = float("-inf")
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
    k = _effective_top_k(params.top_k, vocab_size)
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
