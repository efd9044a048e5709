"""The embedded SmolLM2 GGUF: pagedllm's loader and model, and the engine's greedy chat tokens, against
transformers' own GGUF loading (one file, so that one pytest worker loads that oracle)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.loader import load_model
from tests.models.tiny import SimplePagedRunner

NUM_STEPS = 16
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Write a haiku about paged attention."}],
]


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smol_hf) -> None:
    """`smol_hf`: transformers' own GGUF reading (dequantisation, renaming, Q/K un-permutation), independent of
    ours, shared with the other tests that need it (it takes ~25 s to load)."""
    hf_model, tokenizer = smol_hf
    loaded = load_model(ModelConfig(model=None, dtype="float32"))
    assert torch.equal(hf_model.lm_head.weight, hf_model.model.embed_tokens.weight)
    seqs = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)
                 ["input_ids"]) for c in CHATS]
    runner = SimplePagedRunner(loaded.model, block_size=16, num_blocks=32)
    logits = runner.step(dict(enumerate(seqs)))
    hf_caches: list = [None] * len(seqs)
    new_inputs = [list(s) for s in seqs]
    max_err = 0.0
    for _ in range(NUM_STEPS):
        for i, seq in enumerate(seqs):
            with torch.inference_mode():  # transformers with its own KV cache, one sequence at a time
                out = hf_model(torch.tensor([new_inputs[i]]), cache=hf_caches[i], use_cache=True)
            hf_caches[i], expected = out.cache, out.logits[0, -1].float()
            max_err = max(max_err, (logits[i] - expected).abs().max().item())
            assert int(logits[i].argmax()) == int(expected.argmax()), tokenizer.decode(seq)
            seq.append(int(expected.argmax()))
            new_inputs[i] = [seq[-1]]
        logits = runner.step({i: [seq[-1]] for i, seq in enumerate(seqs)})
    assert max_err < 1e-3, max_err


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence what a CPU does.",
]


@pytest.mark.slow
def test_greedy_tokens_match_transformers_on_chat_prompts(smol_llm, smol_hf) -> None:
    hf_model, hf_tokenizer = smol_hf
    conversations = [[{"role": "user", "content": c}] for c in QUESTIONS]
    ours = smol_llm.chat(conversations, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    # transformers runs the four as one batch, padded on the left; a row that ends early goes on with padding.
    batch = hf_tokenizer.apply_chat_template(conversations, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True, padding=True, tokenizer_kwargs={"padding_side": "left"})
    with torch.inference_mode():
        hf_out = hf_model.generate(**batch, max_new_tokens=24, do_sample=False)
    for row, (conversation, out) in enumerate(zip(conversations, ours)):
        assert out.prompt_token_ids == batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
        tokens, hf_tokens = out.outputs[0].token_ids, hf_out[row, batch["input_ids"].shape[1]:].tolist()
        assert hf_tokens[:len(tokens)] == tokens, conversation
        assert set(hf_tokens[len(tokens):]) <= {hf_tokenizer.pad_token_id}, conversation
