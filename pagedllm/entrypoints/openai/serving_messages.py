"""POST /v1/messages: Anthropic's Messages API (as vLLM serves it, for clients written against Anthropic's SDK),
answered by the chat serving; and POST /v1/messages/count_tokens.

The request becomes a chat completion: `system` a system message, each message's content blocks the chat's
(text; a user's image blocks, base64 or by URL, image_url parts, for a model that takes images; an assistant's
tool_use blocks its tool calls; a user's tool_result blocks tool messages, before its text),
`max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k` the sampling fields, `tools` (`input_schema`) and
`tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`) the chat's, `output_config.format` (a JSON
schema) the response_format. The reply becomes the message's
`content`: a thinking block (under --reasoning-parser), a text block, then a tool_use block per call, with
`stop_reason` end_turn, stop_sequence (naming it), max_tokens or tool_use. Streamed, Anthropic's events (`event:`
and `data:` lines): message_start, then each block's content_block_start, _delta (text_delta, thinking_delta,
input_json_delta) and _stop, then message_delta (the stop reason and output tokens) and message_stop; an error
after the start is an `error` event. Errors come in Anthropic's shape (server.py renders them by path).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from pydantic import Field, ValidationError

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    OpenAIError,
    _Request,
    random_id,
    validation_error,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.tool_parsers import gather_call_deltas
from pagedllm.tokenizer.tokenizer import think_token_ids


class AnthropicMessagesRequest(_Request):
    """The Messages API request (the fields a text model serves; `metadata` and `output_config`'s `effort` are
    taken and change nothing; `output_config.format` a JSON schema the reply follows; `thinking` enabled with
    `budget_tokens`: the thinking_token_budget of a model that thinks between <think> tokens, as vLLM maps it, and
    nothing for one that does not). The sampling fields, which Anthropic's SDK sends only as extra fields, and
    vLLM's chat_template_kwargs and priority."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(gt=0)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0


class AnthropicCountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: the prompt tokens a Messages request would have."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# Anthropic's error types by HTTP status (its SDK raises by status; the type is for people reading the body)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


def anthropic_error(error: OpenAIError) -> dict[str, Any]:
    """An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""
    kind = _ERROR_TYPES.get(error.status_code, "api_error" if error.status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


class OpenAIServingMessages:
    """The Messages API over a chat serving (its engine, names, limits and tool parser)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, request: AnthropicMessagesRequest) -> dict[str, Any] | AsyncIterator[str]:
        """A message dict, or (stream=True) an iterator of SSE lines. Raises OpenAIError on bad input."""
        model = self.chat.check_model(request.model)
        thinks = request.thinking is not None and think_token_ids(self.chat.engine.tokenizer) is not None
        reply = await self.chat.create(_chat_request(request, thinks), sse=False)
        if isinstance(reply, dict):
            (choice,) = reply["choices"]
            message = choice["message"]
            content = _content(message.get("reasoning"), message.get("content"), message.get("tool_calls") or [])
            return {"id": random_id("msg"), "type": "message", "role": "assistant", "model": model,
                    "content": content, **_stop(choice["finish_reason"], choice["stop_reason"]),
                    "usage": _usage(reply["usage"])}
        return _events(random_id("msg"), model, reply)

    async def count_tokens(self, request: AnthropicCountTokensRequest) -> dict[str, int]:
        self.chat.check_model(request.model)
        fields = request.model_dump(exclude={"model"})
        tokens = await self.chat.render(_chat_request(AnthropicMessagesRequest(model=request.model, max_tokens=1,
                                                                               **fields)))
        return {"input_tokens": len(tokens)}


