"""Engine faults. A runner that raises during one step fails that step's batch alone, with a clear error; the
engine goes on serving, the pool stays whole, and nothing is logged of anyone's prompt. A killed engine loop turns
/health to 503 within a second, and every waiting client gets an error, not a hang."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

import httpx
import pytest

from pagedllm.engine.async_engine import AsyncEngine, RequestFailedError
from pagedllm.sampling_params import SamplingParams
from tests.entrypoints.server_utils import metric, scrape, start_server, wait_until
from tests.reliability.tiny_server import build_tiny_engine, error_shape, offline, pool_is_whole, served_alone

POISON = "POISON-7f3a"
SECRET = "secret-4b1d9e"


class PoisonedRunner:
    """Wraps a ModelRunner: any run of the model over a batch holding a request whose prompt contains POISON
    raises, once that request has `poison_from` tokens computed (0: from its first step on)."""

    def __init__(self, runner, poison_ids: list[int], poison_from: int = 0) -> None:
        self.runner, self.poison_ids, self.poison_from = runner, poison_ids, poison_from
        self.poisoned: set[str] = set()
        self.failed_batches: list[set[str]] = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _is_poisoned(self, token_ids: list[int]) -> bool:
        n = len(self.poison_ids)
        return any(token_ids[i:i + n] == self.poison_ids for i in range(len(token_ids) - n + 1))

    def prepare(self, out):
        self.poisoned |= {new.request_id for new in out.new_requests if self._is_poisoned(new.prompt_token_ids)}
        self.runner.prepare(out)

    def run(self, scheduled):
        if any(s.request_id in self.poisoned and s.num_computed_tokens >= self.poison_from for s in scheduled):
            self.failed_batches.append({s.request_id for s in scheduled})
            raise RuntimeError("injected fault in the model forward")
        return self.runner.run(scheduled)


def _poison(engine, poison_from: int = 0) -> PoisonedRunner:
    runner = PoisonedRunner(engine.runner, engine.tokenizer.encode(POISON), poison_from)
    engine.runner = runner
    return runner


def _step_to_the_end(engine) -> dict[str, object]:
    """Step until nothing is left, checking the pool after every step; the finished outputs by request id."""
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output
        engine.kv_cache_manager.check_integrity()
    return results


@pytest.mark.parametrize("num_tokens_before_fault", [0, 4], ids=["in-its-prefill", "in-its-decode"])
def test_a_failing_request_fails_alone(tiny_model_dir, caplog, num_tokens_before_fault):
    engine = build_tiny_engine(tiny_model_dir, num_blocks=64, max_num_seqs=4)
    prompts = [f"{SECRET} request {i}" for i in range(10)]
    alone = served_alone(engine, prompts, 20)
    # A seeded n = 2 request forks and copies its shared block (copy-on-write) beside the failing one.
    sampled = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    sampled_alone = [c.token_ids for c in offline(engine).generate(["forked"], sampled, use_tqdm=False)[0].outputs]
    num_poison_tokens = len(engine.tokenize_prompt(f"{POISON} {SECRET}"))
    runner = _poison(engine, num_poison_tokens + num_tokens_before_fault - 1 if num_tokens_before_fault else 0)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, prompt in enumerate(prompts[:4]):
        engine.add_request(f"a{i}", prompt, params)
    engine.add_request("poison", f"{POISON} {SECRET}", params)     # waits for a seat, then breaks its runs
    engine.add_request("forked", "forked", sampled)
    for i, prompt in enumerate(prompts[4:], start=4):
        engine.add_request(f"b{i}", prompt, params)
    with caplog.at_level(logging.DEBUG):
        results = _step_to_the_end(engine)
    assert any({"poison", "forked"} < batch for batch in runner.failed_batches)  # it was batched with others...
    assert set(results) == {f"a{i}" for i in range(4)} | {f"b{i}" for i in range(4, 10)} | {"poison", "forked"}
    poisoned = results.pop("poison")
    assert poisoned.outputs[0].finish_reason == "abort" and "injected fault" in poisoned.error
    assert len(poisoned.outputs[0].token_ids) == num_tokens_before_fault
    forked = results.pop("forked")                                  # ...and took none of them down
    assert forked.error is None and [c.token_ids for c in forked.outputs] == sampled_alone
    for request_id, output in results.items():
        completion = output.outputs[0]
        assert output.error is None and completion.finish_reason == "length"
        assert completion.token_ids == alone[prompts[int(request_id[1:])]]
    assert pool_is_whole(engine) and not engine._tracked
    assert "injected fault" in caplog.text and SECRET not in caplog.text and POISON not in caplog.text


def test_requests_that_read_a_failing_requests_blocks_in_its_step_recompute_them(tiny_model_dir, caplog):
    """A prompt admitted beside another that shares its prefix hits the blocks that step computes (cached ahead).
    When the writer's run raises, those blocks may hold nothing: their hashes are taken back and the readers wait
    again and recompute, so they answer as alone; the writer fails alone, and nothing unsure stays cached."""
    engine = build_tiny_engine(tiny_model_dir, num_blocks=64)
    shared = "a system prompt long enough to fill three blocks of sixteen bytes, then "
    prompts = {"writer": shared + "W", "reader-1": shared + "first", "reader-2": shared + "second"}
    alone = served_alone(engine, list(prompts.values()) + [shared + "later"], 8)
    assert engine.reset_prefix_cache()

    class FailingWriter:
        def __init__(self, runner):
            self.runner = runner

        def __getattr__(self, name):
            return getattr(self.runner, name)

        def run(self, scheduled):
            if any(s.request_id == "writer" for s in scheduled):
                raise RuntimeError("injected fault in the writer's run")
            return self.runner.run(scheduled)

    engine.runner = FailingWriter(engine.runner)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    with caplog.at_level(logging.WARNING):
        results = _step_to_the_end(engine)
    assert "2 that read blocks computed in the same step wait again" in caplog.text
    writer = results.pop("writer")
    assert writer.outputs[0].finish_reason == "abort" and "writer's run" in writer.error
    for request_id, output in results.items():
        assert output.error is None and output.outputs[0].token_ids == alone[prompts[request_id]]
    engine.add_request("later", shared + "later", params)          # hits only blocks a step did compute
    later = _step_to_the_end(engine)["later"]
    assert later.num_cached_tokens > 0 and later.outputs[0].token_ids == alone[shared + "later"]
    assert pool_is_whole(engine) and not engine._tracked


def test_a_failing_prepare_fails_the_whole_step(tiny_model_dir):
    """The block moves run once, before any forward pass; when they fail, every request of the step fails."""
    engine = build_tiny_engine(tiny_model_dir, num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    real_prepare = engine.runner.prepare

    def prepare(out):
        if len(out.scheduled) > 1:
            raise RuntimeError("injected fault in the block moves")
        real_prepare(out)
    engine.runner.prepare = prepare
    for i in range(3):
        engine.add_request(f"r{i}", f"request {i}", params)
    results = _step_to_the_end(engine)
    assert set(results) == {"r0", "r1", "r2"}
    assert all(o.outputs[0].finish_reason == "abort" and "block moves" in o.error for o in results.values())
    assert pool_is_whole(engine) and not engine._tracked


def _failing_prompt(engine, failure: str) -> str:
    """A prompt that fails before its first sampled token: too big for the KV pool, or a runner fault."""
    if failure == "runner-fault":
        _poison(engine)
        return f"{POISON} go"
    return "x" * (engine.kv_cache_manager.num_usable_blocks * 16 + 1)    # the whole pool holds one token less


@pytest.mark.parametrize("failure", ["too-big-for-the-pool", "runner-fault"])
def test_an_n3_request_that_fails_before_it_forks_is_answered_offline(tiny_model_dir, failure):
    engine = build_tiny_engine(tiny_model_dir, num_blocks=8)          # 7 usable blocks of 16 tokens
    llm = offline(engine)
    bad = _failing_prompt(engine, failure)
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    single = llm.generate([bad], SamplingParams(max_tokens=5), use_tqdm=False)[0]     # the n == 1 contract
    outputs = llm.generate(["fine one", bad, "fine two"], params, use_tqdm=False)
    assert [c.finish_reason for c in single.outputs] == ["abort"]
    failed = outputs[1]
    assert failed.finished and failed.error == single.error
    assert [(c.index, c.finish_reason, c.token_ids) for c in failed.outputs] == [(i, "abort", []) for i in range(3)]
    for output in (outputs[0], outputs[2]):                            # the others in the same call finish
        assert output.error is None and [len(c.token_ids) for c in output.outputs] == [5, 5, 5]
    assert (failure == "runner-fault") == ("injected fault" in (failed.error or ""))
    assert not engine._tracked and pool_is_whole(engine)


@pytest.mark.parametrize("failure", ["too-big-for-the-pool", "runner-fault"])
def test_an_n2_request_that_fails_before_it_forks_is_answered_by_the_async_engine(tiny_model_dir, failure):
    engine = build_tiny_engine(tiny_model_dir, num_blocks=8)
    bad = _failing_prompt(engine, failure)
    params = SamplingParams(n=2, max_tokens=5, ignore_eos=True)

    async def serve() -> list:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            return [o async for o in async_engine.generate("bad", bad, params)]
        finally:
            async_engine.shutdown()

    if failure == "runner-fault":
        with pytest.raises(RequestFailedError, match="injected fault"):
            asyncio.run(asyncio.wait_for(serve(), 30))
    else:
        (output,) = asyncio.run(asyncio.wait_for(serve(), 30))
        assert output.finished and [c.finish_reason for c in output.outputs] == ["abort", "abort"]
    assert not engine._tracked and pool_is_whole(engine)


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
    real_run, calls = engine.runner.run, []

    def run(scheduled):     # the 10th step of the stream fails
        calls.append(1)
        if len(calls) == 10:
            raise RuntimeError("injected fault at step 10")
        return real_run(scheduled)
    engine.runner.run = run
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
