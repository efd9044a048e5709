"""Custom logits processors with vLLM's interface: the batch updates keep each request at its index (a processor that
mirrors them sees the rows the engine gives it), a per-request processor forces the tokens a request's extra_args
name, offline and served, one that leaves the argmax alone runs on random rows only, and bad ones are refused."""

from __future__ import annotations

import random

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm import LLM, SamplingParams
from pagedllm.sample.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    CustomLogits,
    LogitsProcessor,
    MoveDirectionality,
)
from tests.entrypoints.server_utils import start_server
from tests.models.tiny import save_tiny_model

GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)


class Mirror(LogitsProcessor):
    """Keeps index -> request name from the batch updates alone, and checks each row against it in `apply`."""

    def __init__(self, config, device, is_pin_memory) -> None:
        self.names: dict[int, str] = {}
        self.batch_size = 0

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.names.pop(index, None)
        for index, params, _, _ in batch_update.added:
            self.names[index] = params.extra_args["name"]
        for first, second, direction in batch_update.moved:
            assert direction == MoveDirectionality.UNIDIRECTIONAL
            self.names[second] = self.names.pop(first)
        self.batch_size = batch_update.batch_size

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape[0] == self.batch_size == len(self.names)
        return logits


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sets(st.integers(0, 9), max_size=8), min_size=1, max_size=12))
def test_the_updates_keep_each_request_at_its_index_and_the_indices_dense(batches: list[set[int]]) -> None:
    mirror = Mirror(None, None, False)
    custom = CustomLogits([mirror])
    for batch in batches:
        names = [f"r{i}" for i in random.Random(len(batch)).sample(sorted(batch), len(batch))]
        requests = [(SamplingParams(extra_args={"name": name}), [], []) for name in names]
        before = dict(custom._index)
        order = custom.arrange(names, requests)
        assert sorted(order) == list(range(len(names)))
        assert {index: names[row] for index, row in enumerate(order)} == mirror.names    # what the processor sees
        assert mirror.batch_size == len(names) or not names or before == custom._index
        # a request that samples on keeps its index unless it fills a gap
        kept = [r for r in names if r in before and before[r] < len(names)]
        assert all(custom._index[r] == before[r] for r in kept)


class ForceToken(AdapterLogitsProcessor):
    """vLLM's example: a request whose extra_args name a `target_token` gets only that token."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        target = (sampling_params.extra_args or {}).get("target_token")
        if target is not None and not isinstance(target, int):
            raise ValueError(f"target_token must be an integer, got {target!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        target = (params.extra_args or {}).get("target_token")
        if target is None:
            return None

        def force(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
            forced = torch.full_like(row, float("-inf"))
            forced[target + len(output_ids) % 2] = 0.0      # target, target + 1, target, ...: reads the live ids
            return forced

        return force


class TopOnly(LogitsProcessor):
    """Leaves only each row's largest logit: it never changes the argmax, so it runs on random rows only, after their
    temperature, where it makes sampling greedy."""

    def __init__(self, config, device, is_pin_memory) -> None:
        self.calls = 0

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.where(logits == logits.amax(dim=-1, keepdim=True), logits, float("-inf"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa", initializer_range=0.5)[0])


@pytest.fixture(scope="module")
def forced(folder: str) -> LLM:
    # by import path, as --logits-processors names them; a small pool, so that requests are preempted
    return LLM(folder, dtype="float32", block_size=4, num_kv_blocks=10, max_num_seqs=4,
               logits_processors=[f"{__name__}.ForceToken", Mirror])


def test_a_request_gets_the_tokens_its_extra_args_force_the_others_their_own(folder: str, forced: LLM) -> None:
    plain = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=64)
    prompts = [[5 + i, 6, 7, 8, 9, 10 + i] for i in range(7)]
    params = [SamplingParams(**GREEDY, extra_args={"target_token": 40 + i, "name": f"p{i}"}) if i % 2 else
              SamplingParams(**GREEDY, extra_args={"name": f"p{i}"}) for i in range(7)]
    outputs = forced.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = plain.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**GREEDY), use_tqdm=False)
    for i, (output, reference) in enumerate(zip(outputs, expected)):
        tokens = output.outputs[0].token_ids
        assert tokens == ([40 + i, 41 + i] * 3 if i % 2 else reference.outputs[0].token_ids), i
    assert sum(forced.engine.make_stats().num_preemptions_total.values()) > 0     # some ran twice, forced alike
    # n = 2: each child is a request of its own, forced from its own output ids
    (two,) = forced.generate({"prompt_token_ids": prompts[0]}, SamplingParams(n=2, temperature=1.0, seed=3, **{
        "max_tokens": 4, "ignore_eos": True}, extra_args={"target_token": 60, "name": "n"}), use_tqdm=False)
    assert [c.token_ids for c in two.outputs] == [[60, 61, 60, 61]] * 2


def test_an_argmax_invariant_processor_runs_on_random_rows_after_temperature(folder: str) -> None:
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=64, logits_processors=[TopOnly])
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    greedy = llm.generate(prompt, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    (top_only,) = llm.engine.runner.sampler.custom.invariant
    assert top_only.calls == 0          # greedy rows: not run
    sampled = llm.generate(prompt, SamplingParams(temperature=1.5, seed=9, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
    assert sampled == greedy and top_only.calls == 6


def test_a_bad_request_or_processor_is_a_clear_error(folder: str, forced: LLM) -> None:
    with pytest.raises(ValueError, match="target_token must be an integer"):
        forced.generate("hi", SamplingParams(extra_args={"target_token": "x"}), use_tqdm=False)
    assert not forced.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="'no.such.Processor' is not found"):
        LLM(folder, dtype="float32", num_kv_blocks=16, logits_processors=["no.such.Processor"])
    with pytest.raises(ValueError, match="not a subclass of pagedllm.sample.logits_processor.LogitsProcessor"):
        LLM(folder, dtype="float32", num_kv_blocks=16, logits_processors=[dict])
    with pytest.raises(ValueError, match="not with speculative decoding"):
        LLM(folder, dtype="float32", num_kv_blocks=16, logits_processors=[TopOnly],
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_the_server_passes_vllm_xargs_to_the_processors(forced: LLM) -> None:
    running = start_server(forced.engine, api_key=None)
    try:
        body = {"model": running.model_name, "prompt": "Once", "max_tokens": 4, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "vllm_xargs": {"target_token": 70, "name": "s"}}
        reply = httpx.post(f"{running.base_url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["token_ids"] == [70, 71, 70, 71]
        bad = httpx.post(f"{running.base_url}/v1/completions", timeout=60,
                         json={**body, "vllm_xargs": {"target_token": "x", "name": "s"}})
        assert bad.status_code == 400 and "target_token must be an integer" in bad.text
    finally:
        running.stop()
