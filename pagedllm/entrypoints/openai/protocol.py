"""OpenAI request schemas (pydantic) and the error type every endpoint answers with.

Requests accept OpenAI's fields plus vLLM's sampling extras (top_k, min_p, ...). Unknown fields are ignored, as
OpenAI's own server does. Responses are built as plain dicts by the serving modules: they are encoded once per
chunk, and pydantic would only add a second copy of each field.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class OpenAIError(Exception):
    """An error sent back as `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

    Args:
        message: what went wrong, for the user.
        status_code: HTTP status (400 bad input, 401 key, 404 model, 413 body, 503 engine dead).
        param: the request field at fault, if any.
        code: a short machine-readable code, e.g. "model_not_found".
    """

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        """OpenAI's own types: every client error is an invalid_request_error; `code` tells them apart."""
        return "server_error" if self.status_code >= 500 else "invalid_request_error"

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(errors: Sequence[Any]) -> OpenAIError:
    """pydantic's errors of a request body (FastAPI's or a batch line's) as OpenAI's 400, naming the first bad
    field."""
    if not errors:
        return OpenAIError("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return OpenAIError(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                           code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if not loc:
        return OpenAIError(f"the request body is invalid: {first['msg']}")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return OpenAIError(f"{'.'.join(loc)}: {first['msg']}{more}", param=loc[0])


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# vLLM's bounds: a 64-bit signed seed (torch takes [-2**63, 2**64), so seed + choice index still fits).
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1


def _has_lone_surrogate(value: Any) -> bool:
    """True if any string in a JSON value holds a lone surrogate ("\\ud800", or invalid UTF-8 bytes that Python's
    json decoder lets through): no tokenizer or response encoder can take one. Iterative: any nesting depth."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class _Request(BaseModel):
    # NaN and +-Infinity (which Python's json accepts) are refused in every float field.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                if _has_lone_surrogate(key) or _has_lone_surrogate(value):
                    raise ValueError(f"field {key!r} holds a lone surrogate: the text is not valid Unicode")
        return data


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    thinking_token_budget: int | None = None     # the most tokens a reasoning model thinks (-1: no budget)
    # a streamed chunk every that many tokens, the first and last at once; raises the server's --stream-interval
    stream_interval: int | None = Field(default=None, ge=1)
    # vLLM's arguments for custom extensions: the SamplingParams' extra_args, which custom logits processors read
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    use_beam_search: bool = False       # vLLM's: n beams kept, the n best sequences answered (not streamed)
    # beam search's: a sequence scores cum_logprob / length ** length_penalty
    length_penalty: float = Field(default=1.0, ge=-100, le=100)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    prompt_logprobs: int | None = None      # top log-probabilities per prompt token (not with stream)
    # keep this many of the prompt's tokens (-1: as many as fit): the last ones ("left", the default) or the first
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    return_token_ids: bool | None = None    # the choices' token ids (streamed: each chunk's) and the prompt's
    return_tokens_as_token_ids: bool | None = None    # logprobs name tokens "token_id:{id}"
    # vLLM's: the request's id (the response's, after its prefix), else a random one
    request_id: str | None = Field(default=None, min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or a list of token-id lists;
    `prompt_embeds` (vLLM's, with --enable-prompt-embeds): base64 of a torch.save'd [tokens, hidden_size] tensor, or
    a list of them, prompts after `prompt`'s (which may then be left out)."""

    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: _FunctionName


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    # Validated by the chat template (roles, content parts); the schema below documents the common shape.
    messages: list[dict[str, Any]] = Field(min_length=1, json_schema_extra={"items": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"enum": ["system", "user", "assistant", "developer", "tool"]},
                       "content": {"type": "string"}}}})
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False    # vLLM's: the last message left open, for the reply to continue it
    echo: bool = False                      # vLLM's: the reply starts with the last message, if it is the assistant's
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None     # vLLM's: arguments for the model's image processor
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True    # false: at most one call (vLLM's)
    include_reasoning: bool = True      # with --reasoning-parser: false leaves the reasoning out (vLLM's)
    # OpenAI's: how hard a reasoning model thinks, given to the chat template as `reasoning_effort` (as vLLM does)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class ResponsesRequest(_Request):
    """POST /v1/responses (OpenAI's Responses API), the part a text model serves: serving_responses.py."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    include_reasoning: bool = True          # vLLM's: with --reasoning-parser, false leaves the reasoning item out
    reasoning: dict[str, Any] | None = None     # OpenAI's {"effort": ...}: the chat's reasoning_effort
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    top_logprobs: int | None = None
    # vLLM's extras
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    priority: int = 0
    cache_salt: str | None = None


class TokenizeRequest(_Request):
    """POST /tokenize: either `prompt` or chat `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


class _PoolingRequest(_Request):
    """What the requests that embed prompts share (vLLM's extras): truncate_prompt_tokens (-1: as many as the
    context holds), truncation_side, priority."""

    model: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    priority: int = 0


class _PromptsToPoolRequest(_PoolingRequest):
    """`input`: a string, a list of strings, token ids, or a list of token-id lists; or, as vLLM's chat form,
    `messages`, rendered by the chat template (with no generation prompt unless asked) into one prompt."""

    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    user: str | None = None


class EmbeddingRequest(_PromptsToPoolRequest):
    """POST /v1/embeddings. `encoding_format` "base64" sends each vector as its little-endian float32 bytes (what
    OpenAI's SDK asks for by default). vLLM's extras: normalize, and _PoolingRequest's."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool = True


class ClassificationRequest(_PromptsToPoolRequest):
    """POST /classify (vLLM's; and /v1/classify): each prompt through the model's classification head.
    `use_activation` false gives the logits instead of probabilities."""

    use_activation: bool = True


class ScoreRequest(_PoolingRequest):
    """POST /score (and /v1/score), vLLM's: scores of the pairs of `text_1` and `text_2`, 1:1, 1:N or N:N."""

    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_PoolingRequest):
    """POST /rerank (and /v1/rerank, /v2/rerank), vLLM's after Jina's and Cohere's: `documents` ordered by their
    relevance to `query`, the best `top_n` (all when 0)."""

    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class CollectiveRPCRequest(BaseModel):
    """vLLM's /collective_rpc body (VLLM_SERVER_DEV_MODE): a worker method by name, with string arguments."""

    method: str = Field(min_length=1)
    args: list[str] = Field(default_factory=list)
    kwargs: dict[str, str] = Field(default_factory=dict)
    timeout: float | None = Field(default=None, gt=0)


class StartProfileRequest(BaseModel):
    """vLLM's /start_profile body: what one profiling session overrides of --profiler-config."""

    profile_prefix: str | None = None
    delay_iterations: int | None = Field(default=None, ge=0)
    max_iterations: int | None = Field(default=None, ge=0)


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter body (its lora_int_id is taken and not needed: names are unique)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
