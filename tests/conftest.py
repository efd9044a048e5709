"""Shared fixtures. The embedded model is loaded once per session, in float32 so that batching changes no bits
that matter and greedy tokens can be compared exactly with Hugging Face transformers."""

from __future__ import annotations

import pytest

MiB = 1 << 20


@pytest.fixture(scope="session")
def smol_llm():
    from pagedllm import LLM

    return LLM(dtype="float32", kv_cache_memory=256 * MiB, max_model_len=2048)


@pytest.fixture(scope="session")
def smol_hf():
    """transformers' own model and tokenizer, loaded from the same GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.loader.resolve import resolve_model

    resolved = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(resolved.path, gguf_file=resolved.gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(resolved.path, gguf_file=resolved.gguf_file)
    return model.eval(), tokenizer
