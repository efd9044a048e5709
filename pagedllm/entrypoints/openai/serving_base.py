"""What /v1/completions and /v1/chat/completions share before they answer: model check, limits, prompt
validation, sampling parameters, and running one engine request per prompt, whose `n` completions the engine
forks (serving_choices.py answers)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncGenerator, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, cast

from pagedllm.engine.admission import QueueFullError
from pagedllm.engine.async_engine import AsyncEngine, EngineDeadError, EngineDrainingError, RequestFailedError
from pagedllm.engine.data_parallel import AsyncDataParallelEngine
from pagedllm.engine.llm_engine import PromptTooLongError, require_tokenizer
from pagedllm.entrypoints.openai.protocol import OpenAIError, _PoolingRequest, _SamplingFields, random_id
from pagedllm.entrypoints.openai.structured_outputs import structured_outputs_from
from pagedllm.inputs import ParsedPrompt, TokensPrompt, truncation_slice
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal import ImageInput
from pagedllm.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ServerLimits:
    """Per-request limits (vLLM's defaults where it has one).

    Args:
        max_request_body_bytes: larger bodies get 413.
        max_n: most completions per prompt.
        max_stop_strings: most stop strings per request.
        max_logprobs: most top log-probabilities per token (vLLM's max_logprobs).
        max_prompts: most prompts in one /v1/completions request.
        max_choices: most engine requests one HTTP request may start (prompts x n).
    """

    max_request_body_bytes: int = 4 * 1024 * 1024
    max_n: int = 128
    max_stop_strings: int = 64
    max_logprobs: int = 20
    max_prompts: int = 1024
    max_choices: int = 1024


@dataclass(frozen=True)
class FrontendOptions:
    """How the server answers, beyond its limits: vLLM's frontend flags, with its defaults.

    Args:
        response_role: the role of a chat reply that follows the generation prompt (--response-role); a reply
            that continues the last message (add_generation_prompt false) takes that message's role.
        default_chat_template_kwargs: template variables every chat is rendered with, under a request's own
            chat_template_kwargs, e.g. `{"enable_thinking": False}` for Qwen3.
        return_tokens_as_token_ids: log-probabilities name tokens "token_id:{id}" unless a request says otherwise.
        force_include_usage: a streamed response ends with its usage whether or not stream_options asks.
        trust_request_chat_template: take a chat request's own `chat_template`; off (vLLM's default), 400: the
            template is Jinja the client wrote.
        trust_request_mm_kwargs: take a chat request's own `mm_processor_kwargs`; off (vLLM's default), 400: they
            change what an image costs to process.
        exclude_tools_when_tool_choice_none: a chat with tool_choice "none" is rendered without its tools.
        chat_template_content_format: how a message's content reaches the chat template: "auto", "string" or
            "openai" (pagedllm.tokenizer.chat_template).
        sse_keep_alive_interval: a stream idle this many seconds gets an SSE comment line (0: never), so that a
            proxy's read timeout does not close it.
        enable_per_request_metrics: a chat or completion response of one choice carries vLLM's `metrics` (its
            timings: `RequestTimes.response_metrics`), streamed on the usage chunk.
    """

    response_role: str = "assistant"
    default_chat_template_kwargs: dict[str, Any] | None = None
    return_tokens_as_token_ids: bool = False
    force_include_usage: bool = False
    trust_request_chat_template: bool = False
    trust_request_mm_kwargs: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    chat_template_content_format: str = "auto"
    sse_keep_alive_interval: float = 0.0
    enable_per_request_metrics: bool = False


@dataclass(slots=True)
class ChoiceDelta:
    """What one response choice produced in one engine output.

    Args:
        index: the choice's index in the response: prompt_index * n + the completion's index.
        delta: the completion's new text and tokens (the engine runs with output_kind "delta").
        prompt_index: which prompt of the request the choice completes.
        prompt_logprobs: the prompt's log-probabilities, if asked for; they come once per prompt, with the first
            delta of one of its choices.
        num_cached_tokens: of the prompt's tokens, those the prefix cache held.
        metrics: the request's timings, with its last output (`RequestOutput.metrics`), where the engine keeps them.
    """

    index: int
    delta: CompletionOutput
    prompt_index: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: Any = None


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]
    token_type_ids: list[int] | None = None     # a cross-encoder's pair (BERT's); None: all 0
    images: tuple[ImageInput, ...] = ()         # a chat's images, their placeholders in token_ids

    def engine_prompt(self) -> list[int] | TokensPrompt | ParsedPrompt:
        """What the engine takes: the token ids, with their types or images if any."""
        if self.images:
            return ParsedPrompt(self.text, self.token_ids, image_inputs=self.images)
        if self.token_type_ids is None:
            return self.token_ids
        return TokensPrompt(prompt_token_ids=self.token_ids, token_type_ids=self.token_type_ids)


OutputStream = AsyncGenerator[ChoiceDelta, None]


class LoRAModules:
    """The LoRA adapters a server serves, by name, shared by its serving objects; `/v1/load_lora_adapter` and
    `/v1/unload_lora_adapter` change them while it runs (`add`, `remove`)."""

    def __init__(self, lora_modules: Sequence[LoRARequest] = ()) -> None:
        self._by_name = {lora.lora_name: lora for lora in lora_modules}
        self._next_id = max((lora.lora_int_id for lora in lora_modules), default=0) + 1

    def __iter__(self) -> Iterator[LoRARequest]:
        return iter(list(self._by_name.values()))

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def new(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest for an adapter not served yet, with an id never given before (not served until `add`)."""
        self._next_id += 1
        return LoRARequest(name, self._next_id - 1, path)

    def add(self, lora: LoRARequest) -> None:
        self._by_name[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest | None:
        return self._by_name.pop(name, None)


def load_lora_modules(engine: AsyncEngine | AsyncDataParallelEngine, lora_modules: Sequence[LoRARequest],
                      served_model_names: Sequence[str]) -> LoRAModules:
    """Check and load the LoRA adapters a server serves, before its engine starts: a name served twice, or an
    adapter that does not load, stops the start with a ValueError saying why."""
    names = set(served_model_names)
    for lora in lora_modules:
        if lora.lora_name in names:
            raise ValueError(f"LoRA module name {lora.lora_name!r} is served already (as a model name or another "
                             "module's)")
        names.add(lora.lora_name)
    if lora_modules and not isinstance(engine, AsyncEngine):
        raise ValueError("LoRA adapters run on one engine: data_parallel_size must be 1")
    for lora in lora_modules:
        engine.engine.runner.load_lora(lora)
    return LoRAModules(lora_modules)


class OpenAIServing:
    """Base of the serving classes.

    Args:
        engine: the running AsyncEngine.
        served_model_names: names accepted in `model`; the first is reported back.
        lora_modules: LoRA adapters served beside the base model, each under its `lora_name` as `model` (one
            LoRAModules shared by the server's serving objects).
        limits: per-request limits.
        options: how requests are answered beyond the limits (default: vLLM's defaults).
    """

    def __init__(self, engine: AsyncEngine, served_model_names: Sequence[str], limits: ServerLimits,
                 lora_modules: LoRAModules | None = None, options: FrontendOptions | None = None) -> None:
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.limits = limits
        self.options = options or FrontendOptions()
        self.lora_modules = lora_modules if lora_modules is not None else LoRAModules()

    # ---- validation ---------------------------------------------------------------------------------------------
    def tokenizer_for(self, param: str) -> Any:
        """The engine's tokenizer; 400 naming `param` when the server runs without one (--skip-tokenizer-init)."""
        try:
            return require_tokenizer(self.engine.tokenizer)
        except ValueError as exc:
            raise OpenAIError(f"{exc}: only token ids come in and go out", param=param) from None

    @staticmethod
    def request_id_for(prefix: str, given: str | None) -> str:
        """A response's id: the request's own `request_id` after `prefix` (vLLM's), else a random one."""
        return random_id(prefix) if given is None else f"{prefix}-{given}"

    def check_model(self, model: str | None) -> str:
        """The name to report; 404 for a model this server does not serve (a base name or a LoRA adapter's)."""
        if model is None or model == "":
            return self.served_model_names[0]
        if model not in self.served_model_names and self.lora_modules.get(model) is None:
            names = [*self.served_model_names, *(lora.lora_name for lora in self.lora_modules)]
            raise OpenAIError(f"The model `{model}` does not exist. This server serves {', '.join(names)}.", 404,
                              "model", "model_not_found")
        return model

    def lora_for(self, model: str) -> LoRARequest | None:
        """The LoRA adapter a checked `model` names; None for the base model."""
        return self.lora_modules.get(model)

    def check_common(self, request: _SamplingFields) -> None:
        if request.stream_options is not None and not request.stream:
            raise OpenAIError("stream_options can only be set when stream is true", param="stream_options")
        if not 1 <= request.n <= self.limits.max_n:
            raise OpenAIError(f"n must be in [1, {self.limits.max_n}], got {request.n}", param="n")
        stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
        if len(stops) > self.limits.max_stop_strings:
            raise OpenAIError(f"stop has {len(stops)} strings; at most {self.limits.max_stop_strings} are allowed",
                              param="stop")

    def check_logprobs(self, num_logprobs: int | None, param: str) -> None:
        if num_logprobs is not None and not 0 <= num_logprobs <= self.limits.max_logprobs:
            raise OpenAIError(f"{param} must be in [0, {self.limits.max_logprobs}], got {num_logprobs}",
                              param=param)

    def check_prompt_logprobs(self, request: _SamplingFields) -> None:
        """vLLM's `prompt_logprobs`: in range, and not with stream (they come with the whole response)."""
        self.check_logprobs(request.prompt_logprobs, "prompt_logprobs")
        if request.stream and request.prompt_logprobs is not None:
            raise OpenAIError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")

    def truncation(self, request: _SamplingFields | _PoolingRequest) -> slice | None:
        """The prompt tokens vLLM's truncate_prompt_tokens keeps (`truncation_slice`): the first k (truncation_side
        "right") or the last k ("left"), on the tokenizer's own side where the request names none; -1 keeps as
        many as fit: the whole context to embed, all but one token to generate. None: all of them."""
        keep = request.truncate_prompt_tokens
        if keep is None:
            return None
        most = self.engine.max_model_len - (0 if isinstance(request, _PoolingRequest) else 1)
        keep = most if keep == -1 else keep
        if not 1 <= keep <= most:
            raise OpenAIError(f"truncate_prompt_tokens must be -1 or in [1, {most}] (max_model_len is "
                              f"{self.engine.max_model_len}), got {request.truncate_prompt_tokens}",
                              param="truncate_prompt_tokens")
        return truncation_slice(keep, request.truncation_side, self.engine.tokenizer)

    async def prompt_token_ids(self, prompt: str | list[int], param: str = "prompt",
                               truncation: slice | None = None, pooling: bool = False) -> list[int]:
        """The prompt tokenized (off the event loop), cut to `truncation` (see truncation()), and put through the
        engine's checks (`pooling`: a prompt to embed, which may fill the context), with vLLM's wording for a
        prompt over the context."""
        if truncation is not None:
            token_ids = prompt if isinstance(prompt, list) else await self.engine.run_on_tokenizer_thread(
                self.engine.tokenizer.encode, prompt)
            prompt = token_ids[truncation]
        try:
            # A list is already ints (the request schema): as a ParsedPrompt it skips parse_prompt's pass over it.
            return await self.engine.tokenize_prompt(ParsedPrompt(None, prompt) if isinstance(prompt, list) else prompt,
                                                     pooling)
        except PromptTooLongError as exc:
            raise OpenAIError(f"This model's maximum context length is {exc.max_model_len} tokens. However, your "
                              f"request has {exc.num_tokens} input tokens. Please reduce the length of the input "
                              "messages.", param=param, code="context_length_exceeded") from exc
        except ValueError as exc:
            raise OpenAIError(str(exc), param=param) from exc

    async def prompts(self, prompt: str | list[str] | list[int] | list[list[int]], truncation: slice | None,
                      param: str = "prompt", pooling: bool = False) -> list[Prompt]:
        """A request's prompts (one or a batch, each text or token ids), each through `prompt_token_ids`."""
        raw: list[str | list[int]]
        if isinstance(prompt, str):
            raw = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            raw = [cast(list[int], prompt)]         # one prompt as token ids
        else:
            raw = cast(list[str | list[int]], list(prompt))
        if not raw:
            raise OpenAIError(f"{param} must not be empty", param=param)
        if len(raw) > self.limits.max_prompts:
            raise OpenAIError(f"at most {self.limits.max_prompts} prompts per request", param=param)
        return [Prompt(item if isinstance(item, str) and truncation is None else None,
                       await self.prompt_token_ids(item, param, truncation, pooling)) for item in raw]

    def resolve_max_tokens(self, max_tokens: int | None, num_prompt_tokens: int, param: str = "max_tokens") -> int:
        """`max_tokens`, or all the context left, at most the model's generation config's max_tokens (as vLLM);
        400 if prompt + max_tokens overflows the context."""
        max_len = self.engine.max_model_len
        cap = self.engine.default_sampling.get("max_tokens")
        if max_tokens is None:
            return min(max_len - num_prompt_tokens, cap or max_len)
        if max_tokens >= 1 and num_prompt_tokens + max_tokens > max_len:
            raise OpenAIError(f"This model's maximum context length is {max_len} tokens. However, you requested "
                              f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, "
                              f"{max_tokens} in the completion). Please reduce the length of the messages or "
                              "completion.", param=param, code="context_length_exceeded")
        return min(max_tokens, cap) if cap and max_tokens >= 1 else max_tokens

    def sampling_params(self, request: _SamplingFields, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams for one prompt's engine request: its `n` completions are forked in the engine."""
        try:
            logit_bias = {int(k): v for k, v in (request.logit_bias or {}).items()}
        except ValueError as exc:
            raise OpenAIError("logit_bias keys must be token ids", param="logit_bias") from exc
        vocab_size = self.engine.vocab_size
        for name, token_ids in (("logit_bias", list(logit_bias)), ("stop_token_ids", request.stop_token_ids or []),
                                ("allowed_token_ids", request.allowed_token_ids or [])):
            if any(not 0 <= t < vocab_size for t in token_ids):
                raise OpenAIError(f"{name} takes token ids in [0, {vocab_size})", param=name)
        fields: dict[str, Any] = dict(
            n=request.n, max_tokens=max_tokens, stop=request.stop, seed=request.seed, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
            logit_bias=logit_bias or None, allowed_token_ids=request.allowed_token_ids, bad_words=request.bad_words,
            thinking_token_budget=request.thinking_token_budget, stream_interval=request.stream_interval,
            extra_args=request.vllm_xargs,
            ignore_eos=request.ignore_eos, min_tokens=request.min_tokens,
            stop_token_ids=request.stop_token_ids, skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output, output_kind="delta",
            structured_outputs=structured_outputs_from(request.response_format, request.structured_outputs))
        # what the request leaves unset: the model's generation config's default, else SamplingParams' own
        optional = dict(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                        min_p=request.min_p, repetition_penalty=request.repetition_penalty)
        defaults = self.engine.default_sampling
        fields.update({k: defaults[k] if v is None else v for k, v in optional.items()
                       if v is not None or k in defaults})
        try:
            return SamplingParams(**fields)
        except ValueError as exc:
            raise OpenAIError(str(exc), param=_param_of(str(exc))) from exc

    def check_num_choices(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.limits.max_choices:
            raise OpenAIError(f"{num_prompts} prompts x n={n} is more than the {self.limits.max_choices} "
                              "completions one request may ask for", param="n")

    # ---- running ------------------------------------------------------------------------------------------------
    async def run_prompts(self, request_id: str, prompts: list[Prompt], params_per_prompt: list[SamplingParams],
                          priority: int, cache_salt: str | None, lora_request: LoRARequest | None) -> OutputStream:
        """Start one engine request per prompt (`{request_id}-{prompt_index}`), whose `n` completions the engine
        forks off it, sharing the prompt's KV blocks; yield each completion's deltas as they arrive, in any order.

        Closing this iterator (or cancelling its consumer) aborts every request still running, with all its
        completions.
        """
        streams = [self.engine.generate(f"{request_id}-{i}", prompt.engine_prompt(), params,
                                        prompt_token_ids=prompt.token_ids, priority=priority, cache_salt=cache_salt,
                                        lora_request=lora_request)
                   for i, (prompt, params) in enumerate(zip(prompts, params_per_prompt))]
        n = params_per_prompt[0].n
        if len(streams) == 1:
            async with aclosing(streams[0]) as stream:
                async for output in stream:
                    for delta in _choice_deltas(0, n, output):
                        yield delta
            return
        async for prompt_index, output in _merge(streams):
            for delta in _choice_deltas(prompt_index, n, output):
                yield delta

    async def first_then_rest(self, outputs: OutputStream) -> OutputStream:
        """Wait for the first output before answering, so that a request the engine refuses gets a real status
        code rather than an error inside a 200 stream."""
        first = await anext(outputs)

        async def chained() -> OutputStream:
            async with aclosing(outputs):
                yield first
                async for item in outputs:
                    yield item
        return chained()


def _choice_deltas(prompt_index: int, n: int, output: RequestOutput) -> list[ChoiceDelta]:
    """An engine output carries the completion that changed (all n of them when the request is aborted)."""
    return [ChoiceDelta(prompt_index * n + completion.index, completion, prompt_index, output.prompt_logprobs,
                        output.num_cached_tokens, output.metrics) for completion in output.outputs]


async def _merge(streams: list[AsyncGenerator[RequestOutput, None]]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several output streams; an error in one ends them all."""
    queue: asyncio.Queue = asyncio.Queue()
    _DONE = object()

    async def drain(i: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async with aclosing(stream):
                async for output in stream:
                    queue.put_nowait((i, output))
            queue.put_nowait((i, _DONE))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _param_of(message: str) -> str | None:
    """The field a message names first, as SamplingParams' do: 'top_p must be in (0, 1], got 2' -> 'top_p'; None
    for a message that does not start that way ('invalid structured_outputs.json: ...', 'the prompt is empty')."""
    named = _NAMES_A_FIELD.match(message)
    return named[1] if named else None


_NAMES_A_FIELD = re.compile(r"([a-z_]+(?:\.[a-z_]+)*) (?:must|is|takes) ")


def error_for(exc: BaseException) -> OpenAIError:
    """The OpenAI error for an exception raised while a request runs."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDrainingError):
        return OpenAIError(str(exc), 503, code="server_shutting_down")
    if isinstance(exc, QueueFullError):      # a load balancer or the client's retry sends it elsewhere
        return OpenAIError(str(exc), 503, code=exc.reason)
    if isinstance(exc, EngineDeadError):
        return OpenAIError(str(exc), 503, code="engine_dead")
    if isinstance(exc, RequestFailedError):
        return OpenAIError(str(exc), 500, code="engine_step_failed")
    if isinstance(exc, ValueError):
        return OpenAIError(str(exc), 400, _param_of(str(exc)))
    logger.exception("request failed", exc_info=exc)
    return OpenAIError(f"internal error: {exc!r}", 500)

