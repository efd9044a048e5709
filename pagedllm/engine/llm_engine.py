"""LLMEngine: the step loop. Schedule, run, update; then turn token updates into RequestOutputs."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.attention.selector import runs_in_cuda_graphs
from pagedllm.config import EngineConfig, SchedulerConfig, StructuredOutputsConfig
from pagedllm.core.kv_cache.block_map import BlockMap
from pagedllm.core.kv_cache.block_pool import PrefixCacheStats
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.kv_cache.residency import ResidencyTracker
from pagedllm.core.request import FinishReason, Request, RequestStatus, child_request_id
from pagedllm.core.sched.output import RequestUpdate, RunnerOutput, ScheduledRequest, SchedulerOutput
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.device import describe_device, resolve_engine_device
from pagedllm.distributed import Peers, TensorParallelError, apply_to_model, invoke, start_peers
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.beam_search import BeamSearchDriver, BeamSearchOutput, BeamSearchParams
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.heap import paused_gc
from pagedllm.inputs import ParsedPrompt, PromptType, parse_prompt, truncation_slice
from pagedllm.loader import IMAGE_ENCODERS, LoadedModel, load_model
from pagedllm.loader.generation_config import read_generation_config
from pagedllm.loader.pooling_config import model_pooling_type
from pagedllm.logger import init_logger
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.stats import SchedulerStats
from pagedllm.models.llama import (
    attends_both_ways,
    class_labels,
    classifier_pooling,
    generates,
    has_conv_layers,
    kv_window,
    num_experts,
    token_type_vocab_size,
)
from pagedllm.multimodal import ImageInput, ImageProcessor, check_image_count, pixels_hash
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.profiler import EngineProfiler
from pagedllm.runner import kv_tensors
from pagedllm.runner.model_runner import ModelRunner, StepTimings, model_shape
from pagedllm.sample.logits_processor import CustomLogits, load_logits_processors
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.draft_model import DraftModel
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.tokenizer.reasoning import REASONING_FORMATS, marker_token_ids
from pagedllm.tokenizer.tokenizer import model_tokenizer, think_token_ids

logger = init_logger(__name__)

PromptInput = PromptType | ParsedPrompt

# The swap-or-recompute costs (see docs/architecture.md, "Swap and auto preemption"). Defaults per device: bytes
# per second moving KV blocks to and from the swap pool, and the flop rate a prefill achieves. With
# preemption_mode "auto" a start-up measurement replaces them, and on a CPU each step's timings then update them.
_SWAP_BYTES_PER_SECOND = {"cuda": 12e9, "cpu": 2e9}   # pinned host memory over PCIe; memcpy into a mapped file
_PREFILL_FLOPS_PER_SECOND = {"cuda": 1e14, "cpu": 5e10}
_MEASURE_PREFILL_TOKENS = 256   # the start-up prefill (fewer when the step budget, pool or context is smaller)
_MEASURE_SWAP_BLOCKS = 16       # the start-up copy to the swap pool and back
_COST_EMA_WEIGHT = 0.2          # the newest step's weight in the moving averages
_MIN_TOKENS_FOR_RATE = 64       # a step of fewer tokens measures its fixed overhead more than per-token work


@dataclass
class _Completion:
    """One of a request's n completions: text so far and what to report."""

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    sent_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


@dataclass
class _Tracked:
    """The engine's view of one request and its n completions (parallel sampling forks them in the core)."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None    # [None] + one position per computed prompt token
    prompt_logprobs_sent: bool = False              # output_kind "delta": they go out once, in the first output
    pooling: PoolingParams | None = None            # an embedding request
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class PromptTooLongError(ValueError):
    """A prompt that leaves no room in the context for a generated token (or, to embed, over the context)."""

    def __init__(self, num_tokens: int, max_model_len: int, pooling: bool = False) -> None:
        room = "at most max_model_len tokens long, to embed" if pooling else \
            "shorter, to leave room for at least one generated token"
        super().__init__(f"the prompt has {num_tokens} tokens, but max_model_len is {max_model_len}: it must be "
                         f"{room}")
        self.num_tokens, self.max_model_len = num_tokens, max_model_len


NO_TOKENIZER = "the engine has no tokenizer (skip_tokenizer_init=True)"
SLEEP_LEVELS = (0, 1, 2)                            # vLLM's sleep levels (LLMEngine.sleep)
SLEEP_MODES = ("abort", "wait", "keep")             # what a sleep does with unfinished requests (vLLM's PauseMode)
SLEEP_TAGS = ("weights", "kv_cache", "scheduling")  # what wake_up brings back


def check_sleep(level: int, mode: str | None = None) -> None:
    """ValueError unless `level` (and `mode`, where given) are vLLM's sleep level and mode."""
    if mode is not None and mode not in SLEEP_MODES:
        raise ValueError(f"sleep mode must be one of {SLEEP_MODES}, got {mode!r}")
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")


def require_tokenizer(tokenizer):
    """`tokenizer`, an engine's (ValueError when it runs without one: skip_tokenizer_init)."""
    if tokenizer is None:
        raise ValueError(NO_TOKENIZER)
    return tokenizer


def model_eos_token_id(tokenizer, hf_config: Any) -> int | None:
    """The EOS id replies end at: the tokenizer's, or without one (skip_tokenizer_init) the model config's (the
    first of a list; the generation config's others stop replies too, as `eos_stop_token_ids`)."""
    if tokenizer is not None:
        return tokenizer.eos_token_id
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        return eos[0] if eos else None
    return eos if isinstance(eos, int) else None


def apply_tokenization_kwargs(prompt_list: list[ParsedPrompt], truncate_prompt_tokens: int | None,
                              tokenization_kwargs: dict[str, Any] | None, tokenizer: Any,
                              max_model_len: int) -> list[ParsedPrompt]:
    """The prompts as vLLM's tokenization_kwargs leave them (LLM's calls, AsyncLLM.generate; `tokenizer` and
    `max_model_len` the engine's): text prompts tokenized with(out) the tokenizer's
    special tokens (`add_special_tokens`), then `truncate_prompt_tokens` (or tokenization_kwargs' one) of each
    prompt's tokens kept, its first, or its last (tokenization_kwargs' `truncation_side`, else the tokenizer's:
    `truncation_slice`), as token ids (with their types); -1 keeps as many as the context holds. Without
    either, the prompts as given."""
    kwargs = dict(tokenization_kwargs or {})
    keep, side = kwargs.pop("truncate_prompt_tokens", None), kwargs.pop("truncation_side", None)
    special = kwargs.pop("add_special_tokens", None)
    if kwargs or side not in (None, "left", "right") or special not in (None, True, False):
        raise ValueError("tokenization_kwargs takes truncate_prompt_tokens, truncation_side ('left' or 'right') "
                         f"and add_special_tokens (a bool), got {tokenization_kwargs!r}")
    if None not in (keep, truncate_prompt_tokens) and keep != truncate_prompt_tokens:
        raise ValueError(f"truncate_prompt_tokens is {truncate_prompt_tokens} and tokenization_kwargs' {keep}: "
                         "give one")
    keep = truncate_prompt_tokens if keep is None else keep
    if keep is None and special is None:
        return prompt_list
    if any(p.images for p in prompt_list):
        raise ValueError("tokenization_kwargs tokenize and cut text prompts: a prompt with images cannot be")
    if special is not None:
        tokenizer = require_tokenizer(tokenizer)
        prompt_list = [ParsedPrompt(p.text, tokenizer.encode(p.text, add_special_tokens=special), p.cache_salt)
                       if p.token_ids is None and p.text is not None else p for p in prompt_list]
    if keep is None:
        return prompt_list
    if keep != -1 and not 1 <= keep <= max_model_len:
        raise ValueError(f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}], got {keep}")
    kept = truncation_slice(max_model_len if keep == -1 else keep, side, tokenizer)
    return [ParsedPrompt(None, (p.token_ids if p.token_ids is not None else
                                require_tokenizer(tokenizer).encode(p.text))[kept],
                         p.cache_salt, None if p.token_type_ids is None else p.token_type_ids[kept])
            for p in prompt_list]


