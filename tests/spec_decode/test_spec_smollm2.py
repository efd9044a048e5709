"""Speculative decoding on the embedded SmolLM2 (float32): greedy tokens identical with and without it, on an
input-grounded prompt where n-gram lookup pays, the second time with a prefix-cache hit."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams

MiB = 1 << 20
TEXT = ("The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox runs into the "
        "forest, where the trees are tall and the river is cold.")


def test_greedy_tokens_identical_on_smollm2(smol_llm: LLM) -> None:
    tokenizer = smol_llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}], tokenize=False,
        add_generation_prompt=True)
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
