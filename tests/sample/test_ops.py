"""The sampler's tensor ops on their own: the fast paths against the plain ones."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.kernels import kernels_for
from pagedllm.sample.metadata import SamplingMetadata, SamplingRow, TokenBitmask
from pagedllm.sample.ops import (
    apply_penalties_dense,
    apply_token_bitmask,
    argmax_rows,
    filtered_probs,
    gather_logprobs,
    inverse_cdf_sample,
    raw_logprobs,
    rejection_sample,
    sample_rows,
    top_k_top_p_candidates,
    top_k_top_p_sorted,
    verify_rows,
)


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


@pytest.mark.parametrize("vocab", [49152, 1000, 7])      # whole chunks of the kernel's 256, a partial one, less
def test_argmax_rows_is_torch_argmax_with_ties_and_nan(vocab: int, isa_level: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(11, vocab + 3)[:, :vocab]  # rows a stride apart, as the LM head's padded vocabulary
    logits[1, [5, vocab // 2, vocab - 1]] = 50.0   # ties across chunks: the first index
    logits[2, [vocab - 2, vocab - 1]] = 50.0       # ties in one chunk
    logits[3, [vocab - 1, 3]] = float("nan")       # NaN counts as the largest, the first one wins
    logits[4] = float("-inf")                      # a row masked out entirely (a grammar, min_tokens)
    logits[5, vocab - 1] = float("inf")
    logits[6] = 0.0                                # all equal
    logits[7, 0] = 1e30
    logits[8, vocab - 1] = 60.0                    # the max in the last chunk, after a NaN-free row of others
    logits[8, 0] = float("-inf")
    logits[9] = -0.0                               # -0 and 0 tie
    logits[9, vocab - 1] = 0.0
    logits[10, vocab - 1] = float("nan")           # the only NaN, last
    kernels = kernels_for(logits)
    assert kernels is not None
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        rows = logits.to(dtype)
        for x in (rows, rows[:1], rows[3:4]):
            expected = x.argmax(dim=-1)
            assert torch.equal(kernels.argmax_rows(x), expected), (dtype, x.shape)
            assert torch.equal(argmax_rows(x), expected)
    assert torch.equal(argmax_rows(logits.double()), logits.double().argmax(dim=-1))    # torch's path


def test_argmax_rows_refuses_what_it_cannot_read() -> None:
    kernels = kernels_for(torch.empty(0))
    assert kernels is not None
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        kernels.argmax_rows(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="unit stride along V"):
        kernels.argmax_rows(torch.zeros(4, 2).t())
    with pytest.raises(RuntimeError, match="V > 0"):
        kernels.argmax_rows(torch.zeros(2, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_rows_draws_the_inverse_cdf_token(isa_level: str, dtype: torch.dtype) -> None:
    """The kernel's draw is the token whose float64 CDF interval holds u * total (to float32 rounding of the sums),
    and almost always torch's own draw (`inverse_cdf_sample` of the softmax); -inf tokens are never drawn."""
    g = torch.Generator().manual_seed(1)
    rows, vocab = 64, 5000
    logits = (torch.randn(rows, vocab + 7, generator=g) * 4)[:, :vocab].to(dtype)   # rows a stride apart
    logits[::3, 100:4000] = float("-inf")                   # filtered tokens (a mask, top-k), one chunk left whole
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.05
    uniform = torch.rand(rows, generator=g)
    uniform[:4] = torch.tensor([0.0, 1.0 - 2**-24, 0.5, 1e-9])
    kernels = kernels_for(logits)
    assert kernels is not None
    drawn = kernels.sample_rows(logits, temperature, uniform)
    assert torch.equal(sample_rows(logits, temperature, uniform), drawn)
    probs = torch.softmax(logits.double() / temperature.double().unsqueeze(1), dim=-1)
    cdf = probs.cumsum(-1)
    target = uniform.double() * cdf[:, -1]
    tol = 1e-5
    for r in range(rows):
        t = int(drawn[r])
        assert probs[r, t] > 0, (r, t)
        assert cdf[r, t] > target[r] - tol and (t == 0 or cdf[r, t - 1] <= target[r] + tol), (r, t)
    torch_draw = inverse_cdf_sample(torch.softmax(logits.float() / temperature.unsqueeze(1), dim=-1), uniform)
    assert (torch_draw == drawn).float().mean() >= 0.95


