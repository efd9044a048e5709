"""vLLM's development endpoints (VLLM_SERVER_DEV_MODE=1) on a tiny random Llama behind the real server: sleep mode
with each of its modes answering every request, pause and resume, the prefix cache's reset, the world size and
collective_rpc; without the switch, none is served."""

from __future__ import annotations

import threading

import httpx
import pytest

from pagedllm import SamplingParams
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.entrypoints.openai.server import DEV_MODE_ENV, build_app
from pagedllm.entrypoints.openai.transport import CONTROL_PATHS
from tests.entrypoints.server_utils import RunningServer, metric, scrape, start_server, wait_until
from tests.reliability.tiny_server import build_tiny_engine, offline

PROMPT = "Once upon a time, in a paged cache,"
MAX_TOKENS = 200        # ~0.2 s of steps, within the tiny model's 256-token context
DEV_ROUTES = set(CONTROL_PATHS) - {"/start_profile", "/stop_profile"}      # those: with a profiler (test_profiler)




@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DEV_MODE_ENV, "1")
        running = start_server(build_tiny_engine(tiny_llama_dir), api_key=None)
    yield running
    running.stop()


def _greedy_tokens(tiny_llama_dir, max_tokens: int) -> list[int]:
    llm = offline(build_tiny_engine(tiny_llama_dir))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