def tokenize_prompt(tokenizer, prompt: PromptInput, vocab_size: int, max_model_len: int,
                    pooling: bool = False) -> list[int]:
    """Token ids of a prompt (any form of `pagedllm.inputs`), validated: not empty, inside the vocabulary and the
    context, which a prompt to embed (`pooling`) may fill, as in vLLM, and one to generate from must leave a token
    of. Reads nothing but its arguments, so any thread may call it (the tokenizer's `encode` is thread-safe)."""
    parsed = parse_prompt(prompt)
    if parsed.images or parsed.prompt_embeds is not None:
        raise ValueError("pagedllm takes images and prompt_embeds in generate (and images in chat), on one engine: "
                         "not in beam search, embeddings or data-parallel replicas")
    if parsed.token_ids is None and tokenizer is None:
        raise ValueError(NO_TOKENIZER + ": give prompts as token ids")
    token_ids = parsed.token_ids if parsed.token_ids is not None else tokenizer.encode(parsed.text)
    if not token_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    if len(token_ids) > max_model_len - (0 if pooling else 1):
        raise PromptTooLongError(len(token_ids), max_model_len, pooling)
    return token_ids


def follow_step_costs(sched: SchedulerConfig, timings: StepTimings) -> None:
    """Move the scheduler's swap-or-recompute costs towards what a step took: an exponential moving average of the
    seconds per token of steps of at least _MIN_TOKENS_FOR_RATE tokens, and of the seconds per block of steps
    that swapped."""
    if timings.num_tokens >= _MIN_TOKENS_FOR_RATE:
        sched.recompute_seconds_per_token = _ema(sched.recompute_seconds_per_token,
                                                 timings.forward_seconds / timings.num_tokens)
    if timings.num_swapped_blocks:
        sched.swap_seconds_per_block = _ema(sched.swap_seconds_per_block,
                                            timings.swap_seconds / timings.num_swapped_blocks)


def _ema(average: float, sample: float) -> float:
    return (1 - _COST_EMA_WEIGHT) * average + _COST_EMA_WEIGHT * sample


def _run_prompts_whole(config: EngineConfig) -> None:
    """An encoder's token attends to those after it, so its K/V depend on the whole prompt: each prompt runs in one
    step (chunked prefill off, a step's budget holding max_model_len tokens) and no block of it is shared with
    another prompt (prefix caching off), as vLLM runs encoder-only models."""
    cache, sched = config.cache, config.scheduler
    if cache.enable_prefix_caching or sched.enable_chunked_prefill:
        logger.info("an encoder model (bidirectional attention): prefix caching and chunked prefill are off, each "
                    "prompt runs in one step")
    cache.enable_prefix_caching = sched.enable_chunked_prefill = False
    if sched.max_num_batched_tokens < sched.max_model_len:
        logger.info("max_num_batched_tokens raised from %d to max_model_len, %d, so that a step holds any prompt",
                    sched.max_num_batched_tokens, sched.max_model_len)
        sched.max_num_batched_tokens = sched.max_model_len


def _run_with_recurrent_states(config: EngineConfig) -> None:
    """Recurrent layers (Mamba-2's, Gated DeltaNet's) keep a state a request, not a row a token
    (pagedllm.models.recurrent): a cached block holds none
    (prefix caching off), a swapped request's would have to be swapped too (preemption recomputes), and a rejected
    draft token cannot be taken back out of one (no speculative decoding)."""
    cache, sched = config.cache, config.scheduler
    if config.speculative is not None:
        raise ValueError("speculative decoding is not supported with recurrent layers (Mamba-2, Gated DeltaNet): a "
                         "rejected draft token cannot be taken back out of a request's recurrent state")
    if cache.enable_prefix_caching or sched.preemption_mode != "recompute" or cache.swap_space:
        logger.info("recurrent layers (a state a request): prefix caching and swapping are off, preemption "
                    "recomputes")
    cache.enable_prefix_caching, cache.swap_space, sched.preemption_mode = False, 0, "recompute"


