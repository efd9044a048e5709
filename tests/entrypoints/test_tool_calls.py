"""Tool calling through the official openai SDK, on a tiny random model behind the real server (hermes parser):
"auto" parses the calls the model writes (here the reply is steered into one with structured_outputs), "required"
and a named function force them with a JSON schema, streamed calls arrive in OpenAI's delta shape, and a
conversation with tool results renders and runs."""

from __future__ import annotations

import json
import re

import openai
import pytest

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig
from pagedllm.engine.llm_engine import LLMEngine
from tests.entrypoints.server_utils import API_KEY, RunningServer, start_server
from tests.models.tiny import save_tiny_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> RunningServer:
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa", max_position_embeddings=2048)[0]
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(folder), dtype="float32", max_model_len=2048),
                                    cache=CacheConfig(block_size=16, num_blocks=512)))
    running = start_server(engine, tool_call_parser="hermes")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _literal(text: str) -> str:
    """A regex matching exactly `text` (escaping only what the regex dialects share as metacharacters)."""
    return re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", text)


def _valid_weather_arguments(arguments: str) -> bool:
    value = json.loads(arguments)
    return set(value) == {"city", "unit"} and len(value["city"]) <= 8 and value["unit"] in ("C", "F")


def test_auto_parses_the_call_the_model_writes(client, server):
    out = client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=200, temperature=0,
        extra_body={"structured_outputs": {"regex": _literal("It is sunny. " + PARIS_CALL)}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "It is sunny."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "C"}


def test_auto_streams_content_then_the_call(client, server):
    stream = client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, tools=[WEATHER], max_tokens=200, temperature=0, stream=True,
        extra_body={"structured_outputs": {"regex": _literal("Sure. " + PARIS_CALL)}})
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    content = "".join(c.delta.content or "" for c in chunks)
    calls = [call for c in chunks for call in c.delta.tool_calls or []]
    assert content == "Sure. " and "<tool_call" not in content            # the marker never leaks as content
    assert [(c.index, c.function.name) for c in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "C"}
    assert chunks[-1].finish_reason == "tool_calls"


def test_auto_without_a_call_is_plain_content(client, server):
    out = client.chat.completions.create(model=server.model_name, messages=MESSAGES, tools=[WEATHER],
                                         max_tokens=20, temperature=0, extra_body={"structured_outputs":
                                                                                   {"choice": ["No tool needed."]}})
    assert out.choices[0].message.content == "No tool needed." and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"


def test_required_forces_valid_calls(client, server):
    out = client.chat.completions.create(model=server.model_name, messages=MESSAGES, tools=[WEATHER, TIME],
                                         tool_choice="required", max_tokens=300, temperature=1.0, seed=3, n=3)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            assert (call.function.name, set(arguments)) in (("get_weather", {"city", "unit"}), ("get_time", {"zone"}))


def test_required_without_parallel_calls_makes_exactly_one(client, server):
    for stream in (False, True):
        out = client.chat.completions.create(model=server.model_name, messages=MESSAGES, tools=[WEATHER, TIME],
                                             tool_choice="required", parallel_tool_calls=False, max_tokens=300,
                                             stream=stream)
        if stream:
            calls = {c.index: c for chunk in out for c in chunk.choices[0].delta.tool_calls or []}
            assert list(calls) == [0]
        else:
            assert len(out.choices[0].message.tool_calls) == 1 and out.choices[0].finish_reason == "tool_calls"


def test_a_named_function_streams_its_arguments(client, server):
    stream = client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=200, temperature=1.0, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    calls = [call for c in chunks for call in c.delta.tool_calls or []]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert all(c.index == 0 and c.id is None for c in calls[1:])           # later deltas carry arguments only
    assert _valid_weather_arguments("".join(c.function.arguments for c in calls))
    assert chunks[-1].finish_reason == "tool_calls"


def test_a_conversation_with_tool_results_runs(client, server):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    out = client.chat.completions.create(model=server.model_name, messages=messages, tools=[WEATHER],
                                         tool_choice="none", max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason == "length" and not out.choices[0].message.tool_calls


@pytest.mark.parametrize("kwargs, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_bad_tool_requests_are_a_clear_400(client, server, kwargs, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model=server.model_name, messages=MESSAGES, tools=[WEATHER], max_tokens=5,
                                       **kwargs)
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        client.chat.completions.create(model=server.model_name, messages=MESSAGES, tool_choice="required",
                                       max_tokens=5)


def test_qwen3_coder_calls_are_typed_by_the_requests_tools(tmp_path):
    """--tool-call-parser qwen3_coder: the XML call the model writes comes back with its arguments typed by the
    request's tool (the parser is given the request's tools)."""
    folder = save_tiny_model(tmp_path / "m", "llama-gqa", max_position_embeddings=2048)[0]
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(folder), dtype="float32", max_model_len=2048),
                                    cache=CacheConfig(block_size=16, num_blocks=256)))
    running = start_server(engine, tool_call_parser="qwen3_coder")
    try:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        book = {"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "nights": {"type": "integer"}}}}}
        reply = ("<tool_call>\n<function=book>\n<parameter=city>\nParis\n</parameter>\n<parameter=nights>\n3\n"
                 "</parameter>\n</function>\n</tool_call>")
        out = client.chat.completions.create(model=running.model_name, messages=MESSAGES, tools=[book],
                                             max_tokens=200, temperature=0,
                                             extra_body={"structured_outputs": {"regex": _literal(reply)}})
        [call] = out.choices[0].message.tool_calls
        assert call.function.name == "book" and json.loads(call.function.arguments) == {"city": "Paris", "nights": 3}
        assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    finally:
        running.stop()
