"""POST /v1/responses: OpenAI's Responses API, the part a text model serves, answered by the chat serving.

The request becomes a chat completion: `instructions` a system message, `input` (a string, or message,
function_call and function_call_output items; a message's input_image parts by URL chat's image_url parts) the
conversation, `text.format` the response_format, function `tools`
and `tool_choice` the chat's, `max_output_tokens` max_completion_tokens. The reply becomes the response's `output`:
a reasoning item (under --reasoning-parser), a message item with one output_text part, then a function_call item
per tool call; a reply cut by the token limit leaves the response "incomplete". Streamed, the chat's chunks become
the Responses events (`event:` and `data:` lines): response.created and .in_progress, the reasoning's and then the
message's output_item / content_part / reasoning_text or output_text events as their text arrives, a function
call's events once it is complete, then response.completed, whose response's status may
be "incomplete", as vLLM sends it (or an `error` event).

With `store` (true by default, as OpenAI's) a finished response is kept in memory (the most recent
`MAX_STORED_RESPONSES`), for `GET /v1/responses/{id}` and for a later request's `previous_response_id`, which
continues its conversation: the earlier input and output come before the new input (the earlier `instructions` do
not carry over, as in OpenAI's API); `GET /v1/responses/{id}/input_items` lists its input items (ids given, message
text as input_text parts), paged as OpenAI pages them.

With `background` (and `store`), the answer is the response "queued" at once; it runs in the server's event loop,
and `GET /v1/responses/{id}` shows it "in_progress", then "completed" (or "incomplete", or "failed" with its
`error`); `POST /v1/responses/{id}/cancel` stops it, its engine request aborted, and leaves it "cancelled".
Background responses are not streamed (poll them).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, NamedTuple, cast

from pydantic import ValidationError

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    OpenAIError,
    ResponsesRequest,
    now,
    random_id,
    validation_error,
)
from pagedllm.entrypoints.openai.serving_base import error_for
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.tool_parsers import gather_call_deltas

MAX_STORED_RESPONSES = 10_000     # in memory: the oldest stored response is forgotten first


class _Stored(NamedTuple):
    response: dict[str, Any]
    conversation: list[dict[str, Any]]      # as chat messages: the earlier ones, this input, then its output
    input_items: list[dict[str, Any]]       # this request's input, as the API lists it


class OpenAIServingResponses:
    """The Responses API over a chat serving (its engine, names and limits), with the responses stored."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self._stored: OrderedDict[str, _Stored] = OrderedDict()
        self._running: dict[str, asyncio.Task] = {}     # background responses not yet done, by id

    def retrieve(self, response_id: str) -> dict[str, Any]:
        """A stored response (GET /v1/responses/{id}); 404 if it is not, or no longer, stored."""
        return self._get(response_id).response

    def input_items(self, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None,
                    before: str | None = None) -> dict[str, Any]:
        """A stored response's input items (GET /v1/responses/{id}/input_items), OpenAI's page: `order` asc or
        desc (the default), at most `limit` (1-100), after or before the item with that id."""
        if not 1 <= limit <= 100:
            raise OpenAIError(f"limit must be in [1, 100], got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise OpenAIError(f"order must be asc or desc, got {order!r}", param="order")
        items = self._get(response_id).input_items
        items = items if order == "asc" else items[::-1]
        ids = [item["id"] for item in items]
        for cursor, param in ((after, "after"), (before, "before")):
            if cursor is not None and cursor not in ids:
                raise OpenAIError(f"no input item {cursor!r} in response {response_id!r}", param=param)
        start = ids.index(after) + 1 if after is not None else 0
        end = ids.index(before) if before is not None else len(items)
        page = items[start:end][:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < end}

    def _get(self, response_id: str) -> _Stored:
        stored = self._stored.get(response_id)
        if stored is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.", 404, "response_id", "not_found")
        return stored

    async def delete(self, response_id: str) -> dict[str, Any]:
        """Forget a stored response, stopping it if it runs in the background (DELETE /v1/responses/{id}, OpenAI's
        answer); 404 as retrieve's."""
        self.retrieve(response_id)
        await self._stop(response_id)
        del self._stored[response_id]
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """Stop a background response (POST /v1/responses/{id}/cancel): "cancelled" if it was still running, as it
        stands if it had ended; 400 for one that did not run in the background, 404 as retrieve's."""
        if not self.retrieve(response_id).get("background"):
            raise OpenAIError("Cannot cancel a synchronous response: only a background response can be cancelled.",
                              param="response_id")
        await self._stop(response_id)
        return self.retrieve(response_id)

    async def _stop(self, response_id: str) -> None:
        task = self._running.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)     # its engine request aborted, its state stored

    def _store(self, response: dict[str, Any], messages: list[dict[str, Any]],
               input_items: list[dict[str, Any]]) -> None:
        self._stored[response["id"]] = _Stored(response, messages + _as_messages(response["output"]), input_items)
        while len(self._stored) > MAX_STORED_RESPONSES:
            self._stored.popitem(last=False)

    async def create(self, request: ResponsesRequest) -> dict[str, Any] | AsyncIterator[str]:
        """A response dict, or (stream=True) an iterator of SSE lines. Raises OpenAIError on bad input."""
        earlier: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = self._stored.get(request.previous_response_id)
            if stored is None:
                raise OpenAIError(f"Response with id '{request.previous_response_id}' not found.", 404,
                                  "previous_response_id", "not_found")
            if stored.response["status"] not in ("completed", "incomplete"):     # a background one not done
                raise OpenAIError(f"Response with id '{request.previous_response_id}' is "
                                  f"{stored.response['status']}: only a finished response can be continued",
                                  param="previous_response_id")
            earlier = stored.conversation
        if request.background and (request.stream or not request.store):
            raise OpenAIError("a background response must be stored (store: true) and is not streamed: poll "
                              "GET /v1/responses/{id}", param="background")
        if request.top_logprobs:
            raise OpenAIError("top_logprobs is not supported on /v1/responses (use /v1/chat/completions)",
                              param="top_logprobs")
        response = _Response(request, self.chat.check_model(request.model))
        messages = earlier + _messages(request.input)     # the conversation, without this request's instructions
        items = _input_items(request.input)

        def store(done: dict[str, Any]) -> None:
            if request.store:
                self._store(done, messages, items)
        chat_request = _chat_request(request, messages)
        if request.background:
            return self._start_in_background(response, chat_request, store, items)
        reply = await self._chat(chat_request)
        if isinstance(reply, dict):
            done = response.answered(reply)
            store(done)
            return done
        return _events(response, reply, store)

    async def _chat(self, request: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        try:
            return await self.chat.create(request, sse=False)
        except OpenAIError as exc:      # named as the chat request names it: name the Responses API's field
            exc.param = _CHAT_TO_RESPONSES_FIELD.get(exc.param, exc.param)
            raise

    def _start_in_background(self, response: _Response, request: ChatCompletionRequest,
                             store: Callable[[dict[str, Any]], None], items: list[dict[str, Any]]) -> dict[str, Any]:
        """Store the response "queued" and run it in a task of the event loop; returns it queued."""
        response_id = response.fields["id"]

        def stand(fields: dict[str, Any]) -> None:       # a state before the end: no conversation to continue yet
            self._stored[response_id] = _Stored(fields, [], items)

        async def run() -> None:
            stand(response.fields)
            try:
                store(response.answered(cast(dict[str, Any], await self._chat(request))))
            except asyncio.CancelledError:
                stand(response.fields | {"status": "cancelled"})
            except Exception as exc:  # noqa: BLE001 - the response fails, the server goes on
                error = error_for(exc)
                stand(response.fields | {"status": "failed", "error": {"code": error.code or error.type,
                                                                       "message": error.message}})
            finally:
                self._running.pop(response_id, None)
        queued = response.fields | {"status": "queued"}
        stand(queued)
        self._running[response_id] = asyncio.get_running_loop().create_task(run())
        return queued


class _Response:
    """The response object, as it stands at each step."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.fields: dict[str, Any] = {
            "id": random_id("resp"), "object": "response", "created_at": now(), "status": "in_progress",
            "model": model, "output": [], "incomplete_details": None, "error": None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {}, "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id, "reasoning": request.reasoning,
            "store": request.store,
            "temperature": request.temperature,
            "text": request.text or {"format": {"type": "text"}}, "tool_choice": request.tool_choice,
            "tools": request.tools, "top_p": request.top_p, "truncation": "disabled", "usage": None,
            "user": request.user, "background": request.background}

    def answered(self, reply: dict[str, Any]) -> dict[str, Any]:
        """The response a whole chat completion makes."""
        (choice,) = reply["choices"]
        message = choice["message"]
        return self.finished(_output(message.get("reasoning"), message.get("content"), message.get("tool_calls") or []),
                             choice["finish_reason"], reply["usage"])

    def finished(self, output: list[dict[str, Any]], finish_reason: str | None,
                 usage: dict[str, int]) -> dict[str, Any]:
        incomplete = finish_reason == "length"
        for index, item in enumerate(output):        # a cut reply cut its last item; those before it are whole
            item["status"] = "incomplete" if incomplete and index == len(output) - 1 else "completed"
        return self.fields | {
            "status": "incomplete" if incomplete else "completed", "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": {"input_tokens": usage["prompt_tokens"],
                      "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                      "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage["total_tokens"]}}


# ---- request -> chat ----------------------------------------------------------------------------------------------
_CHAT_TO_RESPONSES_FIELD = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                            "max_tokens": "max_output_tokens", "response_format": "text"}


def _chat_request(request: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request: the instructions as a system message, then `conversation` (the earlier responses' input
    and output, then this request's input)."""
    messages = [{"role": "system", "content": request.instructions}] if request.instructions is not None else []
    messages += conversation
    fields: dict[str, Any] = {
        "model": request.model, "messages": messages, "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k, "min_p": request.min_p,
        "presence_penalty": request.presence_penalty, "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty, "logit_bias": request.logit_bias, "seed": request.seed,
        "user": request.user, "include_reasoning": request.include_reasoning,
        "reasoning_effort": (request.reasoning or {}).get("effort"),
        "priority": request.priority, "cache_salt": request.cache_salt, "stream": request.stream,
        "stream_options": {"include_usage": True} if request.stream else None,
        "response_format": _response_format(request.text)}
    if request.tools:
        fields["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(request.tools)]
        fields["tool_choice"] = _chat_tool_choice(request.tool_choice)
        fields["parallel_tool_calls"] = request.parallel_tool_calls
    elif request.tool_choice not in ("auto", "none"):
        raise OpenAIError("tool_choice needs tools", param="tool_choice")
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from exc


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user message; function_call items join one assistant message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise OpenAIError("input must not be empty", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(i, item.get("content"))})
        elif kind == "function_call":
            _require_strings(i, item, "call_id", "name", "arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _require_strings(i, item, "call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(i, item.get("output"))})
        elif kind != "reasoning":           # a reasoning item sent back: this server's models write none
            raise OpenAIError(f"input[{i}] has type {kind!r}; this server takes message, function_call and "
                              "function_call_output items", param="input")
    return messages


