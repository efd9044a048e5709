"""Speculative decoding on the embedded SmolLM2 (float32): greedy tokens identical with and without it, on an
input-grounded prompt where n-gram lookup pays, the second time with a prefix-cache hit; and with the model's own
GGUF blocks as its draft model (the quantized copy agrees with the float32 model on most tokens)."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams
from pagedllm.loader.resolve import default_model_gguf

MiB = 1 << 20
TEXT = ("The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox runs into the "
        "forest, where the trees are tall and the river is cold.")


def _prompt(llm: LLM) -> str:
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}], tokenize=False,
        add_generation_prompt=True)


def test_greedy_tokens_identical_on_smollm2(smol_llm: LLM) -> None:
    prompt = _prompt(smol_llm)
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = smol_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    spec = LLM(dtype="float32", kv_cache_memory=64 * MiB, max_model_len=512,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                   "prompt_lookup_min": 2})
    first = spec.generate(prompt, params, use_tqdm=False)[0]
    second = spec.generate(prompt, params, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == expected
    assert second.num_cached_tokens > 0
    stats = spec.engine.make_stats().spec_decoding
    assert stats.acceptance_rate > 0.5, stats


def test_its_gguf_blocks_as_draft_model_give_the_float32_tokens(smol_llm: LLM) -> None:
    prompts = [_prompt(smol_llm), "Write a short poem about the sea."]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params, use_tqdm=False)]
    spec = LLM(dtype="float32", kv_cache_memory=64 * MiB, max_model_len=512,
               speculative_config={"model": str(default_model_gguf()), "quantization": "gguf",
                                   "num_speculative_tokens": 4})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == expected
    stats = spec.engine.make_stats().spec_decoding
    assert stats.acceptance_rate > 0.7, stats
