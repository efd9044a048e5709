"""A tiny random Llama (tests/models/tiny.py: vocab 384, 2 layers, context 256) behind the real engine and server.

Steps take milliseconds, so the reliability tests can afford thousands of requests. Greedy outputs are
float32 and do not depend on the batch, so "served under load" can be compared with "served alone".
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

STRESS = bool(os.environ.get("PAGEDLLM_STRESS"))
stress = pytest.mark.skipif(not STRESS, reason="a long run: `make stress` (PAGEDLLM_STRESS=1) runs it")
TINY_CONTEXT = 256


def build_tiny_engine(folder: Path, *, num_blocks: int = 512, block_size: int = 16, max_num_seqs: int = 256,
                      preemption_mode: str = "recompute", swap_space: float = 0.0,
                      enable_prefix_caching: bool = True, max_num_batched_tokens: int = 2048,
                      scheduling_policy: str = "fcfs", swap_path: str | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(folder), dtype="float32", max_model_len=TINY_CONTEXT),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, swap_space=swap_space, swap_path=swap_path,
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  preemption_mode=preemption_mode, scheduling_policy=scheduling_policy)))


def offline(engine: LLMEngine) -> LLM:
    """The offline LLM API around an already built engine."""
    return LLM.from_engine(engine)


def served_alone(engine: LLMEngine, prompts: list[str], max_tokens: int) -> dict[str, list[int]]:
    """Greedy token ids of each prompt, run one at a time (a batch of one, nothing else in the pool)."""
    llm = offline(engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return {p: llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in dict.fromkeys(prompts)}


def random_prompts(num: int, seed: int, min_len: int = 8, max_len: int = 64) -> list[str]:
    """`num` distinct ASCII prompts (the byte tokenizer makes one token per character)."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "paged", "block", "cache", "token", "queue", "swap", "fork", "tail"]
    prompts: list[str] = []
    while len(prompts) < num:
        text = f"{len(prompts)}:"
        target = rng.randint(min_len, max_len)
        while len(text) < target:
            text += " " + rng.choice(words)
        prompts.append(text[:target])
    return prompts


def error_shape(response) -> dict:
    """The `error` object of an OpenAI-shaped error response; fails the test if the shape is wrong."""
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == ("server_error" if response.status_code >= 500 else "invalid_request_error"), error
    return error


def pool_is_whole(engine) -> bool:
    """Nothing running or waiting, and every usable block free (cached-but-unused counts as free)."""
    manager = engine.kv_cache_manager
    return (not engine.scheduler.requests and manager.num_free_blocks == manager.num_usable_blocks)


def audit_block_tables(engine, scheduler_output) -> int:
    """Assert that no scheduled request can read a block it does not hold; returns how many blocks are shared.

    Each request's block table in the step's plan is exactly its table in the KV cache manager; every block in
    it is in use (never a free block); a block in several tables has a ref count of at least its number of
    holders, and is a full, cached block whose hash is each holder's own hash at that position (the same
    tokens and the same cache salt). Then the manager's `check_integrity()` (ref count == holders, pools whole).
    """
    manager = engine.kv_cache_manager
    holders: dict[int, list[tuple[str, int]]] = {}
    for scheduled in scheduler_output.scheduled:
        assert scheduled.block_ids == manager.get_block_ids(scheduled.request_id), scheduled.request_id
        for position, block_id in enumerate(scheduled.block_ids):
            assert manager.pool.blocks[block_id].ref_cnt > 0, f"{scheduled.request_id} reads free block {block_id}"
            holders.setdefault(block_id, []).append((scheduled.request_id, position))
    shared = {block_id: held for block_id, held in holders.items() if len(held) > 1}
    for block_id, held in shared.items():
        block = manager.pool.blocks[block_id]
        assert block.ref_cnt >= len(held) and block.block_hash is not None, f"block {block_id} shared, not cached"
        for request_id, position in held:
            request_hashes = engine.scheduler.requests[request_id].block_hashes
            assert position < len(request_hashes) and request_hashes[position] == block.block_hash, (
                f"{request_id} shares block {block_id} with different content")
    manager.check_integrity()
    return len(shared)


def install_block_audit(engine) -> list[int]:
    """Run `audit_block_tables` before the runner prepares each step; returns the per-step shared-block counts
    (one entry per audited step)."""
    audited: list[int] = []
    prepare = engine.runner.prepare

    def audited_prepare(scheduler_output):
        audited.append(audit_block_tables(engine, scheduler_output))
        return prepare(scheduler_output)
    engine.runner.prepare = audited_prepare
    return audited


def prompt_traces(tokenizer, text: str) -> list[str]:
    """What a prompt looks like in a log: its text, and its token ids as a printed list shows them (the server
    hands the engine token ids, so a logged request shows ids, not text)."""
    return [text, ", ".join(map(str, tokenizer.encode(text, add_special_tokens=False)))]