def _input_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as the API lists it: each item with an id, a message's text as input_text (output_text for the
    assistant's) parts."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    listed = []
    for item in items:
        kind = item.get("type", "message")
        item = {"type": kind, **item}
        if kind == "message":
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            content = item.get("content")
            item["content"] = [{"type": part, "text": content}] if isinstance(content, str) else content
            item.setdefault("status", "completed")
        item.setdefault("id", random_id({"message": "msg", "function_call": "fc"}.get(kind, "item")))
        listed.append(item)
    return listed


def _require_strings(index: int, item: dict[str, Any], *keys: str) -> None:
    for key in keys:
        if not isinstance(item.get(key), str):
            raise OpenAIError(f"input[{index}] ({item['type']}) needs {key}, a string", param="input")


def _text(index: int, content: Any) -> str | list[dict[str, Any]]:
    """A message's content: a string, or its parts as chat parts: text (input_text, output_text) and images
    (input_image by URL, as chat's image_url)."""
    if isinstance(content, str) or content is None:
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"input[{index}].content must be a string or a list of parts", param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise OpenAIError(f"input[{index}].content[{j}] must be a text part (input_text or output_text) or an "
                              f"input_image with an image_url, got {kind!r}", param="input")
    return parts


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as the chat's response_format (the Responses API flattens json_schema's fields)."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise OpenAIError("text.format must be an object: {\"type\": \"text\" | \"json_object\" | "
                          "\"json_schema\", ...}", param="text")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt


def _chat_tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise OpenAIError(f"tools[{index}] has type {tool.get('type')!r}; this server takes function tools",
                          param="tools")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _as_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat's assistant message: its message text and its function calls (a reasoning
    item is left out, as chat templates leave earlier turns' thinking out)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return [{"role": "assistant", "content": text if text or not calls else None,
             **({"tool_calls": calls} if calls else {})}]


# ---- reply -> output ---------------------------------------------------------------------------------------------
# the chat reply's text fields -> (item type, content part type, the events' prefix); reasoning comes first
_TEXT_ITEMS = {"reasoning": ("reasoning", "reasoning_text", "response.reasoning_text"),
               "content": ("message", "output_text", "response.output_text")}


def _text_item(key: str, text: str | None) -> dict[str, Any]:
    """A reasoning or message item with one text part (none yet: `text` None, as a streamed item opens)."""
    kind, _, _ = _TEXT_ITEMS[key]
    parts = [] if text is None else [_text_part(key, text)]
    if kind == "reasoning":
        return {"type": "reasoning", "id": random_id("rs"), "summary": [], "content": parts, "status": "in_progress"}
    return {"type": "message", "id": random_id("msg"), "status": "in_progress", "role": "assistant", "content": parts}


def _text_part(key: str, text: str) -> dict[str, Any]:
    _, part_type, _ = _TEXT_ITEMS[key]
    return {"type": part_type, "text": text} | ({"annotations": [], "logprobs": []} if key == "content" else {})


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {"type": "function_call", "id": random_id("fc"), "call_id": call["id"], "name": function["name"],
            "arguments": function["arguments"], "status": "in_progress"}