class LLMEngine:
    """Loads a model, sizes the KV pool, and runs the scheduler/runner loop one step at a time."""

    def __init__(self, config: EngineConfig) -> None:
        # The engine fills in what it derives (context length, pool sizes, preemption costs) on its own copy.
        config = self.config = copy.deepcopy(config)
        resolve_engine_device(config)
        if config.parallel.data_parallel_size > 1:
            raise ValueError("an LLMEngine is one replica: data_parallel_size > 1 runs several behind a router "
                             "(pagedllm.engine.data_parallel; LLM and the server build them)")
        peers = start_peers(config)     # the workers load their slices while this process loads rank 0's
        try:
            with paused_gc():           # loading makes many long-lived objects and little garbage: pagedllm.heap
                self._start(config, peers)
        except BaseException:
            peers.close()
            raise

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """An engine of these arguments (vLLM's); one replica (data_parallel_size 1)."""
        return cls(engine_args.create_engine_config())

    def _start(self, config: EngineConfig, peers: Peers) -> None:
        loaded = load_model(config.model, 0, config.parallel.tensor_parallel_size)
        self.model_name = loaded.resolved.name
        self.tokenizer = None if config.model.skip_tokenizer_init else \
            model_tokenizer(loaded.resolved, config.model.tokenizer, config.model.chat_template)
        self.hf_config = loaded.hf_config
        self.image_processor = self._image_processor(loaded)
        encoder = getattr(loaded.model, "image_encoder", None)
        if encoder is not None and encoder.attends_whole_image:    # an image's placeholders in one step
            if config.scheduler.max_num_batched_tokens < encoder.image_tokens:
                raise ValueError(f"{self.model_name}'s image placeholders see each other, so a step computes an "
                                 f"image's {encoder.image_tokens} whole: max_num_batched_tokens "
                                 f"({config.scheduler.max_num_batched_tokens}) must hold them")
            config.scheduler.whole_images = True
        self.class_labels = class_labels(loaded.hf_config)     # a classifier's; None: the model cannot classify
        self.classifier_pooling = classifier_pooling(loaded.hf_config)     # the token its classification head reads
        self.token_type_vocab_size = token_type_vocab_size(loaded.hf_config)    # 0: it takes no token type ids
        self.generates = generates(loaded.hf_config)            # False: no LM head, it only pools
        # embeddings' pooling
        self.pooling_type = model_pooling_type(loaded.resolved, config.model.pooler_config, loaded.gguf_file)
        defaults = read_generation_config(config.model.generation_config, loaded.resolved, loaded.hf_config,
                                          config.model.override_generation_config)
        self.default_sampling = defaults.sampling       # SamplingParams field -> the model's default
        # the model's other EOS ids: stop ids of every request that does not ignore EOS (vLLM's
        # update_from_generation_config), e.g. Llama 3's <|eot_id|> and <|eom_id|> beside <|end_of_text|>
        self.eos_stop_token_ids = [t for t in dict.fromkeys(defaults.eos_token_ids)
                                   if t != self.eos_token_id]
        self.max_model_len = loaded.max_model_len
        config.scheduler.max_model_len = self.max_model_len
        if attends_both_ways(loaded.hf_config):
            _run_prompts_whole(config)
        config.scheduler.check_whole_prompts_fit()
        self.structured_output = StructuredOutputManager(self.tokenizer, model_shape(loaded.hf_config).vocab_size,
                                                         config.structured_outputs)
        self.constrained_after = self._thought_markers(config.structured_outputs)
        self.logits_processors = load_logits_processors(config.model.logits_processors or [])
        if self.logits_processors and config.speculative is not None:
            raise ValueError("custom logits processors see one row a request and step: not with speculative decoding")
        device = torch.device(config.model.device)
        custom = CustomLogits([cls(config, device, False) for cls in self.logits_processors]) \
            if self.logits_processors else None
        self.runner = ModelRunner(loaded, config.cache, self.eos_token_id, config.model.seed,
                                  self.structured_output, peers, config.lora, self._load_draft(config),
                                  config.model.logprobs_mode, custom)
        self.vocab_size = self.runner.shape.vocab_size
        if self.runner.mixers:
            _run_with_recurrent_states(config)
        num_blocks = config.cache.num_blocks or self._num_blocks()
        config.cache.num_blocks = num_blocks
        self.runner.allocate_kv_cache(num_blocks)
        if self.runner.mixers:
            self.runner.allocate_recurrent_states(config.scheduler.max_num_seqs)
        self._setup_swap()
        self._setup_costs()
        # a mixture of experts sorts its tokens by expert on the host (run_experts), a short convolution finds its
        # tokens' earlier ones and a recurrent layer its requests' states by their sequences' lengths, which a graph
        # cannot capture
        model_config = self.runner.model.config
        if (self.runner.device.type == "cuda" and not config.model.enforce_eager and config.lora is None
                and runs_in_cuda_graphs(self.runner.attn_backend) and not num_experts(model_config)
                and not has_conv_layers(model_config) and not self.runner.mixers):
            self._capture_decode_graphs()
        self.graphs_captured = self.runner.decode_graphs is not None
        self.profiler = EngineProfiler(config.profiler, self.runner.device) if config.profiler.profiler else None
        self.sleep_level: int | None = None     # sleep mode: the deepest level asked since awake (None: awake)
        self.kv_released = False                # ... and whether the KV pool's memory is released
        # blocks behind a window every layer attends within are freed; not with a draft model, which runs a whole
        # context again after a preemption or a prefix hit
        window = kv_window(loaded.hf_config) if self.runner.draft is None else 0
        residency = ResidencyTracker(config.cache.kv_cache_metrics_sample, config.model.seed) \
            if config.cache.kv_cache_metrics else None
        self.kv_cache_manager = KVCacheManager(num_blocks, config.cache.block_size,
                                               config.cache.enable_prefix_caching, config.cache.num_swap_blocks,
                                               window, residency)
        spec = config.speculative
        proposer = NgramProposer(spec) if spec is not None and spec.method == "ngram" else None
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager,
                                   proposer.propose if proposer is not None else None,
                                   spec.disable_by_batch_size if spec else None,
                                   config.lora.max_loras if config.lora is not None else None,
                                   spec.num_lookahead_tokens if spec else 0)
        self.beam_search = BeamSearchDriver(self.scheduler, self.tokenizer)
        self.capacity = kv_tensors.CapacityReport(num_blocks, config.cache.block_size,
                                                  self.runner.kv_bytes_per_token, self.max_model_len, window)
        logger.info("device %s; %s", describe_device(self.runner.device), self.capacity)
        self._tracked: dict[str, _Tracked] = {}
        # the last step's new tokens: request id -> completion index -> count, for the statistics of outputs that
        # do not carry each step's tokens (the offline "final" outputs; pagedllm.metrics.stats.StepRecorder)
        self.step_new_tokens: dict[str, dict[int, int]] = {}

    def _thought_markers(self, config: StructuredOutputsConfig) -> tuple[int, int] | None:
        """The (start, end) token ids of the reasoning format after whose thought a constraint applies; None where
        it applies from the first token (no reasoning parser, enable_in_reasoning, or markers that are no tokens
        of the vocabulary, said once)."""
        if not config.reasoning_parser or config.enable_in_reasoning:
            return None
        if config.reasoning_parser not in REASONING_FORMATS:
            raise ValueError(f"structured_outputs_config.reasoning_parser must be one of "
                             f"{', '.join(REASONING_FORMATS)}, got {config.reasoning_parser!r}")
        markers = marker_token_ids(self.tokenizer, config.reasoning_parser)
        if markers is None:
            logger.warning("the %s reasoning format's markers are no tokens of %s's vocabulary: structured outputs "
                           "constrain the thought too", config.reasoning_parser, self.model_name)
        return markers

    def _load_draft(self, config: EngineConfig) -> DraftModel | None:
        """The draft model of `speculative_config` (method "draft_model"), in the model's dtype and on its device;
        None for another method. It must generate and hold the whole context (max_model_len)."""
        spec = config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        draft_config = dataclasses.replace(config.model, model=spec.model, quantization=spec.quantization,
                                           max_model_len=None, chat_template=None, hf_overrides=None,
                                           pooler_config=None)
        # a draft's GGUF blocks in 16-bit integer arithmetic: at a few rows the fastest on every CPU (AMX tiles
        # dequantise every block for one row), and a draft's bits need not be the same whatever its batch
        try:
            loaded = load_model(draft_config, gguf_activation_bits=16)
        except (ValueError, OSError) as e:
            raise ValueError(f"speculative_config.model {spec.model!r}: {e}") from e
        if not generates(loaded.hf_config) or attends_both_ways(loaded.hf_config):
            raise ValueError(f"speculative_config.model {spec.model!r} is not a generative (decoder) model")
        draft_len = loaded.max_model_len
        if draft_len < self.max_model_len:
            raise ValueError(f"speculative_config.model {spec.model!r} holds {draft_len} tokens of context, fewer "
                             f"than the model's max_model_len {self.max_model_len}: set max_model_len <= {draft_len}")
        draft_vocab, vocab = model_shape(loaded.hf_config).vocab_size, model_shape(self.hf_config).vocab_size
        if draft_vocab != vocab:
            logger.warning("the draft model's vocabulary (%d) is not the model's (%d): it must share the model's "
                           "tokenizer; it drafts among the ids both have", draft_vocab, vocab)
        return DraftModel(loaded, config.cache.block_size, config.cache.kv_cache_dtype, self.max_model_len, vocab)

    def _setup_swap(self) -> None:
        """Size the swap pool from swap_space GiB, and allocate it."""
        cache, sched = self.config.cache, self.config.scheduler
        bytes_per_block = self.runner.layout.bytes_per_token * cache.block_size
        num_swap_blocks = int(cache.swap_space * kv_tensors.GiB) // bytes_per_block
        cache.num_swap_blocks = num_swap_blocks if num_swap_blocks >= 2 else 0
        self.swap_space_bytes = cache.num_swap_blocks * bytes_per_block
        if cache.num_swap_blocks:
            self.runner.allocate_swap_space(cache.num_swap_blocks, cache.swap_path)
            logger.info("swap pool: %d blocks of %d tokens (%.2f GiB) in %s", cache.num_swap_blocks,
                        cache.block_size, self.swap_space_bytes / kv_tensors.GiB, self.runner.swap.location)
        elif sched.preemption_mode != "recompute":
            logger.warning("preemption_mode=%r without swap space (swap_space=%s GiB): preempting by recompute",
                           sched.preemption_mode, cache.swap_space)

    def _setup_costs(self) -> None:
        """Give the scheduler the swap-or-recompute costs: the device's defaults, or with "auto" and a swap pool a
        start-up measurement, which each step on a CPU then updates (`follow_step_costs`)."""
        cache, sched = self.config.cache, self.config.scheduler
        device = self.runner.device.type if self.runner.device.type in _SWAP_BYTES_PER_SECOND else "cpu"
        num_params = sum(p.numel() for p in self.runner.model.parameters())
        bytes_per_block = self.runner.layout.bytes_per_token * cache.block_size
        sched.swap_seconds_per_block = bytes_per_block / _SWAP_BYTES_PER_SECOND[device]
        sched.recompute_seconds_per_token = 2 * num_params / _PREFILL_FLOPS_PER_SECOND[device]
        measured = sched.preemption_mode == "auto" and cache.num_swap_blocks > 0
        # A GPU runs kernels asynchronously: its step times would be those of the launches.
        self._follow_costs = measured and self.runner.device.type == "cpu"
        if measured:
            self._measure_costs()

    def _measure_costs(self) -> None:
        """A short prefill and a block copy to the swap pool and back, while both pools are still empty."""
        cache, sched = self.config.cache, self.config.scheduler
        assert cache.num_blocks is not None
        num_tokens = min(_MEASURE_PREFILL_TOKENS, sched.max_num_batched_tokens, self.max_model_len - 1,
                         (cache.num_blocks - 1) * cache.block_size)
        sched.recompute_seconds_per_token = self.runner.measure_prefill_seconds_per_token(num_tokens)
        num_blocks = min(_MEASURE_SWAP_BLOCKS, cache.num_blocks - 1, cache.num_swap_blocks - 1)
        sched.swap_seconds_per_block = self.runner.measure_swap_seconds_per_block(num_blocks)
        logger.info("preemption costs, measured: recompute %.3g ms per token, swap %.3g ms per block (out or in)",
                    1e3 * sched.recompute_seconds_per_token, 1e3 * sched.swap_seconds_per_block)

    def _capture_decode_graphs(self) -> None:
        start = time.perf_counter()
        self.runner.capture_decode_graphs(self.config.scheduler.max_num_seqs, self.max_model_len)
        assert self.runner.decode_graphs is not None
        logger.info("CUDA graphs: decode steps of %s sequences captured in %.1f s (enforce_eager=True turns them off)",
                    ", ".join(map(str, self.runner.decode_graphs.sizes)), time.perf_counter() - start)

    def _num_blocks(self) -> int:
        cache, sched = self.config.cache, self.config.scheduler
        if attends_both_ways(self.hf_config):
            # an encoder's requests end with the step that runs them, and no later step reads their K/V (which its
            # modules never write): the pool only holds one step's prompts (vLLM gives an encoder no KV cache at
            # all), not the 4 GiB a decoder's would take
            return -(-sched.max_num_batched_tokens // cache.block_size) + sched.max_num_seqs + 1
        activation_bytes = 0
        if cache.kv_cache_memory is None and self.runner.device.type == "cuda":
            activation_bytes = self._profile_activation_bytes()
        budget = kv_tensors.kv_budget_bytes(cache.kv_cache_memory, cache.gpu_memory_utilization,
                                            self.runner.weight_bytes(), self.runner.device, activation_bytes)
        budget -= self._recurrent_state_bytes(budget)
        return kv_tensors.num_blocks_for(budget, self.runner.kv_bytes_per_token, cache.block_size)

    def _recurrent_state_bytes(self, budget: int) -> int:
        """What recurrent layers' states take of the KV budget: two slots a running request (its states, and a step's
        next ones before they are committed); at most half the budget, max_num_seqs lowered to fit."""
        per_request = self.runner.recurrent_bytes_per_request
        if not per_request:
            return 0
        sched = self.config.scheduler
        fitting = budget // 2 // per_request
        if fitting < 1:
            raise ValueError(f"a request's recurrent states ({per_request / kv_tensors.GiB:.2f} GiB with a step's next "
                             f"ones) do not fit half the KV budget ({budget / kv_tensors.GiB:.2f} GiB): raise "
                             "kv_cache_memory")
        if fitting < sched.max_num_seqs:
            logger.info("max_num_seqs lowered from %d to %d: each running request's recurrent states take %.1f MiB "
                        "(with a step's next ones), at most half the KV budget", sched.max_num_seqs, fitting,
                        per_request / (1 << 20))
            sched.max_num_seqs = fitting
        return sched.max_num_seqs * per_request

    def _profile_activation_bytes(self) -> int:
        """The activation peak of the largest step the scheduler may run: a full token budget (one sequence, so at
        most max_model_len - 1 tokens) and the logits of max_num_seqs rows."""
        sched = self.config.scheduler
        num_tokens = min(sched.max_num_batched_tokens, self.max_model_len - 1)
        peak = self.runner.profile_activation_bytes(num_tokens, min(sched.max_num_seqs, num_tokens))
        logger.info("profile run: %d tokens peak at %.2f GiB of activations beside %.2f GiB of weights", num_tokens,
                    peak / kv_tensors.GiB, self.runner.weight_bytes() / kv_tensors.GiB)
        return peak

    # ---- requests ---------------------------------------------------------------------------------------------
    def get_tokenizer(self):
        """The tokenizer (vLLM's `LLMEngine.get_tokenizer`; ValueError with skip_tokenizer_init, which loads none)."""
        return require_tokenizer(self.tokenizer)

    @property
    def eos_token_id(self) -> int | None:
        """The EOS id replies end at (`model_eos_token_id`), read when asked: a caller may set the tokenizer's."""
        return model_eos_token_id(self.tokenizer, self.hf_config)

    def tokenize_prompt(self, prompt: PromptInput, pooling: bool = False) -> list[int]:
        """Token ids of a prompt, validated: not empty, inside the vocabulary and the context (see
        `tokenize_prompt`)."""
        return tokenize_prompt(self.tokenizer, prompt, self.vocab_size, self.max_model_len, pooling)

    def _image_processor(self, loaded: LoadedModel) -> ImageProcessor | None:
        """A multimodal model's processor, which makes token ids and pixels of a prompt's text and images; None for
        a model that takes no images (the loader loaded no image encoder), or an engine without a tokenizer."""
        encoder = getattr(loaded.model, "image_encoder", None)
        if encoder is None or self.tokenizer is None:
            return None
        return encoder.processor(loaded.resolved.path, loaded.hf_config.image_token_id, loaded.dtype,
                                 self.config.model.mm_processor_kwargs)

    @property
    def image_limit(self) -> int | None:
        """The most images a prompt may hold (`ModelConfig.image_limit`); None: no limit."""
        return self.config.model.image_limit

    @property
    def image_marker(self) -> str | None:
        """What marks an image's place in a prompt's text (Llava's `<image>`); None: the model takes no images."""
        return None if self.image_processor is None else self.image_processor.image_token

    def process_images(self, parsed: ParsedPrompt, add_special_tokens: bool = True) -> ParsedPrompt:
        """A prompt with images (`parsed.images`) as the model's processor makes it: token ids, each image's
        `<image>` expanded into its placeholders, and `image_inputs` (`add_special_tokens` False for a chat
        template's text). ValueError for a model that takes no images, a prompt with more than `image_limit`, or
        one whose markers do not match its images. Thread-safe."""
        check_image_count(len(parsed.images), self.image_limit)
        if self.image_processor is None:
            raise ValueError(f"{self.model_name} takes no images: pagedllm reads the images of "
                             f"{', '.join(sorted(IMAGE_ENCODERS))} checkpoints that have their processor config and "
                             "tokenizer")
        assert parsed.text is not None, "parse_prompt gives images beside text only"
        token_ids, images = self.image_processor(parsed.text, list(parsed.images), add_special_tokens,
                                                 parsed.processor_kwargs)
        return ParsedPrompt(parsed.text, token_ids, parsed.cache_salt, image_inputs=images)

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | PoolingParams,
                    priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None, lora_request: LoRARequest | None = None) -> None:
        """Queue a request: a generation (SamplingParams), or an embedding of the prompt (PoolingParams: its output
        carries `embedding` and no completion). `prompt_token_ids`, when given, are the already validated tokens of
        `prompt`; a `cache_salt` argument overrides the prompt dict's own. A non-zero `priority` needs
        scheduling_policy "priority" (ValueError otherwise). `lora_request` runs it with that LoRA adapter, which
        is loaded now (ValueError for one that cannot be, or when the engine has LoRA off)."""
        self.config.scheduler.check_priority(priority)
        if lora_request is not None:
            self.runner.load_lora(lora_request)
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is None:
            self._check_generates()
        elif pooling.pooling_type is None:      # the model's pooling for an embedding; its head's for a classifier
            pooling = dataclasses.replace(pooling, pooling_type=self.pooling_type if pooling.task == "embed"
                                          else self.classifier_pooling)
        if pooling is not None and pooling.task == "classify":
            self._check_classifies(pooling)
        if pooling is not None and pooling.dimensions is not None:
            self._check_dimensions(pooling.dimensions)
        if pooling is not None:   # the prompt's forward pass, then one greedy token that nobody sees
            params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        if not isinstance(params.output_kind, str):     # None, the caller's default: one output, once finished;
            params = dataclasses.replace(params, output_kind=params.output_kind or "final")     # or an enum set late
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        parsed, token_ids = self._prompt(prompt, prompt_token_ids, pooling)
        embeds = any(image.embeds for image in parsed.image_inputs)
        if embeds and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not computed for prompt_embeds: their positions hold no tokens")
        cache_salt = cache_salt if cache_salt is not None else parsed.cache_salt
        if any(t >= self.vocab_size for t in [*(params.logit_bias or {}), *params.stop_token_ids,
                                              *(params.allowed_token_ids or []), *(params.logprob_token_ids or [])]):
            raise ValueError(f"logit_bias, stop_token_ids, allowed_token_ids and logprob_token_ids take token ids in "
                             f"[0, {self.vocab_size})")
        if self.tokenizer is None:
            params = self._tokens_only(params)
        if params.structured_outputs is not None:
            self.structured_output.compile(params.structured_outputs)   # a cache hit when the caller compiled it
            params.constrained_after = self.constrained_after
        missing = [t for t in self.eos_stop_token_ids if t not in params.stop_token_ids]
        if missing and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + missing)
        params.resolve_bad_words(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        if params.thinking_token_budget is not None:
            params.resolve_thinking(think_token_ids(self.tokenizer))
        for processor in self.logits_processors:
            processor.validate_params(params)
        # (prompt embeddings' placeholder ids are no text for the detokenizer to go on from)
        context = [] if embeds else token_ids
        reports = params.logprobs is not None or params.logprob_token_ids     # each token's logprobs
        completions = [_Completion(i, IncrementalDetokenizer(self.tokenizer, params, context),
                                   logprobs=[] if reports else None) for i in range(params.n)]
        self.scheduler.add_request(Request(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(), priority=priority,
            cache_salt=cache_salt, pooling_params=pooling, lora_request=lora_request,
            token_type_ids=parsed.token_type_ids, images=parsed.image_inputs))
        self._tracked[request_id] = _Tracked(parsed.text, token_ids, params, completions,
                                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                                             pooling=pooling)

    def _prompt(self, prompt: PromptInput, prompt_token_ids: list[int] | None, pooling: PoolingParams | None
                ) -> tuple[ParsedPrompt, list[int]]:
        """A request's prompt, parsed (its images through the processor), and its token ids, checked."""
        parsed = parse_prompt(prompt)
        if parsed.prompt_embeds is not None:
            parsed, prompt_token_ids = self.embeds_prompt(parsed), None
        if parsed.images:   # token ids are the processor's: each image's marker expanded into its placeholders
            parsed, prompt_token_ids = self.process_images(parsed), None
        if parsed.image_inputs:
            self._check_takes_images(pooling)
        token_ids = prompt_token_ids if prompt_token_ids is not None else \
            self.tokenize_prompt(parsed, pooling is not None)
        if parsed.token_type_ids is not None:
            self._check_token_types(parsed.token_type_ids, len(token_ids))
        return parsed, token_ids

    def embeds_prompt(self, parsed: ParsedPrompt) -> ParsedPrompt:
        """A prompt given as embeddings (`parsed.prompt_embeds`), checked, as one image of its whole length
        (`ImageInput.embeds`: its rows stand for its tokens) with a placeholder token id 0 for each row. Thread-safe
        (as `process_images`, which it stands beside)."""
        embeds = parsed.prompt_embeds
        if not self.config.model.enable_prompt_embeds:
            raise ValueError("prompt_embeds needs an engine started with enable_prompt_embeds=True "
                             "(--enable-prompt-embeds)")
        if not torch.is_tensor(embeds) or not embeds.is_floating_point():
            raise ValueError("prompt_embeds must be a floating-point torch tensor")
        if embeds.dim() == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]
        hidden = self.hf_config.hidden_size
        if embeds.dim() != 2 or embeds.shape[1] != hidden or embeds.shape[0] == 0:
            raise ValueError(f"prompt_embeds must be [tokens, hidden_size {hidden}], got {tuple(embeds.shape)}")
        embeds = embeds.detach().to("cpu", self.runner.model.dtype).contiguous()
        length = embeds.shape[0]
        image = ImageInput(0, length, pixels_hash(embeds, tuple(embeds.shape)), embeds, embeds=True)
        return dataclasses.replace(parsed, token_ids=[0] * length, image_inputs=(image,), prompt_embeds=None)

    @staticmethod
    def _tokens_only(params: SamplingParams) -> SamplingParams:
        """`params` for an engine without a tokenizer: no text (detokenize=False); what needs the tokenizer refused."""
        for name, needs in (("stop", params.stop), ("bad_words", params.bad_words),
                            ("structured_outputs", params.structured_outputs)):
            if needs:
                raise ValueError(f"{name} needs a tokenizer, and {NO_TOKENIZER}")
        return dataclasses.replace(params, detokenize=False) if params.detokenize else params

    def add_beam_search(self, request_id: str, prompt: PromptInput, params: BeamSearchParams,
                        lora_request: LoRARequest | None = None) -> None:
        """Queue a beam search (every beam with `lora_request`'s adapter, if given); its result comes from
        `pop_beam_search_output` once `step()` finished it."""
        if request_id in self._tracked or request_id in self.beam_search.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_generates()
        if self.runner.mixers:
            raise ValueError(f"beam search is not supported with {self.model_name}'s recurrent layers: its beams fork "
                             "between steps, and a request's recurrent state is its own")
        token_ids = self.tokenize_prompt(prompt)
        if lora_request is not None:
            self.runner.load_lora(lora_request)
        eos = frozenset(t for t in [self.eos_token_id, *self.eos_stop_token_ids] if t is not None)
        self.beam_search.add(request_id, token_ids, params, eos, self.max_model_len, lora_request)

    def _check_classifies(self, pooling: PoolingParams) -> None:
        if self.class_labels is None:
            raise ValueError(f"{self.model_name} has no classification head: classify needs a checkpoint saved as a "
                             "sequence classifier (LlamaForSequenceClassification, Qwen2ForSequenceClassification, "
                             "MistralForSequenceClassification, BertForSequenceClassification, "
                             "XLMRobertaForSequenceClassification, ...)")
        if pooling.pooling_type != self.classifier_pooling:
            raise ValueError(f"{self.model_name}'s classification head reads the {self.classifier_pooling} token "
                             f"(pooling_type {self.classifier_pooling!r}), not {pooling.pooling_type!r}")

    def _check_dimensions(self, dimensions: int) -> None:
        """A shorter embedding only from a model trained for it (a Matryoshka model's config says so), as vLLM."""
        listed = getattr(self.hf_config, "matryoshka_dimensions", None)
        if not (listed or getattr(self.hf_config, "is_matryoshka", False)):
            raise ValueError(f"dimensions must be unset: {self.model_name} does not support Matryoshka embeddings, "
                             f"got {dimensions} (a model trained for them says so in its config, is_matryoshka or "
                             "matryoshka_dimensions, which hf_overrides can set)")
        size = self.runner.embedding_size
        if not dimensions <= size:
            raise ValueError(f"dimensions must be in [1, {size}] for {self.model_name}, got {dimensions}")
        if listed and dimensions not in listed:
            raise ValueError(f"dimensions must be one of {self.model_name}'s Matryoshka dimensions {list(listed)}, "
                             f"got {dimensions}")

    def _check_takes_images(self, pooling: PoolingParams | None) -> None:
        if pooling is not None:
            raise ValueError("a prompt with images or embeddings is for generation: pagedllm embeds and classifies "
                             "text only")
        if self.config.parallel.tensor_parallel_size > 1:
            raise ValueError("a prompt with images or embeddings runs on one rank: tensor parallelism takes text "
                             "prompts only")

    def _check_token_types(self, token_type_ids: list[int], num_tokens: int) -> None:
        if not self.token_type_vocab_size:
            raise ValueError(f"{self.model_name} takes no token_type_ids: only a BERT-family encoder adds token type "
                             "embeddings")
        if len(token_type_ids) != num_tokens:
            raise ValueError(f"token_type_ids has {len(token_type_ids)} entries for {num_tokens} prompt tokens")
        if not all(0 <= t < self.token_type_vocab_size for t in token_type_ids):
            raise ValueError(f"token_type_ids of {self.model_name} are in [0, {self.token_type_vocab_size})")

    def _check_generates(self) -> None:
        if attends_both_ways(self.hf_config):
            raise ValueError(f"{self.model_name} is an encoder (its attention is bidirectional): it embeds, and "
                             "cannot generate")
        if not self.generates:
            raise ValueError(f"{self.model_name} was saved without an LM head (a bare decoder, or a classifier whose "
                             "config does not tie its embeddings to one): it embeds or classifies, and cannot "
                             "generate")

    def pop_beam_search_output(self, request_id: str) -> BeamSearchOutput | None:
        return self.beam_search.outputs.pop(request_id, None)

    def pop_beam_search_outputs(self) -> dict[str, BeamSearchOutput]:
        """Every finished beam search's output, by request id, taken."""
        outputs, self.beam_search.outputs = self.beam_search.outputs, {}
        return outputs

    def abort_request(self, request_ids: list[str], stop_reason: str | None = None) -> list[RequestOutput]:
        """Abort requests (ids that already finished are skipped). Returns each aborted request's last output:
        every completion still running ends with finish_reason "abort" and `stop_reason`."""
        outputs = []
        for request_id in request_ids:
            tracked = self._tracked.pop(request_id, None)
            num_completions = tracked.params.n if tracked is not None else 1
            self.scheduler.finish_requests([request_id] + [child_request_id(request_id, i)
                                                           for i in range(1, num_completions)], FinishReason.ABORT)
            self.beam_search.abort(request_id)
            if tracked is None:
                continue
            for completion in tracked.completions:
                if completion.finish_reason is None:
                    completion.finish_reason, completion.stop_reason = FinishReason.ABORT, stop_reason
            outputs.append(self._make_output(request_id, tracked, tracked.completions))
        return outputs

    @property
    def dtype(self) -> torch.dtype:
        """The model's weights and KV cache dtype."""
        return self.runner.layout.dtype

    @property
    def quantization(self) -> str | None:
        """How the linear weights run, as resolved at load (None: in `dtype`)."""
        return self.runner.quantization

    def make_stats(self) -> SchedulerStats:
        """The scheduler's snapshot after the last step, and the sleep level (for metrics; from the stepping
        thread)."""
        stats = self.scheduler.make_stats()
        stats.sleep_level = self.sleep_level
        return stats

    def make_block_map(self) -> BlockMap:
        """A snapshot of the KV pools and the requests' block tables (for the dashboard; from the stepping thread)."""
        return self.scheduler.make_block_map()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Queried and hit prompt tokens of the prefix cache so far (for metrics)."""
        return self.kv_cache_manager.prefix_cache_stats

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached block hash; False (nothing done) while requests hold blocks, unless
        `reset_running_requests` (vLLM's): the running requests then drop their blocks and wait to be recomputed
        first. `reset_connector`: vLLM's external KV connector's cache, which pagedllm has none of."""
        del reset_connector
        if reset_running_requests:
            self._requeue_running()
        return self.kv_cache_manager.reset_prefix_cache()

    def _requeue_running(self) -> None:
        """Every running request drops its blocks (and recurrent state) and waits to be recomputed."""
        for request_id in self.scheduler.requeue_running():
            if self.runner.recurrent is not None:
                self.runner.recurrent.release(request_id)

    def is_healthy(self) -> bool:
        """False once a tensor-parallel worker died or a rank-wide operation failed: the engine cannot step."""
        return self.runner.peers.is_alive()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list:
        """vLLM's collective_rpc: on every tensor-parallel rank, the method of that name of the rank's ModelRunner
        (pagedllm's worker), or `method(runner, *args, **kwargs)`; the results in rank order (rank 0's first).
        For ranks in other processes, a function must pickle (a module-level one) and so must its result."""
        kwargs = kwargs or {}
        with self.runner.peers.call(method, args, kwargs, timeout) as others:
            own = invoke(self.runner, method, args, kwargs)
        return [own, *others]

    def apply_model(self, function: Callable[[torch.nn.Module], Any]) -> list:
        """vLLM's apply_model: `function(model)` on every rank's model (its slice of the weights), in rank order."""
        return self.collective_rpc(apply_to_model, args=(function,))

    # ---- LoRA adapters (vLLM's LLMEngine calls) ------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now, ahead of the requests that name it (ValueError for one that cannot load, or with
        LoRA off); True."""
        self.runner.load_lora(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter (requests naming it later load it again); whether it was loaded."""
        return self.runner.loras is not None and self.runner.loras.drop(lora_id)

    def list_loras(self) -> set[int]:
        """The `lora_int_id`s of the adapters loaded (at most max_cpu_loras; the least recently used go first)."""
        return self.runner.loras.ids() if self.runner.loras is not None else set()

    # ---- profiling (vLLM's start_profile / stop_profile) --------------------------------------------------------
    def start_profile(self, profile_prefix: str | None = None, *, delay_iterations: int | None = None,
                      max_iterations: int | None = None) -> None:
        """Start recording the engine's steps with torch's profiler (pagedllm.profiler; `profiler_config`)."""
        if self.profiler is None:
            raise ValueError("start_profile needs a profiler: profiler_config={'profiler': 'torch', "
                             "'torch_profiler_dir': DIR} (--profiler-config)")
        self.profiler.start(profile_prefix, delay_iterations, max_iterations)

    def stop_profile(self) -> None:
        """End the profiling session and write its trace."""
        if self.profiler is not None:
            self.profiler.stop()

    # ---- sleep mode (vLLM's) -------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep, the requests already dealt with by the caller (`LLM.sleep`'s mode). Level 0 pauses
        scheduling: requests are taken, and `step()` runs none. Level 1 also releases the KV pool's memory on
        every rank: each running request waits to be recomputed (a swapped one keeps its swap blocks), the prefix
        cache is emptied. Level 2 is level 1 here: the weights stay in memory (vLLM's level 1 offloads GPU weights
        to host memory, where pagedllm's already are on a CPU; its level 2 discards them for the caller to load
        new ones, which the weights kept in place serve too)."""
        check_sleep(level)
        self.sleep_level = max(level, self.sleep_level or 0)
        if level == 0 or self.kv_released:
            return
        self._requeue_running()
        emptied = self.kv_cache_manager.reset_prefix_cache()
        assert emptied, "a block in use after every running request left"
        self.runner.release_kv_cache()
        self.kv_released = True
        logger.info("asleep (level %d): the KV pool's %.2f GiB released", level,
                    self.capacity.num_blocks * self.capacity.block_size * self.runner.kv_bytes_per_token
                    / kv_tensors.GiB)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """vLLM's wake_up: bring back what `tags` name ("kv_cache", "weights", "scheduling"; None: all) and
        resume scheduling once no memory is released any more. Returns whether the engine is fully awake."""
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        unknown = [tag for tag in tags if tag not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"wake_up tags are among {SLEEP_TAGS}, got {unknown}")
        if "kv_cache" in tags and self.kv_released:
            self.runner.allocate_kv_cache(self.config.cache.num_blocks)
            if self.graphs_captured:
                self._capture_decode_graphs()
            self.kv_released = False
        if not self.kv_released:
            self.sleep_level = None
        return self.sleep_level is None

    def release_kv_cache_memory(self) -> None:
        """vLLM's: from a level-0 sleep, release the KV pool's memory as level 1 does (wake_up(["kv_cache"])
        brings it back; kept requests are recomputed)."""
        if not self.is_sleeping():
            raise RuntimeError("release_kv_cache_memory() releases a paused engine's KV pool: sleep(level=0) first")
        self.sleep(1)

    def is_sleeping(self) -> bool:
        return self.sleep_level is not None

    def unfinished_request_ids(self) -> list[str]:
        """The requests added and not finished, in the order added."""
        return list(self._tracked)

    def get_supported_tasks(self) -> tuple[str, ...]:
        """What this model serves, by vLLM's task names: "generate" (with an LM head, not an encoder), "embed"
        (every model), "classify" (with a classification head)."""
        generates = self.generates and not attends_both_ways(self.hf_config)
        return (*(("generate",) if generates else ()), "embed",
                *(("classify",) if self.class_labels is not None else ()))

    def get_num_unfinished_requests(self) -> int:
        """Requests added and not finished yet (vLLM's; a request's n completions count once)."""
        return len(self._tracked)

    def close(self) -> None:
        """Release the swap pool: its file is closed and deleted. The engine must not step afterwards."""
        self.runner.close()

    # ---- the loop -----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.sleep_level is not None:     # asleep: requests wait (LLM and the server refuse to step it)
            return []
        outputs = self._step()
        if self.profiler is not None:
            self.profiler.step()
        return outputs

    def _step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        try:
            self.runner.prepare(scheduler_output)
        except TensorParallelError:
            raise
        except Exception as exc:  # noqa: BLE001 - the block moves may be half done: the whole step fails
            self.kv_cache_manager.undo_blocks_ahead()     # its hits fail with the rest
            errors = dict.fromkeys(self._step_request_ids(scheduler_output), exc)
            return self._finish_step(scheduler_output, RunnerOutput(), errors)
        runner_output, errors, requeued = self._run_step(scheduler_output.scheduled)
        if requeued:
            scheduler_output = dataclasses.replace(scheduler_output, scheduled=[
                s for s in scheduler_output.scheduled if s.request_id not in requeued])
        if self._follow_costs and not errors:
            follow_step_costs(self.config.scheduler, self.runner.last_timings)
        return self._finish_step(scheduler_output, runner_output, errors)

    def _step_request_ids(self, scheduler_output: SchedulerOutput) -> list[str]:
        """The step's requests and those it was swapping out: their KV is unsure when the block moves fail."""
        live = self.scheduler.requests
        return [s.request_id for s in scheduler_output.scheduled] + [
            r for r in scheduler_output.preempted_request_ids if live[r].status is RequestStatus.SWAPPED]

    def _run_step(self, scheduled: list[ScheduledRequest]
                  ) -> tuple[RunnerOutput, dict[str, Exception], set[str]]:
        """Run the step's requests: (output, errors, requeued). When the run raises, the blocks the step cached
        ahead are taken back first and the requests that hit them go back to wait (`undo_step_sharing`: those
        blocks may hold nothing, should their writer fail again), then the others run again in halves (`_execute`).
        """
        try:
            return self.runner.run(scheduled), {}, set()
        except TensorParallelError:
            raise   # the ranks are out of step: no rerun can help, the engine fails as a whole
        except Exception as exc:  # noqa: BLE001 - a failed run fails its own requests, not the engine
            requeued = self.scheduler.undo_step_sharing(scheduled)
            if len(scheduled) == 1:
                return RunnerOutput(), {scheduled[0].request_id: exc}, requeued
            logger.warning("engine step failed for %d requests: %r; running them again in halves to find the "
                           "failing ones%s", len(scheduled), exc,
                           f" ({len(requeued)} that read blocks computed in the same step wait again)" if requeued
                           else "")
        output, errors = self._in_halves([s for s in scheduled if s.request_id not in requeued])
        return output, errors, requeued

    def _execute(self, scheduled: list[ScheduledRequest]) -> tuple[RunnerOutput, dict[str, Exception]]:
        """Run some of the step's requests. When the runner raises, each half is run again, recursively, down to
        single requests, so that only a request whose own run raises fails (with its error) and one bad request
        cannot fail a whole batch. A rerun is safe: `runner.run` writes only the K/V slots of these requests' new
        tokens (a rerun overwrites the same slots) and advances their sampling state only once it has sampled;
        the block moves ran once, in `prepare`, and the scheduler's counters move only in `update_from_output`.
        """
        try:
            return self.runner.run(scheduled), {}
        except TensorParallelError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed run fails its own requests, not the engine
            if len(scheduled) == 1:
                return RunnerOutput(), {scheduled[0].request_id: exc}
        return self._in_halves(scheduled)

    def _in_halves(self, scheduled: list[ScheduledRequest]) -> tuple[RunnerOutput, dict[str, Exception]]:
        if len(scheduled) <= 1:
            return self._execute(scheduled)
        middle = len(scheduled) // 2
        first, first_errors = self._execute(scheduled[:middle])
        second, second_errors = self._execute(scheduled[middle:])
        return first.merged(second), first_errors | second_errors

    def _finish_step(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput,
                     errors: dict[str, Exception]) -> list[RequestOutput]:
        """Fail the requests whose run raised, then apply the step's result to the others."""
        self.step_new_tokens = {}
        outputs = self._fail_requests(errors)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs += [o for o in map(self._process, updates) if o is not None]
        if self.beam_search.groups:
            self.beam_search.advance()
        return outputs

    def _fail_requests(self, errors: dict[str, Exception]) -> list[RequestOutput]:
        """Abort each failed request, with every sequence of its group (its other completions; a request fails
        as a whole), freeing their blocks. Each gets a final output whose `error` names the exception. A failed
        beam is dropped from its search, which goes on with the others."""
        for exc in {id(exc): exc for exc in errors.values()}.values():
            logger.error("engine step failed for %d request(s): %r", sum(e is exc for e in errors.values()), exc,
                         exc_info=(type(exc), exc, exc.__traceback__))
        outputs = []
        for request_id, exc in errors.items():
            request = self.scheduler.requests.get(request_id)
            if request is None:  # a sibling's failure already aborted it
                continue
            if request.group_id not in self._tracked:
                self.scheduler.finish_requests(request_id, FinishReason.ABORT)
                self.beam_search.on_update(RequestUpdate(request_id, [], finish_reason=FinishReason.ABORT))
                continue
            (output,) = self.abort_request([request.group_id])
            output.error = f"the engine step running this request failed: {exc!r}"
            outputs.append(output)
        return outputs

    def _process(self, update: RequestUpdate) -> RequestOutput | None:
        """Detokenize one sequence's update. With n > 1, a "final" output waits for all n completions; a
        streamed one carries just the completion that changed (its `index` says which), or all n when the
        request ended before it forked."""
        request_id = update.parent_request_id or update.request_id
        tracked = self._tracked.get(request_id)
        if tracked is None:
            self.beam_search.on_update(update)
            return None
        tracked.num_cached_tokens = update.num_cached_tokens
        if update.embedding is not None:
            tracked.embedding = update.embedding
        if update.new_prompt_logprobs and tracked.prompt_logprobs is not None:
            tracked.prompt_logprobs += (self._logprob_position(entries, tracked.params.detokenize)
                                        for entries in update.new_prompt_logprobs)
        if not update.new_token_ids and update.finish_reason is None:
            return None     # a chunk of the prompt: nothing to report until the first token
        completion = tracked.completions[update.index]
        stop_str, update.new_token_ids = self._detokenize(completion, update.new_token_ids)
        completion.token_ids.extend(update.new_token_ids)
        if update.new_token_ids:
            counts = self.step_new_tokens.setdefault(request_id, {})
            counts[update.index] = counts.get(update.index, 0) + len(update.new_token_ids)
        self._append_logprobs(completion, update, tracked.params.detokenize)
        finish_reason, stop_reason = update.finish_reason, update.stop_reason
        if stop_str is not None and finish_reason is None:
            self.scheduler.finish_requests([update.request_id], FinishReason.STOP)
            finish_reason, stop_reason = FinishReason.STOP, stop_str
        completion.finish_reason, completion.stop_reason = finish_reason, stop_reason
        changed = [completion]
        if finish_reason is not None and not completion.token_ids:
            # Finished before its first sampled token, so it never forked: its n - 1 other completions end with it.
            changed = tracked.completions
            for unforked in changed:
                unforked.finish_reason, unforked.stop_reason = finish_reason, stop_reason
        if tracked.finished:
            del self._tracked[request_id]
        if tracked.params.output_kind == "final":
            if not tracked.finished:
                return None
            return self._make_output(request_id, tracked, tracked.completions)
        interval = max(tracked.params.stream_interval or 1, self.config.scheduler.stream_interval)
        if finish_reason is None and completion.sent_tokens and \
                len(completion.token_ids) - completion.sent_tokens < interval:
            return None     # streamed every `interval` tokens, the first and the last at once
        return self._make_output(request_id, tracked, changed)

    @staticmethod
    def _detokenize(completion: _Completion, token_ids: list[int]) -> tuple[str | None, list[int]]:
        """Feed the tokens to the detokenizer one by one (a speculative step brings several); on a stop string,
        the tokens after the one completing it are dropped, as if they had never been generated."""
        for index, token_id in enumerate(token_ids):
            stop_str = completion.detokenizer.update([token_id])
            if stop_str is not None:
                return stop_str, token_ids[:index + 1]
        return None, token_ids

    def _append_logprobs(self, completion: _Completion, update: RequestUpdate, detokenize: bool) -> None:
        if completion.logprobs is None or update.new_logprobs is None:
            return
        for token_id, entries in zip(update.new_token_ids, update.new_logprobs):
            position = self._logprob_position(entries, detokenize)
            completion.logprobs.append(position)
            completion.cumulative_logprob += position[token_id].logprob

    def _logprob_position(self, entries: list[tuple[int, float, int]], detokenize: bool) -> dict[int, Logprob]:
        """The runner's (token_id, logprob, rank) entries of one position, with each token's text (None when the
        request asked for no text)."""
        return {token_id: Logprob(logprob, rank, self.tokenizer.decode([token_id]) if detokenize else None)
                for token_id, logprob, rank in entries}

    def _make_output(self, request_id: str, tracked: _Tracked, completions: list[_Completion]) -> RequestOutput:
        prompt_logprobs = None if tracked.prompt_logprobs_sent else tracked.prompt_logprobs
        tracked.prompt_logprobs_sent = tracked.params.output_kind == "delta"
        outputs = [] if tracked.pooling is not None else [self._completion_output(tracked, c) for c in completions]
        return RequestOutput(request_id=request_id, prompt=tracked.prompt, prompt_token_ids=tracked.prompt_token_ids,
                             outputs=outputs, finished=tracked.finished, num_cached_tokens=tracked.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs, embedding=tracked.embedding)

    def _completion_output(self, tracked: _Tracked, completion: _Completion) -> CompletionOutput:
        finished = completion.finish_reason is not None
        delta = tracked.params.output_kind == "delta"
        start = completion.sent_tokens if delta else 0
        completion.sent_tokens = len(completion.token_ids)
        return CompletionOutput(
            index=completion.index,
            text=completion.detokenizer.get_next_output_text(finished, delta),
            token_ids=completion.token_ids[start:],
            cumulative_logprob=completion.cumulative_logprob if completion.logprobs is not None else None,
            logprobs=completion.logprobs[start:] if completion.logprobs is not None else None,
            finish_reason=completion.finish_reason.value if completion.finish_reason is not None else None,
            stop_reason=completion.stop_reason,
        )
