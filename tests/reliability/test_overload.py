"""Overload: many more requests than the KV pool holds, under each preemption mode.

Every request completes and none fails; every greedy result equals the same prompt served alone; preemptions
happen and are counted; latency stays bounded (no starvation); a high-priority request skips the queue (counted
in engine steps, which another process on the machine's cores does not stretch).
CI: 200 requests at concurrency 64; `make stress`: 1,000 at 256. Both against a pool of about 10% of the
concurrent demand. The stress run writes its figures to .stress/overload-<mode>.json for docs/reliability.md."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from pagedllm.sampling_params import SamplingParams
from tests.entrypoints.server_utils import metric, scrape, start_server, wait_until
from tests.reliability.tiny_server import STRESS, build_tiny_engine, random_prompts, served_alone

NUM_REQUESTS, CONCURRENCY = (1000, 256) if STRESS else (200, 64)
NUM_DISTINCT = 100 if STRESS else 50
MAX_TOKENS = 48
BLOCK_SIZE = 16
MAX_PROMPT_LEN = 48
BLOCKS_PER_REQUEST = -(-(MAX_PROMPT_LEN + MAX_TOKENS) // BLOCK_SIZE)       # 6
NUM_BLOCKS = max(BLOCKS_PER_REQUEST + 2, CONCURRENCY * BLOCKS_PER_REQUEST // 10)
PROMPTS = random_prompts(NUM_DISTINCT, seed=7, min_len=16, max_len=MAX_PROMPT_LEN)
RESULTS = Path(".stress")


@pytest.fixture(scope="module")
def alone(tiny_model_dir) -> dict[str, list[int]]:
    return served_alone(build_tiny_engine(tiny_model_dir, num_blocks=64), PROMPTS, MAX_TOKENS)


def _engine(folder, mode: str):
    """The tiny engine with a pool of 10% of the demand; swap and auto get a swap pool (a refusal fails)."""
    swap_space = 0.0 if mode == "recompute" else 0.05      # GiB; the tiny model's blocks are 8 KiB
    engine = build_tiny_engine(folder, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, preemption_mode=mode,
                               swap_space=swap_space, scheduling_policy="priority")
    assert mode == "recompute" or engine.config.cache.num_swap_blocks > 0, f"{mode}: no swap pool"
    return engine


def _record_decisions(scheduler) -> Counter:
    """Count each preemption's mode as the scheduler decides it, beside what the cost model predicts from the
    scheduler's own rates at that moment: {(decided, predicted): count}."""
    decisions: Counter = Counter()
    decide = scheduler._preemption_mode

    def spy(request):
        mode = decide(request)
        decisions[mode, _cost_model_choice(scheduler, request)] += 1
        return mode
    scheduler._preemption_mode = spy
    return decisions


def _count_swapped_blocks(runner) -> Counter:
    """Count the blocks each step hands the runner to move: {"out": device -> swap pool, "in": back}."""
    moved: Counter = Counter()
    prepare = runner.prepare

    def spy(scheduler_output):
        moved["out"] += len(scheduler_output.blocks_to_swap_out)
        moved["in"] += len(scheduler_output.blocks_to_swap_in)
        return prepare(scheduler_output)
    runner.prepare = spy
    return moved


def _record_waits(scheduler) -> dict[int, list[int]]:
    """Each request's wait in engine steps, from its arrival to its first step, by its priority: a count of steps
    does not stretch when another process takes the machine's cores, as seconds do."""
    waits: dict[int, list[int]] = {}
    arrived: dict[str, tuple[int, int]] = {}    # request id -> (step count at arrival, priority)
    steps = [0]
    add, schedule = scheduler.add_request, scheduler.schedule

    def add_spy(request):
        arrived[request.request_id] = (steps[0], request.priority)
        return add(request)

    def schedule_spy():
        output = schedule()
        steps[0] += 1
        for scheduled in output.scheduled:
            if scheduled.request_id in arrived:
                step, priority = arrived.pop(scheduled.request_id)
                waits.setdefault(priority, []).append(steps[0] - step)
        return output
    scheduler.add_request, scheduler.schedule = add_spy, schedule_spy
    return waits


def _cost_model_choice(scheduler, request) -> str:
    """Swap when moving the blocks out and back costs less than recomputing them (the module docstring of
    pagedllm/core/sched/scheduler.py), unless the request cannot swap."""
    config, manager = scheduler.config, scheduler.kv_cache_manager
    if request.num_computed_tokens == request.num_tokens or not manager.can_swap_out(request):
        return "recompute"
    num_blocks = -(-request.num_computed_tokens // manager.block_size)
    swap_cost = 2 * num_blocks * config.swap_seconds_per_block
    return "swap" if swap_cost < request.num_computed_tokens * config.recompute_seconds_per_token else "recompute"


async def _one(client: httpx.AsyncClient, prompt: str, priority: int = 0) -> tuple[str, list[int] | None, float]:
    started = time.monotonic()
    response = await client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "priority": priority,
        "logprobs": 0})
    elapsed = time.monotonic() - started
    if response.status_code != 200:
        return f"{response.status_code}: {response.text[:200]}", None, elapsed
    choice = response.json()["choices"][0]
    return choice["finish_reason"], choice["logprobs"]["tokens"], elapsed