def _post(server: RunningServer, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", timeout=30, **kwargs)


def _get(server: RunningServer, path: str, **kwargs) -> dict:
    response = httpx.get(f"{server.base_url}{path}", timeout=30, **kwargs)
    assert response.status_code == 200, response.text
    return response.json()


def _sleep_states(server: RunningServer) -> dict[str, float]:
    """vLLM's engine_sleep_state series, by state."""
    values = scrape(server.base_url)
    return {state: metric(values, "pagedllm:engine_sleep_state", sleep_state=state)
            for state in ("awake", "weights_offloaded", "discard_all")}


def _completion_in_background(server: RunningServer, max_tokens: int) -> tuple[threading.Thread, dict]:
    """A greedy completion sent from a thread; the dict gets its JSON once it is answered."""
    answer: dict = {}

    def send() -> None:
        body = {"model": server.model_name, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        answer.update(httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json())

    thread = threading.Thread(target=send)
    thread.start()
    return thread, answer


def test_without_the_switch_no_development_endpoint_is_served(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv(DEV_MODE_ENV, raising=False)
    engine = AsyncEngine(build_tiny_engine(tiny_llama_dir))
    assert not set(build_app(engine).openapi()["paths"]) & DEV_ROUTES
    monkeypatch.setenv(DEV_MODE_ENV, "true")
    assert set(build_app(engine).openapi()["paths"]) >= DEV_ROUTES


def test_a_request_sent_while_asleep_runs_after_wake_up(server, tiny_llama_dir):
    expected = _greedy_tokens(tiny_llama_dir, 8)
    assert _get(server, "/is_sleeping") == {"is_sleeping": False}
    assert _post(server, "/sleep", params={"level": 1}).json() == {"status": "sleeping", "level": 1}
    assert _get(server, "/is_sleeping") == {"is_sleeping": True}
    assert wait_until(lambda: _sleep_states(server) == {"awake": 0, "weights_offloaded": 1, "discard_all": 0})
    thread, answer = _completion_in_background(server, 8)
    thread.join(0.5)
    assert thread.is_alive() and not answer, "a request waits while the engine sleeps"
    # scheduling alone cannot resume: the KV pool is still released
    assert _post(server, "/wake_up", params={"tags": "scheduling"}).json() == \
        {"status": "sleeping", "tags": ["scheduling"]}
    assert _post(server, "/wake_up").json() == {"status": "awake", "tags": None}
    thread.join(30)
    assert answer["choices"][0]["token_ids"] == expected
    assert _get(server, "/is_sleeping") == {"is_sleeping": False}
    assert wait_until(lambda: _sleep_states(server) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0})


def _running_one(server: RunningServer) -> tuple[threading.Thread, dict]:
    """A long greedy completion, frozen mid-way by /pause (mode "keep")."""
    thread, answer = _completion_in_background(server, MAX_TOKENS)
    while not server.engine.num_active_requests:
        thread.join(0.005)
    assert _post(server, "/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert server.engine.num_active_requests == 1 and _get(server, "/is_paused") == {"is_paused": True}
    return thread, answer


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_a_request_caught_by_a_sleep_is_ended_or_recomputed(server, tiny_llama_dir, mode):
    """"abort" ends the request in flight (finish_reason "abort", the tokens it had); "keep" recomputes it after
    /wake_up, to the tokens it would have given awake."""
    expected = _greedy_tokens(tiny_llama_dir, MAX_TOKENS)
    thread, answer = _running_one(server)
    if mode == "keep":      # "wait" cannot finish it while paused: refused, not a hang
        response = _post(server, "/sleep", params={"mode": "wait"})
        assert response.status_code == 400 and "wake it up first" in response.text
    assert _post(server, "/sleep", params={"level": 1, "mode": mode}).status_code == 200
    assert _post(server, "/wake_up").json()["status"] == "awake"
    thread.join(30)
    choice = answer["choices"][0]
    if mode == "abort":
        assert choice["finish_reason"] == "abort"
        assert choice["token_ids"] == expected[:len(choice["token_ids"])] and len(choice["token_ids"]) < MAX_TOKENS
    else:
        assert choice["finish_reason"] == "length" and choice["token_ids"] == expected


def test_sleep_mode_wait_lets_the_request_in_flight_finish_first(server, tiny_llama_dir):
    expected = _greedy_tokens(tiny_llama_dir, MAX_TOKENS)
    thread, answer = _completion_in_background(server, MAX_TOKENS)
    while not server.engine.num_active_requests:
        thread.join(0.005)
    assert _post(server, "/sleep", params={"mode": "wait"}).status_code == 200
    assert server.engine.engine.get_num_unfinished_requests() == 0, "the sleep waited for it"
    assert _post(server, "/wake_up").json()["status"] == "awake"
    thread.join(30)
    assert answer["choices"][0]["token_ids"] == expected


def test_pause_resume_and_the_other_controls(server):
    assert _post(server, "/pause").json() == {"status": "paused"}
    assert _get(server, "/is_paused") == {"is_paused": True}
    assert _post(server, "/resume").json() == {"status": "resumed"}
    assert _get(server, "/is_paused") == {"is_paused": False}
    assert _post(server, "/reset_prefix_cache").json() == {"success": True}
    assert _get(server, "/get_world_size") == {"world_size": 1}
    assert _get(server, "/get_world_size", params={"include_dp": "false"}) == {"world_size": 1}
    weight_bytes = server.engine.engine.runner.weight_bytes()
    assert _post(server, "/collective_rpc", json={"method": "weight_bytes"}).json() == \
        {"results": [str(weight_bytes)]}


@pytest.mark.parametrize(("method", "path", "kwargs", "words"), [
    ("post", "/sleep", {"params": {"level": 3}}, "level"),
    ("post", "/sleep", {"params": {"mode": "later"}}, "mode"),
    ("post", "/wake_up", {"params": {"tags": "gpu"}}, "wake_up tags are among"),
    ("post", "/release_kv_cache_memory", {}, "sleep(level=0) first"),
    ("post", "/collective_rpc", {"json": {"method": "no_such_method"}}, "no_such_method"),
    ("post", "/collective_rpc", {"json": {"args": []}}, "method"),
])
def test_bad_controls_are_a_400_and_change_nothing(server, method, path, kwargs, words):
    response = httpx.request(method, f"{server.base_url}{path}", timeout=30, **kwargs)
    assert response.status_code == 400 and words in response.text
    assert _get(server, "/is_sleeping") == {"is_sleeping": False}


def test_with_an_api_key_the_controls_need_it(tiny_llama_dir, monkeypatch):
    """vLLM leaves its development routes open; pagedllm puts them behind the API key, as the model's routes."""
    monkeypatch.setenv(DEV_MODE_ENV, "1")
    guarded = start_server(build_tiny_engine(tiny_llama_dir))
    try:
        assert _post(guarded, "/sleep").status_code == 401
        assert httpx.get(f"{guarded.base_url}/is_sleeping", timeout=30).status_code == 401
        assert _post(guarded, "/collective_rpc", json={"method": "weight_bytes"}).status_code == 401
        assert _get(guarded, "/is_sleeping", headers=guarded.headers) == {"is_sleeping": False}
    finally:
        guarded.stop()


def test_reset_prefix_cache_may_requeue_a_request_in_flight(server, tiny_llama_dir):
    """vLLM's /reset_prefix_cache?reset_running_requests=true: the request in flight is recomputed after the reset
    and gives its tokens; without the flag the reset waits for an idle pool."""
    expected = _greedy_tokens(tiny_llama_dir, MAX_TOKENS)
    thread, answer = _running_one(server)
    assert _post(server, "/reset_prefix_cache").json() == {"success": False}
    assert _post(server, "/reset_prefix_cache", params={"reset_running_requests": "true"}).json() == \
        {"success": True}
    assert _post(server, "/resume").json() == {"status": "resumed"}
    thread.join(30)
    assert answer["choices"][0]["token_ids"] == expected
