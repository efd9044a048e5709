"""The Ray backend (`distributed_executor_backend="ray"`) on a local Ray cluster, on a tiny MHA Llama: data-parallel
replicas as Ray actors, offline and on the server, each of them rank 0 of a tensor-parallel group whose other rank
is a Ray actor too; one engine's greedy tokens; the engine's refusals reach the caller as themselves; a replica or
a worker rank that dies fails its requests (and the server's /health); a cluster too small is refused at once; and
a cluster the engine started is stopped when it closes, one it joined is left running."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedllm.distributed.ray_replica import RayReplica
from pagedllm.engine.data_parallel import AsyncDataParallelEngine, DataParallelEngine, build_async_engine
from pagedllm.sampling_params import StructuredOutputsParams
from tests.entrypoints.server_utils import metric, scrape, start_server, wait_until
from tests.models.tiny import save_tiny_model
from tests.reliability.tiny_server import TINY_CONTEXT, random_prompts

ray = pytest.importorskip("ray")

SYSTEM = "You are a terse assistant. Answer in one word. Context: " + "abcdefgh" * 6   # 3+ blocks of 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder, _ = save_tiny_model(tmp_path_factory.mktemp("ray-dp") / "llama", "llama-mha", initializer_range=0.5)
    return folder


@pytest.fixture(scope="module")
def local_cluster():
    """One local cluster for the module, as `ray start --head` would give: the engines join it, not own it. Four
    logical CPUs: two replicas of two tensor-parallel ranks each (on this machine's cores, oversubscribed)."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


CONFIG = dict(dtype="float32", max_model_len=TINY_CONTEXT, block_size=16, num_kv_blocks=128)


def test_the_server_on_replicas_in_actors_and_a_dead_one_answers_503(tiny_dir):
    """No cluster yet: the engine starts a local one (2 CPUs here, one per replica) and stops it on close."""
    assert not ray.is_initialized()
    prompts = ["alpha beta", "gamma delta", SYSTEM + " Question?", SYSTEM + " Another?"]
    with LLM(str(tiny_dir), **CONFIG) as one:
        expected = [o.outputs[0].text for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    engine = build_async_engine(EngineConfig(
        model=ModelConfig(model=str(tiny_dir), dtype="float32", max_model_len=TINY_CONTEXT),
        cache=CacheConfig(block_size=16, num_blocks=128), scheduler=SchedulerConfig(max_num_seqs=32),
        parallel=ParallelConfig(data_parallel_size=2, distributed_executor_backend="ray")))
    assert isinstance(engine, AsyncDataParallelEngine)
    assert all(isinstance(replica.engine, RayReplica) for replica in engine.replicas)
    server = start_server(engine, api_key=None)
    try:
        base = server.base_url
        body = {"max_tokens": GREEDY.max_tokens, "temperature": 0.0, "ignore_eos": True}
        for prompt, text in zip(prompts, expected, strict=True):
            response = httpx.post(f"{base}/v1/completions", json=body | {"prompt": prompt}, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == text
        bad = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 5,
                                                         "structured_outputs": {"regex": "[0-9"}}, timeout=60)
        assert bad.status_code == 400 and "invalid structured_outputs.regex" in bad.text  # compiled in the actor
        values = scrape(base)
        finished = [metric(values, "pagedllm:request_success_total", replica=str(i), finished_reason="length")
                    for i in range(2)]
        assert sum(finished) == 4 and all(finished)    # both replicas ran requests, each labelled
        os.kill(engine.replicas[0].engine.pid, signal.SIGKILL)
        assert wait_until(lambda: httpx.get(f"{base}/health", timeout=10).status_code == 503)
    finally:
        server.stop()
        engine.close()
    assert not ray.is_initialized(), "the local cluster the engine started (no RAY_ADDRESS) is stopped on close"


def test_replicas_of_tensor_parallel_groups_in_actors_give_one_engines_tokens_and_refuse_as_one_engine(
        tiny_dir, local_cluster, tmp_path):
    """Two replica actors, each rank 0 of a tensor-parallel group of 2 (its rank 1 another actor)."""
    prompts = random_prompts(6, seed=5) + [SYSTEM + f" Question {i}?" for i in range(4)]
    with LLM(str(tiny_dir), **CONFIG) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    with pytest.raises(ValueError, match="unless distributed_executor_backend='ray'"):
        LLM(str(tiny_dir), **CONFIG, data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="need 6 Ray actors .* the Ray cluster has 4 CPU"):
        LLM(str(tiny_dir), **CONFIG, data_parallel_size=3, tensor_parallel_size=2, distributed_executor_backend="ray")
    profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profiler_with_stack": False}
    llm = LLM(str(tiny_dir), **CONFIG, data_parallel_size=2, tensor_parallel_size=2, distributed_executor_backend="ray",
              profiler_config=profiler)
    with llm:
        engine = llm.engine
        assert isinstance(engine, DataParallelEngine)
        assert all(isinstance(replica, RayReplica) for replica in engine.replicas)
        pids = [replica.pid for replica in engine.replicas]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        llm.start_profile("run")        # each actor, its own process, records its own session
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        llm.stop_profile()
        assert sorted(path.name.split(".")[0] for path in tmp_path.iterdir()) == ["run_dp0", "run_dp1"]
        assert [o.outputs[0].token_ids for o in outputs] == expected
        # vLLM's collective_rpc reaches every rank of every replica; Ray's actors take a lambda
        assert llm.get_world_size() == 4 and llm.get_world_size(include_dp=False) == 2
        assert llm.collective_rpc(lambda runner, a: (runner.tp_rank, a), args=(7,)) == [(0, 7), (1, 7)] * 2
        queries = [replica.prefix_cache_stats.num_queries for replica in engine.replicas]
        assert all(queries) and sum(queries) == len(prompts)
        # The engine's own refusal, raised in the actor, reaches the caller as the same ValueError.
        bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9"))
        with pytest.raises(ValueError, match="invalid structured_outputs.regex"):
            llm.generate(["hello"], bad, use_tqdm=False)
        # Replica 1's tensor-parallel rank 1 dies: that replica's next step fails, as the engine's own error.
        worker = ray.get_actor(f"pagedllm-tp1-{pids[1]}")
        os.kill(ray.get(worker.pid.remote()), signal.SIGKILL)
        with pytest.raises(Exception, match="tensor-parallel"):
            llm.generate(prompts, GREEDY, use_tqdm=False)
    assert ray.is_initialized(), "a cluster the engine joined is left running"
