"""Engine configuration: plain dataclasses, no torch, so that `pagedllm.core` can import them.

Each config validates itself in `__post_init__` and raises `ValueError` naming the field.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar

from pagedllm.pooling_params import POOLING_TYPES

PreemptionMode = Literal["recompute", "swap", "auto"]
SchedulingPolicy = Literal["fcfs", "priority"]
DistributedExecutorBackend = Literal["mp", "ray"]
QUANTIZATIONS = (None, "int8", "w8a8", "gguf", "awq", "gptq", "fp8", "compressed-tensors", "mxfp4")
# what logprobs hold (vLLM's logprobs_mode; pagedllm.sample.sampler)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
# where the weights come from (vLLM's load_format; pagedllm.loader.load_model)
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# how a chat message's content reaches the template (vLLM's chat_template_content_format; pagedllm.tokenizer)
CHAT_CONTENT_FORMATS = ("auto", "string", "openai")
# vLLM's tokenizer modes that pagedllm runs: the checkpoint's own fast tokenizer (transformers')
TOKENIZER_MODES = ("auto", "hf")
MODALITIES = ("image", "video", "audio")    # limit_mm_per_prompt's keys (vLLM's); pagedllm reads images
DataParallelRouterPolicy = Literal["prefix_aware", "round_robin"]
T = TypeVar("T")


def _require(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


DEFAULT_BLOCK_SIZE = 8


@dataclass
class CacheConfig:
    """How the KV cache is laid out and how big its pools are.

    Args:
        block_size: tokens per KV block. 8 by default (vLLM uses 16): a request wastes half a block at its tail
            on average, and on the mixed benchmark 16 wastes 2.9% of the pool against 1.4% for 8, at the same
            speed (docs/benchmarks.md).
        kv_cache_memory: bytes for the KV pool; None sizes it from the memory budget.
        gpu_memory_utilization: fraction of device memory for weights + activations + KV; None uses the
            device's default (on a CPU, a 4 GiB pool capped by what is available).
        swap_space: GiB of the second (host or memory-mapped) pool used by swap preemption.
        swap_path: file backing the swap pool on a CPU device (not on tmpfs; deleted when the engine closes); None
            uses an anonymous file in a disk-backed directory.
        enable_prefix_caching: reuse the KV of full blocks whose token chains match.
        kv_cache_dtype: "auto" stores K/V in the model's dtype; "int8" stores them as int8 with one float32 scale
            per token and kv head (symmetric absmax), dequantized inside the attention kernels: a float32 model
            gets about 3.8x the blocks for the same memory at head_dim 64, a bfloat16 one about 1.9x. "fp8" is
            refused: no CPU pagedllm runs on has fp8 arithmetic, and int8 with per-token scales is as small and
            more precise.
        num_blocks: filled in at start-up from the memory budget (tests may set it directly).
        num_swap_blocks: filled in at start-up from `swap_space`.
        kv_cache_metrics: track a sample of the pool's blocks from allocation to reuse (vLLM's KV cache residency
            metrics: their lifetimes, idle times before reuse and gaps between reads; `core.kv_cache.residency`).
        kv_cache_metrics_sample: the fraction of allocated blocks tracked, in (0, 1].
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    swap_space: float = 0.0
    swap_path: str | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    num_blocks: int | None = None
    num_swap_blocks: int = 0
    kv_cache_metrics: bool = False
    kv_cache_metrics_sample: float = 0.01

    def __post_init__(self) -> None:
        _require(0.0 < self.kv_cache_metrics_sample <= 1.0, "kv_cache_metrics_sample", "in (0, 1]",
                 self.kv_cache_metrics_sample)
        _require(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0, "block_size",
                 "a positive power of two", self.block_size)
        _require(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory",
                 "a positive number of bytes", self.kv_cache_memory)
        _require(self.gpu_memory_utilization is None or 0.0 < self.gpu_memory_utilization <= 1.0,
                 "gpu_memory_utilization", "in (0, 1]", self.gpu_memory_utilization)
        _require(self.swap_space >= 0, "swap_space", ">= 0 (GiB)", self.swap_space)
        _require(self.num_blocks is None or self.num_blocks >= 2, "num_blocks", ">= 2", self.num_blocks)
        _require(self.kv_cache_dtype != "fp8", "kv_cache_dtype",
                 "'auto' or 'int8' ('fp8' is not supported: the CPU has no fp8 arithmetic; use 'int8')",
                 self.kv_cache_dtype)
        _require(self.kv_cache_dtype in ("auto", "int8"), "kv_cache_dtype", "one of 'auto', 'int8'",
                 self.kv_cache_dtype)


