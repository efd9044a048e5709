"""Prometheus metrics: the logger on its own, the core snapshot, and figures moving on a live server."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import generate_latest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.stats import IterationStats, RequestTimes, SchedulerStats
from pagedllm.sampling_params import SamplingParams
from tests.entrypoints.server_utils import RunningServer, metric, scrape, wait_until


def _values(stat_logger: PrometheusStatLogger) -> dict[str, float]:
    values = {}
    for line in generate_latest(stat_logger.registry).decode().splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def test_two_loggers_do_not_clash_and_counters_take_increments():
    first, second = PrometheusStatLogger("a"), PrometheusStatLogger("b")
    stats = SchedulerStats(num_running=2, num_waiting=1, num_blocks_free=30, num_blocks_total=40,
                           num_preemptions_total={"recompute": 3}, prefix_cache_queries_total=64,
                           prefix_cache_hits_total=32)
    iteration = IterationStats()
    times = RequestTimes(arrival=0.0, num_prompt_tokens=5)
    times.on_scheduled(iteration, 0.1)
    times.on_tokens(iteration, 1, 0.5)
    times.on_tokens(iteration, 1, 0.7)
    times.on_finished(iteration, "length", 0.7)
    first.record(stats, iteration)
    first.record(stats, None)                   # cumulative core counters unchanged: no double counting
    values = _values(first)
    assert metric(values, "pagedllm:num_requests_running") == 2
    assert metric(values, "pagedllm:kv_cache_usage_perc") == pytest.approx(0.25)
    assert metric(values, "pagedllm:num_preemptions_total", mode="recompute") == 3
    assert metric(values, "pagedllm:prefix_cache_hits_total") == 32
    assert metric(values, "pagedllm:prompt_tokens_total") == 5
    assert metric(values, "pagedllm:generation_tokens_total") == 2
    assert metric(values, "pagedllm:request_success_total", finished_reason="length") == 1
    assert metric(values, "pagedllm:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert metric(values, "pagedllm:inter_token_latency_seconds_sum") == pytest.approx(0.2)
    assert metric(values, "pagedllm:request_queue_time_seconds_sum") == pytest.approx(0.1)
    assert metric(values, "pagedllm:e2e_request_latency_seconds_count") == 1
    assert metric(_values(second), "pagedllm:prompt_tokens_total", model_name="b") == 0


def test_vllms_request_histograms_take_each_phase_and_size():
    stat_logger = PrometheusStatLogger("m", max_model_len=100)
    iteration, idle = IterationStats(num_step_tokens=24), IterationStats()
    times = RequestTimes(arrival=0.0, num_prompt_tokens=20, max_tokens=30, n=2)
    times.on_scheduled(iteration, 0.5)
    times.on_tokens(iteration, 2, 1.0, [(0, 1), (1, 1)])        # the first token of each completion
    times.on_tokens(iteration, 3, 2.0, [(0, 2), (1, 1)])
    times.on_tokens(iteration, 1, 2.5, [(0, 1)])                # completion 0: 4 tokens, completion 1: 2
    times.on_finished(iteration, "length", 3.0)
    never = RequestTimes(arrival=0.0, num_prompt_tokens=7)      # aborted in the queue: no phase but its queue
    never.on_finished(iteration, "abort", 1.0)
    stat_logger.record(SchedulerStats(), iteration)
    stat_logger.record(SchedulerStats(), idle)                  # a loop without a step: no step observed
    values = _values(stat_logger)
    assert metric(values, "pagedllm:request_prefill_time_seconds_sum") == pytest.approx(0.5)
    assert metric(values, "pagedllm:request_decode_time_seconds_sum") == pytest.approx(1.5)
    assert metric(values, "pagedllm:request_inference_time_seconds_sum") == pytest.approx(2.5)
    assert metric(values, "pagedllm:request_time_per_output_token_seconds_sum") == pytest.approx(1.5 / 3)
    assert metric(values, "pagedllm:request_prefill_time_seconds_count") == 1       # the aborted one had none
    assert metric(values, "pagedllm:request_prompt_tokens_sum") == 27
    assert metric(values, "pagedllm:request_prompt_tokens_count") == 2
    assert metric(values, "pagedllm:request_generation_tokens_sum") == 6
    assert metric(values, "pagedllm:request_max_num_generation_tokens_sum") == 4
    assert metric(values, "pagedllm:request_params_max_tokens_sum") == 30
    assert metric(values, "pagedllm:request_params_n_sum") == 2
    assert metric(values, "pagedllm:request_params_n_count") == 1              # an embedding's has none
    assert metric(values, "pagedllm:iteration_tokens_total_sum") == 24
    assert metric(values, "pagedllm:iteration_tokens_total_count") == 1
    buckets = [key for key in values if key.startswith("pagedllm:request_prompt_tokens_bucket")]
    assert [key.split('le="')[1].split('"')[0] for key in buckets] == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0",
                                                                      "100.0", "+Inf"]


def test_scheduler_snapshot_reads_the_core():
    kv = KVCacheManager(num_blocks=11, block_size=4, enable_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64), kv)
    for i in range(2):
        scheduler.add_request(Request(f"r{i}", list(range(1 + 10 * i, 10 + 10 * i)), SamplingParams(max_tokens=4)))
    assert scheduler.make_stats().num_waiting == 2 and scheduler.make_stats().scheduled_request_ids == []
    scheduler.schedule()
    stats = scheduler.make_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_total) == (2, 0, 10)
    assert stats.num_blocks_free == 10 - 2 * 3
    assert stats.prefix_cache_queries_total == kv.prefix_cache_stats.num_query_tokens > 0
    assert stats.scheduled_request_ids == ["r0", "r1"] and stats.num_scheduled_tokens == 18
    # 9 prompt tokens each in 3 blocks of 4 slots: 12 slots held, 9 filled once the step's tokens are computed
    assert stats.num_kv_slots_running == 2 * 12 and stats.num_kv_slots_filled == 0


@pytest.mark.slow
def test_live_figures_move(server: RunningServer):
    url, headers = server.base_url, server.headers
    assert wait_until(lambda: metric(scrape(url), "pagedllm:num_requests_running") == 0)
    before = scrape(url)
    total = metric(before, "pagedllm:num_blocks_total")
    assert total > 0 and metric(before, "pagedllm:num_blocks_free") == total     # cached blocks count as free
    prompt = ("Count slowly from one to one hundred, one number per line, please. Do not skip any number, and do "
              "not add any words between the numbers: just the numbers themselves.")
    num_prompt_tokens = len(server.engine.tokenizer.encode(prompt))
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        during = scrape(url)                                # the request is running now
        assert metric(during, "pagedllm:num_requests_running") == 1
        assert metric(during, "pagedllm:num_blocks_free") < total
        assert metric(during, "pagedllm:kv_cache_usage_perc") > 0
        assert [line for line in lines if line][-1] == "data: [DONE]"
    assert wait_until(lambda: metric(scrape(url), "pagedllm:num_requests_running") == 0)
    after = scrape(url)

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("pagedllm:prompt_tokens_total") == num_prompt_tokens
    assert grew("pagedllm:generation_tokens_total") == 40
    assert grew("pagedllm:request_success_total", finished_reason="length") == 1
    assert grew("pagedllm:time_to_first_token_seconds_count") == 1
    assert grew("pagedllm:request_queue_time_seconds_count") == 1
    assert grew("pagedllm:e2e_request_latency_seconds_count") == 1
    assert grew("pagedllm:inter_token_latency_seconds_count") == 39
    assert grew("pagedllm:request_prompt_tokens_sum") == num_prompt_tokens
    assert grew("pagedllm:request_generation_tokens_sum") == 40
    assert grew("pagedllm:request_params_max_tokens_sum") == 40
    assert grew("pagedllm:request_decode_time_seconds_count") == 1
    assert grew("pagedllm:iteration_tokens_total_sum") >= num_prompt_tokens + 39
    assert grew("pagedllm:prefix_cache_queries_total") >= num_prompt_tokens
    assert metric(after, "pagedllm:num_blocks_free") == total

    # The same prompt again: its full blocks come from the prefix cache.
    hits = metric(after, "pagedllm:prefix_cache_hits_total")
    httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 2}, headers=headers, timeout=60)
    assert num_prompt_tokens > 32
    assert metric(scrape(url), "pagedllm:prefix_cache_hits_total") >= hits + 32


def test_spec_decode_counters_appear_only_with_speculation_and_take_increments():
    from pagedllm.metrics.stats import SpecDecodingStats

    stat_logger = PrometheusStatLogger("m")
    stat_logger.record(SchedulerStats(), None)
    assert not any("spec_decode" in key for key in _values(stat_logger))
    spec = SpecDecodingStats()
    spec.observe(3, 2)
    spec.observe(3, 0)
    stat_logger.record(SchedulerStats(spec_decoding=spec.copy()), None)
    spec.observe(2, 2)
    stat_logger.record(SchedulerStats(spec_decoding=spec.copy()), None)
    stat_logger.record(SchedulerStats(spec_decoding=spec.copy()), None)
    values = _values(stat_logger)
    assert values['pagedllm:spec_decode_num_drafts_total{model_name="m"}'] == 3
    assert values['pagedllm:spec_decode_num_draft_tokens_total{model_name="m"}'] == 8
    assert values['pagedllm:spec_decode_num_accepted_tokens_total{model_name="m"}'] == 4
    per_pos = 'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="%d"}'
    assert (values[per_pos % 0], values[per_pos % 1]) == (2, 2)
    assert (spec.acceptance_rate, spec.mean_acceptance_length) == (0.5, 1 + 4 / 3)


def test_kv_block_residency_histograms_appear_only_with_the_metrics_on():
    from pagedllm.metrics.stats import BlockResidency

    stat_logger = PrometheusStatLogger("m")
    stat_logger.record(SchedulerStats(), None)
    assert not any("kv_block" in key for key in _values(stat_logger))
    stat_logger.record(SchedulerStats(kv_block_residencies=[BlockResidency(3.0, 0.3, (0.01, 40.0)),
                                                            BlockResidency(0.5, 0.5)]), None)
    stat_logger.record(SchedulerStats(kv_block_residencies=[]), None)
    values = _values(stat_logger)
    assert values['pagedllm:kv_block_lifetime_seconds_count{model_name="m"}'] == 2
    assert values['pagedllm:kv_block_lifetime_seconds_sum{model_name="m"}'] == 3.5
    assert values['pagedllm:kv_block_idle_before_evict_seconds_bucket{le="0.5",model_name="m"}'] == 2
    assert values['pagedllm:kv_block_reuse_gap_seconds_count{model_name="m"}'] == 2
    assert values['pagedllm:kv_block_reuse_gap_seconds_bucket{le="0.01",model_name="m"}'] == 1


def test_the_engine_reports_its_blocks_residency_when_asked(tmp_path):
    """A full sample on a small pool: the blocks' memory is reused, and their lives reach the snapshots, each once."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.openai.api_server import make_parser
    from pagedllm.entrypoints.openai.cli_args import engine_config_from_args
    from tests.models.tiny import save_tiny_model

    folder, _ = save_tiny_model(tmp_path / "m")
    args = make_parser().parse_args(["--model", str(folder), "--kv-cache-metrics", "--kv-cache-metrics-sample", "1"])
    assert (engine_config_from_args(args).cache.kv_cache_metrics, args.kv_cache_metrics_sample) == (True, 1.0)
    with LLM(str(folder), dtype="float32", num_kv_blocks=16, block_size=4) as llm:
        assert llm.engine.make_stats().kv_block_residencies is None      # off by default
    with LLM(str(folder), dtype="float32", num_kv_blocks=16, block_size=4, kv_cache_metrics=True,
             kv_cache_metrics_sample=1.0) as llm:
        prompts = [{"prompt_token_ids": [3 + i + 7 * j for j in range(20)]} for i in range(4)]
        llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        ended = llm.engine.make_stats().kv_block_residencies
        assert ended and all(r.lifetime >= r.idle >= 0 for r in ended)
        assert llm.engine.make_stats().kv_block_residencies == []


