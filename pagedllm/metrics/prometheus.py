"""Prometheus metrics under vLLM's names with the prefix `pagedllm:`, each labelled with model_name (and with
data parallelism, `replica`: "0", "1", ...).

Each server owns a `CollectorRegistry`, so tests (or one process serving two apps) never clash in the global
registry. `record()` is called from the engine thread after each step; prometheus_client is thread safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from pagedllm.engine.admission import REASONS
from pagedllm.metrics.stats import IterationStats, SchedulerStats, SpecDecodingStats

PREFIX = "pagedllm:"
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")     # vLLM's engine_sleep_state series

# No `*_created` series next to each counter (as in vLLM): they double the scrape for nothing.
disable_created_metrics()

# vLLM's buckets, in seconds.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]
# KV block residency, vLLM's: millisecond reuse gaps up to half-hour lifetimes
_RESIDENCY_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600,
                      1200, 1800]
_STEP_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def _one_two_five(limit: int) -> list[int]:
    """vLLM's buckets of token counts: 1, 2, 5, 10, 20, 50, ... up to `limit`."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return buckets
            buckets.append(step * scale)
        scale *= 10


class PrometheusStatLogger:
    """Turns SchedulerStats and IterationStats into gauges, counters and histograms.

    Args:
        model_name: the value of every metric's model_name label.
        registry: where the metrics live; a fresh one when None.
        swap_space_bytes: the size of the swap pool (0: none), a fixed gauge (per replica).
        data_parallel_size: replicas behind the server; above 1 every metric also has a `replica` label ("0",
            "1", ...) and `record` takes the replica's index.
        max_model_len: the largest token count the token histograms' buckets (1, 2, 5, 10, ...) reach.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, swap_space_bytes: int = 0,
                 data_parallel_size: int = 1, max_model_len: int = 8192) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        label_names = ["model_name"] + (["replica"] if data_parallel_size > 1 else [])
        families = _Families(self.registry, label_names, max_model_len)
        label_values = [[model_name]] if data_parallel_size == 1 else \
            [[model_name, str(index)] for index in range(data_parallel_size)]
        self._replicas = [_ReplicaMetrics(families, values, swap_space_bytes) for values in label_values]
        refusals = Counter(PREFIX + "admission_rejections", "Requests refused by a queue limit, by limit.",
                           ["model_name", "reason"], registry=self.registry)
        self._refusals = {reason: refusals.labels(model_name, reason) for reason in REASONS}

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats | None,
               replica: int = 0) -> None:
        """Record one step of one replica (the only one without data parallelism)."""
        self._replicas[replica].record(scheduler_stats, iteration)

    def record_admission_rejection(self, reason: str) -> None:
        """Count a request the server's front refused (`reason`: the queue limit, pagedllm.engine.admission)."""
        self._refusals[reason].inc()