@dataclass
class SchedulerConfig:
    """What one engine step may hold.

    Args:
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: the step's token budget (prefill chunks plus decodes).
        max_model_len: most tokens (prompt + output) one request may reach.
        enable_chunked_prefill: a prompt longer than what is left of a step's budget runs in chunks over several
            steps (vLLM's default); False: it waits for a step with room for all of it, so a prompt runs whole, and
            max_num_batched_tokens must hold max_model_len tokens (`check_whole_prompts_fit`). An encoder model
            (EmbeddingGemma's bidirectional attention) runs this way, whatever was asked.
        preemption_mode: "recompute", "swap" or "auto" when blocks run out.
        scheduling_policy: "fcfs" (the default: every request has priority 0, first come first served) or
            "priority" (a request's `priority` orders the queues, lower first). Under "fcfs" a non-zero priority
            is refused, as in vLLM, so that no client can jump the queue unless the operator allows it.
        max_num_encoder_input_tokens: the step's budget of image placeholders whose images it encodes (vLLM's):
            a prompt's chunk stops before an image that would go past what is left of it, so that the image
            encoder's work (seconds an image on a CPU) is spread over steps rather than stalling every stream's
            decode in one; the step's first image runs whatever its size. None: max_num_batched_tokens.
        long_prefill_token_threshold: the most tokens one request computes in a step while others wait or run
            (vLLM's), so that a long prompt's chunks leave room for the others' decodes and prompts; 0: no cap
            (the default). Not for a request alone, nor without chunked prefill.
        long_prefill_token_threshold_adaptive: raise that cap to a fair share of the step's budget,
            max_num_batched_tokens / the requests running and waiting, where that is more (vLLM's).
        stream_interval: a streamed request's outputs go out once this many tokens are new, its first and last at
            once (vLLM's `--stream-interval`); 1, the default: every step's. A request's own `stream_interval`
            raises it. More than 1 spares the server an SSE chunk (and its detokenizing and JSON) a token.
        whole_images: each image's placeholders computed in one step (a chunk stops before an image it would
            cut): the engine sets it for a model whose images see themselves whole (Gemma 3's).
        scheduler_reserve_full_isl: admit a waiting request only while the free blocks hold its whole sequence
            (after its prefix-cache hit; with a sliding window, what the window keeps), not only its first chunk
            (vLLM's, on by default): a long prompt admitted on its first chunk would take its later chunks' blocks
            from the running requests, preempting them.
        watermark: the fraction of the pool's blocks an admission leaves free while other requests run (vLLM's;
            0.0, the default: none), headroom for the running ones to grow into without preemption.
        max_num_active_seqs: the most sequences running at once, below max_num_seqs (vLLM's; None: max_num_seqs),
            which still sizes what is made for a step (a GPU's decode graphs): smaller decode batches, each token
            sooner.
        swap_seconds_per_block: estimated time to copy one KV block between the device and the swap pool.
        recompute_seconds_per_token: estimated time to recompute one token's K/V (a prefill token).
            "auto" swaps a victim when 2 x blocks x swap_seconds_per_block (out and back in) is less than
            computed tokens x recompute_seconds_per_token. The engine fills both in: with "auto" it measures
            them at start-up and, on a CPU, updates them after each step; otherwise device defaults.
    """

    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = "recompute"
    scheduling_policy: SchedulingPolicy = "fcfs"
    max_num_encoder_input_tokens: int | None = None
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    stream_interval: int = 1
    whole_images: bool = False
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    max_num_active_seqs: int | None = None
    swap_seconds_per_block: float = 0.0
    recompute_seconds_per_token: float = 0.0

    @property
    def max_running_seqs(self) -> int:
        """The most sequences running at once: max_num_active_seqs, else max_num_seqs."""
        return self.max_num_active_seqs or self.max_num_seqs

    def __post_init__(self) -> None:
        _require(self.max_model_len > 0, "max_model_len", "> 0", self.max_model_len)
        _require(self.max_num_seqs > 0, "max_num_seqs", "> 0", self.max_num_seqs)
        _require(self.max_num_batched_tokens > 0, "max_num_batched_tokens", "> 0",
                 self.max_num_batched_tokens)
        _require(self.max_num_encoder_input_tokens is None or self.max_num_encoder_input_tokens > 0,
                 "max_num_encoder_input_tokens", "> 0", self.max_num_encoder_input_tokens)
        _require(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold", ">= 0 (0: no cap)",
                 self.long_prefill_token_threshold)
        _require(self.stream_interval >= 1, "stream_interval", ">= 1", self.stream_interval)
        _require(0.0 <= self.watermark < 1.0, "watermark", "in [0, 1)", self.watermark)
        _require(self.max_num_active_seqs is None or 0 < self.max_num_active_seqs <= self.max_num_seqs,
                 "max_num_active_seqs", f"None or in [1, max_num_seqs ({self.max_num_seqs})]",
                 self.max_num_active_seqs)
        _require(self.preemption_mode in ("recompute", "swap", "auto"), "preemption_mode",
                 "one of 'recompute', 'swap', 'auto'", self.preemption_mode)
        _require(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy", "one of 'fcfs', 'priority'",
                 self.scheduling_policy)

    def check_whole_prompts_fit(self) -> None:
        """Without chunked prefill, a step must have room for a prompt of max_model_len tokens: ValueError
        otherwise (as in vLLM), rather than a long prompt that would wait for ever."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill a prompt runs in one step, so max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) must be at least max_model_len ({self.max_model_len}): "
                             "raise the one, lower the other, or enable chunked prefill")

    def check_priority(self, priority: int) -> None:
        """Raise ValueError for a non-zero priority unless scheduling_policy is "priority"."""
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(f"priority is {priority}, but priority scheduling is not enabled: the server must run "
                             "with --scheduling-policy priority (LLM(scheduling_policy='priority'))")


@dataclass(frozen=True)
class MediaAccess:
    """Where a chat's image URLs may be read from, besides data: URLs (pagedllm.tokenizer.chat_template)."""

    local_path: str = ""                    # file:// URLs of files under this folder; "": none
    domains: tuple[str, ...] | None = None  # the hosts of http(s) URLs; None: any


