"""The weights moved into one huge-page buffer after loading: the same values and attributes, the kernels' alignment,
embedding tables left where they are, nothing moved where the advice is refused or PAGEDLLM_HUGE_PAGES=0; an
engine's greedy tokens the same either way; and where it happens by default (not on AMD's CPUs)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.cpu import CpuInfo
from pagedllm.layers.embedding import VocabEmbedding
from pagedllm.loader import huge_pages


@pytest.fixture(autouse=True)
def placement_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite turns the placement off (tests/conftest.py); these tests turn it on."""
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "1")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = VocabEmbedding(512, 256)
        self.big = nn.Linear(256, 300, bias=True)
        self.other = nn.Linear(300, 256, bias=False)
        for p in self.parameters():
            nn.init.normal_(p)
        self.big.weight.brgemm = True         # an attribute a kernel reads on the packed weight


def test_weights_move_with_their_values_and_attributes() -> None:
    model = _Model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    embed_ptr, weight = model.embed.weight.data_ptr(), model.big.weight
    moved = huge_pages.place_in_huge_pages(model)
    assert moved >= (256 * 300 + 300 * 256) * 4
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)
    assert model.big.weight is weight and model.big.weight.brgemm          # the same Parameter object
    assert model.embed.weight.data_ptr() == embed_ptr                       # a lookup table stays
    assert model.big.bias.numel() * 4 < huge_pages.MIN_BYTES                # too small: stays
    ptrs = sorted(p.data_ptr() for p in (model.big.weight, model.other.weight))
    assert all(ptr % 64 == 0 for ptr in ptrs) and ptrs[1] - ptrs[0] < moved   # one buffer, aligned slots


@pytest.mark.parametrize("how", ["refused", "turned off"])
def test_nothing_moves_when_refused_or_turned_off(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    model = _Model()
    ptr = model.big.weight.data_ptr()
    if how == "refused":
        monkeypatch.setattr(huge_pages, "_advise_huge_pages", lambda address, length: False)
    else:
        monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "0")
    assert huge_pages.place_in_huge_pages(model) == 0 and model.big.weight.data_ptr() == ptr


def test_the_default_model_gives_the_same_tokens_either_way(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["The capital of France is", "Write a haiku about the sea."]
    with caplog.at_level(logging.INFO, logger="pagedllm.loader"):
        placed = LLM(max_model_len=256, kv_cache_memory=32 << 20)
    assert any("in 2 MiB pages" in r.getMessage() for r in caplog.records)
    got = [o.outputs[0].token_ids for o in placed.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "0")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedllm.loader"):
        plain = LLM(max_model_len=256, kv_cache_memory=32 << 20)
    assert not any("in 2 MiB pages" in r.getMessage() for r in caplog.records)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)] == got


@pytest.mark.parametrize("model_name,env,expected", [
    ("Intel(R) Xeon(R) Processor", None, True), ("AMD EPYC 9B45", None, False),     # session 32's Zen 5 ran slower
    ("AMD EPYC 9B45", "1", True), ("Intel(R) Xeon(R) Processor", "0", False)])
def test_where_the_weights_go_by_default(monkeypatch: pytest.MonkeyPatch, model_name: str, env: str | None,
                                         expected: bool) -> None:
    monkeypatch.setattr(huge_pages, "cpu_info", lambda: CpuInfo("x86_64", model_name, frozenset({"avx2"})))
    if env is None:
        monkeypatch.delenv(huge_pages.HUGE_PAGES_ENV)
    else:
        monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, env)
    assert huge_pages.wanted() is expected
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "yes")
    with pytest.raises(ValueError, match="PAGEDLLM_HUGE_PAGES must be 0 or 1"):
        huge_pages.wanted()
