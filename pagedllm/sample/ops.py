"""The sampler's tensor ops, each over the whole batch: penalties, top-k / top-p, min-p, inverse-CDF sampling, the
verdicts on draft tokens and the logprobs gather."""

from __future__ import annotations

import sys
from types import ModuleType

import numpy as np
import torch

from pagedllm.kernels import kernels_for
from pagedllm.sample.metadata import Penalties, TokenBitmask

# Top-p looks at each row's largest logits first (see top_k_top_p_candidates).
_TOP_P_CANDIDATES = 1024


# The dtypes the kernels read (kernels/csrc/sampling.cpp); others take torch's ops.
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _row_kernels(x: torch.Tensor) -> ModuleType | None:
    """The kernel module where sampling.cpp's kernels take x: [N, V] CPU rows of a dtype they read, V > 0, each row
    contiguous."""
    if x.dim() != 2 or x.dtype not in _KERNEL_DTYPES or x.shape[1] == 0 or x.stride(1) != 1:
        return None
    return kernels_for(x)


def _float32_row_kernels(x: torch.Tensor) -> ModuleType | None:
    """`_row_kernels` for the kernels that change float32 logits in place (the bitmask, the penalties)."""
    return _row_kernels(x) if x.dtype == torch.float32 else None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of [N, V] rows: the first index of each row's largest value (of its first NaN).

    torch's CPU argmax is a scalar loop (~1.1 ms for [32, 49152] float32 rows, several percent of a decode step of
    32 rows); the C++ kernel takes a vectorised max of each chunk of a row, then the first index of the max in the
    first chunk holding it, and reads bf16 rows as they are. torch's argmax is the reference, and the path of other
    devices, shapes and dtypes.
    """
    kernels = _row_kernels(x)
    return x.argmax(dim=-1) if kernels is None else kernels.argmax_rows(x)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor,
                top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's token drawn with its uniform number from softmax(logits / temperature) [B, V] after its top-k, top-p
    and min-p (None: off for every row): `inverse_cdf_sample` of `filtered_probs`, which is the reference and the path
    of other devices, shapes and dtypes. On the CPU the C++ kernel draws each row at once, reading bf16 logits as they
    are; its sums are chunked where torch's cumsum runs in order, so a draw differs only where u falls within float
    rounding of a boundary between two tokens (or a row's top-p sum within rounding of its p)."""
    kernels = _row_kernels(logits)
    if kernels is None:
        probs = filtered_probs(logits.float() / temperature.unsqueeze(1), top_k, top_p, min_p)
        return inverse_cdf_sample(probs, uniform)
    return kernels.sample_rows(logits, temperature.float().contiguous(), uniform.float().contiguous(), top_k, top_p,
                               min_p)