def test_a_request_is_scheduled_when_its_first_step_began_and_its_response_metrics_follow():
    """The tracker dates a request's scheduling at the start of the step that first ran it (vLLM's scheduled_ts),
    not at its end; the response's per-request metrics (--enable-per-request-metrics) come from those times."""
    from pagedllm.metrics.stats import RequestStatsTracker
    from pagedllm.outputs import CompletionOutput, RequestOutput

    tracker = RequestStatsTracker()
    tracker.on_added("r", arrival=1.0, num_prompt_tokens=4)
    output = RequestOutput("r", None, [1, 2, 3, 4], [CompletionOutput(0, "", [7], None, None)])
    first = IterationStats(started=3.0)
    tracker.on_step([output], ["r"], first, now=5.0)       # queued 2 s, its prefill step took 2 s
    assert first.queue_times == [2.0] and output.metrics is None
    last = RequestOutput("r", None, [1, 2, 3, 4], [CompletionOutput(0, "", [8, 9], None, "length")], finished=True)
    tracker.on_step([last], ["r"], IterationStats(started=5.5), now=6.0)
    assert last.metrics.response_metrics() == pytest.approx({
        "time_to_first_token_ms": 2000.0, "generation_time_ms": 1000.0, "queue_time_ms": 2000.0,
        "mean_itl_ms": 500.0, "tokens_per_second": 1.0})


