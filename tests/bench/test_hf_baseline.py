"""The transformers peer: its model from a GGUF file (the same weights as the checkpoint the file was written from,
a mixture of experts' per-expert blocks stacked as transformers keeps them, and its logits within float32's noise:
the file keeps its config's numbers, such as the norms' epsilon, in float32), and its generation options for the
bench's sampling flags."""

from __future__ import annotations

import pytest
import torch

from pagedllm.bench.hf_baseline import hf_sampling, load_hf_model
from pagedllm.loader.resolve import resolve_model
from tests.loader.test_gguf import write_model_gguf
from tests.models.tiny import build_tiny_hf_model


@pytest.mark.parametrize(("kind", "arch"), [("qwen2-moe", "qwen2moe"), ("mixtral", "llama"), ("llama-gqa", "llama")])
def test_a_gguf_file_gives_the_checkpoints_transformers_model(tmp_path, kind, arch) -> None:
    original = build_tiny_hf_model(kind, seed=5)
    path = tmp_path / "m.gguf"
    write_model_gguf(original, path, arch)
    loaded = load_hf_model(resolve_model(str(path)), "float32")
    expected, got = original.state_dict(), loaded.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    with torch.inference_mode():
        torch.testing.assert_close(loaded(ids).logits, original(ids).logits, rtol=0, atol=1e-5)


def test_the_sampling_flags_in_transformers_names():
    """Greedy keeps only the repetition penalty (vLLM applies it to greedy requests too); a sampled request names
    top-k off, as transformers' own default is 50; vLLM's -1 is off too."""
    assert hf_sampling({"temperature": 0.0}) == {"do_sample": False}
    assert hf_sampling({"temperature": 0.0, "top_p": 0.5, "repetition_penalty": 1.2}) == {
        "do_sample": False, "repetition_penalty": 1.2}
    assert hf_sampling({"temperature": 0.7}) == {"do_sample": True, "temperature": 0.7, "top_p": 1.0, "top_k": 0,
                                                 "min_p": None}
    assert hf_sampling({"temperature": 1.0, "top_k": -1, "top_p": 0.9, "min_p": 0.05}) == {
        "do_sample": True, "temperature": 1.0, "top_p": 0.9, "top_k": 0, "min_p": 0.05}
    with pytest.raises(ValueError, match="no frequency_penalty or presence_penalty"):
        hf_sampling({"temperature": 0.7, "presence_penalty": 0.5, "frequency_penalty": 0.1})
