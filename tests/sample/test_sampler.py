"""The vectorised Sampler against the per-row reference, plus the properties each option promises."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata, SamplingRow, make_generator
from pagedllm.sample.ops import unpack_bitmask
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from tests.sample.reference import sample_reference

VOCAB = 97
EOS = 3


def _row(params: SamplingParams, seed: int | None = None, prompt: list[int] | None = None,
         output: list[int] | None = None) -> SamplingRow:
    return SamplingRow(params=params, prompt_token_ids=prompt or [], output_token_ids=output or [],
                       generator=None if seed is None else make_generator(seed), eos_token_id=EOS)


def _sample(logits: torch.Tensor, rows: list[SamplingRow]):
    return Sampler()(logits, SamplingMetadata.build(rows, logits.shape[1], "cpu"))


def _random_params(rng: random.Random) -> SamplingParams:
    if rng.random() < 0.3:
        return SamplingParams(temperature=0.0, repetition_penalty=rng.choice([1.0, 1.3]),
                              logprobs=rng.choice([None, 0, 3]))
    return SamplingParams(
        temperature=rng.choice([0.5, 1.0, 1.7]),
        top_k=rng.choice([0, -1, 1, 5, 40, VOCAB + 10]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.05, 0.2]),
        repetition_penalty=rng.choice([1.0, 0.8, 1.5]),
        frequency_penalty=rng.choice([0.0, 0.5, -0.5]),
        presence_penalty=rng.choice([0.0, 1.0]),
        logit_bias=rng.choice([None, {5: 3.0, 7: -100.0}]),
        allowed_token_ids=rng.choice([None, list(range(20, 30)) + rng.sample(range(VOCAB), 20)]),
        min_tokens=rng.choice([0, 4]),
        stop_token_ids=rng.choice([[], [11, 12]]),
        logprobs=rng.choice([None, 0, 2, 5]),
    )


def _random_rows(rng: random.Random, batch: int) -> list[SamplingRow]:
    rows = []
    for i in range(batch):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 8))]
        seed = None if rng.random() < 0.25 else 1000 + i  # unseeded rows share the global draw
        params = _random_params(rng)
        if rng.random() < 0.5:
            # bad words (resolved): one token, the output's last tokens and one more, and one that cannot match yet;
            # their last tokens outside 20..29, which every mask allows, so that no row is masked out entirely
            tail = output[len(output) - rng.randrange(0, min(3, len(output)) + 1):]
            params.bad_words_token_ids = [[rng.randrange(30, VOCAB)], tail + [rng.randrange(30, VOCAB)],
                                          [rng.randrange(VOCAB)] * (len(output) + 1) + [rng.randrange(30, VOCAB)]]
        rows.append(_row(params, seed=seed, prompt=prompt, output=output))
    return rows


def _clone_rows(rows: list[SamplingRow]) -> list[SamplingRow]:
    """Same rows with fresh generators in the same state."""
    out = []
    for row in rows:
        generator = None
        if row.generator is not None:
            generator = torch.Generator()
            generator.set_state(row.generator.get_state())
        out.append(SamplingRow(row.params, row.prompt_token_ids, row.output_token_ids, generator, row.eos_token_id,
                               row.token_bitmask))
    return out


def _random_bitmask(generator: torch.Generator, vocab_size: int = VOCAB) -> torch.Tensor:
    """[ceil(V / 32)] int32 with random bits, tokens 20..29 always allowed (so no row is masked out entirely)."""
    bits = torch.rand(vocab_size, generator=generator) < 0.3
    bits[20:30] = True
    words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int64)
    for token_id in bits.nonzero().flatten().tolist():
        words[token_id // 32] |= 1 << (token_id % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)   # bit 31 is the sign bit


@pytest.mark.parametrize("case", range(12))
def test_matches_reference_on_random_batches(case: int) -> None:
    rng = random.Random(case)
    torch.manual_seed(case)
    batch = rng.randrange(1, 9)
    rows = _random_rows(rng, batch)
    mask_generator = make_generator(case)
    for row in rows[case % 2::2]:             # structured outputs on every other row, half the cases
        row.token_bitmask = _random_bitmask(mask_generator) if case >= 6 else None
    ref_rows = _clone_rows(rows)
    logits = torch.randn(batch, VOCAB) * 3
    meta = SamplingMetadata.build(rows, VOCAB, "cpu")
    sampler = Sampler()

    processed = sampler.process_logits(logits, meta)
    probs = sampler.compute_probs(processed, meta)
    out = sampler(logits, SamplingMetadata.build(rows, VOCAB, "cpu"))
    for i, (row, ref_row) in enumerate(zip(rows, ref_rows)):
        ref = sample_reference(logits[i], ref_row)
        torch.testing.assert_close(processed[i], ref.logits)
        if ref.probs is not None:
            torch.testing.assert_close(probs[i], ref.probs, atol=1e-6, rtol=1e-5)
        if row.params.greedy or row.generator is not None:
            assert int(out.token_ids[i]) == ref.token_id, f"row {i}: {row.params}"
        if row.params.logprobs is not None:
            _check_logprobs(out, i, ref.logprobs, row.params.logprobs)
    assert (out.logprobs is None) == all(r.params.logprobs is None for r in rows)


def _check_logprobs(out, i: int, raw_logprobs: torch.Tensor, num: int) -> None:
    ids = out.logprobs.token_ids[i]
    values = out.logprobs.logprobs[i]
    sampled = int(out.token_ids[i])
    assert int(ids[0]) == sampled
    torch.testing.assert_close(values[0], raw_logprobs[sampled])
    expected_top = torch.topk(raw_logprobs, num)
    torch.testing.assert_close(values[1:1 + num], expected_top.values)
    assert int(out.logprobs.ranks[i]) == int((raw_logprobs > raw_logprobs[sampled]).sum()) + 1


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
@pytest.mark.parametrize("case", range(4))
def test_each_logprobs_mode_reports_its_point_of_the_processing(mode: str, case: int) -> None:
    """vLLM's logprobs_mode against the reference: the raw logits, or the distribution each row is sampled from
    (a greedy row's processed logits; a random row's after temperature and filters, -inf where they cut)."""
    rng = random.Random(case)
    rows = _random_rows(rng, 6)
    for row in rows:
        row.params.logprobs = rng.choice([0, 3])
    ref_rows = _clone_rows(rows)
    logits = torch.randn(len(rows), VOCAB) * 3
    out = Sampler(mode)(logits, SamplingMetadata.build(rows, VOCAB, "cpu"))
    for i, (row, ref_row) in enumerate(zip(rows, ref_rows)):
        ref = sample_reference(logits[i], ref_row)
        if mode == "raw_logits":
            expected = logits[i]
        elif ref.probs is None:     # greedy: it takes the argmax of its processed logits
            expected = ref.logits if mode == "processed_logits" else torch.log_softmax(ref.logits, dim=-1)
        elif mode == "processed_logits":
            expected = torch.where(ref.probs > 0, ref.logits / row.params.temperature, float("-inf"))
        else:
            expected = torch.log(ref.probs)
        _check_logprobs(out, i, expected, row.params.logprobs)


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    logits = torch.randn(3, VOCAB)
    rows = [_row(SamplingParams(temperature=0, logprobs=4, repetition_penalty=2.0), prompt=[1, 2]),
            _row(SamplingParams(temperature=0.7, top_k=3, logprobs=1), seed=1),
            _row(SamplingParams(temperature=0))]
    out = _sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.token_ids.shape == (3, 5)
    assert out.logprobs.logprobs.shape == (3, 5)
    assert out.logprobs.ranks.shape == (3,)
    torch.testing.assert_close(out.logprobs.logprobs, raw.gather(1, out.logprobs.token_ids))
    assert out.logprobs.token_ids[0, 1:].tolist() == raw[0].topk(4).indices.tolist()
    assert int(out.logprobs.ranks[2]) == 1  # plain greedy takes the top token


def test_all_greedy_is_argmax_and_has_no_logprobs() -> None:
    logits = torch.randn(5, VOCAB)
    out = _sample(logits, [_row(SamplingParams(temperature=0)) for _ in range(5)])
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.token_ids.dtype == torch.long
    assert out.logprobs is None


@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0)] * 4,                                     # the argmax of the bf16 rows as they are
    [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={7: 0.5})] * 2,
    [SamplingParams(temperature=0, logprobs=3)] * 4,
    [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=5, top_k=20)] * 2,
], ids=["greedy", "biased", "logprobs", "mixed"])
def test_bf16_logits_sample_as_their_float32_widening(params: list[SamplingParams]) -> None:
    logits = (torch.randn(4, VOCAB) * 3).bfloat16()         # ties are common in bf16: the first index wins either way
    logits[0, [10, 50]] = logits[0].max() + 1
    rows = [_row(p, seed=p.seed) for p in params]
    twins = _clone_rows(rows)                              # the seeded row's generator as it was
    narrow, wide = _sample(logits, rows), _sample(logits.float(), twins)
    assert narrow.token_ids.tolist() == wide.token_ids.tolist()
    assert narrow.token_ids[0] == 10
    assert (narrow.logprobs is None) == (wide.logprobs is None)
    if wide.logprobs is not None:
        assert torch.equal(narrow.logprobs.logprobs, wide.logprobs.logprobs)
        assert narrow.logprobs.logprobs.dtype == torch.float32


def test_does_not_modify_callers_logits() -> None:
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    params = SamplingParams(temperature=0.8, repetition_penalty=1.5, logit_bias={1: 5.0}, min_tokens=2, top_p=0.5)
    _sample(logits, [_row(params, seed=3, prompt=[1, 2]), _row(SamplingParams(temperature=0))])
    assert torch.equal(logits, before)


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(6, VOCAB) * 2
    greedy = _sample(logits, [_row(SamplingParams(temperature=0)) for _ in range(6)]).token_ids
    for top_p in (1.0, 0.7):
        rows = [_row(SamplingParams(temperature=1.5, top_k=1, top_p=top_p), seed=i) for i in range(3)]
        rows += [_row(SamplingParams(temperature=1.5, top_k=1, top_p=top_p)) for _ in range(3)]
        assert _sample(logits, rows).token_ids.tolist() == greedy.tolist()


def test_seeded_rows_independent_of_batch_and_position() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95)
    target = torch.randn(VOCAB)

    def run(batch: int, position: int, steps: int = 8) -> list[int]:
        generator = make_generator(1234)
        tokens = []
        for step in range(steps):
            logits = torch.randn(batch, VOCAB)
            logits[position] = target + step
            rows = [_row(SamplingParams(temperature=1.0), seed=None if j % 2 else 99 + j) for j in range(batch)]
            rows[position] = SamplingRow(params, [], tokens[:], generator, EOS)
            tokens.append(int(_sample(logits, rows).token_ids[position]))
        return tokens

    alone = run(1, 0)
    assert run(4, 2) == alone
    assert run(7, 6) == alone
    assert len(set(alone)) > 1  # really random, not stuck on one token


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (VOCAB - 3))
    logits = torch.log(probs).expand(4000, VOCAB).contiguous()
    torch.manual_seed(0)
    out = _sample(logits, [_row(SamplingParams(temperature=1.0)) for _ in range(4000)])
    freq = torch.bincount(out.token_ids, minlength=VOCAB).float() / 4000
    torch.testing.assert_close(freq[:3], probs[:3], atol=0.03, rtol=0)
    assert freq[3:].sum() == 0


def test_top_p_and_min_p_restrict_support() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * (VOCAB - 4))
    logits = torch.log(probs + 1e-12).expand(500, VOCAB).contiguous()
    top_p = _sample(logits, [_row(SamplingParams(top_p=0.65), seed=i) for i in range(500)]).token_ids
    assert set(top_p.tolist()) == {0, 1}
    min_p = _sample(logits, [_row(SamplingParams(min_p=0.45), seed=i) for i in range(500)]).token_ids
    assert set(min_p.tolist()) == {0, 1, 2}


def test_logit_bias_forces_a_token() -> None:
    logits = torch.randn(3, VOCAB)
    rows = [_row(SamplingParams(temperature=0, logit_bias={42: 100.0})),
            _row(SamplingParams(temperature=1.0, logit_bias={42: 100.0}), seed=1),
            _row(SamplingParams(temperature=0, logit_bias={int(logits[2].argmax()): -100.0}))]
    tokens = _sample(logits, rows).token_ids.tolist()
    assert tokens[:2] == [42, 42]
    assert tokens[2] == int(logits[2].topk(2).indices[1])


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS] = 50.0
    logits[:, 11] = 40.0
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[11])
    rows = [_row(params, output=[]), _row(params, output=[5, 6]), _row(params, output=[5, 6, 7]),
            _row(SamplingParams(temperature=0, min_tokens=3, ignore_eos=True), output=[])]
    tokens = _sample(logits, rows).token_ids.tolist()
    assert tokens[0] not in (EOS, 11) and tokens[1] not in (EOS, 11)
    assert tokens[2] == EOS          # min_tokens reached
    assert tokens[3] == EOS          # ignore_eos: EOS does not stop, so it is not suppressed


def test_penalties() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, :4] = torch.tensor([2.0, -2.0, 2.0, 1.0])
    meta = SamplingMetadata.build(
        [_row(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
              prompt=[0, 1], output=[2, 2, 1])], VOCAB, "cpu")
    processed = Sampler.process_logits(logits, meta)[0, :4]
    # token 0: prompt only -> 2 / 2; token 1: prompt + once -> -2 * 2 - 0.5 - 0.25;
    # token 2: twice -> 2 / 2 - 1.0 - 0.25; token 3: unseen.
    torch.testing.assert_close(processed, torch.tensor([1.0, -4.75, -0.25, 1.0]))


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8] = 3.0, 2.0
    rows = [_row(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[7])]
    assert _sample(logits, rows).token_ids.tolist() == [8]


def test_out_of_vocab_ids_are_ignored() -> None:
    params = SamplingParams(temperature=0, logit_bias={VOCAB + 1: 5.0}, min_tokens=2, stop_token_ids=[VOCAB + 3],
                            repetition_penalty=1.2)
    logits = torch.randn(1, VOCAB)
    row = SamplingRow(params, prompt_token_ids=[VOCAB + 7], output_token_ids=[VOCAB + 9], eos_token_id=VOCAB + 2)
    out = _sample(logits, [row])
    assert out.token_ids.tolist() == [int(logits[0].argmax())]


def test_logprobs_to_lists_respects_each_rows_count() -> None:
    logits = torch.randn(3, VOCAB)
    rows = [_row(SamplingParams(temperature=0, logprobs=3)), _row(SamplingParams(temperature=0)),
            _row(SamplingParams(temperature=0, logprobs=0))]
    lists = _sample(logits, rows).logprobs.to_lists(["a", "b", "c"])
    assert set(lists) == {"a", "c"}
    raw = torch.log_softmax(logits, dim=-1)
    (entries,) = lists["a"]
    top = raw[0].topk(3)
    assert [(t, r) for t, _, r in entries] == [(int(raw[0].argmax()), 1)] + [(int(t), j + 1)
                                                                             for j, t in enumerate(top.indices)]
    assert entries[1][1] == pytest.approx(float(top.values[0]))
    assert lists["c"] == [[(int(raw[2].argmax()), pytest.approx(float(raw[2].max())), 1)]]


def test_engine_generator_makes_unseeded_rows_reproducible() -> None:
    logits = torch.randn(4, VOCAB)
    rows = [_row(SamplingParams(temperature=1.0)) for _ in range(4)]

    def run() -> list[int]:
        meta = SamplingMetadata.build(rows, VOCAB, "cpu", generator=make_generator(7))
        return Sampler()(logits, meta).token_ids.tolist()

    assert run() == run()


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 97, 1000])
def test_unpack_bitmask_matches_shift_and_mask(vocab_size: int) -> None:
    bitmask = torch.randint(-2**31, 2**31, (3, (vocab_size + 31) // 32), dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    expected = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size].bool()
    assert torch.equal(unpack_bitmask(bitmask, vocab_size), expected)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_masked_token_is_never_sampled_whatever_its_bias(temperature: float) -> None:
    """The mask comes first: a +100 logit_bias, top-k 1 or a huge logit cannot bring a masked token back."""
    logits = torch.randn(64, VOCAB)
    logits[:, 5] = 50.0
    bitmask = _random_bitmask(make_generator(0))
    bitmask[0] &= ~(1 << 5)                                 # token 5 is masked
    allowed = unpack_bitmask(bitmask.unsqueeze(0), VOCAB)[0]
    params = SamplingParams(temperature=temperature, top_k=1 if temperature else 0, logit_bias={5: 100.0})
    rows = [SamplingRow(params, [], [], make_generator(i), EOS, bitmask) for i in range(64)]
    token_ids = _sample(logits, rows).token_ids
    assert allowed[token_ids].all() and not allowed[5]
