"""Decode steps replayed from captured graphs (pagedllm.runner.cuda_graphs), on every machine.

A CUDA graph needs a GPU (tests/test_gpu.py captures real ones there). Here the capture is `ReplayingCapture`:
replaying runs the captured forward pass again over the same static buffers with the capture's own metadata, which
is what a graph replays, short of fixing the kernels' launches. The model attends through the Triton kernel (the
CUDA device's backend: compiled where there is a CUDA device, else run by Triton's interpreter on CPU tensors), so
a host value read at capture instead of on the device, a padding row written into a real block or a stale buffer
row would change the greedy tokens or their logprobs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.runner.cuda_graphs import capture_sizes

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_NUM_SEQS = 8
# Lengths that let the batch shrink step by step: 5 decodes (padded to 8), then 4, 3 (padded to 4), 2, 1.
PROMPTS = [[3 + i, 40 + 3 * i, 7, 90 + i, 11][: 2 + i % 4] for i in range(5)]
MAX_TOKENS = [4, 6, 7, 9, 10]


class ReplayingCapture:
    """A Capture over CPU tensors: replay() runs the captured pass again and writes its result into the tensor the
    capture returned. It counts the replays of each size."""

    def __init__(self) -> None:
        self.replays: Counter[int] = Counter()

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        out = run()

        def replay() -> None:
            self.replays[out.shape[0]] += 1
            out.copy_(run())

        return replay, out


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    from tests.models.tiny import save_tiny_model

    folder, _ = save_tiny_model(tmp_path_factory.mktemp("graphs") / "m", "llama-mqa", seed=5)
    return str(folder)


def _triton_llm(folder: str) -> LLM:
    """The tiny model attending through the Triton kernel: on a CUDA device with its own graphs off (each test
    captures its own), else on the CPU with the kernel in Triton's interpreter."""
    from pagedllm.attention.triton_attention import paged_attention

    llm = LLM(model=folder, dtype="float32", block_size=4, num_kv_blocks=64, max_num_seqs=MAX_NUM_SEQS,
              max_model_len=64, device=DEVICE, enforce_eager=DEVICE == "cuda")
    for layer in llm.engine.runner.model.model.layers:
        layer.self_attn.attn_backend = paged_attention
    return llm


def greedy_with_logprobs(llm: LLM) -> tuple[list[list[int]], torch.Tensor]:
    """Each prompt's greedy tokens, and the logprobs of them all (which any stray K/V write would move)."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_TOKENS]
    outputs = [out.outputs[0] for out in
               llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    logprobs = [position[token].logprob for out in outputs for token, position in zip(out.token_ids, out.logprobs)]
    return [out.token_ids for out in outputs], torch.tensor(logprobs)


def test_capture_sizes_cover_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(10) == [1, 2, 4, 8, 16]
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(1000) == capture_sizes(256)    # larger batches run eagerly


def test_replayed_decode_steps_give_the_eager_tokens(tiny_folder) -> None:
    eager_tokens, eager_logprobs = greedy_with_logprobs(_triton_llm(tiny_folder))
    llm = _triton_llm(tiny_folder)
    capture = ReplayingCapture()
    llm.engine.runner.capture_decode_graphs(MAX_NUM_SEQS, llm.engine.max_model_len, capture)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    assert graphs.block_tables.shape == (8, 16)    # 64 tokens in blocks of 4
    tokens, logprobs = greedy_with_logprobs(llm)
    assert tokens == eager_tokens
    torch.testing.assert_close(logprobs, eager_logprobs, rtol=0, atol=1e-5)
    # Every size replayed, the padded ones (5 -> 8, 3 -> 4) included; prefill steps ran eagerly.
    assert set(capture.replays) == {1, 2, 4, 8}
    assert sum(capture.replays.values()) == max(MAX_TOKENS) - 1


def test_only_decode_steps_that_fit_replay(tiny_folder) -> None:
    llm = _triton_llm(tiny_folder)
    runner = llm.engine.runner
    runner.capture_decode_graphs(2, llm.engine.max_model_len, ReplayingCapture())
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2]
    decodes = AttentionMetadata.build([[1, 2], [3]], [5, 2], [1, 1], block_size=4)
    assert graphs.covers(decodes)
    assert not graphs.covers(AttentionMetadata.build([[1, 2], [3]], [5, 0], [1, 3], block_size=4))   # a prefill
    assert not graphs.covers(AttentionMetadata.build([[1], [2], [3]], [1, 1, 1], [1, 1, 1], block_size=4))
    assert not graphs.covers(AttentionMetadata.build([list(range(1, 18))], [64], [1], block_size=4))  # too wide
    runner.allocate_kv_cache(32)
    assert runner.decode_graphs is None      # they read the old pool
