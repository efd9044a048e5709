"""What an operator relies on: no client sets its own priority unless the server allows it, and the swap pool is
reported (start-up log, /metrics) and its file deleted when the engine closes or the server stops."""

from __future__ import annotations

import logging

import httpx
import pytest

from pagedllm.entrypoints.openai.api_server import make_parser
from pagedllm.entrypoints.openai.cli_args import engine_config_from_args
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.sampling_params import SamplingParams
from tests.entrypoints.server_utils import metric, scrape, start_server
from tests.reliability.tiny_server import build_tiny_engine, error_shape, offline, pool_is_whole

SWAP_SPACE = 1 / 1024          # GiB: 128 blocks of the tiny model's 16-token blocks (8 KiB each)
BLOCK_BYTES = 16 * 512
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def fcfs_server(tiny_model_dir):
    running = start_server(build_tiny_engine(tiny_model_dir, num_blocks=64), api_key=None)
    yield running
    running.stop()


# ---- priority ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, {"prompt": "hello", "max_tokens": 2, "priority": -10}),
    (COMPLETIONS, {"prompt": ["a", "b"], "n": 2, "max_tokens": 2, "priority": 3, "stream": True}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 1}),
])
def test_fcfs_refuses_a_priority_with_400(fcfs_server, path, body):
    response = httpx.post(fcfs_server.base_url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = error_shape(response)
    assert error["param"] == "priority" and "priority scheduling is not enabled" in error["message"], error
    assert "--scheduling-policy priority" in error["message"]
    ok = httpx.post(fcfs_server.base_url + path, json={**body, "priority": 0}, timeout=30)
    assert ok.status_code == 200, ok.text
    assert pool_is_whole(fcfs_server.engine.engine)


def test_the_priority_policy_accepts_a_priority(tiny_model_dir):
    server = start_server(build_tiny_engine(tiny_model_dir, num_blocks=64, scheduling_policy="priority"),
                          api_key=None)
    try:
        response = httpx.post(f"{server.base_url}{COMPLETIONS}", json={"prompt": "hi", "max_tokens": 2,
                                                                       "priority": -10}, timeout=30)
    finally:
        server.stop()
    assert response.status_code == 200, response.text


def test_offline_fcfs_refuses_a_priority_before_running_anything(tiny_model_dir):
    llm = offline(build_tiny_engine(tiny_model_dir, num_blocks=64))
    params = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate(["a", "b"], params, use_tqdm=False, priority=[0, 5])
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.engine.add_request("x", "a", params, priority=-1)
    assert len(llm.generate(["a", "b"], params, use_tqdm=False, priority=[0, 0])) == 2


def test_the_flags_reach_the_config(tmp_path):
    default = engine_config_from_args(make_parser().parse_args([]))
    assert default.scheduler.scheduling_policy == "fcfs" and default.cache.swap_path is None
    args = make_parser().parse_args(["--scheduling-policy", "priority", "--swap-path", str(tmp_path / "s")])
    config = engine_config_from_args(args)
    assert config.scheduler.scheduling_policy == "priority" and config.cache.swap_path == str(tmp_path / "s")
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--scheduling-policy", "lottery"])


# ---- the swap pool -------------------------------------------------------------------------------------------------
def test_close_deletes_a_named_swap_file_and_the_log_reports_the_pool(tiny_model_dir, disk_tmp_path, caplog):
    path = disk_tmp_path / "swap.bin"
    logging.getLogger("pagedllm").addHandler(caplog.handler)
    try:
        with offline(build_tiny_engine(tiny_model_dir, num_blocks=64, swap_space=SWAP_SPACE,
                                       swap_path=str(path))) as llm:
            assert path.stat().st_size == 128 * BLOCK_BYTES
            assert len(llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)) == 1
    finally:
        logging.getLogger("pagedllm").removeHandler(caplog.handler)
    assert not path.exists()
    assert f"swap pool: 128 blocks of 16 tokens (0.00 GiB) in the file {path}" in caplog.text
    llm.close()     # twice is harmless


def test_server_stop_deletes_the_swap_file_and_metrics_report_the_pool(tiny_model_dir, disk_tmp_path):
    path = disk_tmp_path / "swap.bin"
    engine = build_tiny_engine(tiny_model_dir, num_blocks=64, swap_space=SWAP_SPACE, swap_path=str(path),
                               preemption_mode="swap")
    server = start_server(engine, api_key=None)
    try:
        assert httpx.post(f"{server.base_url}{COMPLETIONS}", json={"prompt": "hi", "max_tokens": 2},
                          timeout=30).status_code == 200
        values = scrape(server.base_url)
        assert path.exists()
    finally:
        server.stop()
    assert not path.exists()
    assert metric(values, "pagedllm:swap_space_bytes") == 128 * BLOCK_BYTES
    assert metric(values, "pagedllm:num_swap_blocks_total") == 127          # block 0 is the null block
    assert metric(values, "pagedllm:num_swap_blocks_used") == 0


def test_swap_metrics_count_the_blocks_of_swapped_requests(tiny_model_dir):
    engine = build_tiny_engine(tiny_model_dir, num_blocks=12, swap_space=SWAP_SPACE, preemption_mode="swap",
                               max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i in range(4):
        engine.add_request(str(i), f"{i}: a prompt of some thirty tokens or so", params)
    while not engine.scheduler.num_swapped:
        assert engine.has_unfinished_requests(), "the pool was meant to force a swap"
        engine.step()
    stats = engine.make_stats()
    swapped = sum(len(engine.kv_cache_manager.get_swapped_block_ids(r.request_id)) for r in engine.scheduler.swapped)
    assert swapped > 0 and stats.num_swap_blocks_total - stats.num_swap_blocks_free == swapped
    stat_logger = PrometheusStatLogger("m", swap_space_bytes=engine.swap_space_bytes)
    stat_logger.record(stats, None)
    assert stat_logger.registry.get_sample_value("pagedllm:num_swap_blocks_used", {"model_name": "m"}) == swapped
    engine.close()

