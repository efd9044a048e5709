"""Tensor parallelism (pagedllm/distributed): two ranks give the tokens one rank gives, on tiny random models whose
heads split unevenly or whose single KV head is replicated, on SmolLM2, under preemption by swap and by recompute,
with prefix caching and n > 1; and a worker that dies fails the engine cleanly."""

from __future__ import annotations

import dataclasses
import multiprocessing.forkserver
import os
import signal
import time

import httpx
import pytest
import torch

from pagedllm import LLM, SamplingParams, distributed
from pagedllm.kernels import cpu_kernels
from pagedllm.layers.linear import HeadShard, head_shard
from tests.distributed import rpc_functions as rpc
from tests.entrypoints.server_utils import start_server, wait_until
from tests.models.tiny import save_tiny_model

MiB = 1 << 20
PROMPTS = ["hello world", "the quick brown fox jumps over", "a", "tensor parallel ranks share each layer"]
# Two shared-prefix prompts, for the prefix cache (block size 4: several whole blocks).
SHARED = "a long shared system prompt that fills whole blocks: "
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_head_shard_splits_whole_gqa_groups() -> None:
    # SmolLM2: 9 query heads, 3 KV heads, at tp 2: rank 0 takes 2 groups, rank 1 the third; no KV head twice.
    assert head_shard(9, 3, 0, 2) == HeadShard(q_start=0, num_heads=6, kv_start=0, num_kv_heads=2)
    assert head_shard(9, 3, 1, 2) == HeadShard(q_start=6, num_heads=3, kv_start=2, num_kv_heads=1)
    assert head_shard(32, 8, 3, 4) == HeadShard(q_start=24, num_heads=8, kv_start=6, num_kv_heads=2)
    # Fewer KV heads than ranks: queries split evenly, each KV head replicated on the ranks that read it.
    assert [head_shard(8, 2, r, 4) for r in range(4)] == [
        HeadShard(0, 2, 0, 1), HeadShard(2, 2, 0, 1), HeadShard(4, 2, 1, 1), HeadShard(6, 2, 1, 1)]
    assert head_shard(4, 1, 1, 2) == HeadShard(2, 2, 0, 1)


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(9, 3, 4), (6, 2, 4), (4, 3, 2)])
def test_head_shard_refuses_what_cannot_split(heads: int, kv_heads: int, tp: int) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size|multiple"):
        head_shard(heads, kv_heads, 0, tp)


def _generate(llm: LLM, prompts: list[str], params: SamplingParams) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def _prefix_hits(llm: LLM) -> list[tuple[int, list[int]]]:
    """(cached prompt tokens, greedy tokens) of two prompts sharing SHARED, run one after the other."""
    outputs = [llm.generate([SHARED + end], GREEDY, use_tqdm=False)[0] for end in ("one", "another")]
    return [(o.num_cached_tokens, o.outputs[0].token_ids) for o in outputs]


# (kind, overrides, preemption mode): uneven GQA groups (6 query heads over 3 KV heads: 2 groups and 1) preempting
# by swap; Qwen2 (q/k/v biases, untied head) with one KV head replicated on both ranks, preempting by recompute;
# Gemma 3 (branch norms, GELU, a local layer over a sliding window and a global one), by recompute; Phi (LayerNorms,
# parallel branches, an ungated MLP split by columns and rows, the LM head's biases split as its rows), by recompute;
# GPT-BigCode (learned position embeddings, split as the vocabulary is; one KV head), by swap; BLOOM (ALiBi: each
# rank its heads' slopes), by recompute.
TINY_CASES = [("llama-gqa", dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96), "swap"),
              ("qwen2", dict(num_key_value_heads=1), "recompute"), ("gemma3", dict(), "recompute"),
              ("phi", dict(vocab_size=383), "recompute"), ("gpt-bigcode", dict(), "swap"),
              ("bloom", dict(), "recompute")]


@pytest.mark.parametrize(("kind", "overrides", "mode"), TINY_CASES,
                         ids=["llama-uneven-gqa", "qwen2-mqa", "gemma3", "phi", "gpt-bigcode", "bloom"])
