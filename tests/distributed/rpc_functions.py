"""What the tests send to tensor-parallel workers through vLLM's collective_rpc and apply_model: module-level
functions, which pickle by name; this module imports nothing a worker has not, so that it loads at once there."""

from __future__ import annotations

import time


def attention_heads(model):
    """The attention heads a rank's first layer computes (its HeadShard)."""
    return model.model.layers[0].self_attn.qkv_proj.heads


def rank_and_sum(runner, a: int, b: int = 0) -> tuple[int, int]:
    return runner.tp_rank, a + b


def fail_on_workers(runner) -> int:
    if runner.tp_rank:
        raise KeyError("only on workers")
    return 0


def sleep_on_workers(runner, seconds: float) -> int:
    if runner.tp_rank:
        time.sleep(seconds)
    return runner.tp_rank


def kv_pool_released(runner) -> bool:
    return runner.kv is None