def _output(reasoning: str | None, content: str | None, tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A reasoning item if the reply reasoned, a message item for its text (none if it only calls tools), then a
    function_call item per call."""
    items = [_text_item("reasoning", reasoning)] if reasoning else []
    items += [_text_item("content", content or "")] if content or not tool_calls else []
    return items + [_call_item(call) for call in tool_calls]


# ---- streaming ----------------------------------------------------------------------------------------------------
async def _events(response: _Response, chunks: AsyncIterator[dict[str, Any]],
                  on_done: Callable[[dict[str, Any]], None]) -> AsyncIterator[str]:
    """The chat's chunks as the Responses API's events: a text item (reasoning, then the message) opens with its
    first delta and closes when the next begins or the reply ends; function calls come whole, at the end. The
    finished response goes to `on_done` (to be stored) before its last event."""
    sequence = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def close(key: str, item: dict[str, Any], index: int, text: str, status: str) -> list[str]:
        part = _text_part(key, text)
        item.update(content=[part], status=status)
        extra = {"logprobs": []} if key == "content" else {}
        return [event(f"{_TEXT_ITEMS[key][2]}.done", item_id=item["id"], output_index=index, content_index=0,
                      text=text, **extra),
                event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                      part=part),
                event("response.output_item.done", output_index=index, item=item)]

    output: list[dict[str, Any]] = []
    open_key, text = None, ""       # the text item being streamed (output[-1]), and its text so far
    calls: dict[int, dict[str, Any]] = {}
    finish_reason, usage = None, None
    async with aclosing(chunks):     # from the first event on: a client that leaves aborts the request at once
        yield event("response.created", response=response.fields)
        yield event("response.in_progress", response=response.fields)
        async for chunk in chunks:
            if "error" in chunk:
                error = chunk["error"]
                yield event("error", code=error.get("code") or error.get("type"), message=error["message"],
                            param=error.get("param"))
                return
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice["delta"]
                finish_reason = choice["finish_reason"] or finish_reason
                for key in _TEXT_ITEMS:
                    if not delta.get(key):
                        continue
                    if key != open_key:
                        if open_key is not None:
                            for line in close(open_key, output[-1], len(output) - 1, text, "completed"):
                                yield line
                        open_key, text = key, ""
                        output.append(_text_item(key, None))
                        yield event("response.output_item.added", output_index=len(output) - 1, item=output[-1])
                        yield event("response.content_part.added", item_id=output[-1]["id"],
                                    output_index=len(output) - 1, content_index=0, part=_text_part(key, ""))
                    text += delta[key]
                    yield event(f"{_TEXT_ITEMS[key][2]}.delta", item_id=output[-1]["id"], output_index=len(output) - 1,
                                content_index=0, delta=delta[key], **({"logprobs": []} if key == "content" else {}))
                gather_call_deltas(calls, delta.get("tool_calls") or [])
    status = "incomplete" if finish_reason == "length" else "completed"
    if open_key is not None:
        for line in close(open_key, output[-1], len(output) - 1, text, status):
            yield line
    elif not calls:                 # an empty reply still has its (empty) message
        output.append(_text_item("content", ""))
    for call in (calls[i] for i in sorted(calls)):
        item, index = _call_item(call), len(output)
        output.append(item)
        yield event("response.output_item.added", output_index=index, item=item | {"arguments": ""})
        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                    delta=item["arguments"])
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                    arguments=item["arguments"])
        item["status"] = status
        yield event("response.output_item.done", output_index=index, item=item)
    done = response.finished(output, finish_reason, usage or {"prompt_tokens": 0, "completion_tokens": 0,
                                                              "total_tokens": 0,
                                                              "prompt_tokens_details": {"cached_tokens": 0}})
    on_done(done)
    # response.completed even for an incomplete response (its status says so), as vLLM does: the SDK's stream
    # helpers wait for that event alone
    yield event("response.completed", response=done)