@dataclass
class ModelConfig:
    """Which model to run and in what precision.

    Args:
        model: a Hugging Face folder, a `.gguf` file, or None for the embedded default model.
        dtype: "auto" (bfloat16 where the CPU supports it, float32 otherwise), "bfloat16", "float16"
            or "float32".
        max_model_len: caps the model's own context length; None keeps it.
        seed: seed of the engine's global random stream.
        chat_template: a Jinja template that replaces the model's own.
        tokenizer: a tokenizer (or model) folder, or a .gguf file, whose tokenizer replaces the model's own (vLLM's
            `tokenizer`: for a GGUF file without a vocabulary, or one that converts badly); None: the model's.
        skip_tokenizer_init: load no tokenizer (vLLM's): prompts must be token ids, and completions carry token ids
            and no text (as `detokenize=False`); stop strings, bad words, structured outputs and chat are refused.
            The EOS id is then the model config's.
        quantization: how linear weights are stored, all multiplied in pagedllm's CPU kernels. None: the
            checkpoint's own, as vLLM: an AWQ or GPTQ folder (its config.json's quantization_config) runs as such, a
            .gguf file as "gguf" under dtype "auto" where that can run and pays (the CPU kernels, one rank; VNNI or
            a big model); otherwise the weights are in `dtype` (a dtype named outright dequantises a .gguf file:
            `loader.implied_gguf`).
            "int8": int8 with one scale per output row (weight-only, quantized at load from any checkpoint).
            "w8a8": the same int8 weights, times activations quantized to int8 in each matmul (one scale per 64
            values of a token's row), summed in int32.
            "gguf": a .gguf file's Q4_0, Q4_1, Q8_0 and Q4_K linear weights kept in their blocks, times activations
            quantized to 16 bits in each matmul (other types are dequantised to `dtype`). "awq" / "gptq": an
            AutoAWQ (GEMM) or AutoGPTQ/GPTQModel 4-bit checkpoint's weights kept in 4 bits, repacked for the Q4_1
            kernel (group_size a multiple of 32; GPTQ act-order gathers the activations in the weight's input
            order); "compressed-tensors" with its pack-quantized (W4A16) format the same. gguf, awq, gptq and
            4-bit compressed-tensors run on one rank. "fp8" / "compressed-tensors": a checkpoint saved in 8 bits
            (transformers' and DeepSeek's FP8 blocks; compressed-tensors' FP8 or int8 weights, llm-compressor's), read
            dequantised into `dtype` (`pagedllm.loader.fp8`), as None reads it; "int8" and "w8a8" quantize those
            weights at load as any others. "mxfp4": an MXFP4 checkpoint's (gpt-oss's) experts kept in their 4 bits,
            packed for the GGUF kernel (`pagedllm.loader.mxfp4`), on one CPU rank; elsewhere None reads them
            dequantised.
        device: "auto" (CUDA when torch sees a CUDA device, else the CPU), "cpu", "cuda" or "cuda:N"; the engine
            resolves it at start-up (`pagedllm.device.resolve_device`).
        enforce_eager: run the model's modules one by one, from Python: on a GPU, instead of replaying the decode
            steps' CUDA graphs (`pagedllm.runner.cuda_graphs`); on a CPU, instead of running all decoder layers in one
            C++ call a step (`LlamaForCausalLM.use_decoder_stack`; the same bits either way).
        generation_config: "auto" (the model's generation_config.json: its sampling defaults for requests that set
            none, and its other EOS ids as stop ids), "vllm" (none of it) or a folder holding such a file; vLLM's
            `--generation-config` (pagedllm.loader.generation_config).
        override_generation_config: sampling defaults set over `generation_config`'s (vLLM's), by
            generation_config.json's names, e.g. `{"temperature": 0.5, "max_new_tokens": 256}`.
        disable_cascade_attn: never run a step's attention as cascade attention (vLLM's key). By default the CPU
            kernels do where every sequence of a step starts with the same cached blocks and enough of them share
            enough keys to pay (`pagedllm/kernels/csrc/paged_attention.cpp`); its results differ from the
            sequence-by-sequence ones in the order of their float sums, so turning it off makes a request's
            attention independent of the batch it ran in.
        hf_overrides: fields set on the model's transformers config after it is read (vLLM's), e.g.
            `{"max_position_embeddings": 4096}`; or, to serve a causal LM as a classifier from its LM head's rows
            (vLLM's way for Qwen3-Reranker), `{"architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}` (`pagedllm.loader`).
        pooler_config: how embeddings pool (vLLM's): `{"pooling_type": "LAST" | "MEAN" | "CLS"}`; None takes the
            model's sentence-transformers config, else LAST (`pagedllm.loader.pooling_config`).
        mm_processor_kwargs: arguments for the model's processor on every prompt with images (vLLM's), e.g.
            Idefics3's `{"do_image_splitting": false}`; a prompt's own `mm_processor_kwargs` add to them.
        limit_mm_per_prompt: the most images one prompt may hold (vLLM's), `{"image": 2}`: a prompt with more is
            refused before any of its images is read. `{"image": 0}` turns images off: the image encoder is not
            loaded, and a vision-language checkpoint serves text in the memory of its language model. A limit may
            also be vLLM's `{"count": N, ...}` (its other fields size vLLM's memory profiling: unused here);
            "video" and "audio" limits are taken and change nothing (pagedllm reads images only). None: no limit.
        language_model_only: images off, as `limit_mm_per_prompt` `{"image": 0}` (vLLM's switch for every modality):
            a vision-language checkpoint serves text, without its image encoder.
        disable_sliding_window: the context is capped at the model's smallest sliding window, and every layer
            attends over all of it (vLLM's); a model without one is left as it is.
        allowed_local_media_path: a folder whose files a chat's images may name by `file://` URL (vLLM's; a
            security risk: any client may read the images there); "": file URLs are refused.
        allowed_media_domains: the hosts whose http(s) image URLs a chat may name (vLLM's), e.g. `["example.com"]`;
            None: any host.
        enable_prompt_embeds: take prompts given as embeddings (vLLM's `{"prompt_embeds": tensor}`, [tokens,
            hidden_size]: what the model's embedding layer would give), off by default as in vLLM.
        logits_processors: custom logits processors (vLLM's), classes or their import paths
            ("package.module.Class"): subclasses of `pagedllm.sample.logits_processor.LogitsProcessor`, built once
            and run on every sampling step's logits. Not with speculative decoding.
        logprobs_mode: what the logprobs of generated tokens hold (vLLM's): "raw_logprobs" (the default: the
            log_softmax of the model's logits), "processed_logprobs" (those of the distribution a token is sampled
            from: after logit_bias, bad words, penalties, temperature, top-k, top-p, min-p), "raw_logits" or
            "processed_logits" (the logits at those two points); a prompt's are raw either way.
        load_format: where the weights come from (vLLM's): "auto" (a folder's safetensors, or the .gguf file),
            "safetensors" or "gguf" (the same, refusing the other kind), or "dummy": random weights in the shapes of
            a folder's config.json (uniform in [-0.001, 0.001], vLLM's), no checkpoint read, to measure a model's
            speed and memory before its weights are at hand.
    """

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    chat_template: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    device: str = "auto"
    quantization: str | None = None
    enforce_eager: bool = False
    disable_cascade_attn: bool = False
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    hf_overrides: dict[str, Any] | None = None
    pooler_config: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    limit_mm_per_prompt: dict[str, Any] | None = None
    language_model_only: bool = False
    disable_sliding_window: bool = False
    allowed_local_media_path: str = ""
    allowed_media_domains: list[str] | None = None
    logits_processors: list[str | type] | None = None
    enable_prompt_embeds: bool = False
    logprobs_mode: str = "raw_logprobs"
    load_format: str = "auto"

    def __post_init__(self) -> None:
        _require(not self.allowed_local_media_path or Path(self.allowed_local_media_path).is_dir(),
                 "allowed_local_media_path", "an existing folder, or '' for none", self.allowed_local_media_path)
        _require(self.allowed_media_domains is None or (isinstance(self.allowed_media_domains, list) and all(
            isinstance(domain, str) for domain in self.allowed_media_domains)), "allowed_media_domains",
            "a list of host names, or None for any", self.allowed_media_domains)
        _require(self.load_format in LOAD_FORMATS, "load_format", f"one of {', '.join(LOAD_FORMATS)} (pagedllm reads "
                 "safetensors and GGUF files)", self.load_format)
        _require(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", f"one of {', '.join(LOGPROBS_MODES)}",
                 self.logprobs_mode)
        limits = self.limit_mm_per_prompt
        _require(limits is None or (isinstance(limits, dict) and set(limits) <= set(MODALITIES)
                                    and all(_item_limit(v) is not None for v in limits.values())),
                 "limit_mm_per_prompt", f"a dict of {', '.join(MODALITIES)} to a count >= 0 (or to {{'count': N, "
                 "...})", limits)
        _require(self.hf_overrides is None or isinstance(self.hf_overrides, dict), "hf_overrides",
                 "a dict of config fields", self.hf_overrides)
        _require(self.mm_processor_kwargs is None or isinstance(self.mm_processor_kwargs, dict),
                 "mm_processor_kwargs", "a dict of the processor's arguments", self.mm_processor_kwargs)
        pooler = self.pooler_config
        _require(pooler is None or (isinstance(pooler, dict) and set(pooler) == {"pooling_type"}
                                    and pooler["pooling_type"] in POOLING_TYPES),
                 "pooler_config", f"{{'pooling_type': one of {', '.join(POOLING_TYPES)}}}", pooler)
        _require(self.tokenizer is None or Path(self.tokenizer).expanduser().exists(), "tokenizer",
                 "a local tokenizer or model folder, or a .gguf file (models are not downloaded)", self.tokenizer)
        _require(self.dtype in ("auto", "bfloat16", "float16", "float32"), "dtype",
                 "one of 'auto', 'bfloat16', 'float16', 'float32'", self.dtype)
        _require(self.max_model_len is None or self.max_model_len > 0, "max_model_len", "> 0",
                 self.max_model_len)
        _require(self.quantization in QUANTIZATIONS, "quantization",
                 "None, 'int8', 'w8a8', 'gguf', 'awq', 'gptq', 'fp8', 'compressed-tensors' or 'mxfp4'",
                 self.quantization)
        _require(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None, "device",
                 "'auto', 'cpu', 'cuda' or 'cuda:N'", self.device)
        _require(self.quantization in (None, "fp8") or not self.device.startswith("cuda"), "quantization",
                 "None or 'fp8' on a GPU (the quantized kernels are CPU kernels)", self.quantization)

    @property
    def media_access(self) -> MediaAccess:
        """Where a chat's image URLs may be read from (`allowed_local_media_path`, `allowed_media_domains`)."""
        domains = None if self.allowed_media_domains is None else tuple(self.allowed_media_domains)
        return MediaAccess(self.allowed_local_media_path, domains)

    @property
    def image_limit(self) -> int | None:
        """The most images a prompt may hold (`limit_mm_per_prompt`, 0 with `language_model_only`); None: no
        limit."""
        if self.language_model_only:
            return 0
        limits = self.limit_mm_per_prompt or {}
        return _item_limit(limits["image"]) if "image" in limits else None


