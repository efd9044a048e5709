"""SamplingMetadata.build: the rows' parameters as tensors, and the flags that let the sampler skip work."""

from __future__ import annotations

from pagedllm.sample.metadata import SamplingMetadata, SamplingRow
from pagedllm.sampling_params import SamplingParams

VOCAB = 97


def _row(params: SamplingParams) -> SamplingRow:
    return SamplingRow(params=params, prompt_token_ids=[], output_token_ids=[])


def test_metadata_flags_skip_work() -> None:
    meta = SamplingMetadata.build([_row(SamplingParams(temperature=0, top_k=5))], VOCAB, "cpu")
    assert meta.all_greedy and meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.penalties is None
    assert meta.logit_bias is None and meta.banned is None and meta.allowed is None and meta.max_num_logprobs is None
    meta = SamplingMetadata.build([_row(SamplingParams(top_k=VOCAB + 5)), _row(SamplingParams(top_k=-1))],
                                  VOCAB, "cpu")
    assert meta.all_random and meta.top_k is None
    meta = SamplingMetadata.build([_row(SamplingParams(top_k=2, logprobs=3)), _row(SamplingParams(logprobs=1))],
                                  VOCAB, "cpu")
    assert meta.top_k.tolist() == [2, VOCAB] and meta.max_num_logprobs == 3