def verify_rows(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, draft_ids: torch.Tensor,
                top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                min_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample` of each row's draft (-1: none) against the distribution `sample_rows` draws from, with its
    two uniform numbers [B, 2]: that of `filtered_probs`, the reference and the path of other devices, shapes and
    dtypes. On the CPU the C++ kernel weighs, filters and draws each row at once (torch's [B, V] ops took ~45 ms to
    verify 32 requests' 3 drafts greedy, ~270 ms with top-p); its draws differ from torch's as `sample_rows`' do."""
    kernels = _row_kernels(logits)
    if kernels is None:
        probs = filtered_probs(logits.float() / temperature.unsqueeze(1), top_k, top_p, min_p)
        return rejection_sample(probs, draft_ids, uniform)
    return kernels.verify_rows(logits, temperature.float().contiguous(), uniform.float().contiguous(),
                               draft_ids.contiguous(), top_k, top_p, min_p)


def rejection_sample(probs: torch.Tensor, draft_ids: torch.Tensor,
                     uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: whether its draft is accepted, and the token to emit if the run stops at this row.

    Args:
        probs: [R, V] target distributions.
        draft_ids: [R] the draft token each row verifies; -1 for a bonus row (no draft, never accepted).
        uniform: [R, 2] numbers in [0, 1).

    Returns:
        accepted: [R] bool, uniform[:, 0] < p(draft).
        recovered: [R] int64, drawn from p with the draft removed (the residual of a point-mass draft), or from
            p itself on a bonus row, by inverse CDF with uniform[:, 1].
    """
    has_draft = draft_ids >= 0
    index = draft_ids.clamp(min=0).unsqueeze(1)                           # [R, 1]
    p_draft = probs.gather(1, index).squeeze(1)                            # [R]
    accepted = has_draft & (uniform[:, 0] < p_draft)
    residual = torch.where(has_draft.unsqueeze(1), probs.scatter(1, index, 0.0), probs)
    return accepted, inverse_cdf_sample(residual, uniform[:, 1])


def filtered_probs(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                   min_p: torch.Tensor | None) -> torch.Tensor:
    """The distribution a random row samples from, of its logits after temperature: top-k, top-p, softmax, min-p."""
    if top_p is not None:
        logits = apply_top_k_top_p(logits, top_k, top_p)
    elif top_k is not None:
        logits = apply_top_k_only(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    return probs if min_p is None else apply_min_p(probs, min_p)


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


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """Set every token a constrained row does not allow to -inf, in place: on the CPU in C++ from the bits
    themselves (~6.5 ms for 32 rows of SmolLM2's vocabulary through the unpacking below), which is its reference and
    the path of other devices."""
    kernels = _float32_row_kernels(logits)
    if kernels is not None:
        kernels.apply_token_bitmask(logits, mask.rows, mask.bitmask)
        return
    allowed = unpack_bitmask(mask.bitmask, logits.shape[1]).to(logits.device)     # [R, V] bool
    logits[mask.rows] = logits[mask.rows].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool, bit j of word w -> column 32 * w + j.

    Read as bytes: on a little-endian machine byte k of word w holds bits 8k..8k+7, so numpy's little-order
    unpackbits over the bytes yields the columns in order (a [R, W, 32] shift-and-mask costs 32x the memory).
    """
    assert sys.byteorder == "little", "the bitmask's byte view assumes a little-endian machine"
    as_bytes = bitmask.contiguous().numpy().view(np.uint8)                          # [R, 4W]
    bits = np.unpackbits(as_bytes, axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> None:
    """Repetition (HF/vLLM: divide positive logits, multiply negative ones) on prompt and output tokens, then
    frequency and presence (OpenAI) on output tokens: in place on float32 `logits`.

    On the CPU the C++ kernel visits each row's own tokens (~600 a row for a 512-token prompt), where the dense
    form below takes five passes over [B, V] and builds two [B, V] tables a step (~11 ms for 32 rows of SmolLM2's
    vocabulary): the same operations in the same order, so the same bits. `apply_penalties_dense` is its
    reference, and the path of other devices."""
    kernels = _float32_row_kernels(logits)
    if kernels is None:
        apply_penalties_dense(logits, penalties)
    else:
        kernels.apply_penalties(logits, penalties.prompt_ids, penalties.prompt_starts, penalties.output_ids,
                                penalties.output_starts, penalties.repetition, penalties.frequency, penalties.presence)


def apply_penalties_dense(logits: torch.Tensor, penalties: Penalties) -> None:
    """`apply_penalties` in torch's ops over the whole [B, V]."""
    seen, counts = _seen_and_counts(penalties, logits.shape[1])
    repetition = torch.where(seen, penalties.repetition.unsqueeze(1), 1.0)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    penalised = penalised - penalties.frequency.unsqueeze(1) * counts
    logits.copy_(penalised - penalties.presence.unsqueeze(1) * (counts > 0))


def _seen_and_counts(penalties: Penalties, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] bool: each row's tokens in its prompt or output; [B, V] float32: the times each was generated. Ids
    outside the vocabulary land in an extra column, cut off."""
    def scatter(ids: torch.Tensor, starts: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        rows = torch.repeat_interleave(torch.arange(len(starts) - 1, device=ids.device), starts.diff())
        table = torch.zeros(len(starts) - 1, vocab_size + 1, device=ids.device)
        ids = torch.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)
        return table.index_put_((rows, ids), values.expand(len(ids)), accumulate=True)[:, :vocab_size]

    one = torch.ones(1, device=penalties.prompt_ids.device)
    counts = scatter(penalties.output_ids, penalties.output_starts, one)
    seen = (scatter(penalties.prompt_ids, penalties.prompt_starts, one) > 0) | (counts > 0)
    return seen, counts


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's logits >= its k-th largest (ties at the boundary are kept); no full sort."""
    max_k = int(top_k.max())
    top_values = logits.topk(max_k, dim=-1).values                  # [B, max_k], descending
    threshold = top_values.gather(1, (top_k - 1).unsqueeze(1))      # [B, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p. Top-p keeps the smallest set of the most likely tokens whose probability reaches p
    (always at least one token), and the ties of its least likely one (the C++ draw's rule: which of equal logits
    sorts first decides nothing). Tries the row's largest logits first; sorts the whole vocabulary only when some
    row's top-p set may reach past them (a full sort of [8, 49152] costs about 25 ms on one CPU core). The torch
    reference of the C++ draw (`sample_rows`), and the path of other devices and of rows that report logprobs."""
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
    least = values.gather(1, (keep.sum(dim=-1, keepdim=True) - 1))  # the last kept value: its ties are kept too
    values = values.masked_fill(values < least, float("-inf"))
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
    least = sorted_logits.gather(1, drop.sum(dim=-1, keepdim=True))  # the first kept value: its ties are kept too
    sorted_logits = sorted_logits.masked_fill(sorted_logits < least, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens less likely than min_p times the row's top probability, and renormalise."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def raw_scores(logits: torch.Tensor, logprobs_mode: str) -> torch.Tensor:
    """What a raw mode reports of float32 `logits`: their log_softmax, or the logits in "raw_logits"."""
    return logits if logprobs_mode == "raw_logits" else torch.log_softmax(logits, dim=-1)


def raw_logprobs(logits: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor,
                 logprobs_mode: str = "raw_logprobs") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gather_logprobs` of the raw scores of `logits` [B, V] (`raw_scores`, which with it is the reference and the
    path of other devices): on the CPU one C++ pass a row, reading bf16 logits as they are, where torch's
    log_softmax, the rank's comparison and topk took 4-11 ms for 32 rows of SmolLM2's vocabulary. Its log-softmax
    differs from torch's by float rounding; its rank counts the larger logits, and equal values among the top come
    in index order."""
    kernels = _row_kernels(logits)
    if kernels is None:
        return gather_logprobs(raw_scores(logits.float(), logprobs_mode), num_logprobs, token_ids)
    return kernels.row_logprobs(logits, token_ids.contiguous(), num_logprobs, logprobs_mode != "raw_logits")


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int,
                    token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled tokens' logprobs and ranks, and the top `num_logprobs` of each row.

    Returns (token_ids [B, 1 + num_logprobs], logprobs [B, 1 + num_logprobs], ranks [B]): column 0 is the sampled
    token, then the top tokens in order; a rank is 1-based (1 = most likely).
    """
    sampled = logprobs.gather(1, token_ids.unsqueeze(1))           # [B, 1]
    ranks = (logprobs > sampled).sum(dim=-1) + 1                    # [B]
    top = logprobs.topk(num_logprobs, dim=-1) if num_logprobs > 0 else None
    ids = token_ids.unsqueeze(1) if top is None else torch.cat([token_ids.unsqueeze(1), top.indices], dim=1)
    values = sampled if top is None else torch.cat([sampled, top.values], dim=1)
    return ids, values, ranks