def _kept(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The tokens a row's top-k, top-p and min-p keep of its float64 `probs` [V], ties kept together: the oracle."""
    keep = probs > 0
    if top_k < probs.numel():
        keep &= probs >= probs.sort(descending=True).values[top_k - 1]
    q = torch.where(keep, probs, 0.0)
    if top_p < 1.0:
        ordered = q.sort(descending=True).values
        before = ordered.cumsum(0) - ordered                    # the mass of the tokens ahead of each
        keep &= q >= ordered[int((before < top_p * q.sum()).sum()) - 1]
    return keep & (probs >= min_p * probs.max())


# (top_k, top_p, min_p) a row: k within the 20 chunks' count and past it, p alone and with k, min-p alone and last
_FILTERS = [(1, 1.0, 0.0), (3, 1.0, 0.0), (20, 1.0, 0.0), (50, 1.0, 0.0), (300, 1.0, 0.0), (5000, 0.5, 0.0),
            (5000, 0.9, 0.0), (5000, 0.99, 0.0), (40, 0.9, 0.0), (300, 0.7, 0.1), (5000, 1.0, 0.05),
            (5000, 0.95, 0.3), (7, 0.2, 0.0), (5000, 1e-6, 0.0)]


def _filtered_rows(seed: int, dtype: torch.dtype) -> tuple[torch.Generator, list[tuple[int, float, float]],
                                                             torch.Tensor, torch.Tensor]:
    """Rows of 5,000 logits for _FILTERS, six times over, each time at another scale (peaked, flat; bf16 ties), a
    stride apart, every fifth with a masked span; their filters, logits and temperatures, and the generator to go on
    drawing from."""
    g = torch.Generator().manual_seed(seed)
    vocab, repeats = 5000, 6
    filters = _FILTERS * repeats
    rows = len(filters)
    scale = torch.tensor([4.0, 8.0, 0.05, 1.0, 20.0, 0.5]).repeat_interleave(len(_FILTERS)).unsqueeze(1)
    logits = (torch.randn(rows, vocab + 3, generator=g)[:, :vocab] * scale).to(dtype)   # rows a stride apart
    logits[::5, 1000:3000] = float("-inf")                   # masked tokens
    return g, filters, logits, torch.rand(rows, generator=g) + 0.3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_rows_filters_keep_the_oracles_tokens(isa_level: str, dtype: torch.dtype) -> None:
    """With top-k, top-p and min-p, every draw is a token the float64 oracle keeps, inside that token's interval of
    the kept distribution's CDF, and almost always torch's draw (`inverse_cdf_sample` of `filtered_probs`); over
    peaked, flat and bf16 rows (whose logits tie often: a boundary's ties are kept together)."""
    g, filters, logits, temperature = _filtered_rows(2, dtype)
    rows = len(filters)
    uniform = torch.rand(rows, generator=g)
    uniform[:3] = torch.tensor([0.0, 1.0 - 2**-24, 1e-9])
    top_k = torch.tensor([f[0] for f in filters])
    top_p = torch.tensor([f[1] for f in filters])
    min_p = torch.tensor([f[2] for f in filters])
    kernels = kernels_for(logits)
    assert kernels is not None
    drawn = kernels.sample_rows(logits, temperature, uniform, top_k, top_p, min_p)
    assert torch.equal(sample_rows(logits, temperature, uniform, top_k, top_p, min_p), drawn)
    probs = torch.softmax(logits.double() / temperature.double().unsqueeze(1), dim=-1)
    for r, (k, p, m) in enumerate(filters):
        kept = torch.where(_kept(probs[r], k, p, m), probs[r], 0.0)
        cdf = kept.cumsum(0)
        target = float(uniform[r]) * float(cdf[-1])
        t = int(drawn[r])
        assert kept[t] > 0, (r, t, filters[r])
        assert cdf[t] > target - 1e-5 and (t == 0 or cdf[t - 1] <= target + 1e-5), (r, t)
    reference = filtered_probs(logits.float() / temperature.unsqueeze(1), top_k, top_p, min_p)
    assert (inverse_cdf_sample(reference, uniform) == drawn).float().mean() >= 0.95


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_rows_gives_the_oracles_verdicts(isa_level: str, dtype: torch.dtype) -> None:
    """The kernel accepts a draft where u < p(draft) of the float64 oracle's filtered distribution (u away from it by
    more than float rounding) and draws the row's token from p without the draft (from p on a bonus row) inside its
    CDF interval, almost always torch's own draw (`rejection_sample` of `filtered_probs`); drafts at the argmax, at a
    random token, at a masked one, none; a draft that holds all of p (top-k 1) is accepted and stands as the draw."""
    g, filters, logits, temperature = _filtered_rows(3, dtype)
    rows, vocab = logits.shape
    uniform = torch.rand(rows, 2, generator=g)
    kind = torch.arange(rows) % 4
    draft_ids = torch.where(kind == 0, logits.float().argmax(-1), torch.randint(0, vocab, (rows,), generator=g))
    draft_ids = torch.where(kind == 2, torch.full((rows,), 1500), draft_ids)   # masked in every fifth row
    draft_ids = torch.where(kind == 3, -1, draft_ids)
    top_k = torch.tensor([f[0] for f in filters])
    top_p = torch.tensor([f[1] for f in filters])
    min_p = torch.tensor([f[2] for f in filters])
    kernels = kernels_for(logits)
    assert kernels is not None
    accepted, recovered = kernels.verify_rows(logits, temperature, uniform, draft_ids, top_k, top_p, min_p)
    fast = verify_rows(logits, temperature, uniform, draft_ids, top_k, top_p, min_p)
    assert torch.equal(fast[0], accepted) and torch.equal(fast[1], recovered)
    probs = torch.softmax(logits.double() / temperature.double().unsqueeze(1), dim=-1)
    for r, (k, p, m) in enumerate(filters):
        kept = torch.where(_kept(probs[r], k, p, m), probs[r], 0.0)
        kept /= kept.sum()
        d, t = int(draft_ids[r]), int(recovered[r])
        p_draft = float(kept[d]) if d >= 0 else 0.0
        if abs(float(uniform[r, 0]) - p_draft) > 1e-5:
            assert bool(accepted[r]) == (float(uniform[r, 0]) < p_draft), (r, d, p_draft)
        if p_draft > 1 - 1e-6:     # no residual
            assert bool(accepted[r]) and t == d, (r, filters[r])
            continue
        residual = kept.clone()
        if d >= 0:
            residual[d] = 0.0
        cdf = residual.cumsum(0)
        target = float(uniform[r, 1]) * float(cdf[-1])
        assert residual[t] > 0, (r, t, filters[r])
        assert cdf[t] > target - 1e-5 and (t == 0 or cdf[t - 1] <= target + 1e-5), (r, t)
    reference = filtered_probs(logits.float() / temperature.unsqueeze(1), top_k, top_p, min_p)
    torch_accepted, torch_recovered = rejection_sample(reference, draft_ids, uniform)
    assert (torch_accepted == accepted).float().mean() >= 0.95
    used = ~accepted & ~torch_accepted      # where the run stops, the recovered token is emitted
    assert (torch_recovered == recovered)[used].float().mean() >= 0.95


def test_verify_rows_refuses_a_draft_past_the_vocabulary() -> None:
    kernels = kernels_for(torch.zeros(1, 8))
    assert kernels is not None
    with pytest.raises(RuntimeError, match="draft id 8 of row 0 is past the 8 tokens"):
        kernels.verify_rows(torch.zeros(1, 8), torch.ones(1), torch.zeros(1, 2), torch.tensor([8]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_rows_filters_keep_ties_together(isa_level: str, dtype: torch.dtype) -> None:
    """Drawn with uniforms across [0, 1), each filter yields exactly the tokens it keeps, the C++ kernel and torch's
    ops alike: a boundary between equal logits keeps all of them, whichever index comes first."""
    vocab = 600                                                  # three chunks, the ties spread across them
    row = torch.full((vocab,), -30.0)
    row[[590, 10, 300, 450]] = torch.tensor([5.0, 3.0, 3.0, 3.0])   # one top token, then three equal ones
    row[[20, 500]] = 2.0
    cases = {(2, 1.0, 0.0): {590, 10, 300, 450},              # top-k's k-th token has two ties
             (600, 0.75, 0.0): {590, 10, 300, 450},           # the top token and one of the three reach p
             (600, 0.5, 0.0): {590},
             (600, 1.0, 0.1): {590, 10, 300, 450},            # exp(-2) = 0.135 of the top token
             (600, 1.0, 0.2): {590},
             (5, 0.95, 0.0): {590, 10, 300, 450, 20, 500}}    # k = 5 keeps both 2.0s, p then keeps all six
    draws = 512
    uniform = (torch.arange(draws) + 0.5) / draws
    logits = row.to(dtype).expand(draws, vocab)
    temperature = torch.ones(draws)
    kernels = kernels_for(logits)
    assert kernels is not None
    for (k, p, m), expected in cases.items():
        filters = torch.full((draws,), k), torch.full((draws,), p), torch.full((draws,), m)
        assert set(kernels.sample_rows(logits, temperature, uniform, *filters).tolist()) == expected, (k, p, m)
        reference = filtered_probs(logits.float(), *filters)
        assert set(inverse_cdf_sample(reference, uniform).tolist()) == expected, (k, p, m)


def test_sample_rows_refuses_filters_of_the_wrong_shape_or_dtype() -> None:
    kernels = kernels_for(torch.empty(0))
    assert kernels is not None
    x, ones = torch.zeros(2, 8), torch.ones(2)
    with pytest.raises(RuntimeError, match="top_k must be contiguous Long"):
        kernels.sample_rows(x, ones, ones, top_k=torch.ones(2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="top_p must be contiguous Float"):
        kernels.sample_rows(x, ones, ones, top_p=torch.ones(3))
    with pytest.raises(RuntimeError, match="min_p must be contiguous Float"):
        kernels.sample_rows(x, ones, ones, min_p=torch.ones(2, dtype=torch.float64))


def test_penalties_kernel_gives_the_dense_forms_bits(isa_level: str) -> None:
    """The C++ penalties against torch's ops over [B, V]: bit for bit, with repeated and out-of-vocabulary ids, a
    token in both the prompt and the output, rows without tokens, and rows a stride apart."""
    g = torch.Generator().manual_seed(3)
    vocab = 3000
    prompts = [[5, 5, 7, -1, vocab, 2999], [], [1, 2, 3] * 50, [9]]
    outputs = [[7, 7, 7, 11, vocab + 5], [0, 0, 2999], [], [9, 9]]
    meta = SamplingMetadata.build(
        [SamplingRow(SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p), prompt, output)
         for (r, f, p), prompt, output in zip([(1.3, 0.5, 0.25), (0.8, -0.5, 1.0), (1.5, 0.0, 0.0), (1.0, 2.0, 0.0)],
                                              prompts, outputs)], vocab, "cpu")
    penalties = meta.penalties
    assert penalties is not None
    logits = (torch.randn(4, vocab + 5, generator=g) * 5)[:, :vocab]
    original, expected = logits.clone(), logits.clone()
    apply_penalties_dense(expected, penalties)
    kernels = kernels_for(logits)
    assert kernels is not None
    kernels.apply_penalties(logits, penalties.prompt_ids, penalties.prompt_starts, penalties.output_ids,
                            penalties.output_starts, penalties.repetition, penalties.frequency, penalties.presence)
    assert torch.equal(logits, expected)
    assert (logits != original).sum(dim=1).tolist() == [4, 2, 3, 1]   # each row's distinct tokens in the vocabulary
    with pytest.raises(RuntimeError, match="logits must be float32"):
        kernels.apply_penalties(logits.bfloat16(), penalties.prompt_ids, penalties.prompt_starts, penalties.output_ids,
                                penalties.output_starts, penalties.repetition, penalties.frequency, penalties.presence)
    with pytest.raises(RuntimeError, match="starts must run from 0"):
        kernels.apply_penalties(logits, penalties.prompt_ids, penalties.prompt_starts + 1, penalties.output_ids,
                                penalties.output_starts, penalties.repetition, penalties.frequency, penalties.presence)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_logprobs_are_torchs_log_softmax_gathered(isa_level: str, dtype: torch.dtype) -> None:
    """The C++ logprobs against `gather_logprobs` of torch's log_softmax: the token's value and rank, and the top
    values (ties among them in index order); the logits themselves, bit for bit, in "raw_logits"."""
    g = torch.Generator().manual_seed(4)
    rows, vocab = 9, 5000
    logits = (torch.randn(rows, vocab + 3, generator=g) * 3)[:, :vocab].to(dtype)    # rows a stride apart
    logits[1, [7, 4000, 4999]] = 20.0                      # a three-way tie at the top, across chunks
    logits[2, 1000:3000] = float("-inf")                   # masked tokens
    token_ids = torch.randint(0, vocab, (rows,), generator=g)
    token_ids[1], token_ids[2] = 4000, 1500                # a tied top token; a token at -inf
    kernels = kernels_for(logits)
    assert kernels is not None
    wide = logits.float()
    for num in (0, 5, 40):                                  # 40 > the row's 20 chunks: every value a candidate
        ids, values, ranks = kernels.row_logprobs(logits, token_ids, num, True)
        want_ids, want_values, want_ranks = gather_logprobs(torch.log_softmax(wide, dim=-1), num, token_ids)
        assert torch.equal(ids[:, 0], token_ids) and torch.equal(ranks, want_ranks)
        torch.testing.assert_close(values, want_values)
        assert torch.equal(values[:, 1:], values[:, 1:].sort(dim=1, descending=True).values)
        assert torch.equal(wide.gather(1, ids[:, 1:]), wide.gather(1, want_ids[:, 1:]))   # the same top values
        assert torch.equal(raw_logprobs(logits, num, token_ids)[1], values)
        if num:
            assert ids[1, 1:4].tolist() == [7, 4000, 4999]   # equal values in index order
        ids, values, ranks = kernels.row_logprobs(logits, token_ids, num, False)
        assert torch.equal(values, wide.gather(1, ids))
        assert torch.equal(values[:, 1:], wide.topk(num, dim=-1).values)
    assert ranks[1] == 1 and values[2, 0] == float("-inf")
    with pytest.raises(RuntimeError, match="outside"):
        kernels.row_logprobs(logits, torch.full((rows,), vocab), 1, True)


@pytest.mark.parametrize("words", [32, 20])              # ceil(1000 / 32) words; fewer: the tokens past them refused
def test_token_bitmask_kernel_masks_what_torchs_unpacking_does(isa_level: str, words: int) -> None:
    g = torch.Generator().manual_seed(5)
    vocab = 1000
    bitmask = torch.randint(-2**31, 2**31, (2, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1                                         # every bit set: the whole row allowed
    mask = TokenBitmask(rows=torch.tensor([2, 0]), bitmask=bitmask)
    logits = (torch.randn(3, vocab + 4, generator=g))[:, :vocab]                     # rows a stride apart
    expected = logits.double()
    apply_token_bitmask(expected, mask)                     # float64: torch's path
    kernels = kernels_for(logits)
    assert kernels is not None
    kernels.apply_token_bitmask(logits, mask.rows, mask.bitmask)
    assert torch.equal(logits.double(), expected)
    refused = logits[2].isinf()
    assert 0 < int(refused[:32 * words].sum()) < 32 * words and bool(refused[32 * words:].all())
    assert torch.isinf(logits[0, 32 * words:]).all() and not torch.isinf(logits[0, :min(vocab, 32 * words)]).any()
    assert not torch.isinf(logits[1]).any()                 # a row without a mask
    with pytest.raises(RuntimeError, match="outside"):
        kernels.apply_token_bitmask(logits, torch.tensor([3, 0]), bitmask)