class _Families:
    """The metric families, each registered once, labelled `label_names`; `_ReplicaMetrics` takes their children."""

    def __init__(self, registry: CollectorRegistry, label_names: list[str], max_model_len: int) -> None:
        self.registry, self.label_names = registry, label_names

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, label_names, registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*label_names, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, label_names, buckets=buckets, registry=registry)

        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_swapped = gauge("num_requests_swapped", "Requests whose KV blocks are swapped out.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.blocks_free = gauge("num_blocks_free", "Free KV-cache blocks (cached-but-unused count as free).")
        self.blocks_total = gauge("num_blocks_total", "KV-cache blocks in the pool.")
        self.swap_blocks_used = gauge("num_swap_blocks_used", "Swap-pool blocks holding swapped-out KV.")
        self.swap_blocks_total = gauge("num_swap_blocks_total", "Blocks in the swap pool (0: no swap pool).")
        self.swap_space_bytes = gauge("swap_space_bytes", "Size of the swap pool in bytes (0: no swap pool).")
        self.preemptions = counter("num_preemptions", "Requests preempted, by mode.", ("mode",))
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache, once per request admitted.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Requests finished, by finish reason.",
                                       ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a request.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS)
        # vLLM's per-request histograms: its phases, its sizes, and each step's tokens
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                      _REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last.", _REQUEST_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to finished.",
                                        _REQUEST_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "A request's decode time per output token after its first.", _ITL_BUCKETS)
        sizes = _one_two_five(max_model_len)
        self.prompt_length = histogram("request_prompt_tokens", "A request's prompt tokens.", sizes)
        self.generation_length = histogram("request_generation_tokens", "A request's generated tokens.", sizes)
        self.max_generation_length = histogram("request_max_num_generation_tokens",
                                               "A request's longest completion, in tokens.", sizes)
        self.max_tokens_param = histogram("request_params_max_tokens", "A request's max_tokens.", sizes)
        self.n_param = histogram("request_params_n", "A request's n.", [1, 2, 5, 10, 20])
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens an engine step ran.", _STEP_BUCKETS)
        self.sleep_state = Gauge(PREFIX + "engine_sleep_state", "vLLM's sleep state, one series a state: awake 1 "
                                 "when awake; weights_offloaded 1 at sleep level 1, discard_all 1 at level 2 (both 0 "
                                 "and awake 0 at level 0).", [*label_names, "sleep_state"], registry=registry)
        self._spec: _SpecDecodingFamilies | None = None
        self._lora_info: Gauge | None = None
        self._residency: tuple[Histogram, Histogram, Histogram] | None = None

    @property
    def residency(self) -> tuple[Histogram, Histogram, Histogram]:
        """vLLM's KV block residency histograms (lifetime, idle before reuse, reuse gaps), made at the first stats
        with `--kv-cache-metrics` on: without it, no such series."""
        if self._residency is None:
            sampled = " Of a sample of the blocks (--kv-cache-metrics-sample)."
            self._residency = tuple(Histogram(PREFIX + name, doc + sampled, self.label_names,
                                              buckets=_RESIDENCY_BUCKETS, registry=self.registry) for name, doc in (
                ("kv_block_lifetime_seconds", "A KV block's life, from its allocation to its memory's reuse."),
                ("kv_block_idle_before_evict_seconds", "How long a KV block went unread before its memory's reuse."),
                ("kv_block_reuse_gap_seconds", "Time between two reads of a KV block (prefix-cache hits).")))
        return self._residency

    @property
    def lora_info(self) -> Gauge:
        """vLLM's `lora_requests_info`, made at the first stats with LoRA on: a series per (max_lora, waiting
        adapters, running adapters), the names comma-joined, whose value is when that set was last seen (the newest
        is the present; LoRA-aware routers read it)."""
        if self._lora_info is None:
            self._lora_info = Gauge(PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
                                    [*self.label_names, "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                                    registry=self.registry)
        return self._lora_info

    @property
    def spec(self) -> _SpecDecodingFamilies:
        """Made at the first stats with speculative decoding on: without it, no spec_decode series."""
        if self._spec is None:
            self._spec = _SpecDecodingFamilies(self.registry, self.label_names)
        return self._spec


class _ReplicaMetrics:
    """One replica's series (all of them without data parallelism) and its last cumulative stats."""

    def __init__(self, families: _Families, label_values: list[str], swap_space_bytes: int) -> None:
        self.families, self.label_values = families, label_values
        def series(family):
            return family.labels(*label_values)

        f = families
        self.num_running, self.num_waiting = series(f.num_running), series(f.num_waiting)
        self.num_swapped, self.kv_usage = series(f.num_swapped), series(f.kv_usage)
        self.blocks_free, self.blocks_total = series(f.blocks_free), series(f.blocks_total)
        self.swap_blocks_used, self.swap_blocks_total = series(f.swap_blocks_used), series(f.swap_blocks_total)
        self.prefix_queries, self.prefix_hits = series(f.prefix_queries), series(f.prefix_hits)
        self.prompt_tokens, self.generation_tokens = series(f.prompt_tokens), series(f.generation_tokens)
        self.ttft, self.itl = series(f.ttft), series(f.itl)
        self.e2e, self.queue_time = series(f.e2e), series(f.queue_time)
        self.prefill_time, self.decode_time = series(f.prefill_time), series(f.decode_time)
        self.inference_time, self.tpot = series(f.inference_time), series(f.tpot)
        self.prompt_length, self.generation_length = series(f.prompt_length), series(f.generation_length)
        self.max_generation_length = series(f.max_generation_length)
        self.max_tokens_param, self.n_param = series(f.max_tokens_param), series(f.n_param)
        self.iteration_tokens = series(f.iteration_tokens)
        self.sleep_states = {state: f.sleep_state.labels(*label_values, state) for state in SLEEP_STATES}
        self._record_sleep(None)
        series(f.swap_space_bytes).set(swap_space_bytes)
        for reason in ("stop", "length", "abort"):
            f.request_success.labels(*label_values, reason)
        self._last: SchedulerStats | None = None
        self._spec: _SpecDecodingMetrics | None = None

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self._record_scheduler(scheduler_stats)
        if iteration is not None:
            self._record_iteration(iteration)

    def _record_sleep(self, level: int | None) -> None:
        awake, offloaded, discarded = level is None, level == 1, level == 2
        for state, value in zip(SLEEP_STATES, (awake, offloaded, discarded), strict=True):
            self.sleep_states[state].set(int(value))

    def _record_scheduler(self, stats: SchedulerStats) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.num_swapped.set(stats.num_swapped)
        self.kv_usage.set(stats.kv_cache_usage)
        self.blocks_free.set(stats.num_blocks_free)
        self.blocks_total.set(stats.num_blocks_total)
        self.swap_blocks_used.set(stats.num_swap_blocks_total - stats.num_swap_blocks_free)
        self.swap_blocks_total.set(stats.num_swap_blocks_total)
        self._record_sleep(stats.sleep_level)
        last = self._last or SchedulerStats()
        # The core keeps cumulative counts; a Prometheus counter takes increments.
        for mode, count in stats.num_preemptions_total.items():
            _inc(self.families.preemptions.labels(*self.label_values, mode),
                 count - last.num_preemptions_total.get(mode, 0))
        _inc(self.prefix_queries, stats.prefix_cache_queries_total - last.prefix_cache_queries_total)
        _inc(self.prefix_hits, stats.prefix_cache_hits_total - last.prefix_cache_hits_total)
        if stats.max_loras is not None:
            self.families.lora_info.labels(*self.label_values, str(stats.max_loras),
                                           ",".join(stats.waiting_lora_adapters),
                                           ",".join(stats.running_lora_adapters)).set_to_current_time()
        if stats.kv_block_residencies is not None:
            lifetime, idle, gap = (family.labels(*self.label_values) for family in self.families.residency)
            for residency in stats.kv_block_residencies:
                lifetime.observe(residency.lifetime)
                idle.observe(residency.idle)
                for value in residency.reuse_gaps:
                    gap.observe(value)
        if stats.spec_decoding is not None:
            if self._spec is None:
                self._spec = _SpecDecodingMetrics(self.families.spec, self.label_values)
            self._spec.record(stats.spec_decoding, last.spec_decoding or SpecDecodingStats())
        self._last = stats

    def _record_iteration(self, it: IterationStats) -> None:
        if it.num_step_tokens:
            self.iteration_tokens.observe(it.num_step_tokens)
        _inc(self.prompt_tokens, it.num_prompt_tokens)
        _inc(self.generation_tokens, it.num_generation_tokens)
        for value in it.time_to_first_tokens:
            self.ttft.observe(value)
        for value in it.inter_token_latencies:
            self.itl.observe(value)
        for value in it.queue_times:
            self.queue_time.observe(value)
        for finished in it.finished:
            self.families.request_success.labels(*self.label_values, finished.finish_reason).inc()
            self.e2e.observe(finished.e2e_latency)
            for histogram, value in ((self.prefill_time, finished.prefill_time),
                                     (self.decode_time, finished.decode_time),
                                     (self.inference_time, finished.inference_time),
                                     (self.tpot, finished.time_per_output_token),
                                     (self.max_tokens_param, finished.max_tokens), (self.n_param, finished.n)):
                if value is not None:
                    histogram.observe(value)
            self.prompt_length.observe(finished.num_prompt_tokens)
            self.generation_length.observe(finished.num_generation_tokens)
            self.max_generation_length.observe(finished.max_num_generation_tokens)


class _SpecDecodingFamilies:
    """vLLM's speculative decoding counters: acceptance rate = accepted / draft tokens, mean acceptance length =
    1 + accepted tokens / drafts."""

    def __init__(self, registry: CollectorRegistry, label_names: list[str]) -> None:
        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*label_names, *extra], registry=registry)

        self.num_drafts = counter("spec_decode_num_drafts", "Draft runs verified.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position.",
                               ("position",))


class _SpecDecodingMetrics:
    """One replica's speculative decoding series."""

    def __init__(self, families: _SpecDecodingFamilies, label_values: list[str]) -> None:
        self.families, self.label_values = families, label_values
        self.num_drafts = families.num_drafts.labels(*label_values)
        self.num_draft_tokens = families.num_draft_tokens.labels(*label_values)
        self.num_accepted_tokens = families.num_accepted_tokens.labels(*label_values)

    def record(self, stats: SpecDecodingStats, last: SpecDecodingStats) -> None:
        _inc(self.num_drafts, stats.num_drafts - last.num_drafts)
        _inc(self.num_draft_tokens, stats.num_draft_tokens - last.num_draft_tokens)
        _inc(self.num_accepted_tokens, stats.num_accepted_tokens - last.num_accepted_tokens)
        previous = last.num_accepted_tokens_per_pos
        for position, count in enumerate(stats.num_accepted_tokens_per_pos):
            before = previous[position] if position < len(previous) else 0
            _inc(self.families.per_pos.labels(*self.label_values, str(position)), count - before)


def _inc(counter: Counter, amount: float) -> None:
    if amount > 0:
        counter.inc(amount)
