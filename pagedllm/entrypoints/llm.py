"""The offline API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages)`."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from tqdm.auto import tqdm

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams
from pagedllm.engine.data_parallel import DataParallelEngine
from pagedllm.engine.llm_engine import LLMEngine, apply_tokenization_kwargs, check_sleep
from pagedllm.entrypoints.openai.tool_parsers import with_tools
from pagedllm.inputs import ParsedPrompt, PromptType, as_prompt_list
from pagedllm.logger import init_logger
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.log_stats import LoggingStatLogger
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.reader import Metric, metrics_snapshot
from pagedllm.metrics.stats import IterationStats, StepRecorder
from pagedllm.multimodal import check_image_count
from pagedllm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import TASKS, PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.scoring import cosine_similarity, cross_encoder_prompt, pair_up
from pagedllm.tokenizer.chat_template import (
    apply_chat_template,
    conversation_images,
    image_parts,
    render_chat_template,
)

logger = init_logger(__name__)

# A progress bar or none, as vLLM's `use_tqdm`: a bool, or a callable that makes the bar from tqdm's arguments.
UseTqdm = bool | Callable[..., tqdm]
Conversation = list[dict[str, Any]]


class LLM:
    """An engine for offline batch inference.

    `LLM(model, **kwargs)`: `model` is a Hugging Face folder, a `.gguf` file, or None for the embedded
    SmolLM2-135M-Instruct; the keywords are `EngineArgs`' fields (pagedllm/engine/arg_utils.py says each), e.g.
    `dtype`, `max_model_len`, `kv_cache_memory`, `enable_prefix_caching`, `tensor_parallel_size`, `quantization`,
    `speculative_config`; an unknown one is a TypeError.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        args = EngineArgs(model, **kwargs)
        config = args.create_engine_config()
        self._attach(LLMEngine(config) if config.parallel.data_parallel_size == 1 else DataParallelEngine(config),
                     log_stats=not args.disable_log_stats)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """An LLM of these arguments (vLLM's)."""
        return cls(**{f.name: getattr(engine_args, f.name) for f in dataclasses.fields(EngineArgs)})

    @classmethod
    def from_engine(cls, engine: LLMEngine | DataParallelEngine) -> LLM:
        """The offline API around an engine already built, on this thread (see `generate`)."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: LLMEngine | DataParallelEngine, log_stats: bool = False) -> None:
        self.engine = engine
        self._counter = itertools.count()
        self._built_on = threading.get_ident()
        self._warned_of_thread = False
        # the requests `enqueue` queued, in order, and the outputs of those that finished (during a generate, say)
        self._enqueued: dict[str, RequestOutput | None] = {}
        self._stats: StepRecorder | None = None          # log_stats: each step recorded for the loggers,
        self._registry: CollectorRegistry | None = None  # ... one of which keeps the metrics get_metrics reads
        if log_stats:
            assert isinstance(engine, LLMEngine)
            self._stats, self._registry = StepRecorder(), CollectorRegistry()
            metrics = PrometheusStatLogger(engine.model_name, self._registry,
                                           swap_space_bytes=engine.swap_space_bytes,
                                           max_model_len=engine.max_model_len)
            self._stats.loggers += [metrics.record, LoggingStatLogger().record]

    def close(self) -> None:
        """Release the engine's swap pool (its file is deleted). `with LLM(...) as llm:` closes on leaving."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def llm_engine(self) -> LLMEngine | DataParallelEngine:
        """The engine, by vLLM's name: `add_request(request_id, prompt, params)`, `step()` (the outputs of requests
        that finished in it, by default), `has_unfinished_requests()`, `abort_request(ids)`, as vLLM's LLMEngine."""
        return self.engine

    def get_world_size(self, include_dp: bool = True) -> int:
        """The processes that run the model (vLLM's): tensor_parallel_size, times data_parallel_size with
        include_dp."""
        parallel = self.engine.config.parallel
        return parallel.tensor_parallel_size * (parallel.data_parallel_size if include_dp else 1)

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list:
        """Run a method on every worker and return the results (vLLM's): pagedllm's worker is a rank's
        `ModelRunner` (its `model`, `device`, ...); `method` is the name of one of its methods, or a function
        called as `method(runner, *args, **kwargs)`. One result a rank, rank 0's first (and replica by replica
        under data parallelism). Ranks in worker processes get the function pickled (a module-level function,
        not a lambda; Ray's actors take any), and send back their results; `timeout`: seconds to wait for them
        (TimeoutError). A function that raises on a worker raises RuntimeError here, with its traceback; the
        engine goes on."""
        return self.engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list:
        """`func(model)` on every rank's model (its slice of the weights under tensor parallelism), the results
        in rank order (vLLM's; as `collective_rpc` sends it)."""
        return self.engine.apply_model(func)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Put the engine to sleep (vLLM's sleep mode): no request runs until `wake_up`, and from level 1 the KV
        pool's memory is released (pagedllm.engine.llm_engine.LLMEngine.sleep; the weights stay, in host memory).

        Args:
            level: 0 pauses scheduling (`enqueue` still takes requests); 1 also releases the KV pool's memory and
                empties the prefix cache; 2 is 1 here (vLLM's level 2 discards GPU weights for new ones to be
                loaded; pagedllm's stay in place, where collective_rpc can change them).
            mode: what happens to requests not finished (those `enqueue` queued): "abort" ends them (finish_reason
                "abort"; wait_for_completion returns them so), "wait" runs them to the end first (their outputs
                kept for wait_for_completion), "keep" leaves them queued, to run (recomputed) after wake_up.
        """
        check_sleep(level, mode)
        if mode == "abort":
            self._keep_enqueued(self._abort(self.engine.unfinished_request_ids()))
        elif mode == "wait" and self.engine.has_unfinished_requests():
            self._check_awake("sleep(mode='wait') runs the unfinished requests to the end")
            while self.engine.has_unfinished_requests():
                self._step()
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake the engine (vLLM's): bring back what `tags` name ("kv_cache", "weights", "scheduling"; None:
        all), and resume scheduling once nothing is released any more; returns whether it is fully awake. From a
        level-0 sleep, `wake_up(["scheduling"])` resumes."""
        return self.engine.wake_up(tags)

    def release_kv_cache_memory(self) -> None:
        """From a level-0 sleep, release the KV pool's memory as level 1 does (vLLM's); `wake_up(["kv_cache"])`
        brings it back, and kept requests are recomputed."""
        self.engine.release_kv_cache_memory()

    def _check_awake(self, what: str) -> None:
        if self.engine.is_sleeping():
            raise RuntimeError(f"the engine is asleep (LLM.sleep) and {what}: call wake_up() first (enqueue takes "
                               "requests meanwhile)")

    def start_profile(self, profile_prefix: str | None = None, *, delay_iterations: int | None = None,
                      max_iterations: int | None = None) -> None:
        """Record the engine's steps with torch's profiler until `stop_profile` (vLLM's; needs `profiler_config`):
        the trace goes to its folder as `{profile_prefix}.{time_ns}.pt.trace.json.gz` (a Chrome trace; with data
        parallelism, one a replica, `{profile_prefix}_dp{i}`). `delay_iterations` steps pass before recording;
        `max_iterations` recorded steps end the session by themselves (0: until stop_profile)."""
        self.engine.start_profile(profile_prefix, delay_iterations=delay_iterations, max_iterations=max_iterations)

    def stop_profile(self) -> None:
        """End the profiling session and write its trace."""
        self.engine.stop_profile()

    def get_tokenizer(self):
        """The engine's tokenizer (ValueError with skip_tokenizer_init, which loads none)."""
        return self.engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: SamplingParams() with the sampling defaults
        of the model's generation config (`generation_config`), as vLLM's."""
        return SamplingParams(**self.engine.default_sampling)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached block; False (nothing done) while requests are running, unless
        `reset_running_requests` (vLLM's): they then drop their blocks and are recomputed. `reset_connector`:
        taken for vLLM's signature (pagedllm has no external KV connector)."""
        return self.engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def get_metrics(self) -> list[Metric]:
        """A snapshot of the engine's metrics, named as the server's /metrics names them (vLLM's
        `LLM.get_metrics()`; the records, Counter, Gauge, Histogram and Vector, are pagedllm.metrics.reader's).
        Needs `LLM(..., disable_log_stats=False)`, which keeps them."""
        if self._registry is None:
            raise ValueError("get_metrics() reads the statistics that LLM(..., disable_log_stats=False) keeps; "
                             "they are off by default, as in vLLM")
        return metrics_snapshot(self._registry)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt; one BeamSearchOutput per prompt, in order, sequences best first;
        `lora_request` as `generate`'s.

        The beams run in the engine and share their KV blocks copy-on-write (see pagedllm/engine/beam_search.py).
        """
        self._check_awake("beam_search runs its prompts")
        prompt_list = as_prompt_list(prompts)
        loras = _per_prompt(lora_request, len(prompt_list), "lora_request")
        request_ids = [f"beam-{next(self._counter)}" for _ in prompt_list]
        for prompt in prompt_list:
            self.engine.tokenize_prompt(prompt)  # all validated before any runs
        self._load_loras(loras)
        for request_id, prompt, lora in zip(request_ids, prompt_list, loras):
            self.engine.add_beam_search(request_id, prompt, params, lora)
        results: dict[str, BeamSearchOutput] = {}
        self._warn_if_on_another_thread()
        try:
            while len(results) < len(request_ids):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("the engine went idle with beam searches unanswered")
                self._step()
                for request_id in request_ids:
                    output = self.engine.pop_beam_search_output(request_id)
                    if output is not None:
                        results[request_id] = output
        except BaseException:
            self.engine.abort_request([r for r in request_ids if r not in results])
            raise
        return [results[r] for r in request_ids]

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: UseTqdm = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: int | Sequence[int] | None = None, tokenization_kwargs: dict[str, Any] | None = None,
                 mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Complete each prompt; the outputs come back in input order.

        Args:
            prompts: one prompt or a list of them, each a string, a list of token ids, `{"prompt": str}` or
                `{"prompt_token_ids": [...]}` (a dict may add `cache_salt`; see `pagedllm.inputs`).
            sampling_params: one for all prompts, or one per prompt (default: get_default_sampling_params()).
            use_tqdm: show a progress bar when there is more than one prompt; a callable (vLLM's, e.g.
                `functools.partial(tqdm, leave=False)`) makes the bar, given tqdm's arguments.
            lora_request: a LoRA adapter for every prompt, or one (or None) per prompt; needs
                `enable_lora=True`. Prompts of different adapters, and of none, batch together.
            priority: one for all prompts, or one per prompt; lower runs first. Needs scheduling_policy "priority"
                unless all are 0.
            tokenization_kwargs: vLLM's `{"truncate_prompt_tokens": k}` (with `"truncation_side"`), as `embed`'s:
                each prompt cut to k tokens before it runs; `"add_special_tokens": False` tokenizes text prompts
                without the tokenizer's special tokens.
            mm_processor_kwargs: arguments for the model's processor on the prompts' images, under each prompt's
                own `mm_processor_kwargs`.

        Call it from the thread that built the LLM: torch's kernels run on GNU OpenMP, which gives each thread that
        runs them a team of worker threads, and with two teams on the machine every kernel call wakes a sleeping
        worker (pagedllm/engine/engine_thread.py). From another thread it works, about half as fast, and says so
        once in the log. Requests queued by `enqueue` run alongside; their outputs wait for `wait_for_completion`.
        """
        self._check_awake("generate runs its prompts")
        request_ids = self._add_completions(prompts, sampling_params, lora_request, priority, tokenization_kwargs,
                                            mm_processor_kwargs)
        return self._run(request_ids, use_tqdm)

    def enqueue(self, prompts: PromptType | Sequence[PromptType],
                sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                priority: int | Sequence[int] | None = None, use_tqdm: UseTqdm = True,
                tokenization_kwargs: dict[str, Any] | None = None,
                mm_processor_kwargs: dict[str, Any] | None = None) -> list[str]:
        """Queue prompts for generation without running them (vLLM 0.32's): every prompt is checked, and queued,
        before this returns; nothing runs until `wait_for_completion` (or a `generate`, which runs them beside its
        own). The arguments as `generate`'s (use_tqdm is taken for vLLM's signature: queueing shows no bar).
        Returns the queued requests' ids."""
        del use_tqdm
        request_ids = self._add_completions(prompts, sampling_params, lora_request, priority, tokenization_kwargs,
                                            mm_processor_kwargs)
        self._enqueued.update(dict.fromkeys(request_ids))
        return request_ids

    def wait_for_completion(self, output_type: type | tuple[type, ...] | None = None, *,
                            use_tqdm: UseTqdm = True) -> list[RequestOutput]:
        """Run every request queued by `enqueue` and `enqueue_chat` to the end; their outputs, in the order they
        were queued, and the queue empties. `output_type`: the outputs' expected type(s) (vLLM's; default
        RequestOutput), a TypeError otherwise."""
        expected = output_type or RequestOutput
        request_ids = list(self._enqueued)
        if any(output is None for output in self._enqueued.values()):
            self._check_awake("wait_for_completion runs the queued requests")
        try:
            outputs = self._run(request_ids, use_tqdm)
        finally:
            self._enqueued.clear()
        wrong = [o for o in outputs if not isinstance(o, expected)]
        if wrong:
            names = " or ".join(t.__name__ for t in (expected if isinstance(expected, tuple) else (expected,)))
            raise TypeError(f"wait_for_completion expected {names}, got {type(wrong[0]).__name__}")
        return outputs

    def _add_completions(self, prompts: PromptType | Sequence[PromptType],
                         sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                         lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                         priority: int | Sequence[int] | None, tokenization_kwargs: dict[str, Any] | None,
                         mm_processor_kwargs: dict[str, Any] | None) -> list[str]:
        """Check and queue generation requests for `prompts` (generate's arguments); their request ids."""
        prompt_list = self._truncated(as_prompt_list(prompts), None, tokenization_kwargs)
        if mm_processor_kwargs:     # under each prompt's own
            prompt_list = [dataclasses.replace(p, processor_kwargs=mm_processor_kwargs | (p.processor_kwargs or {}))
                           if p.images else p for p in prompt_list]
        params_list = _per_prompt(sampling_params or self.get_default_sampling_params(), len(prompt_list),
                                  "sampling_params")
        priorities = _per_prompt(list(priority) if isinstance(priority, Sequence) else priority or 0,
                                 len(prompt_list), "priority")
        return self._add(prompt_list, params_list, priorities, _per_prompt(lora_request, len(prompt_list),
                                                                           "lora_request"))

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *, use_tqdm: UseTqdm = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
              truncate_prompt_tokens: int | None = None,
              tokenization_kwargs: dict[str, Any] | None = None) -> list[EmbeddingRequestOutput]:
        """Embed each prompt (vLLM's `LLM.embed`): the model's final hidden states pooled as the model says (its
        last token's by default; `PoolingParams.pooling_type`), L2-normalised; the outputs come back in input
        order. The prompts batch with each other and with any generation, through the same paged cache and prefix
        cache; nothing is generated.

        Args:
            prompts: as `generate`'s.
            pooling_params: one for all prompts, or one per prompt (default: `PoolingParams()`).
            use_tqdm: show a progress bar when there is more than one prompt (a callable: as `generate`'s).
            lora_request: as `generate`'s.
            truncate_prompt_tokens: keep k of each prompt's tokens, as vLLM 0.32 does: the first k, or the last
                where the tokenizer truncates on the left (its `truncation_side`); -1 keeps as many as the context
                holds.
            tokenization_kwargs: vLLM 0.32's form of the same: `{"truncate_prompt_tokens": k}`, with
                `"truncation_side": "left"` (the last k) or `"right"` (the first k); `"add_special_tokens": False`
                tokenizes text prompts without the tokenizer's special tokens; other keys are refused.
        """
        outputs = self._pool(prompts, pooling_params or PoolingParams(), "embed", use_tqdm, lora_request,
                             truncate_prompt_tokens, tokenization_kwargs)
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.embedding), o.prompt_token_ids,
                                       o.num_cached_tokens) for o in outputs]

    def classify(self, prompts: PromptType | Sequence[PromptType],
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *, use_tqdm: UseTqdm = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 truncate_prompt_tokens: int | None = None,
                 tokenization_kwargs: dict[str, Any] | None = None) -> list[ClassificationRequestOutput]:
        """Classify each prompt (vLLM's `LLM.classify`) with the checkpoint's classification head (a model saved
        as `LlamaForSequenceClassification`, `Qwen2ForSequenceClassification`, `Qwen3ForSequenceClassification`
        or `MistralForSequenceClassification`, or made one by `hf_overrides`; ValueError for another): the head
        reads the final hidden state at the prompt's last token; `outputs.probs` are the softmax of its logits (the
        sigmoid of a one-label head's). Batched as `embed`'s.

        Args:
            prompts: as `generate`'s.
            pooling_params: one for all prompts, or one per prompt (default: `PoolingParams(task="classify")`;
                `use_activation=False` gives the logits).
            use_tqdm: show a progress bar when there is more than one prompt (a callable: as `generate`'s).
            lora_request: as `generate`'s.
            truncate_prompt_tokens, tokenization_kwargs: as `embed`'s.
        """
        outputs = self._pool(prompts, pooling_params or PoolingParams(task="classify"), "classify", use_tqdm,
                             lora_request, truncate_prompt_tokens, tokenization_kwargs)
        return [ClassificationRequestOutput(o.request_id, ClassificationOutput(o.embedding), o.prompt_token_ids,
                                            o.num_cached_tokens) for o in outputs]

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *, use_tqdm: UseTqdm = True,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, pooling_task: str | None = None,
               truncate_prompt_tokens: int | None = None,
               tokenization_kwargs: dict[str, Any] | None = None) -> list[PoolingRequestOutput]:
        """vLLM's general pooling call: `pooling_task="embed"` gives `embed`'s vectors, "classify" `classify`'s
        probabilities (or logits), each prompt's as one float32 tensor, `outputs.data`. vLLM's per-token tasks
        ("token_embed", "token_classify") and plugins are refused: pagedllm pools one vector a prompt. The other
        arguments as `embed`'s (`pooling_params` default: `PoolingParams(task=pooling_task)`)."""
        if pooling_task not in TASKS:
            raise ValueError(f"LLM.encode needs pooling_task 'embed' or 'classify', got {pooling_task!r}: pagedllm "
                             "pools one vector a prompt (embed, classify and score do the same with their own "
                             "outputs), and has no per-token or plugin task")
        outputs = self._pool(prompts, pooling_params or PoolingParams(task=pooling_task), pooling_task, use_tqdm,
                             lora_request, truncate_prompt_tokens, tokenization_kwargs)
        return [PoolingRequestOutput.of(o) for o in outputs]

    def score(self, data_1: PromptType | Sequence[PromptType], data_2: PromptType | Sequence[PromptType], /, *,
              use_tqdm: UseTqdm = True, lora_request: LoRARequest | None = None,
              truncate_prompt_tokens: int | None = None,
              tokenization_kwargs: dict[str, Any] | None = None) -> list[ScoringRequestOutput]:
        """Score text pairs (vLLM's `LLM.score`); one ScoringRequestOutput per pair, in order. With an embedding
        model each text is embedded (`embed`) and a pair scores the cosine similarity of its two embeddings; with
        a cross-encoder (a classifier with one label, as rerankers are saved) a pair is one prompt, the two texts
        joined as the tokenizer joins a text pair, and scores the classifier's probability (`classify`).

        Args:
            data_1: one prompt (scored against each of data_2) or a list of them (paired with data_2's, one to
                one); each prompt in any of `generate`'s forms.
            data_2: one prompt or a list of them.
            use_tqdm: show a progress bar when there is more than one prompt to run (a callable: as `generate`'s).
            lora_request: a LoRA adapter to run every prompt with (`generate`'s).
            truncate_prompt_tokens, tokenization_kwargs: as `embed`'s, for each text (a cross-encoder: each pair's
                prompt).
        """
        first, second = as_prompt_list(data_1), as_prompt_list(data_2)
        pairs = pair_up(first, second)
        labels = self.engine.class_labels
        if labels is None:
            embedded = self.embed(first + second, use_tqdm=use_tqdm, lora_request=lora_request,
                                  truncate_prompt_tokens=truncate_prompt_tokens,
                                  tokenization_kwargs=tokenization_kwargs)
            firsts, seconds = embedded[:len(first)], embedded[len(first):]
            return [ScoringRequestOutput(seconds[j].request_id,
                                         ScoringOutput(cosine_similarity(firsts[i].outputs.embedding,
                                                                         seconds[j].outputs.embedding)),
                                         firsts[i].prompt_token_ids + seconds[j].prompt_token_ids)
                    for i, j in pairs]
        if len(labels) != 1:
            raise ValueError(f"score needs an embedding model or a cross-encoder (a classifier with one label); "
                             f"this classifier has {len(labels)} labels: use classify")
        tokenizer, token_types = self.get_tokenizer(), self.engine.token_type_vocab_size > 1
        classified = self.classify([cross_encoder_prompt(tokenizer, first[i], second[j], token_types)
                                    for i, j in pairs], use_tqdm=use_tqdm, lora_request=lora_request,
                                   truncate_prompt_tokens=truncate_prompt_tokens,
                                   tokenization_kwargs=tokenization_kwargs)
        return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.probs[0]), o.prompt_token_ids)
                for o in classified]

    def _pool(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | Sequence[PoolingParams],
              task: str, use_tqdm: UseTqdm, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
              truncate_prompt_tokens: int | None, tokenization_kwargs: dict[str, Any] | None) -> list[RequestOutput]:
        """Run pooling requests of `task` to the end (RuntimeError if any failed); their outputs, in order."""
        self._check_awake(f"{task} runs its prompts")
        prompt_list = self._truncated(as_prompt_list(prompts), truncate_prompt_tokens, tokenization_kwargs)
        params_list = _per_prompt(pooling_params, len(prompt_list), "pooling_params")
        for params in params_list:
            if not isinstance(params, PoolingParams) or params.task != task:
                raise ValueError(f"pooling_params must be PoolingParams with task {task!r}, got {params!r}")
        request_ids = self._add(prompt_list, params_list, [0] * len(prompt_list),
                                _per_prompt(lora_request, len(prompt_list), "lora_request"))
        outputs = self._run(request_ids, use_tqdm)
        failed = [o for o in outputs if o.embedding is None]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return outputs

    def _truncated(self, prompt_list: list[ParsedPrompt], truncate_prompt_tokens: int | None,
                   tokenization_kwargs: dict[str, Any] | None) -> list[ParsedPrompt]:
        """The prompts as `apply_tokenization_kwargs` leaves them."""
        return apply_tokenization_kwargs(prompt_list, truncate_prompt_tokens, tokenization_kwargs,
                                         self.engine.tokenizer, self.engine.max_model_len)

    def _add(self, prompt_list: list[ParsedPrompt], params_list: list[SamplingParams | PoolingParams],
             priorities: list[int], loras: list[LoRARequest | None]) -> list[str]:
        """Validate every prompt (and load every adapter) before any is queued, then queue them; their ids."""
        for prio in priorities:
            self.engine.config.scheduler.check_priority(prio)
        prompt_list = [self.engine.process_images(p) if p.images else
                       self.engine.embeds_prompt(p) if p.prompt_embeds is not None else p for p in prompt_list]
        token_ids = [self.engine.tokenize_prompt(p, isinstance(params, PoolingParams))
                     for p, params in zip(prompt_list, params_list)]
        self._load_loras(loras)
        request_ids = [str(next(self._counter)) for _ in prompt_list]
        for request_id, prompt, ids, params, prio, lora in zip(request_ids, prompt_list, token_ids, params_list,
                                                               priorities, loras):
            self.engine.add_request(request_id, prompt, params, priority=prio, prompt_token_ids=ids,
                                    lora_request=lora)
            if self._stats is not None:
                sampling = params if isinstance(params, SamplingParams) else None
                self._stats.requests.on_added(request_id, time.monotonic(), 0 if ids is None else len(ids),
                                              None if sampling is None else sampling.max_tokens,
                                              None if sampling is None else sampling.n)
        return request_ids

    def _load_loras(self, loras: list[LoRARequest | None]) -> None:
        """Load each adapter named (ValueError for what is not a LoRARequest, or cannot load)."""
        named = [lora for lora in loras if lora is not None]
        for lora in named:
            if not isinstance(lora, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest or None, got {lora!r}")
        if named and not isinstance(self.engine, LLMEngine):
            raise ValueError("LoRA adapters run on one engine: data_parallel_size must be 1")
        for lora in dict.fromkeys(named):
            self.engine.runner.load_lora(lora)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *, use_tqdm: UseTqdm = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None,
             chat_template_content_format: str = "auto", priority: int | Sequence[int] | None = None,
             tokenization_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate a reply to a conversation, or to each of a list of conversations; one RequestOutput per
        conversation, in order.

        Args:
            messages: a conversation (a list of `{"role", "content"}` dicts), or a list of conversations.
            sampling_params: one for all conversations, or one per conversation.
            chat_template: a Jinja template replacing the engine's.
            add_generation_prompt: end the prompt with the assistant's turn opening.
            continue_final_message: end the prompt with the last message left open (set add_generation_prompt to
                False), so that the reply continues it: the start of a reply given ("prefill").
            tools: OpenAI-style function tools, rendered as the server renders them (the template's `tools`
                variable, or the system message for a template without one); the reply's calls are its text
                (parse them with a tool parser, e.g. `HermesToolParser`).
            chat_template_kwargs: extra variables for the template (e.g. a model's `enable_thinking`).
            lora_request, priority, tokenization_kwargs: as `generate`'s, per conversation.
            mm_processor_kwargs: arguments for the model's processor on the conversations' images (over the
                engine's `mm_processor_kwargs`).
            chat_template_content_format: how a message's content reaches the template (vLLM's): "auto", "string"
                or "openai" (`render_chat_template`).
        """
        prompts = self._chat_prompts(messages, chat_template, add_generation_prompt, continue_final_message, tools,
                                     chat_template_kwargs, mm_processor_kwargs, chat_template_content_format)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                             priority=priority, tokenization_kwargs=tokenization_kwargs)

    def enqueue_chat(self, messages: Conversation | Sequence[Conversation],
                     sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                     use_tqdm: UseTqdm = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                     priority: int | Sequence[int] | None = None, chat_template: str | None = None,
                     chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
                     continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                     chat_template_kwargs: dict[str, Any] | None = None,
                     tokenization_kwargs: dict[str, Any] | None = None,
                     mm_processor_kwargs: dict[str, Any] | None = None) -> list[str]:
        """`chat`'s conversations queued as `enqueue` queues prompts (vLLM 0.32's); the arguments as `chat`'s.
        Returns the queued requests' ids; `wait_for_completion` runs them."""
        prompts = self._chat_prompts(messages, chat_template, add_generation_prompt, continue_final_message, tools,
                                     chat_template_kwargs, mm_processor_kwargs, chat_template_content_format)
        return self.enqueue(prompts, sampling_params, lora_request, priority, use_tqdm, tokenization_kwargs)

    def _chat_prompts(self, messages: Conversation | Sequence[Conversation], chat_template: str | None,
                      add_generation_prompt: bool, continue_final_message: bool, tools: list[dict[str, Any]] | None,
                      chat_template_kwargs: dict[str, Any] | None, mm_processor_kwargs: dict[str, Any] | None,
                      content_format: str) -> list[ParsedPrompt]:
        """Each conversation's prompt, rendered as `chat` renders it."""
        conversations = _as_conversations(messages)
        template = chat_template or self.engine.config.model.chat_template
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            kwargs: dict[str, Any] = dict(chat_template_kwargs or {})
            if tools:
                used = template or getattr(tokenizer, "chat_template", None) or ""
                conversation, tool_kwargs = with_tools(list(conversation), tools, used)
                kwargs |= tool_kwargs
            prompts.append(self._chat_prompt(conversation, template, add_generation_prompt, continue_final_message,
                                             content_format, kwargs, mm_processor_kwargs))
        return prompts

    def _chat_prompt(self, conversation: Conversation, template: str | None, add_generation_prompt: bool,
                     continue_final_message: bool, content_format: str, kwargs: dict[str, Any],
                     processor_kwargs: dict[str, Any] | None) -> ParsedPrompt:
        """A conversation's prompt: its token ids, and, where it holds images, those (`process_images`)."""
        check_image_count(len(image_parts(conversation)), self.engine.config.model.image_limit)   # none read yet
        tokenizer, images = self.get_tokenizer(), conversation_images(conversation,
                                                                      self.engine.config.model.media_access)
        if not images:
            return ParsedPrompt(None, apply_chat_template(tokenizer, conversation, template, add_generation_prompt,
                                                          continue_final_message, content_format, **kwargs))
        text = render_chat_template(tokenizer, conversation, template, add_generation_prompt, continue_final_message,
                                    self.engine.image_marker, content_format, **kwargs)
        return self.engine.process_images(ParsedPrompt(text, None, images=tuple(images),
                                                       processor_kwargs=processor_kwargs), add_special_tokens=False)

    def _warn_if_on_another_thread(self) -> None:
        if self._warned_of_thread or threading.get_ident() == self._built_on:
            return
        self._warned_of_thread = True
        logger.warning("this LLM runs on a thread other than the one that built it: its kernels may run about half "
                       "as fast (torch's OpenMP gives each thread its own team of workers; see LLM.generate). "
                       "Build the LLM on the thread that calls it.")

    def _run(self, request_ids: list[str], use_tqdm: UseTqdm) -> list[RequestOutput]:
        """Step the engine until `request_ids` have finished; their outputs, in order, with a progress bar
        (`use_tqdm`) when there are several. Queued requests' outputs that finish meanwhile are kept for
        `wait_for_completion`."""
        self._warn_if_on_another_thread()
        use_tqdm = use_tqdm if len(request_ids) > 1 else False
        done = {r: output for r in request_ids if (output := self._enqueued.get(r)) is not None}
        wanted = set(request_ids)  # the engine may also be running requests added directly to it
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=len(request_ids), initial=len(done), desc="Processed prompts", disable=not use_tqdm,
                       dynamic_ncols=True)
        num_output_tokens = 0
        try:
            while len(done) < len(request_ids):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("the engine went idle with requests unanswered")
                for output in self._step():
                    if output.finished and output.request_id in wanted:
                        done[output.request_id] = output
                        num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                        bar.update(1)
                        elapsed = max(bar.format_dict["elapsed"], 1e-9)
                        bar.set_postfix_str(f"output {num_output_tokens / elapsed:.1f} tok/s")
        except BaseException:
            self._abort([r for r in request_ids if r not in done])
            raise
        finally:
            bar.close()
        return [done[r] for r in request_ids]

    def _abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort requests, counted so in the statistics; their last outputs."""
        outputs = self.engine.abort_request(request_ids)
        if self._stats is not None:
            iteration = IterationStats()
            self._stats.requests.on_aborted(request_ids, iteration, time.monotonic())
            self._stats.record(self.engine, [], iteration, stepped=False)
        return outputs

    def _step(self) -> list[RequestOutput]:
        """One engine step; the finished outputs of queued requests (`enqueue`) are kept. With statistics kept
        (disable_log_stats=False), the step is recorded for their loggers, the new tokens counted as the engine made
        them (the outputs here are final: a request's all at once)."""
        if self._stats is None:
            outputs = self.engine.step()
        else:
            iteration = IterationStats(started=time.monotonic())
            outputs = self.engine.step()
            self._stats.record(self.engine, outputs, iteration, True, self.engine.step_new_tokens)
        if self._enqueued:
            self._keep_enqueued(outputs)
        return outputs

    def _keep_enqueued(self, outputs: list[RequestOutput]) -> None:
        """Keep the final outputs of queued requests (`enqueue`) for wait_for_completion."""
        for output in outputs:
            if output.finished and output.request_id in self._enqueued:
                self._enqueued[output.request_id] = output


def _as_conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """One conversation (a list of message dicts) or a list of them -> the list of conversations."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a conversation (a list of message dicts) or a list of conversations")
    if all(isinstance(m, dict) for m in messages):
        return [list(messages)]
    for index, conversation in enumerate(messages):
        if not isinstance(conversation, list | tuple) or not conversation or \
                not all(isinstance(m, dict) for m in conversation):
            raise ValueError(f"conversation {index}: a conversation is a non-empty list of message dicts")
    return [list(c) for c in messages]


def _per_prompt(value, count: int, name: str) -> list:
    if isinstance(value, list | tuple):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count