def test_final_outputs_take_their_tokens_from_the_engines_counts():
    """Offline outputs are final (a request's tokens all at once): the tracker times the tokens as the engine made
    them (`new_tokens`, LLMEngine.step_new_tokens), so the first token is dated at its own step, not at the end."""
    from pagedllm.metrics.stats import RequestStatsTracker
    from pagedllm.outputs import CompletionOutput, RequestOutput

    tracker = RequestStatsTracker()
    tracker.on_added("r", arrival=1.0, num_prompt_tokens=4, max_tokens=3, n=2)
    first = IterationStats(started=1.0)
    tracker.on_step([], ["r"], first, now=2.0, new_tokens={"r": {0: 1, 1: 1}})     # no output: not finished
    assert first.time_to_first_tokens == [1.0] and first.num_generation_tokens == 2
    second = IterationStats(started=2.0)
    tracker.on_step([], ["r"], second, now=3.0, new_tokens={"r": {0: 1, 1: 1}})
    assert second.inter_token_latencies == [0.5] and second.num_generation_tokens == 2
    final = RequestOutput("r", None, [1, 2, 3, 4], [CompletionOutput(0, "", [5, 6, 7], None, "length"),
                                                    CompletionOutput(1, "", [8, 9], None, "stop")], finished=True)
    last = IterationStats(started=3.0)
    tracker.on_step([final], ["r"], last, now=4.0, new_tokens={"r": {0: 1}})      # not the output's 5 tokens
    assert last.num_generation_tokens == 1 and last.inter_token_latencies == [1.0]
    (finished,) = last.finished
    assert (finished.e2e_latency, finished.prefill_time, finished.decode_time) == (3.0, 1.0, 2.0)
    assert (finished.num_generation_tokens, finished.max_num_generation_tokens) == (5, 3)


