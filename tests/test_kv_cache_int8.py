"""kv_cache_dtype="int8": K/V stored as int8 rows with a float32 scale each, end to end on a tiny random Llama.

Every path reads the same quantized values (a token's row depends on its own K/V only), so batching, preemption
by swap or recompute, and prefix caching must leave the greedy tokens exactly as they are."""

from __future__ import annotations

import argparse

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import CacheConfig
from pagedllm.entrypoints.openai.cli_args import add_server_args, engine_config_from_args
from tests.models.tiny import save_tiny_model

BLOCK_SIZE = 4
SHARED = torch.randint(3, 259, (13,), generator=torch.Generator().manual_seed(1)).tolist()  # 3 full blocks + 1
PROMPTS = [SHARED + torch.randint(3, 259, (4 + 9 * i,), generator=torch.Generator().manual_seed(i)).tolist()
           for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa", seed=3)[0])


def _llm(folder: str, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 256)
    return LLM(folder, dtype="float32", block_size=BLOCK_SIZE, kv_cache_dtype="int8", **kw)


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def batched(folder: str) -> list[list[int]]:
    return _tokens(_llm(folder, enable_prefix_caching=False), PROMPTS)


def test_int8_kv_tokens_are_the_same_alone_and_prefix_cached(folder, batched):
    llm = _llm(folder)
    assert llm.engine.runner.kv.dtype == torch.int8
    assert [_tokens(llm, [p])[0] for p in PROMPTS[:2]] == batched[:2]  # alone
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == batched
    assert all(o.num_cached_tokens >= 12 for o in outputs)  # the shared prefix's 3 blocks came from the cache


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_int8_kv_tokens_survive_preemption(folder, batched, mode):
    # 16 blocks of 4 tokens hold 60 tokens; the 4 requests want 180. A block is 4 x 160 bytes in int8.
    llm = _llm(folder, num_kv_blocks=16, swap_space=40 * BLOCK_SIZE * 160 / 2**30, preemption_mode=mode,
               max_num_batched_tokens=32, enable_prefix_caching=False)
    assert llm.engine.config.cache.num_swap_blocks == 40
    assert _tokens(llm, PROMPTS) == batched
    by_mode = llm.engine.scheduler.num_preemptions_by_mode
    assert by_mode[mode] > 0
    llm.engine.kv_cache_manager.check_integrity()


def test_int8_kv_stays_close_to_the_float_cache(folder, batched):
    """Not bit-equal to the float32 cache (the values differ by up to 1/254 of a row's absmax), but the tiny
    model's greedy tokens start the same."""
    plain = LLM(folder, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=256, enable_prefix_caching=False)
    assert [t[:4] for t in _tokens(plain, PROMPTS)] == [t[:4] for t in batched]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_pool_holds_the_blocks_the_int8_row_size_gives(folder, dtype):
    """The tiny model: 2 layers, 2 KV heads, head_dim 16: a token is 2 x 2 x 2 x (16 + 4) = 160 bytes in int8,
    against 2 x 2 x 2 x 16 x 4 = 512 in float32 (3.2x the blocks) and 256 in bfloat16 (1.6x)."""
    budget = 1 << 20
    plain = LLM(folder, dtype=dtype, block_size=BLOCK_SIZE, kv_cache_memory=budget)
    # (vLLM's name for the budget, kv_cache_memory_bytes)
    int8 = LLM(folder, dtype=dtype, block_size=BLOCK_SIZE, kv_cache_memory_bytes=budget, kv_cache_dtype="int8")
    element_size = 4 if dtype == "float32" else 2
    assert plain.engine.config.cache.num_blocks == budget // (BLOCK_SIZE * 2 * 2 * 2 * 16 * element_size)
    assert int8.engine.config.cache.num_blocks == budget // (BLOCK_SIZE * 2 * 2 * 2 * (16 + 4))


def test_a_bad_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'int8', got 'int4'"):
        CacheConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype .*'fp8' is not supported.*use 'int8'"):
        CacheConfig(kv_cache_dtype="fp8")


def test_serve_takes_kv_cache_dtype():
    parser = add_server_args(argparse.ArgumentParser(), positional_model=False)
    assert engine_config_from_args(parser.parse_args([])).cache.kv_cache_dtype == "auto"
    assert engine_config_from_args(parser.parse_args(["--kv-cache-dtype", "int8"])).cache.kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8"])


def test_the_budget_given_under_both_names_must_agree(folder):
    with pytest.raises(ValueError, match="one setting"):
        LLM(folder, kv_cache_memory=1 << 20, kv_cache_memory_bytes=2 << 20)
