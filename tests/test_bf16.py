"""bfloat16 end to end on SmolLM2: greedy tokens are the same served alone, batched, from the prefix cache, and
after preemption, as in float32: the kernels compute each row the same way whatever the batch. Kept small (4
prompts, 6 tokens each): the suite's other "same tokens" tests run in float32."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

SYSTEM = "You are a terse assistant. Answer in one short sentence, without any preamble or apology."
PROMPTS = [f"{SYSTEM} {q}" for q in ("What is a block?", "Name a prime.", "Why is the sky blue?", "Say hi.")]
pytestmark = pytest.mark.slow
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _tokens(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def roomy():
    return LLM(dtype="bfloat16", num_kv_blocks=64, block_size=16, max_model_len=256)


@pytest.fixture(scope="module")
def alone(roomy) -> list[list[int]]:
    return [_tokens(roomy, [p])[0] for p in PROMPTS]


def test_bf16_batched_and_cached_match_alone(roomy, alone):
    assert roomy.engine.runner.layout.dtype == torch.bfloat16
    hits = roomy.engine.kv_cache_manager.prefix_cache_stats.num_hit_tokens
    assert _tokens(roomy, PROMPTS) == alone                                   # batched (and partly cached)
    assert roomy.engine.kv_cache_manager.prefix_cache_stats.num_hit_tokens > hits
    assert _tokens(roomy, PROMPTS[::-1]) == alone[::-1]                       # every prompt block from the cache


def test_bf16_preempted_matches_alone(alone):
    # No prefix cache, 15 usable blocks of 4 tokens against 4 requests of 23-26 prompt tokens (6 or 7 blocks
    # each): the pool admits two, and their growth past a block boundary preempts one (recompute).
    squeezed = LLM(dtype="bfloat16", num_kv_blocks=16, block_size=4, max_model_len=256, enable_prefix_caching=False)
    assert _tokens(squeezed, PROMPTS) == alone
    assert squeezed.engine.scheduler.num_preemptions > 0
    squeezed.engine.kv_cache_manager.check_integrity()