def test_the_reader_gives_each_series_as_a_record():
    """pagedllm.metrics.reader, as vLLM's `get_metrics()` records: counters and gauges by labels, a histogram's
    buckets by upper bound, the accepted drafts by position as one vector."""
    from pagedllm.metrics.reader import Counter, Gauge, Histogram, Vector, metrics_snapshot
    from pagedllm.metrics.stats import FinishedRequestStats, SpecDecodingStats

    stat_logger = PrometheusStatLogger("m")
    spec = SpecDecodingStats()
    spec.observe(3, 2)
    spec.observe(3, 1)
    iteration = IterationStats(num_generation_tokens=7, time_to_first_tokens=[0.02, 3.0])
    iteration.finished.append(FinishedRequestStats("length", 1.0, 0.1, 4, 7))
    stat_logger.record(SchedulerStats(num_running=2, spec_decoding=spec), iteration)
    records = {(r.name, tuple(sorted(r.labels.items()))): r for r in metrics_snapshot(stat_logger.registry)}
    model = (("model_name", "m"),)
    assert records["pagedllm:num_requests_running", model] == \
        Gauge("pagedllm:num_requests_running", {"model_name": "m"}, 2.0)
    assert records["pagedllm:generation_tokens", model] == Counter("pagedllm:generation_tokens", {"model_name": "m"}, 7)
    assert records["pagedllm:request_success", (("finished_reason", "length"), *model)].value == 1
    assert records["pagedllm:spec_decode_num_accepted_tokens_per_pos", model] == \
        Vector("pagedllm:spec_decode_num_accepted_tokens_per_pos", {"model_name": "m"}, [2, 1, 0])
    ttft = records["pagedllm:time_to_first_token_seconds", model]
    assert isinstance(ttft, Histogram) and (ttft.count, ttft.sum) == (2, pytest.approx(3.02))
    assert ttft.buckets["+Inf"] == 2 and ttft.buckets["0.02"] == 1 and ttft.buckets["2.5"] == 1
    assert all(r.name.startswith("pagedllm:") for r in records.values())