def test_two_ranks_give_the_tokens_of_one(tmp_path, disk_tmp_path, kind: str, overrides: dict, mode: str) -> None:
    folder, _ = save_tiny_model(tmp_path / kind, kind, **overrides)
    swap_dir = disk_tmp_path / "swap"
    swap_dir.mkdir()
    # 40 blocks of 4 tokens against 8 requests of ~60 tokens: the step must preempt.
    common = dict(dtype="float32", block_size=4, num_kv_blocks=40, max_num_seqs=8, seed=7,
                  preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0.0)
    prompts = PROMPTS + [SHARED + p for p in PROMPTS]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, n=2, seed=3)
    with LLM(str(folder), **common) as one:
        expected_greedy, expected_sampled = _generate(one, prompts, GREEDY), _generate(one, PROMPTS, sampled)
        expected_prefix = _prefix_hits(one)
        expected_embeddings = [o.outputs.embedding for o in one.embed(PROMPTS, use_tqdm=False)]
    assert expected_prefix[1][0] > 0, "the second prompt was meant to hit the first one's blocks"
    with LLM(str(folder), **common, tensor_parallel_size=2,
             swap_path=str(swap_dir / "kv") if mode == "swap" else None) as two:
        workers = two.engine.runner.peers.processes
        assert [p.is_alive() for p in workers] == [True]
        assert sorted(f.name for f in swap_dir.iterdir()) == (["kv", "kv.rank1"] if mode == "swap" else [])
        assert _generate(two, prompts, GREEDY) == expected_greedy
        stats = two.engine.make_stats()
        assert stats.num_preemptions_total.get(mode, 0) > 0, "the pool was meant to force preemption"
        assert _generate(two, PROMPTS, sampled) == expected_sampled
        assert _prefix_hits(two) == expected_prefix
        for output, embedding in zip(two.embed(PROMPTS, use_tqdm=False), expected_embeddings):
            assert output.outputs.embedding == pytest.approx(embedding, abs=1e-5)
        # A worker that dies while the engine idles fails its health at once, and the next request.
        workers[0].kill()
        workers[0].join(10)
        start = time.monotonic()
        assert not two.engine.is_healthy()
        with pytest.raises(Exception, match="tensor-parallel"):
            two.generate(["hello"], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 30
    for process in workers:
        process.join(10)
        assert not process.is_alive()
    assert not list(swap_dir.iterdir()), "each rank's swap file is deleted on close"


def test_smollm2_on_two_ranks_matches_one(smol_llm) -> None:
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    expected = _generate(smol_llm, prompts, GREEDY)
    with LLM(dtype="float32", kv_cache_memory=64 * MiB, max_model_len=2048, tensor_parallel_size=2) as two:
        assert two.get_world_size() == 2
        # rank 0: 6 query heads and 2 of the 3 KV heads; rank 1 the rest
        assert two.apply_model(rpc.attention_heads) == [HeadShard(0, 6, 0, 2), HeadShard(6, 3, 2, 1)]
        assert two.engine.runner.layout.num_kv_heads == 2
        assert _generate(two, prompts, GREEDY) == expected
        # vLLM's collective_rpc: a worker's failure, a timeout and a function that cannot travel leave the group
        # as it was
        assert two.collective_rpc(rpc.rank_and_sum, args=(1,), kwargs={"b": 2}) == [(0, 3), (1, 3)]
        assert two.collective_rpc("weight_bytes")[0] == two.engine.runner.weight_bytes()
        with pytest.raises(RuntimeError, match="rank 1:\n(.|\n)*KeyError: 'only on workers'"):
            two.collective_rpc(rpc.fail_on_workers)
        with pytest.raises(ValueError, match="do not pickle"):
            two.collective_rpc(lambda runner: 0)
        with pytest.raises(TimeoutError, match="rank 1 gave no result within 0.1 s"):
            two.collective_rpc(rpc.sleep_on_workers, timeout=0.1, args=(0.4,))
        assert two.collective_rpc(rpc.rank_and_sum, args=(5,)) == [(0, 5), (1, 5)]     # the late reply dropped
        # vLLM's sleep mode releases every rank's KV pool, and wake_up brings them back
        two.sleep(level=1)
        assert two.collective_rpc(rpc.kv_pool_released) == [True, True]
        assert two.wake_up() and two.collective_rpc(rpc.kv_pool_released) == [False, False]
        assert two.engine.is_healthy()
        assert _generate(two, prompts[:1], dataclasses.replace(GREEDY, max_tokens=4)) == [[expected[0][0][:4]]]


def test_the_server_on_two_ranks_and_a_dead_worker_fails_every_request_with_503(tmp_path, monkeypatch) -> None:
    """Also: a rank forks from a server that began in another directory (`_worker_context`), and works in rank
    0's (here the model's path is relative to it)."""
    folder, _ = save_tiny_model(tmp_path / "m", "llama-gqa")
    with LLM(str(folder), dtype="float32", kv_cache_memory=8 * MiB) as one:
        expected = [o.outputs[0].text for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert distributed._worker_context().get_start_method() == "forkserver"
    multiprocessing.forkserver.ensure_running()
    monkeypatch.chdir(tmp_path)
    llm = LLM("m", dtype="float32", kv_cache_memory=8 * MiB, tensor_parallel_size=2)
    worker = llm.engine.runner.peers.processes[0]
    server = start_server(llm.engine, api_key=None)
    try:
        served = httpx.post(f"{server.base_url}/v1/completions", timeout=30, json={
            "model": server.model_name, "prompt": PROMPTS, "max_tokens": GREEDY.max_tokens, "temperature": 0,
            "ignore_eos": True}).json()
        assert [c["text"] for c in sorted(served["choices"], key=lambda c: c["index"])] == expected
        body = {"model": server.model_name, "prompt": "hello", "max_tokens": 200, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert any(line.startswith("data: {") for line in lines)    # the stream has started
            os.kill(worker.pid, signal.SIGKILL)
            rest = "\n".join(lines)
        assert '"error"' in rest and "tensor-parallel" in rest
        assert wait_until(lambda: httpx.get(f"{server.base_url}/health").status_code == 503)
        again = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stream": False}, timeout=30)
        assert again.status_code == 503
    finally:
        server.stop()
        llm.close()
    worker.join(10)
    assert not worker.is_alive()
    assert not torch.distributed.is_initialized(), "the process group is left on close"


def test_a_worker_rank_takes_rank_0s_environment_first(monkeypatch) -> None:
    """A rank forks from a server whose environment is the one of when it started (`_worker_context`): the rank
    replaces it by rank 0's of now before anything reads it (the kernels' ISA cap, the huge pages, the bf16
    kernel's choice)."""
    seen: dict[str, str] = {}

    def start_rank(*args) -> None:
        seen.update(os.environ)
        raise InterruptedError

    monkeypatch.setattr(distributed, "_start_rank", start_rank)
    ours = dict(os.environ)
    try:
        with pytest.raises(InterruptedError):
            distributed._worker_main(None, 1, "", None, None, {"PAGEDLLM_MAX_CPU_ISA": "baseline"})
    finally:
        os.environ.clear()
        os.environ.update(ours)
    assert seen == {"PAGEDLLM_MAX_CPU_ISA": "baseline"}


def test_bench_comm_times_a_forward_pass_of_collectives(tmp_path) -> None:
    from pagedllm.bench.cli import main

    folder, _ = save_tiny_model(tmp_path / "m", "llama-gqa")          # hidden 64, 2 layers, vocabulary 384
    result = main(["comm", "--model", str(folder), "--dtype", "float32", "--tokens", "1", "3", "--repeats", "2"])
    assert [(p["tokens"], p["all_reduces"], p["all_reduce_bytes"], p["gather_bytes"]) for p in result["passes"]] == [
        (1, 5, 5 * 64 * 4, 192 * 4), (3, 5, 5 * 3 * 64 * 4, 3 * 192 * 4)]
    transports = ["gloo", "shm"] if cpu_kernels() is not None else ["gloo"]   # shm: with the kernels built
    for p in result["passes"]:
        assert all(p[t]["all_reduce_ms"] > 0 and p[t]["gather_ms"] > 0 for t in transports), p
