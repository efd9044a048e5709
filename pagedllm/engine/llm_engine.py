"""LLMEngine: the step loop. Schedule, run, update; then turn token updates into RequestOutputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.request import FinishReason, Request
from pagedllm.core.sched.output import RequestUpdate
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.loader import load_model
from pagedllm.logger import init_logger
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.runner import kv_tensors
from pagedllm.runner.model_runner import ModelRunner
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer.tokenizer import load_tokenizer

logger = init_logger(__name__)

PromptInput = str | list[int]


@dataclass
class _Tracked:
    """The engine's view of one request: text so far and what to report."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    sent_tokens: int = 0


class LLMEngine:
    """Loads a model, sizes the KV pool, and runs the scheduler/runner loop one step at a time."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        loaded = load_model(config.model)
        self.model_name = loaded.resolved.name
        self.tokenizer = load_tokenizer(loaded.resolved.path, loaded.resolved.gguf_file, config.model.chat_template)
        self.hf_config = loaded.hf_config
        self.max_model_len = self._max_model_len(loaded.hf_config)
        config.scheduler.max_model_len = self.max_model_len
        self.runner = ModelRunner(loaded, config.cache, self.tokenizer.eos_token_id, config.model.seed)
        num_blocks = config.cache.num_blocks or self._num_blocks()
        config.cache.num_blocks = num_blocks
        self.runner.allocate_kv_cache(num_blocks)
        self.kv_manager = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.capacity = kv_tensors.CapacityReport(num_blocks, config.cache.block_size,
                                                  self.runner.layout.bytes_per_token, self.max_model_len)
        logger.info("%s", self.capacity)
        self._tracked: dict[str, _Tracked] = {}

    def _max_model_len(self, hf_config) -> int:
        model_len = getattr(hf_config, "max_position_embeddings", None) or 2048
        wanted = self.config.model.max_model_len
        if wanted is not None and wanted > model_len:
            raise ValueError(f"max_model_len={wanted} is larger than the model's context length {model_len}")
        return wanted or model_len

    def _num_blocks(self) -> int:
        cache = self.config.cache
        budget = kv_tensors.kv_budget_bytes(cache.kv_cache_memory, cache.gpu_memory_utilization,
                                            self.runner.weight_bytes(), self.runner.device)
        return kv_tensors.num_blocks_for(budget, self.runner.layout, cache.block_size)

    # ---- requests ---------------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptInput) -> list[int]:
        """Token ids of a prompt, validated: not empty, inside the vocabulary and the context."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab_size = self.runner.shape.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                             "it must be shorter, to leave room for at least one generated token")
        return token_ids

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams, priority: int = 0,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None) -> None:
        """Queue a request. `prompt_token_ids`, when given, are the already validated tokens of `prompt`."""
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n != 1:
            raise ValueError("n > 1 is not supported yet")
        token_ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize_prompt(prompt)
        vocab_size = self.runner.shape.vocab_size
        if any(t >= vocab_size for t in list(params.logit_bias or {}) + params.stop_token_ids):
            raise ValueError(f"logit_bias and stop_token_ids take token ids in [0, {vocab_size})")
        detokenizer = IncrementalDetokenizer(self.tokenizer, params, token_ids)
        self._tracked[request_id] = _Tracked(prompt if isinstance(prompt, str) else None, token_ids, params,
                                             detokenizer, logprobs=[] if params.logprobs is not None else None)
        self.scheduler.add_request(Request(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
            eos_token_id=self.tokenizer.eos_token_id, arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            priority=priority, cache_salt=cache_salt))

    def abort_request(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, FinishReason.ABORT)
        for request_id in request_ids:
            self._tracked.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the loop -----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        res = self.runner.execute(out)
        updates = self.scheduler.update_from_output(out, res)
        return [o for o in map(self._process, updates) if o is not None]

    def _process(self, update: RequestUpdate) -> RequestOutput | None:
        tracked = self._tracked.get(update.req_id)
        if tracked is None:
            return None
        tracked.token_ids.extend(update.new_token_ids)
        self._append_logprobs(tracked, update)
        finish_reason, stop_reason = update.finish_reason, update.stop_reason
        stop_str = tracked.detokenizer.update(update.new_token_ids) if update.new_token_ids else None
        if stop_str is not None and finish_reason is None:
            self.scheduler.finish_requests([update.req_id], FinishReason.STOP)
            finish_reason, stop_reason = FinishReason.STOP, stop_str
        finished = finish_reason is not None
        if finished:
            del self._tracked[update.req_id]
        if tracked.params.output_kind == "final" and not finished:
            return None
        return self._make_output(update, tracked, finish_reason, stop_reason)

    def _append_logprobs(self, tracked: _Tracked, update: RequestUpdate) -> None:
        if tracked.logprobs is None or update.new_logprobs is None:
            return
        for token_id, entries in zip(update.new_token_ids, update.new_logprobs):
            position = {tid: Logprob(lp, rank, self.tokenizer.decode([tid])) for tid, lp, rank in entries}
            tracked.logprobs.append(position)
            tracked.cumulative_logprob += position[token_id].logprob

    def _make_output(self, update: RequestUpdate, tracked: _Tracked, finish_reason: FinishReason | None,
                     stop_reason: int | str | None) -> RequestOutput:
        finished = finish_reason is not None
        delta = tracked.params.output_kind == "delta"
        start = tracked.sent_tokens if delta else 0
        tracked.sent_tokens = len(tracked.token_ids)
        completion = CompletionOutput(
            index=0,
            text=tracked.detokenizer.get_next_output_text(finished, delta),
            token_ids=tracked.token_ids[start:],
            cumulative_logprob=tracked.cumulative_logprob if tracked.logprobs is not None else None,
            logprobs=tracked.logprobs[start:] if tracked.logprobs is not None else None,
            finish_reason=finish_reason.value if finish_reason is not None else None,
            stop_reason=stop_reason,
        )
        return RequestOutput(request_id=update.req_id, prompt=tracked.prompt,
                             prompt_token_ids=tracked.prompt_token_ids, outputs=[completion], finished=finished,
                             num_cached_tokens=update.num_cached_tokens)
