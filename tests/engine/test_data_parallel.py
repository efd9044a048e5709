"""Offline data parallelism: `LLM(data_parallel_size=2)` routes the prompts over two replicas, steps them in two
threads (each replica built and stepped on its own), and returns the same greedy tokens (and embeddings) as one
engine, in input order. On a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.data_parallel import DataParallelEngine
from tests.reliability.tiny_server import TINY_CONTEXT, random_prompts

SYSTEM = "You are a terse assistant. Answer in one word. Context: " + "abcdefgh" * 6   # 3+ blocks of 16




@pytest.fixture(autouse=True)
def restore_torch_threads():
    """build_replicas divides the process's intra-op threads among the replicas."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _llm(folder, data_parallel_size: int, **kwargs) -> LLM:
    return LLM(str(folder), dtype="float32", max_model_len=TINY_CONTEXT, block_size=16, num_kv_blocks=128,
               data_parallel_size=data_parallel_size, **kwargs)


def test_two_replicas_give_one_engines_greedy_tokens_in_input_order(tiny_llama_dir):
    prompts = random_prompts(10, seed=3) + [SYSTEM + f" Question {i}?" for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with _llm(tiny_llama_dir, 1) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
        embeddings = [o.outputs.embedding for o in one.embed(prompts, use_tqdm=False)]
    with _llm(tiny_llama_dir, 2) as two:
        assert isinstance(two.engine, DataParallelEngine) and len(two.engine.replicas) == 2
        outputs = two.generate(prompts, params, use_tqdm=False)
        assert [o.prompt for o in outputs] == prompts
        assert [o.outputs[0].token_ids for o in outputs] == expected
        queries = [replica.prefix_cache_stats.num_queries for replica in two.engine.replicas]
        assert all(queries) and sum(queries) == len(prompts)      # both replicas ran some of the prompts
        for output, embedding in zip(two.embed(prompts, use_tqdm=False), embeddings):   # so do embeddings
            assert output.outputs.embedding == pytest.approx(embedding, abs=1e-6)
        # n > 1 and beam search run inside one replica each.
        (forked,) = two.generate([prompts[0]], SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True),
                                 use_tqdm=False)
        assert [c.token_ids for c in forked.outputs] == [expected[0], expected[0]]
        (beams,) = two.beam_search([prompts[1]], BeamSearchParams(beam_width=2, max_tokens=3))
        assert len(beams.sequences) == 2
        assert not two.engine.has_unfinished_requests() and not two.engine._owner
        # vLLM's enqueue and collective_rpc reach both replicas
        queued = two.enqueue(prompts, params)
        assert two.llm_engine.get_num_unfinished_requests() == len(prompts)
        done = two.wait_for_completion(use_tqdm=False)
        assert [o.request_id for o in done] == queued and [o.outputs[0].token_ids for o in done] == expected
        assert two.get_world_size() == 2 and two.get_world_size(include_dp=False) == 1
        models = [replica.runner.model for replica in two.engine.replicas]
        assert two.apply_model(lambda model: models.index(model)) == [0, 1]


def test_prefix_aware_routing_hits_the_cache_more_than_round_robin_offline(tiny_llama_dir):
    """Three system prompts, four questions each, one after the other: the router keeps each system prompt on one
    replica (one miss each), round robin computes it on both (two misses each)."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    hit_rates = {}
    for router in ("prefix_aware", "round_robin"):
        with _llm(tiny_llama_dir, 2, data_parallel_router=router) as llm:
            for group in range(3):
                for i in range(4):
                    llm.generate([f"{group}{SYSTEM} Question {i}?"], params, use_tqdm=False)
            hit_rates[router] = llm.engine.prefix_cache_stats.hit_rate
    assert hit_rates["prefix_aware"] > hit_rates["round_robin"]


def test_an_engine_refuses_data_parallel_size_above_one(tiny_llama_dir):
    from pagedllm.config import EngineConfig, ModelConfig, ParallelConfig
    from pagedllm.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="one replica"):
        LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir)),
                               parallel=ParallelConfig(data_parallel_size=2)))
    with pytest.raises(ValueError, match="data_parallel_router"):
        _llm(tiny_llama_dir, 2, data_parallel_router="random")


def test_each_replica_gets_its_own_swap_file(tiny_llama_dir, disk_tmp_path):
    path = disk_tmp_path / "swap"
    with _llm(tiny_llama_dir, 2, swap_space=0.001, swap_path=str(path), preemption_mode="swap") as llm:
        assert [r.runner.swap.location for r in llm.engine.replicas] == [f"the file {path}.0", f"the file {path}.1"]
        assert (disk_tmp_path / "swap.0").exists() and (disk_tmp_path / "swap.1").exists()
    assert not any(disk_tmp_path.iterdir())             # close() deleted both


def test_each_replica_is_built_and_stepped_on_one_thread_of_its_own(tiny_llama_dir, threads_seen):
    """engine_thread.py says why: a thread that runs a replica's forward passes must be the one that built it."""
    with _llm(tiny_llama_dir, 2) as llm:
        llm.generate(random_prompts(6, seed=1), SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        seen = [threads_seen(replica) for replica in llm.engine.replicas]
    assert seen == [("pagedllm-dp-0", {"pagedllm-dp-0"}), ("pagedllm-dp-1", {"pagedllm-dp-1"})]


def test_replicas_without_a_tokenizer_run_on_token_ids(tiny_llama_dir):
    """skip_tokenizer_init across replicas: token ids in and out, and the tokenizer refused as one engine refuses
    it."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 17, 42, 99]} for i in range(4)]
    with _llm(tiny_llama_dir, 1) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    with _llm(tiny_llama_dir, 2, skip_tokenizer_init=True) as two:
        outputs = two.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected and all(o.outputs[0].text == "" for o in outputs)
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            two.get_tokenizer()



def test_replicas_in_this_process_refuse_a_profiler(tiny_llama_dir):
    """torch's profiler records one session a process: in-process replicas cannot each have one (Ray's can)."""
    config = {"profiler": "torch", "torch_profiler_dir": "traces"}
    with pytest.raises(ValueError, match="profiler_config must be None with replicas in this process"):
        _llm(tiny_llama_dir, 2, profiler_config=config)
