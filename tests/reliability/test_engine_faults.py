"""Engine faults. A runner that raises during one step fails that step's batch alone, with a clear error; the
engine goes on serving, the pool stays whole, and nothing is logged of anyone's prompt. A killed engine loop turns
/health to 503 within a second, and every waiting client gets an error, not a hang."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import httpx
import pytest

from pagedllm.sampling_params import SamplingParams
from tests.entrypoints.server_utils import metric, scrape, start_server, wait_until
from tests.reliability.tiny_server import build_tiny_engine, error_shape, served_alone

POISON = "POISON-7f3a"
SECRET = "secret-4b1d9e"


class PoisonedRunner:
    """Wraps a ModelRunner: raises in any step whose batch holds a request whose prompt contains POISON."""

    def __init__(self, runner, poison_ids: list[int]) -> None:
        self.runner, self.poison_ids = runner, poison_ids
        self.poisoned: set[str] = set()
        self.failed_batches: list[set[str]] = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _is_poisoned(self, token_ids: list[int]) -> bool:
        n = len(self.poison_ids)
        return any(token_ids[i:i + n] == self.poison_ids for i in range(len(token_ids) - n + 1))

    def execute(self, out):
        self.poisoned |= {new.request_id for new in out.new_requests if self._is_poisoned(new.prompt_token_ids)}
        batch = {s.request_id for s in out.scheduled}
        if batch & self.poisoned:
            self.failed_batches.append(batch)
            raise RuntimeError("injected fault in the model forward")
        return self.runner.execute(out)


def _poison(engine) -> PoisonedRunner:
    runner = PoisonedRunner(engine.runner, engine.tokenizer.encode(POISON))
    engine.runner = runner
    return runner


def test_a_failed_step_fails_its_batch_alone(tiny_model_dir, caplog):
    engine = build_tiny_engine(tiny_model_dir, num_blocks=64, max_num_seqs=4)
    prompts = [f"{SECRET} request {i}" for i in range(10)]
    alone = served_alone(engine, prompts, 20)
    runner = _poison(engine)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, prompt in enumerate(prompts[:4]):
        engine.add_request(f"a{i}", prompt, params)
    engine.add_request("poison", f"{POISON} {SECRET}", params)     # waits for a seat, then breaks its step
    for i, prompt in enumerate(prompts[4:], start=4):
        engine.add_request(f"b{i}", prompt, params)
    results = {}
    with caplog.at_level(logging.DEBUG):
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    results[output.request_id] = output
            engine.kv_cache_manager.check_integrity()
    assert len(runner.failed_batches) == 1
    failed = runner.failed_batches[0]
    assert "poison" in failed and len(failed) > 1      # it took the requests batched with it down too...
    assert set(results) == {f"a{i}" for i in range(4)} | {f"b{i}" for i in range(4, 10)} | {"poison"}
    for request_id, output in results.items():
        completion = output.outputs[0]
        if request_id in failed:
            assert completion.finish_reason == "abort"
            assert "injected fault" in output.error
        else:                                           # ...and no one else: the others are served exactly
            assert output.error is None and completion.finish_reason == "length"
            assert completion.token_ids == alone[prompts[int(request_id[1:])]]
    assert any(not r.startswith("poison") and r not in failed for r in results)
    manager = engine.kv_cache_manager
    assert not engine.scheduler.requests and manager.num_free_blocks == manager.num_usable_blocks
    assert "injected fault" in caplog.text and SECRET not in caplog.text and POISON not in caplog.text


@pytest.fixture(scope="module")
def poisoned_server(tiny_model_dir):
    engine = build_tiny_engine(tiny_model_dir, num_blocks=128)
    _poison(engine)
    server = start_server(engine, api_key=None)
    yield server
    server.stop()


def test_a_failed_request_gets_a_clear_error_and_the_server_goes_on(poisoned_server):
    url = poisoned_server.base_url
    response = httpx.post(f"{url}/v1/completions", json={"prompt": POISON, "max_tokens": 5}, timeout=30)
    assert response.status_code == 500
    error = error_shape(response)
    assert error["code"] == "engine_step_failed" and "injected fault" in error["message"]
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": POISON}], "stream": True})
    assert chat.status_code == 500 and error_shape(chat)["code"] == "engine_step_failed"
    assert httpx.get(f"{url}/health").status_code == 200
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "fine", "max_tokens": 5}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    values = scrape(url)
    assert metric(values, "pagedllm:num_blocks_free") == metric(values, "pagedllm:num_blocks_total")


def test_a_fault_in_the_middle_of_a_stream_ends_it_with_an_error_event(tiny_model_dir):
    engine = build_tiny_engine(tiny_model_dir, num_blocks=128)
    real_execute, calls = engine.runner.execute, []

    def execute(out):       # the 10th step of the stream fails
        calls.append(1)
        if len(calls) == 10:
            raise RuntimeError("injected fault at step 10")
        return real_execute(out)
    engine.runner.execute = execute
    server = start_server(engine, api_key=None)
    try:
        with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=30,
                          json={"prompt": "go", "max_tokens": 50, "ignore_eos": True, "stream": True}) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert '"code":"engine_step_failed"' in lines[-2] and "injected fault at step 10" in lines[-2]
        assert len(lines) - 2 == 9            # steps 1-9 gave a token each; step 10 failed
        assert httpx.get(f"{server.base_url}/health").status_code == 200
    finally:
        server.stop()


def test_a_killed_engine_loop_fails_fast(tiny_model_dir):
    engine = build_tiny_engine(tiny_model_dir, num_blocks=128)
    kill = threading.Event()
    real_schedule = engine.scheduler.schedule

    def schedule():
        if kill.is_set():
            raise RuntimeError("injected bookkeeping failure")
        time.sleep(0.005)       # keep the waiting requests waiting a little
        return real_schedule()
    engine.scheduler.schedule = schedule
    server = start_server(engine, api_key=None)
    url = server.base_url
    try:
        body = {"prompt": "long", "max_tokens": 200, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            waiting = [pool.submit(httpx.post, f"{url}/v1/completions", json={**body, "stream": s}, timeout=30)
                       for s in (False, True) for _ in range(4)]
            assert wait_until(lambda: metric(scrape(url), "pagedllm:num_requests_running") > 0, timeout=10)
            killed_at = time.monotonic()
            kill.set()
            assert wait_until(lambda: httpx.get(f"{url}/health").status_code == 503, timeout=1.0, interval=0.02)
            assert time.monotonic() - killed_at < 1.0
            for future in waiting:
                response = future.result(timeout=5)            # an answer, not a hang
                if response.status_code == 200:                # the stream had started: an error event ends it
                    assert '"code":"engine_dead"' in response.text and response.text.endswith("data: [DONE]\n\n")
                else:
                    assert response.status_code == 503 and error_shape(response)["code"] == "engine_dead"
        late = httpx.post(f"{url}/v1/completions", json=body, timeout=5)
        assert late.status_code == 503 and error_shape(late)["code"] == "engine_dead"
    finally:
        server.stop()