def _item_limit(value: Any) -> int | None:
    """A limit_mm_per_prompt value's count (an int, or vLLM's {"count": N, ...}); None if it is neither."""
    count = value.get("count") if isinstance(value, dict) else value
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else None


@dataclass
class SpeculativeConfig:
    """Speculative decoding, as vLLM's `speculative_config`: n-gram prompt lookup, or a smaller draft model.

    Args:
        method: "ngram": drafts come from the request's own tokens (the longest suffix n-gram seen before).
            "draft_model": a smaller model of the same tokenizer proposes them (`pagedllm.spec_decode.draft_model`).
            None: "draft_model" when `model` is given, else "ngram" (vLLM's inference).
        model: the draft model (a Hugging Face folder or a `.gguf` file) for "draft_model"; it runs in the target's
            dtype, on its device, one rank.
        quantization: the draft model's `quantization` (`ModelConfig.quantization`); None: its checkpoint's own.
        num_speculative_tokens: most draft tokens verified per request and step (k).
        prompt_lookup_max: longest suffix n-gram looked up ("ngram").
        prompt_lookup_min: shortest suffix n-gram that may give a draft ("ngram").
        disable_by_batch_size: no drafts in a step while more requests than this are running (vLLM's name); None:
            drafts at any batch size. Verifying k drafts computes k more tokens per request: at small batches a
            step is bound by reading the weights and they come nearly free, at large ones a CPU step is bound by
            arithmetic and they cost their full price (docs/benchmarks.md).
    """

    method: str | None = None
    model: str | None = None
    quantization: str | None = None
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        _require(self.method in ("ngram", "draft_model"), "speculative_config.method", "'ngram' or 'draft_model'",
                 self.method)
        _require((self.model is not None) == (self.method == "draft_model"), "speculative_config.model",
                 "a draft model's folder or .gguf file with method 'draft_model', and None with 'ngram'", self.model)
        _require(self.quantization in QUANTIZATIONS, "speculative_config.quantization",
                 "None, 'int8', 'w8a8', 'gguf', 'awq', 'gptq', 'fp8', 'compressed-tensors' or 'mxfp4'",
                 self.quantization)
        _require(self.num_speculative_tokens > 0, "speculative_config.num_speculative_tokens", "> 0",
                 self.num_speculative_tokens)
        _require(self.prompt_lookup_min > 0, "speculative_config.prompt_lookup_min", "> 0", self.prompt_lookup_min)
        _require(self.prompt_lookup_max >= self.prompt_lookup_min, "speculative_config.prompt_lookup_max",
                 f">= prompt_lookup_min ({self.prompt_lookup_min})", self.prompt_lookup_max)
        _require(self.disable_by_batch_size is None or self.disable_by_batch_size > 0,
                 "speculative_config.disable_by_batch_size", "None or > 0", self.disable_by_batch_size)

    @property
    def num_lookahead_tokens(self) -> int:
        """K/V slots a request needs past its step's tokens for the drafts proposed after the step: k for a draft
        model (which writes its drafts' K/V), 0 for n-gram lookup (which writes none)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def from_dict(cls, values: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """vLLM's dict form (`{"method": "ngram", "num_speculative_tokens": 3, ...}`); None turns it off.
        Unknown keys are a ValueError naming them."""
        if values is None or isinstance(values, SpeculativeConfig):
            return values
        return _from_dict(cls, values, "speculative_config")


@dataclass
class ParallelConfig:
    """How many processes and engines run the model (docs/scale-out.md).

    Args:
        tensor_parallel_size: worker processes that each hold 1/N of every layer (and of the KV heads), joined
            by torch.distributed (gloo on a CPU, NCCL on a GPU).
        data_parallel_size: whole engines (replicas), each with its own KV pool and the configured KV budget,
            behind one router.
        data_parallel_router: how the router picks a replica: "prefix_aware" (the replica most likely to hold
            the prompt's prefix, else the least loaded) or "round_robin".
        distributed_executor_backend: how the tensor-parallel workers start: "mp" (local processes) or "ray"
            (Ray actors, on a running cluster or a local one); None: "mp". With "ray", data-parallel replicas
            run in Ray actors too (with "mp", in this process).
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: DistributedExecutorBackend | None = None
    data_parallel_router: DataParallelRouterPolicy = "prefix_aware"

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size", ">= 1", self.tensor_parallel_size)
        _require(self.data_parallel_size >= 1, "data_parallel_size", ">= 1", self.data_parallel_size)
        _require(self.distributed_executor_backend in (None, "mp", "ray"), "distributed_executor_backend",
                 "None, 'mp' or 'ray'", self.distributed_executor_backend)
        _require(self.data_parallel_router in ("prefix_aware", "round_robin"), "data_parallel_router",
                 "one of 'prefix_aware', 'round_robin'", self.data_parallel_router)
        _require(self.tensor_parallel_size == 1 or self.data_parallel_size == 1
                 or self.distributed_executor_backend == "ray", "data_parallel_size",
                 "1 with tensor_parallel_size > 1, unless distributed_executor_backend='ray' (each replica's "
                 "tensor-parallel group needs a process of its own: a Ray actor)", self.data_parallel_size)


@dataclass
class LoRAConfig:
    """LoRA adapters, as vLLM's `enable_lora=True` and its limits (pagedllm.lora).

    Args:
        max_loras: most distinct adapters in one step; a waiting request of another adapter waits.
        max_lora_rank: largest rank an adapter may have.
        max_cpu_loras: adapters kept loaded (the least recently used dropped beyond it, loaded again when needed);
            None: max_loras.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, "max_loras", ">= 1", self.max_loras)
        _require(self.max_lora_rank >= 1, "max_lora_rank", ">= 1", self.max_lora_rank)
        _require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
                 f"None or >= max_loras ({self.max_loras})", self.max_cpu_loras)

    @property
    def capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


# vLLM's structured-output backends; pagedllm compiles every constraint with llguidance (vLLM's "guidance")
STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance", "xgrammar", "outlines", "lm-format-enforcer")


@dataclass
class StructuredOutputsConfig:
    """How structured outputs are compiled and when they apply (vLLM's `structured_outputs_config`).

    Args:
        backend: vLLM's choice of grammar library, taken by name: pagedllm compiles every constraint with
            llguidance (vLLM's "guidance"), whatever is named; a constraint allows the same outputs either way.
        disable_any_whitespace: JSON without optional whitespace (compact) when True, with it when False; None,
            pagedllm's default: compact, so that a model cannot spend its tokens on blank space.
        disable_additional_properties: a JSON schema's objects that leave `additionalProperties` unsaid get False
            (no keys but the schema's), as vLLM's guidance backend does with it.
        reasoning_parser: the reasoning format of the model's replies (`--reasoning-parser`'s names): with it, a
            constraint applies once the reply's thought is over (its end marker generated, or already in the prompt,
            as a template that turns thinking off writes it), unless `enable_in_reasoning`. Formats whose markers
            are tokens of the vocabulary only (not granite's plain text).
        enable_in_reasoning: constrain the thought too (from the reply's first token).
    """

    backend: str = "auto"
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        _require(self.backend in STRUCTURED_OUTPUT_BACKENDS, "structured_outputs_config.backend",
                 f"one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}", self.backend)

    @classmethod
    def from_dict(cls, values: dict | StructuredOutputsConfig | None) -> StructuredOutputsConfig:
        """vLLM's dict form; None: the defaults. Unknown keys are a ValueError naming them (vLLM's
        `reasoning_parser_plugin` among them: pagedllm loads no plugin)."""
        if values is None or isinstance(values, StructuredOutputsConfig):
            return values or cls()
        return _from_dict(cls, values, "structured_outputs_config")


PROFILER_ACTIVITIES = ("CPU", "CUDA")


@dataclass
class ProfilerConfig:
    """How `start_profile` profiles the engine (vLLM's `profiler_config`, `--profiler-config`): torch's profiler over
    the engine's steps, each session's trace written to `torch_profiler_dir` as a Chrome trace
    (`{name}.{time_ns}.pt.trace.json[.gz]`, which Perfetto and chrome://tracing open). pagedllm.profiler runs it.

    Args:
        profiler: "torch", or None: profiling off (start_profile refused).
        torch_profiler_dir: the folder the traces go to (made if missing); needed with "torch".
        torch_profiler_activities: what is recorded, "CPU" and/or "CUDA" (default: CPU, and CUDA on a GPU).
        torch_profiler_record_shapes, torch_profiler_with_memory, torch_profiler_with_stack,
            torch_profiler_with_flops: torch.profiler.profile's record_shapes, profile_memory, with_stack and
            with_flops.
        torch_profiler_use_gzip: write the trace gzipped.
        delay_iterations: engine steps after start_profile before recording starts.
        max_iterations: engine steps recorded before the session stops by itself (0: until stop_profile).
        wait_iterations, warmup_iterations, active_iterations: torch's profiling schedule (used when wait or
            warmup is set): steps skipped, then recorded and thrown away, then recorded.
    """

    profiler: str | None = None
    torch_profiler_dir: str = ""
    torch_profiler_activities: list[str] | None = None
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    delay_iterations: int = 0
    max_iterations: int = 0
    wait_iterations: int = 0
    warmup_iterations: int = 0
    active_iterations: int = 5

    def __post_init__(self) -> None:
        _require(self.profiler in (None, "torch"), "profiler_config.profiler",
                 "'torch' or None (pagedllm profiles with torch's profiler; vLLM's cuda and proton are not taken)",
                 self.profiler)
        _require(self.profiler is None or bool(self.torch_profiler_dir), "profiler_config.torch_profiler_dir",
                 "the folder for the traces with profiler 'torch'", self.torch_profiler_dir)
        activities = self.torch_profiler_activities
        _require(activities is None or (bool(activities) and set(activities) <= set(PROFILER_ACTIVITIES)
                                        and len(set(activities)) == len(activities)),
                 "profiler_config.torch_profiler_activities", f"distinct names among {PROFILER_ACTIVITIES}",
                 activities)
        for name in ("delay_iterations", "max_iterations", "wait_iterations", "warmup_iterations"):
            _require(getattr(self, name) >= 0, f"profiler_config.{name}", ">= 0", getattr(self, name))
        _require(self.active_iterations >= 1, "profiler_config.active_iterations", ">= 1", self.active_iterations)

    @classmethod
    def from_dict(cls, values: dict | ProfilerConfig | None) -> ProfilerConfig:
        """vLLM's dict form; None: profiling off. Unknown keys are a ValueError naming them."""
        if values is None or isinstance(values, ProfilerConfig):
            return values or cls()
        return _from_dict(cls, values, "profiler_config")


def _from_dict(cls: type[T], values: Any, name: str) -> T:
    """A config from vLLM's dict form of it (`name`); ValueError for another value, or naming unknown keys."""
    if not isinstance(values, dict):
        raise ValueError(f"{name} must be a dict, got {values!r}")
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; known: {sorted(known)}")
    return cls(**values)


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig | None = None     # None: LoRA adapters off
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)

    def __post_init__(self) -> None:
        parallel = self.parallel
        _require(self.speculative is None or self.speculative.method != "draft_model"
                 or parallel.tensor_parallel_size == 1, "speculative_config",
                 "n-gram lookup with tensor_parallel_size > 1 (a draft model runs on one rank)", self.speculative)
        _require(self.profiler.profiler is None or parallel.data_parallel_size == 1
                 or parallel.distributed_executor_backend == "ray", "profiler_config",
                 "None with replicas in this process (torch's profiler records one session a process: profile one "
                 "engine, or replicas in Ray actors, distributed_executor_backend='ray')", self.profiler.profiler)
        _require(self.lora is None or parallel.tensor_parallel_size == parallel.data_parallel_size == 1,
                 "enable_lora", "False with tensor_parallel_size or data_parallel_size > 1 (LoRA adapters run on "
                 "one engine of one rank)", self.lora is not None)


def check_vllm_loading_args(model: str | None, tokenizer_mode: str, revision: str | None,
                            tokenizer_revision: str | None, download_dir: str | None = None,
                            hf_token: str | bool | None = None) -> None:
    """vLLM's loading arguments (`LLM(...)`, `pagedllm serve --...`), taken so that code and command lines written
    for vLLM run: `tokenizer_mode` must be one pagedllm runs (TOKENIZER_MODES); a revision names a Hugging Face hub
    commit, and `download_dir` and `hf_token` serve downloads from the hub, which pagedllm never makes, so each one
    given is logged (never the token itself) and the files on disk are read (as transformers reads a local folder
    whatever the revision)."""
    if tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode must be 'auto' or 'hf', got {tokenizer_mode!r}: pagedllm runs the "
                         "checkpoint's own fast tokenizer (transformers'), and has no slow or mistral mode")
    where = model or "the embedded default model"
    unused = [f"{name}={value!r}" for name, value in (("revision", revision), ("tokenizer_revision",
                                                                              tokenizer_revision),
                                                      ("download_dir", download_dir)) if value is not None]
    unused += ["hf_token"] if hf_token not in (None, False) else []
    for what in unused:
        logging.getLogger(__name__).warning(
            "%s is not used: pagedllm never fetches from the Hugging Face hub; %s is read as it is on disk", what,
            where)
