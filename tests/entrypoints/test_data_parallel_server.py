"""The server with two data-parallel replicas (`--data-parallel-size 2`) on a tiny random Llama: the OpenAI routes
work as with one engine, /metrics labels each replica, a disconnect frees the blocks of the replica that ran the
request, a dead replica makes /health answer 503, and the prefix-aware router hits the prefix cache more often
than round robin on a shared-prefix workload."""

from __future__ import annotations

import httpx
import pytest
import torch

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedllm.engine.data_parallel import AsyncDataParallelEngine, build_async_engine
from pagedllm.entrypoints.openai.server import DEV_MODE_ENV
from tests.entrypoints.server_utils import metric, scrape, start_server, wait_until
from tests.models.tiny import save_tiny_model
from tests.reliability.tiny_server import TINY_CONTEXT, pool_is_whole

SYSTEM = "You are a terse assistant. Answer in one word. Context: " + "abcdefgh" * 6   # 3+ blocks of 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder, _ = save_tiny_model(tmp_path_factory.mktemp("dp-server") / "llama", "llama-gqa", initializer_range=0.5)
    return folder


@pytest.fixture(scope="module", autouse=True)
def restore_torch_threads():
    """build_replicas divides the process's intra-op threads among the replicas."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _serve(folder, router: str = "prefix_aware"):
    engine = build_async_engine(EngineConfig(
        model=ModelConfig(model=str(folder), dtype="float32", max_model_len=TINY_CONTEXT),
        cache=CacheConfig(block_size=16, num_blocks=128), scheduler=SchedulerConfig(max_num_seqs=32),
        parallel=ParallelConfig(data_parallel_size=2, data_parallel_router=router)))
    assert isinstance(engine, AsyncDataParallelEngine)
    return start_server(engine, api_key=None)


@pytest.fixture(scope="module")
def dp_server(tiny_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DEV_MODE_ENV, "1")     # vLLM's development endpoints, on every replica
        server = _serve(tiny_dir)
    yield server
    server.stop()


def _complete(base_url: str, prompt: str, **fields) -> dict:
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True} | fields
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_completions_chat_streaming_and_n_work_across_replicas(dp_server):
    base = dp_server.base_url
    texts = {p: _complete(base, p)["choices"][0]["text"] for p in ("alpha beta", "gamma delta", SYSTEM)}
    with httpx.stream("POST", f"{base}/v1/completions", timeout=30, json={
            "prompt": "gamma delta", "max_tokens": 5, "temperature": 0.0, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    streamed = "".join(httpx.Response(200, content=c[6:]).json()["choices"][0]["text"] for c in chunks)
    assert streamed == texts["gamma delta"]
    choices = _complete(base, "alpha beta", n=2)["choices"]
    assert [c["index"] for c in choices] == [0, 1] and {c["text"] for c in choices} == {texts["alpha beta"]}
    chat = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0.0})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    engine = dp_server.engine
    assert wait_until(lambda: engine.num_active_requests == 0)
    assert all(replica.engine.prefix_cache_stats.num_queries > 0 for replica in engine.replicas)


def test_metrics_label_each_replica_and_the_dashboard_shows_replica_0(dp_server):
    for i in range(4):     # lengths 0, 7, 28, 63 more: no two replicas' totals can be equal
        _complete(dp_server.base_url, f"{i} metrics prompt" + "x" * (7 * i * i))
    values = scrape(dp_server.base_url)
    for replica in ("0", "1"):
        assert metric(values, "pagedllm:num_blocks_total", replica=replica) == 127     # block 0 is the null block
    per_replica = [metric(values, "pagedllm:request_success_total", replica=r, finished_reason="length")
                   for r in ("0", "1")]
    served = [replica.engine.prefix_cache_stats.num_queries for replica in dp_server.engine.replicas]
    assert per_replica == served and all(per_replica)
    # /v1/kv_cache (the dashboard's data) shows replica 0.
    kv_cache = httpx.get(f"{dp_server.base_url}/v1/kv_cache", timeout=10).json()
    first = dp_server.engine.replicas[0].latest_stats
    assert kv_cache["stats"]["prefix_cache_queries"] == first.prefix_cache_queries_total
    assert first.prefix_cache_queries_total != dp_server.engine.replicas[1].latest_stats.prefix_cache_queries_total


def test_a_disconnect_frees_the_blocks_of_the_replica_that_ran_it(dp_server):
    with httpx.stream("POST", f"{dp_server.base_url}/v1/completions", timeout=30, json={
            "prompt": SYSTEM, "max_tokens": 150, "ignore_eos": True, "stream": True}) as response:
        next(response.iter_lines())
    replicas = dp_server.engine.replicas
    assert wait_until(lambda: dp_server.engine.num_active_requests == 0 and
                      all(pool_is_whole(r.engine) for r in replicas))


def test_the_development_endpoints_reach_every_replica(dp_server):
    base = dp_server.base_url
    expected = _complete(base, "alpha beta")["choices"][0]["text"]
    assert httpx.post(f"{base}/sleep", timeout=30).json() == {"status": "sleeping", "level": 1}
    replicas = dp_server.engine.replicas
    assert httpx.get(f"{base}/is_sleeping", timeout=30).json() == {"is_sleeping": True}
    assert all(r.engine.runner.kv is None for r in replicas), "each replica's KV pool released"
    assert httpx.post(f"{base}/wake_up", timeout=30).json() == {"status": "awake", "tags": None}
    assert _complete(base, "alpha beta")["choices"][0]["text"] == expected
    assert httpx.get(f"{base}/get_world_size", timeout=30).json() == {"world_size": 2}
    assert httpx.post(f"{base}/collective_rpc", json={"method": "weight_bytes"}, timeout=30).json()["results"] == \
        [str(r.engine.runner.weight_bytes()) for r in replicas]


def test_a_dead_replica_makes_the_server_unhealthy(tiny_dir, monkeypatch):
    server = _serve(tiny_dir)
    try:
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
        broken = server.engine.replicas[1]

        def fail():
            raise RuntimeError("injected bookkeeping failure")
        monkeypatch.setattr(broken.engine, "make_stats", fail)
        broken.abort("wake-up")         # the loop wakes, publishes its stats, and dies
        assert wait_until(lambda: broken.error is not None)
        response = httpx.get(f"{server.base_url}/health", timeout=10)
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
    finally:
        server.stop()


def test_prefix_aware_routing_hits_the_prefix_cache_more_than_round_robin(tiny_dir):
    """Two system prompts, three questions each, sent one after the other: the router computes each system prompt
    once, round robin twice. Hit rate from the replicas' own prefix-cache counters."""
    hit_rates = {}
    for router in ("prefix_aware", "round_robin"):
        server = _serve(tiny_dir, router)
        try:
            for group in range(2):
                for i in range(3):
                    _complete(server.base_url, f"{group}{SYSTEM} Question {i}?", max_tokens=1)
            stats = [replica.engine.prefix_cache_stats for replica in server.engine.replicas]
            hit_rates[router] = sum(s.num_hit_tokens for s in stats) / sum(s.num_query_tokens for s in stats)
        finally:
            server.stop()
    assert hit_rates["prefix_aware"] > hit_rates["round_robin"] > 0


def test_the_flags_reach_the_config_and_the_app(tiny_dir):
    from pagedllm.entrypoints.openai.api_server import build_app_from_args, make_parser
    from pagedllm.entrypoints.openai.cli_args import engine_config_from_args

    default = engine_config_from_args(make_parser().parse_args([])).parallel
    assert (default.data_parallel_size, default.data_parallel_router) == (1, "prefix_aware")
    parallel = engine_config_from_args(make_parser().parse_args(
        ["-dp", "2", "--data-parallel-router", "round_robin"])).parallel
    assert (parallel.data_parallel_size, parallel.data_parallel_router) == (2, "round_robin")
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--data-parallel-router", "random"])
    app = build_app_from_args(make_parser().parse_args(
        ["--model", str(tiny_dir), "-dp", "2", "--kv-cache-memory", "1M", "--max-model-len", str(TINY_CONTEXT)]))
    try:
        assert isinstance(app.state.engine, AsyncDataParallelEngine) and app.state.engine.data_parallel_size == 2
    finally:
        app.state.engine.close()