# ---- request -> chat ----------------------------------------------------------------------------------------------
def _chat_request(request: AnthropicMessagesRequest, thinks: bool = False) -> ChatCompletionRequest:
    """The chat request; `thinks`: the model thinks between <think> tokens, so `thinking`'s budget applies."""
    messages = [] if request.system is None else [{"role": "system", "content": _system(request.system)}]
    for i, message in enumerate(request.messages):
        messages += _chat_messages(i, message)
    fields: dict[str, Any] = {
        "model": request.model, "messages": messages, "max_completion_tokens": request.max_tokens,
        "stop": request.stop_sequences, "temperature": request.temperature, "top_p": request.top_p,
        "top_k": request.top_k, "chat_template_kwargs": request.chat_template_kwargs, "priority": request.priority,
        "stream": request.stream, "response_format": _response_format(request.output_config),
        # continuous usage: the first chunk carries the prompt's tokens, which message_start reports
        "stream_options": {"include_usage": True, "continuous_usage_stats": True} if request.stream else None}
    thinking = request.thinking or {}
    if thinks and thinking.get("type") == "enabled" and isinstance(thinking.get("budget_tokens"), int):
        fields["thinking_token_budget"] = thinking["budget_tokens"]
    if request.tools:
        fields["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(request.tools)]
        choice = request.tool_choice or {"type": "auto"}
        fields["tool_choice"] = _chat_tool_choice(choice)
        fields["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use", False)
    elif request.tool_choice is not None and request.tool_choice.get("type") not in ("auto", "none"):
        raise OpenAIError("tool_choice needs tools", param="tool_choice")
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from exc


def _response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """`output_config.format` (`{"type": "json_schema", "schema": {...}}`) as the chat's response_format."""
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise OpenAIError("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                          param="output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _system(system: str | list[dict[str, Any]]) -> str:
    if isinstance(system, str):
        return system
    return "\n".join(_block_text("system", block) for block in system)


def _block_text(where: str, block: Any) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise OpenAIError(f"{where} must hold text blocks ({{\"type\": \"text\", \"text\": ...}}; images only in a "
                          f"user's message), got {kind!r}", param=where.split("[")[0].split(".")[0])
    return block["text"]


def _chat_messages(index: int, message: dict[str, Any]) -> list[dict[str, Any]]:
    """One Messages API message as chat messages: a user's tool_result blocks become tool messages (first, as
    Anthropic puts them), an assistant's tool_use blocks its tool calls; thinking blocks sent back are left out."""
    where = f"messages[{index}]"
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise OpenAIError(f"{where}.role must be user or assistant, got {role!r} (the system prompt is `system`)",
                          param="messages")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise OpenAIError(f"{where}.content must be a string or a list of content blocks", param="messages")
    texts: list[str] = []
    parts: list[dict[str, Any]] = []    # the text and images in order, where a user's message has an image
    tool_messages: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(f"{where}.content[{j}]", block)}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise OpenAIError(f"{where}.content[{j}] (tool_result) needs tool_use_id, a string", param="messages")
            result = block.get("content", "")
            text = result if isinstance(result, str) else "".join(
                _block_text(f"{where}.content[{j}].content", part) for part in result)
            tool_messages.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise OpenAIError(f"{where}.content[{j}] (tool_use) needs id and name, strings", param="messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind not in ("thinking", "redacted_thinking"):
            texts.append(_block_text(f"{where}.content[{j}]", block))
            parts.append({"type": "text", "text": texts[-1]})
    chat = tool_messages
    if any(part["type"] == "image_url" for part in parts):
        chat.append({"role": role, "content": parts})
    elif texts or calls or not tool_messages:
        chat.append({"role": role, "content": "".join(texts) if texts or not calls else None,
                     **({"tool_calls": calls} if calls else {})})
    return chat


def _image_url(where: str, block: dict[str, Any]) -> str:
    """An image block's source as a chat image_url's: base64 data as a data: URL, or the URL."""
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str) and \
            isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise OpenAIError(f"{where}.source must be {{\"type\": \"base64\", \"media_type\": ..., \"data\": ...}} or "
                      "{\"type\": \"url\", \"url\": ...}", param="messages")


def _chat_tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise OpenAIError(f"tools[{index}] needs a name and an input_schema (custom tools only)", param="tools")
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict[str, Any]) -> str | dict[str, Any]:
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    raise OpenAIError(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice")


# ---- reply -> message --------------------------------------------------------------------------------------------
def _content(reasoning: str | None, text: str | None, tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A thinking block if the reply reasoned, a text block (none if it only calls tools), a tool_use per call."""
    blocks = [_thinking_block(reasoning)] if reasoning else []
    blocks += [{"type": "text", "text": text or ""}] if text or not tool_calls else []
    return blocks + [_tool_use_block(call) for call in tool_calls]


def _thinking_block(thinking: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def _tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call["function"]["arguments"]
    try:
        parsed = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        parsed = None
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": parsed if isinstance(parsed, dict) else {"arguments": arguments}}


def _stop(finish_reason: str | None, stop_reason: int | str | None) -> dict[str, Any]:
    """Anthropic's stop_reason (and stop_sequence) for the chat's finish_reason (and vLLM's stop_reason)."""
    if finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if finish_reason == "tool_calls":
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(usage: dict[str, Any] | None) -> dict[str, int]:
    usage = usage or {}
    return {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
            "cache_read_input_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


# ---- streaming ----------------------------------------------------------------------------------------------------
_DELTAS: dict[str, tuple[Literal["thinking", "text"], str]] = {
    "reasoning": ("thinking", "thinking_delta"), "content": ("text", "text_delta")}


async def _events(message_id: str, model: str, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """The chat's chunks as Anthropic's events: a thinking or text block opens with its first delta and stops when
    the next begins or the reply ends; tool_use blocks come whole, at the end."""

    def event(kind: str, **fields: Any) -> str:
        data = {"type": kind, **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    index, open_key = -1, None          # the block being streamed, and which reply field it streams
    calls: dict[int, dict[str, Any]] = {}
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: dict[str, Any] | None = None
    started = False
    async with aclosing(chunks):        # a client that leaves aborts the request at once
        async for chunk in chunks:
            if "error" in chunk:
                yield event("error", error=anthropic_error(OpenAIError(chunk["error"]["message"], 500))["error"])
                return
            usage = chunk.get("usage") or usage
            if not started:
                started = True
                yield event("message_start", message={
                    "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                    "stop_reason": None, "stop_sequence": None, "usage": _usage(usage) | {"output_tokens": 0}})
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if choice["finish_reason"] is not None:
                    finish_reason, stop_reason = choice["finish_reason"], choice.get("stop_reason")
                for key, (block_type, delta_type) in _DELTAS.items():
                    if not delta.get(key):
                        continue
                    if key != open_key:
                        if open_key is not None:
                            yield event("content_block_stop", index=index)
                        index, open_key = index + 1, key
                        block = _thinking_block("") if block_type == "thinking" else {"type": "text", "text": ""}
                        yield event("content_block_start", index=index, content_block=block)
                    yield event("content_block_delta", index=index, delta={"type": delta_type, block_type: delta[key]})
                gather_call_deltas(calls, delta.get("tool_calls") or [])
    if open_key is not None:
        yield event("content_block_stop", index=index)
    elif not calls:                     # an empty reply still has its (empty) text block
        index += 1
        yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
        yield event("content_block_stop", index=index)
    for call in (calls[i] for i in sorted(calls)):
        block, index = _tool_use_block(call), index + 1
        yield event("content_block_start", index=index, content_block=block | {"input": {}})
        yield event("content_block_delta", index=index,
                    delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        yield event("content_block_stop", index=index)
    yield event("message_delta", delta=_stop(finish_reason, stop_reason),
                usage={"output_tokens": _usage(usage)["output_tokens"]})
    yield event("message_stop")
