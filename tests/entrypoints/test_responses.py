"""/v1/responses (OpenAI's Responses API) on a tiny random Llama behind the real server, driven with the `openai`
SDK: the reply is the chat endpoint's for the same conversation, whole or as the Responses events; text.format and
function tools as the chat's response_format and tools; background responses polled and cancelled; what a text-only
server cannot do is a 400."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving_responses import _events, _output, _Response
from tests.entrypoints.server_utils import (
    RunningServer,
    metric,
    save_tool_model,
    scrape,
    start_server,
    tool_model_engine,
    wait_until,
)

# an enum, so that the random model's forced call ends within a few tokens
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"enum": ["Rome", "Oslo"]}}, "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tool_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def server(tiny_dir):
    running = start_server(tool_model_engine(tiny_dir), api_key=None)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def offline(tiny_dir) -> LLM:
    return LLM(model=str(tiny_dir), dtype="float32", block_size=16, num_kv_blocks=512)


def _offline_chat(offline: LLM, messages: list[dict], max_tokens: int):
    return offline.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]


@pytest.mark.parametrize("max_output_tokens", [3, 40])
def test_a_response_is_the_chat_reply_to_instructions_and_input(client, server, offline, max_output_tokens):
    response = client.responses.create(model=server.model_name, instructions="Be brief.", input="Say something.",
                                       max_output_tokens=max_output_tokens, temperature=0)
    expected = _offline_chat(offline, [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Say something."}], max_output_tokens)
    completion = expected.outputs[0]
    assert response.output_text == completion.text and response.object == "response"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert response.usage.input_tokens == len(expected.prompt_token_ids)
    assert response.usage.output_tokens == len(completion.token_ids)
    cut = completion.finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed") and message.status == response.status
    assert (response.incomplete_details is not None) == cut
    assert response.instructions == "Be brief." and response.max_output_tokens == max_output_tokens


def test_streamed_events_build_the_same_response(client, server):
    asked = dict(model=server.model_name, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Tell me"}, {"type": "input_text", "text": "a story."}]}],
        max_output_tokens=12, temperature=0)
    whole = client.responses.create(**asked)
    with client.responses.stream(**asked) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text == final.output_text and len(deltas) > 1
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == whole.status
    assert len({e.item_id for e in events if hasattr(e, "item_id")} | {final.output[0].id}) == 1


def test_a_stored_response_is_retrieved_and_its_conversation_continued(client, server):
    """store (the default) keeps a response for GET /v1/responses/{id} and for previous_response_id, which sends
    the earlier input and output before the new input: the same reply as the whole conversation sent at once."""
    asked = dict(model=server.model_name, max_output_tokens=8, temperature=0)
    first = client.responses.create(input="My name is Ada.", instructions="Be brief.", **asked)
    assert first.store is True and client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(input="What is my name?", previous_response_id=first.id, **asked)
    whole = client.responses.create(input=[{"role": "user", "content": "My name is Ada."},
                                           {"role": "assistant", "content": first.output_text},
                                           {"role": "user", "content": "What is my name?"}], **asked)
    assert second.previous_response_id == first.id
    assert (second.output_text, second.usage.input_tokens) == (whole.output_text, whole.usage.input_tokens)
    with client.responses.stream(input="And again?", previous_response_id=second.id, **asked) as stream:
        streamed = stream.get_final_response()
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    unstored = client.responses.create(input="Forget this.", store=False, **asked)
    assert unstored.store is False
    for response_id in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="hi", previous_response_id=unstored.id, **asked)
    listed = client.responses.input_items.list(whole.id, order="asc")
    assert [(item.type, item.role, item.content[0].type, item.content[0].text) for item in listed.data] == [
        ("message", "user", "input_text", "My name is Ada."),
        ("message", "assistant", "output_text", first.output_text),
        ("message", "user", "input_text", "What is my name?")]
    newest = client.responses.input_items.list(whole.id, limit=2)     # desc by default, two a page
    assert [item.id for item in newest.data] == [item.id for item in listed.data[::-1][:2]] and newest.has_more
    rest = client.responses.input_items.list(whole.id, limit=2, after=newest.data[-1].id)
    assert [item.id for item in rest.data] == [listed.data[0].id] and not rest.has_more
    assert [i.content[0].text for i in client.responses.input_items.list(second.id).data] == ["What is my name?"]
    client.responses.delete(streamed.id)        # forgotten: neither retrieved nor continued, nor deleted again
    for forgotten in (lambda: client.responses.retrieve(streamed.id), lambda: client.responses.delete(streamed.id),
                      lambda: client.responses.input_items.list(streamed.id),
                      lambda: client.responses.create(input="hi", previous_response_id=streamed.id, **asked)):
        with pytest.raises(openai.NotFoundError):
            forgotten()
    assert client.responses.retrieve(second.id).id == second.id     # the others are kept

    # a function call continued: the tool's output, sent alone, follows the stored call
    called = client.responses.create(model=server.model_name, input="Weather in Rome?", tools=[WEATHER],
                                     tool_choice="required", parallel_tool_calls=False, max_output_tokens=200)
    (call,) = [item for item in called.output if item.type == "function_call"]
    answered = client.responses.create(input=[{"type": "function_call_output", "call_id": call.call_id,
                                               "output": "sunny"}], previous_response_id=called.id, tools=[WEATHER],
                                       tool_choice="none", **asked)
    whole = client.responses.create(input=[{"role": "user", "content": "Weather in Rome?"},
                                           {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                            "arguments": call.arguments},
                                           {"type": "function_call_output", "call_id": call.call_id,
                                            "output": "sunny"}], tools=[WEATHER], tool_choice="none", **asked)
    assert answered.usage.input_tokens == whole.usage.input_tokens and answered.output_text == whole.output_text


def test_text_format_constrains_the_output(client, server):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"],
              "additionalProperties": False}
    response = client.responses.create(model=server.model_name, input="Pick a colour.", max_output_tokens=40,
                                       text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    assert response.status == "completed" and json.loads(response.output_text)["colour"] in ("red", "green")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_function_call_is_a_function_call_item(client, server, tool_choice, stream):
    asked = dict(model=server.model_name, input="Weather in Rome?", tools=[WEATHER], tool_choice=tool_choice,
                 parallel_tool_calls=False, max_output_tokens=200)     # one call: the list ends
    if stream:
        with client.responses.stream(**asked) as events:
            kinds = [e.type for e in events]
            response = events.get_final_response()
        assert "response.function_call_arguments.done" in kinds
    else:
        response = client.responses.create(**asked)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Rome", "Oslo")
    assert call.call_id.startswith("call") and call.status == "completed"


def test_function_call_items_render_as_the_chat_tool_turns(client, server):
    items = [{"role": "user", "content": "Weather in Rome?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    response = client.responses.create(model=server.model_name, input=items, max_output_tokens=1, temperature=0)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    chat = client.chat.completions.create(model=server.model_name, max_tokens=1, temperature=0, messages=[
        items[0], {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content


def test_a_client_that_leaves_a_stream_aborts_its_request(server):
    engine = server.engine.engine
    aborts = metric(scrape(server.base_url), "pagedllm:request_success_total", finished_reason="abort")
    eos = engine.tokenizer.eos_token_id
    body = {"input": "Tell me a story.", "max_output_tokens": 500, "stream": True, "logit_bias": {str(eos): -100}}

    async def open_and_drop() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http, \
                http.stream("POST", "/v1/responses", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "event: response.in_progress":
                    break       # before any text: hang up
    asyncio.run(open_and_drop())
    assert wait_until(lambda: metric(scrape(server.base_url), "pagedllm:request_success_total",
                                     finished_reason="abort") == aborts + 1)
    assert wait_until(lambda: not engine.scheduler.requests)


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True, "store": False}, "background"),
    ({"background": True, "stream": True}, "background"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c"}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "sunny"}]}, "input"),
    ({"text": {"format": "json"}}, "text"),
    ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"model": "gpt-4o"}, "model"),
])
def test_what_this_server_cannot_do_is_a_clear_error(client, server, fields, param):
    with pytest.raises(openai.APIStatusError) as info:
        client.responses.create(**{"model": server.model_name, "input": "hi", **fields})
    assert info.value.status_code in (400, 404) and info.value.body["param"] == param, info.value.body


def _chunk(finish_reason: str | None = None, **delta) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


def _streamed(chunks: list[dict]) -> list[dict]:
    """The events _events makes of these chat chunks, parsed."""
    async def source():
        for chunk in chunks:
            yield chunk

    async def collect() -> list[str]:
        response = _Response(ResponsesRequest(input="hi"), "m")
        return [line async for line in _events(response, source(), lambda done: None)]
    events = []
    for text in asyncio.run(collect()):
        kind_line, data_line = text.strip().split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert kind_line == f"event: {event['type']}"
        events.append(event)
    return events


@pytest.mark.parametrize("cut", [False, True])
def test_reasoning_streams_as_its_own_item_before_the_message(cut):
    usage = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
             "prompt_tokens_details": {"cached_tokens": 0}}
    events = _streamed([_chunk(role="assistant", content=""), _chunk(reasoning="Let me "), _chunk(reasoning="see."),
                        _chunk(content="It is "), _chunk("length" if cut else "stop", content="sunny."),
                        {"choices": [], "usage": usage}])
    kinds = [(e["type"], e.get("output_index")) for e in events]
    assert kinds == [("response.created", None), ("response.in_progress", None),
                     ("response.output_item.added", 0), ("response.content_part.added", 0),
                     ("response.reasoning_text.delta", 0), ("response.reasoning_text.delta", 0),
                     ("response.reasoning_text.done", 0), ("response.content_part.done", 0),
                     ("response.output_item.done", 0),
                     ("response.output_item.added", 1), ("response.content_part.added", 1),
                     ("response.output_text.delta", 1), ("response.output_text.delta", 1),
                     ("response.output_text.done", 1), ("response.content_part.done", 1),
                     ("response.output_item.done", 1), ("response.completed", None)]
    final = events[-1]["response"]
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me see."}]
    assert message["content"][0]["text"] == "It is sunny." and reasoning["status"] == "completed"
    assert message["status"] == final["status"] == ("incomplete" if cut else "completed")
    assert final["usage"]["output_tokens"] == 9
    assert len({e["item_id"] for e in events if e.get("output_index") == 1 and "item_id" in e}) == 1
    whole = _Response(ResponsesRequest(input="hi"), "m").finished(_output("Let me see.", "It is sunny.", []),
                                                                   "length" if cut else "stop", usage)
    assert [(item["type"], item["status"]) for item in whole["output"]] == [
        ("reasoning", "completed"), ("message", "incomplete" if cut else "completed")]


def _polled(client, response_id: str) -> object:
    """The response once it stops running (its status neither queued nor in_progress)."""
    done = {}

    def finished() -> bool:
        done["response"] = client.responses.retrieve(response_id)
        return done["response"].status not in ("queued", "in_progress")
    assert wait_until(finished, timeout=60)
    return done["response"]


def test_a_background_response_is_polled_until_done(client, server):
    fields = {"model": server.model_name, "instructions": "Be brief.", "input": "Say something.",
              "max_output_tokens": 12, "temperature": 0}
    queued = client.responses.create(background=True, **fields)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = _polled(client, queued.id)
    direct = client.responses.create(**fields)
    assert done.status == direct.status and done.output_text == direct.output_text and done.background
    assert done.usage.output_tokens == direct.usage.output_tokens
    continued = client.responses.create(model=server.model_name, input="And then?", max_output_tokens=4,
                                        previous_response_id=done.id)
    assert continued.usage.input_tokens > done.usage.input_tokens    # the background answer was carried on
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        client.responses.cancel(direct.id)
    assert client.responses.cancel(done.id).status == done.status    # done already: as it stands


def test_a_cancelled_background_response_aborts_its_request(tiny_dir):
    """The engine is held still, so that the response is running when it is cancelled: it ends "cancelled", its
    engine request aborted and its blocks back in the pool; a failed one says why."""
    import threading

    engine = tool_model_engine(tiny_dir)
    held, step = threading.Event(), engine.step
    engine.step = lambda: (held.wait(30), step())[1]
    running = start_server(engine, api_key=None)
    try:
        client = running.client()
        queued = client.responses.create(model=running.model_name, input="Say something.", background=True,
                                         max_output_tokens=200)
        assert wait_until(lambda: client.responses.retrieve(queued.id).status == "in_progress")
        with pytest.raises(openai.BadRequestError, match="in_progress"):
            client.responses.create(model=running.model_name, input="more", previous_response_id=queued.id)
        assert wait_until(lambda: bool(engine.scheduler.requests))
        cancelled = client.responses.cancel(queued.id)
        held.set()
        assert cancelled.status == "cancelled" and client.responses.retrieve(queued.id).status == "cancelled"
        assert wait_until(lambda: not engine.scheduler.requests)
        failed = client.responses.create(model=running.model_name, input="x" * 5000, background=True)
        failed = _polled(client, failed.id)      # a prompt past the context: the response fails, saying so
        assert failed.status == "failed" and "context" in failed.error.message
        deleted = client.responses.create(model=running.model_name, input="Say something.", background=True,
                                          max_output_tokens=50)
        client.responses.delete(deleted.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(deleted.id)
    finally:
        held.set()
        running.stop()
