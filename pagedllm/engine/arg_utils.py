"""vLLM's EngineArgs: an engine's arguments as one dataclass. `LLM(model, **kwargs)` takes its fields as keywords;
`LLM.from_engine_args`, `LLMEngine.from_engine_args` and `AsyncLLM.from_engine_args` build an engine from one, as
vLLM's do; `create_engine_config()` checks them and makes the EngineConfig the engine runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.config import (
    DEFAULT_BLOCK_SIZE,
    CacheConfig,
    DataParallelRouterPolicy,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PreemptionMode,
    ProfilerConfig,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
    StructuredOutputsConfig,
    check_vllm_loading_args,
)
from pagedllm.pooling_params import check_runner


@dataclass(kw_only=True)
class EngineArgs:
    """An engine's arguments (vLLM's `EngineArgs`); `model` may be given by position, the rest by keyword.

    Args:
        model: a Hugging Face folder, a `.gguf` file, or None for the embedded SmolLM2-135M-Instruct.
        dtype: "auto", "bfloat16", "float16" or "float32".
        max_model_len: context length cap (prompt + output).
        block_size: tokens per KV block.
        gpu_memory_utilization: fraction of device memory (of RAM on a CPU) for the engine.
        kv_cache_memory: bytes for the KV pool; overrides gpu_memory_utilization. kv_cache_memory_bytes: vLLM's
            name for it.
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: token budget of one step.
        enable_chunked_prefill: run a long prompt in chunks over several steps (False: each prompt in one step,
            which then needs max_num_batched_tokens >= max_model_len).
        max_num_encoder_input_tokens: image placeholders a step may encode the images of (a prompt's chunk stops
            before an image past it; the step's first runs whatever its size); None: max_num_batched_tokens.
        long_prefill_token_threshold: the most tokens one request computes in a step while others wait or run
            (vLLM's; 0: no cap); long_prefill_token_threshold_adaptive: at least a fair share of the step's budget
            (`SchedulerConfig`).
        seed: seed of the global random stream.
        enable_prefix_caching: reuse the KV cache of shared prompt prefixes.
        kv_cache_dtype: "auto" (K/V in the model's dtype) or "int8" (int8 with a float32 scale per token and kv
            head: about 1.9x the blocks of a bfloat16 cache, 3.8x those of a float32 one).
        swap_space: GiB of the swap pool for swap preemption (host memory, or a memory-mapped file on a CPU).
        swap_path: the file backing the swap pool on a CPU device, deleted by `close()`; refused on a RAM-backed
            filesystem (tmpfs). None: an anonymous file in a disk-backed directory.
        preemption_mode: "recompute", "swap" or "auto" (swap when it costs less than recomputing).
        scheduling_policy: "fcfs" (priorities refused) or "priority" (`generate(..., priority=...)` orders the
            queues).
        chat_template: a Jinja template replacing the model's own.
        tokenizer: a tokenizer (or model) folder, or a .gguf file, whose tokenizer replaces the model's own (for a
            GGUF file without a vocabulary, or one that converts badly).
        skip_tokenizer_init: load no tokenizer: prompts must be token ids, and outputs carry token ids and no
            text; stop strings, bad words, structured outputs and `chat` are refused (vLLM's).
        quantization: None (the checkpoint's own: an AWQ/GPTQ folder's 4-bit weights, a .gguf file's blocks
            under dtype "auto" on one CPU rank with VNNI, or a big one without; otherwise the dtype's weights, so
            a dtype named outright dequantises a .gguf), "int8" (linear weights as int8 with per-row scales,
            quantized at load), "w8a8" (the same int8 weights times activations quantized to int8 in each matmul,
            a scale per 64 values of a row, int32 sums), "gguf" (a .gguf file's Q4_0, Q4_1, Q8_0 and Q4_K linear
            weights kept in their blocks, times activations quantized to 16 bits), "awq" or "gptq" (an AutoAWQ or
            AutoGPTQ checkpoint's 4-bit weights kept in 4 bits; one rank only), "mxfp4" (an MXFP4 checkpoint's
            experts, gpt-oss's, kept in their 4 bits; one CPU rank only).
        speculative_config: speculative decoding as vLLM takes it, e.g. `{"method": "ngram",
            "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}` or, with a smaller draft
            model of the same tokenizer, `{"model": PATH, "num_speculative_tokens": 4}`; None: off.
        tensor_parallel_size: worker processes sharing each layer (docs/scale-out.md).
        data_parallel_size: engines (replicas), each with its own KV pool of the configured size, the prompts
            routed among them and the replicas stepped in parallel threads (docs/scale-out.md).
        data_parallel_router: "prefix_aware" (a prompt goes to the replica most likely to hold its prefix, else
            the least loaded) or "round_robin".
        distributed_executor_backend: "mp" (local worker processes, the default) or "ray".
        device: "auto" (CUDA when torch sees a CUDA device, else the CPU), "cpu", "cuda" or "cuda:N".
        enforce_eager: run the model's modules one by one from Python: on a GPU instead of replaying CUDA graphs
            captured at start-up, on a CPU instead of running the decoder layers in one C++ call a step.
        disable_cascade_attn: never run a step's attention as cascade attention over a shared prefix (see
            `ModelConfig.disable_cascade_attn`).
        generation_config: "auto" (the model's generation_config.json: its sampling defaults for calls given no
            SamplingParams, its other EOS ids as stop ids), "vllm" (none of it) or a folder holding such a file;
            `override_generation_config` sets some of those defaults over it (vLLM's), e.g. `{"temperature": 0.5}`.
        trust_remote_code: taken so that code written for vLLM's LLM runs; it changes nothing: pagedllm runs its own
            model code (Llama and Qwen2 architectures), never code from a checkpoint.
        enable_lora: serve LoRA adapters (PEFT's format) named per request by `lora_request`; the base model's
            requests batch with theirs (pagedllm.lora). On one engine of one rank.
        max_loras: most distinct adapters in one step; max_lora_rank: the largest rank taken; max_cpu_loras:
            adapters kept loaded (default max_loras; others load again from their folders when asked for).
        pooler_config: how embeddings pool (vLLM's), `{"pooling_type": "LAST" | "MEAN" | "CLS"}`; by default the
            model's sentence-transformers config says, else LAST.
        hf_overrides: fields set on the model's transformers config (vLLM's; see `ModelConfig.hf_overrides`), e.g.
            to serve Qwen3-Reranker as a classifier made of its LM head's "no" and "yes" rows.
        mm_processor_kwargs: arguments for the model's processor on every prompt with images (vLLM's), e.g.
            `{"do_image_splitting": False}` for Idefics3 (SmolVLM): one tile an image.
        limit_mm_per_prompt: the most images a prompt may hold (vLLM's), e.g. `{"image": 2}`; `{"image": 0}` loads
            no image encoder: a vision-language checkpoint runs as its language model (`ModelConfig`).
        language_model_only: images off, as limit_mm_per_prompt `{"image": 0}` (vLLM's).
        disable_sliding_window: cap the context at the model's sliding window, every layer attending over all of
            it (vLLM's; `ModelConfig.disable_sliding_window`).
        allowed_local_media_path: a folder whose images `chat` may name by file:// URL (vLLM's); "": none.
        allowed_media_domains: the hosts of the http(s) image URLs `chat` reads (vLLM's); None: any.
        logits_processors: custom logits processors (vLLM's interface, pagedllm.sample.logits_processor): classes
            or import paths; a request's `SamplingParams(extra_args=...)` reach them.
        logprobs_mode: what logprobs hold (vLLM's): "raw_logprobs" (the model's), "processed_logprobs" (those of
            the distribution sampled from, after penalties, temperature and filters), "raw_logits" or
            "processed_logits" (`ModelConfig.logprobs_mode`).
        enable_prompt_embeds: take prompts given as embeddings, `{"prompt_embeds": tensor}` ([tokens, hidden_size],
            as the model's embedding layer gives them), as vLLM does with it.
        load_format: "auto", "safetensors", "gguf", or "dummy": random weights in the shapes of a folder's config,
            no checkpoint read, to measure a model before its weights are at hand (`ModelConfig.load_format`).
        kv_cache_metrics, kv_cache_metrics_sample: follow that fraction of the KV blocks from allocation to reuse
            (vLLM's residency metrics: `llm.engine.make_stats().kv_block_residencies`; `CacheConfig`).
        scheduler_reserve_full_isl, watermark: admit a request only while the free blocks hold its whole prompt (on
            by default, as vLLM's), and leave that fraction of the pool free at an admission while others run
            (`SchedulerConfig`).
        max_num_active_seqs: the most sequences running at once, below max_num_seqs (vLLM's).
        structured_outputs_config: how structured outputs compile and when they apply (vLLM's), e.g.
            `{"disable_any_whitespace": False}` for JSON with whitespace, or `{"reasoning_parser": "qwen3"}` for a
            constraint that applies once the thought is over (`StructuredOutputsConfig`).
        runner, convert: vLLM's switches to an embedding model (`runner="pooling"`, `convert="embed"`), taken so that
            code written for vLLM runs; they select nothing, since one pagedllm engine both generates and embeds
            (`embed`), and a checkpoint with a classification head also classifies (`classify`). vLLM's other
            runners and conversions (draft, classify, reward) are refused.
        tokenizer_mode, revision, tokenizer_revision: vLLM's, taken so that code written for it (such as
            lm-evaluation-harness's vLLM backend) runs: the checkpoint's own fast tokenizer is "auto" and "hf"
            (other modes are refused); a revision names a Hugging Face hub commit, which pagedllm never fetches, so
            one given is logged and the files on disk are read.
        disable_log_stats: False keeps the engine's statistics while `generate` and the others run, as vLLM's
            offline LLM does: vLLM's periodic log line of throughput and load (`pagedllm.metrics.log_stats`), and
            the metrics the server's /metrics has, which `get_metrics()` reads. Off by default, as in vLLM; one
            engine (data_parallel_size 1).
        profiler_config: torch's profiler for `start_profile` (vLLM's), e.g. `{"profiler": "torch",
            "torch_profiler_dir": "./traces"}` (`ProfilerConfig`); None: off.
        download_dir, hf_token: vLLM's, for downloads from the Hugging Face hub, which pagedllm never makes: one
            given is logged (never the token) and the model is read from disk. pipeline_parallel_size: 1 only
            (tensor parallelism splits a model). num_gpu_blocks_override: vLLM's name for num_kv_blocks.
            enable_sleep_mode: vLLM's switch for `sleep`, which pagedllm always offers.
    """

    model: str | None = field(default=None, kw_only=False)
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    gpu_memory_utilization: float | None = None
    kv_cache_memory: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_num_encoder_input_tokens: int | None = None
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    seed: int = 0
    enable_prefix_caching: bool = True
    swap_space: float = 0.0
    preemption_mode: PreemptionMode = "recompute"
    chat_template: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    num_kv_blocks: int | None = None
    swap_path: str | None = None
    scheduling_policy: SchedulingPolicy = "fcfs"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    speculative_config: dict[str, Any] | SpeculativeConfig | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    data_parallel_router: DataParallelRouterPolicy = "prefix_aware"
    device: str = "auto"
    enforce_eager: bool = False
    disable_cascade_attn: bool = False
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    trust_remote_code: bool = False
    runner: str = "auto"
    convert: str = "auto"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    hf_overrides: dict[str, Any] | None = None
    pooler_config: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    limit_mm_per_prompt: dict[str, Any] | None = None
    language_model_only: bool = False
    disable_sliding_window: bool = False
    allowed_local_media_path: str = ""
    allowed_media_domains: list[str] | None = None
    logits_processors: list[str | type] | None = None
    logprobs_mode: str = "raw_logprobs"
    structured_outputs_config: dict[str, Any] | StructuredOutputsConfig | None = None
    enable_prompt_embeds: bool = False
    load_format: str = "auto"
    kv_cache_metrics: bool = False
    kv_cache_metrics_sample: float = 0.01
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    max_num_active_seqs: int | None = None
    tokenizer_mode: str = "auto"
    revision: str | None = None
    tokenizer_revision: str | None = None
    disable_log_stats: bool = True
    profiler_config: dict[str, Any] | ProfilerConfig | None = None
    download_dir: str | None = None
    hf_token: str | bool | None = None
    pipeline_parallel_size: int = 1
    num_gpu_blocks_override: int | None = None
    enable_sleep_mode: bool = False

    def create_engine_config(self) -> EngineConfig:
        """The EngineConfig these arguments describe (ValueError naming a bad one)."""
        num_kv_blocks, kv_cache_memory = self.num_kv_blocks, self.kv_cache_memory
        check_runner(self.runner, self.convert)
        check_vllm_loading_args(self.model, self.tokenizer_mode, self.revision, self.tokenizer_revision,
                                self.download_dir, self.hf_token)
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size must be 1, got {self.pipeline_parallel_size}: pagedllm splits a "
                             "model by tensor parallelism (tensor_parallel_size)")
        if self.num_gpu_blocks_override is not None:
            if num_kv_blocks not in (None, self.num_gpu_blocks_override):
                raise ValueError("num_kv_blocks and num_gpu_blocks_override are one setting: give one")
            num_kv_blocks = self.num_gpu_blocks_override
        if not self.disable_log_stats and self.data_parallel_size > 1:
            raise ValueError("disable_log_stats=False keeps one engine's statistics: data_parallel_size must be 1")
        if self.kv_cache_memory_bytes is not None:
            if kv_cache_memory not in (None, self.kv_cache_memory_bytes):
                raise ValueError("kv_cache_memory and kv_cache_memory_bytes are one setting: give one")
            kv_cache_memory = self.kv_cache_memory_bytes
        return EngineConfig(
            model=ModelConfig(model=self.model, dtype=self.dtype, max_model_len=self.max_model_len, seed=self.seed,
                              chat_template=self.chat_template, tokenizer=self.tokenizer,
                              skip_tokenizer_init=self.skip_tokenizer_init, quantization=self.quantization,
                              device=self.device, enforce_eager=self.enforce_eager,
                              disable_cascade_attn=self.disable_cascade_attn,
                              generation_config=self.generation_config,
                              override_generation_config=self.override_generation_config,
                              hf_overrides=self.hf_overrides,
                              pooler_config=self.pooler_config, mm_processor_kwargs=self.mm_processor_kwargs,
                              limit_mm_per_prompt=self.limit_mm_per_prompt,
                              language_model_only=self.language_model_only,
                              disable_sliding_window=self.disable_sliding_window,
                              allowed_local_media_path=self.allowed_local_media_path,
                              allowed_media_domains=self.allowed_media_domains,
                              logits_processors=self.logits_processors,
                              logprobs_mode=self.logprobs_mode, enable_prompt_embeds=self.enable_prompt_embeds,
                              load_format=self.load_format),
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory=kv_cache_memory,
                              gpu_memory_utilization=self.gpu_memory_utilization, swap_space=self.swap_space,
                              swap_path=self.swap_path, enable_prefix_caching=self.enable_prefix_caching,
                              kv_cache_dtype=self.kv_cache_dtype, num_blocks=num_kv_blocks,
                              kv_cache_metrics=self.kv_cache_metrics,
                              kv_cache_metrics_sample=self.kv_cache_metrics_sample),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      enable_chunked_prefill=self.enable_chunked_prefill,
                                      max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
                                      long_prefill_token_threshold=self.long_prefill_token_threshold,
                                      long_prefill_token_threshold_adaptive=self.long_prefill_token_threshold_adaptive,
                                      preemption_mode=self.preemption_mode, scheduling_policy=self.scheduling_policy,
                                      scheduler_reserve_full_isl=self.scheduler_reserve_full_isl,
                                      watermark=self.watermark,
                                      max_num_active_seqs=self.max_num_active_seqs),
            speculative=SpeculativeConfig.from_dict(self.speculative_config),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                    data_parallel_size=self.data_parallel_size,
                                    distributed_executor_backend=self.distributed_executor_backend,
                                    data_parallel_router=self.data_parallel_router),
            lora=LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None,
            structured_outputs=StructuredOutputsConfig.from_dict(self.structured_outputs_config),
            profiler=ProfilerConfig.from_dict(self.profiler_config),
        )


@dataclass(kw_only=True)
class AsyncEngineArgs(EngineArgs):
    """vLLM's `AsyncEngineArgs`: EngineArgs and what the async engine adds (`AsyncLLM.from_engine_args`).

    Args:
        enable_log_requests: log each request as it is added and as it finishes (`--enable-log-requests`).
    """

    enable_log_requests: bool = False