async def _load(base_url: str) -> tuple[list, tuple, float]:
    semaphore = asyncio.Semaphore(CONCURRENCY)
    # keepalive_expiry under the server's 5 s: never reuse a connection the server is closing.
    limits = httpx.Limits(max_connections=CONCURRENCY + 8, max_keepalive_connections=CONCURRENCY + 8,
                          keepalive_expiry=2)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        async def gated(prompt: str):
            async with semaphore:
                return await _one(client, prompt)

        async def high_priority():
            # Submitted once the queue is deep: it must not wait behind the low-priority requests ahead of it.
            await asyncio.sleep(0.3 * NUM_REQUESTS / CONCURRENCY * 0.2)
            return await _one(client, PROMPTS[0], priority=-10)
        started = time.monotonic()
        tasks = [gated(PROMPTS[i % NUM_DISTINCT]) for i in range(NUM_REQUESTS)]
        *results, urgent = await asyncio.gather(*tasks, high_priority())
        return results, urgent, time.monotonic() - started


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_overload_loses_nothing(tiny_model_dir, alone, mode):
    engine = _engine(tiny_model_dir, mode)
    decisions, moved = _record_decisions(engine.scheduler), _count_swapped_blocks(engine.runner)
    waits = _record_waits(engine.scheduler)
    tokenizer = engine.tokenizer
    server = start_server(engine, api_key=None)
    try:
        results, urgent, wall = asyncio.run(_load(server.base_url))
        assert wait_until(lambda: metric(scrape(server.base_url), "pagedllm:num_requests_running") == 0)
        values = scrape(server.base_url)
    finally:
        server.stop()
    errors = [r[0] for r in results if r[0] != "length"]
    assert not errors, errors[:5]
    for i, (_, tokens, _) in enumerate(results):
        expected = [tokenizer.decode([t]) for t in alone[PROMPTS[i % NUM_DISTINCT]]]
        assert tokens == expected, f"request {i} differs from the same prompt served alone"
    preemptions = engine.scheduler.num_preemptions
    assert preemptions > 0, "the pool was meant to be too small"
    assert metric(values, "pagedllm:num_preemptions_total") == preemptions
    by_mode = engine.scheduler.num_preemptions_by_mode
    assert by_mode == {m: sum(n for (d, _), n in decisions.items() if d == m) for m in ("recompute", "swap")}
    if mode == "recompute":
        assert by_mode["swap"] == 0 and moved["out"] == moved["in"] == 0
    elif mode == "swap":                    # the swap pool never fills here: every preemption swaps
        assert by_mode == {"recompute": 0, "swap": preemptions}
        assert moved["out"] > 0 and moved["in"] == moved["out"], moved     # all that went out came back
    else:                                   # auto: every choice is the cost model's
        assert all(decided == predicted for decided, predicted in decisions), decisions
    leaked = metric(values, "pagedllm:num_blocks_total") - metric(values, "pagedllm:num_blocks_free")
    assert leaked == 0
    latencies = sorted(r[2] for r in results)
    p50, p99 = latencies[len(latencies) // 2], latencies[int(0.99 * (len(latencies) - 1))]
    # Little's law: with CONCURRENCY requests always in flight, the mean latency is wall x CONCURRENCY / N.
    # A starved request would sit far beyond it.
    littles_mean = wall * CONCURRENCY / NUM_REQUESTS
    assert latencies[-1] <= 5 * littles_mean, (latencies[-1], littles_mean)
    # The high-priority request skips the queue, the swapped requests too: its first step comes within ~10 steps
    # of its arrival (none admits anyone while steps preempt), never after the median request's wait (~270).
    (urgent_wait,), median_wait = waits[-10], statistics.median(waits[0])
    assert urgent[0] == "length" and urgent_wait * 3 < median_wait, (urgent_wait, median_wait)
    figures = dict(mode=mode, requests=NUM_REQUESTS, concurrency=CONCURRENCY, kv_blocks=NUM_BLOCKS,
                   demand_blocks=CONCURRENCY * BLOCKS_PER_REQUEST, preemptions=preemptions,
                   preemptions_by_mode=dict(engine.scheduler.num_preemptions_by_mode), errors=len(errors),
                   leaked_blocks=int(leaked), wall_s=round(wall, 2), p50_s=round(p50, 3), p99_s=round(p99, 3),
                   max_s=round(latencies[-1], 3), high_priority_s=round(urgent[2], 3),
                   mean_s=round(statistics.mean(latencies), 3))
    print("overload", json.dumps(figures))
    if STRESS:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"overload-{mode}.json").write_text(json.dumps(figures, indent=2))


def test_priority_under_load_at_the_engine(tiny_model_dir):
    """Deterministic: a high-priority request added under load finishes no later than any low-priority request
    that was still waiting when it arrived, and it is never preempted."""
    engine = build_tiny_engine(tiny_model_dir, num_blocks=4 * BLOCKS_PER_REQUEST, block_size=BLOCK_SIZE,
                               scheduling_policy="priority")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:40]):
        engine.add_request(f"low-{i}", prompt, params, priority=0)
    finished_at: dict[str, int] = {}
    step = 0

    def run_step() -> None:
        nonlocal step
        step += 1
        for output in engine.step():
            if output.finished:
                assert output.outputs[0].finish_reason == "length", output
                finished_at[output.request_id] = step
    for _ in range(5):
        run_step()
    waiting = {r.request_id for r in engine.scheduler.waiting}
    assert len(waiting) > 10
    engine.add_request("high", PROMPTS[40], params, priority=-1)
    high = engine.scheduler.requests["high"]
    while engine.has_unfinished_requests():
        run_step()
        engine.kv_cache_manager.check_integrity()
    assert high.num_preemptions == 0
    assert all(finished_at["high"] <= finished_at[r] for r in waiting)
    assert len(finished_at) == 41
