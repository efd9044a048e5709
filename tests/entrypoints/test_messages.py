"""Anthropic's Messages API (/v1/messages, as vLLM serves it) through Anthropic's own SDK, on a tiny random Llama:
the reply is the offline chat reply to the same conversation (system prompt, content blocks, tool calls and their
results), streamed or not, with Anthropic's stop reasons, usage, events and errors."""

from __future__ import annotations

import json

import anthropic
import pytest

from pagedllm import LLM, SamplingParams
from tests.entrypoints.server_utils import API_KEY, RunningServer, save_tool_model, start_server, tool_model_engine

# Anthropic's SDK has no sampling arguments (its models choose): vLLM's clients send them as extra fields
GREEDY = {"temperature": 0}
# an enum, so that the random model's forced call ends within a few tokens
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Rome", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tool_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def server(tiny_dir):
    running = start_server(tool_model_engine(tiny_dir))    # with the API key: Anthropic's SDK sends x-api-key
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_dir) -> LLM:
    return LLM(model=str(tiny_dir), dtype="float32", block_size=16, num_kv_blocks=512, max_model_len=1024)


def _offline_chat(offline: LLM, messages: list[dict], max_tokens: int, **kwargs):
    return offline.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs), use_tqdm=False)[0]


@pytest.mark.parametrize("max_tokens", [3, 40])
def test_a_message_is_the_chat_reply_to_the_system_prompt_and_messages(client, server, offline, max_tokens):
    message = client.messages.create(model=server.model_name, system="Be brief.", max_tokens=max_tokens,
                                     extra_body=GREEDY, messages=[{"role": "user", "content": [
                                         {"type": "text", "text": "Say "}, {"type": "text", "text": "something."}]}])
    expected = _offline_chat(offline, [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Say something."}], max_tokens)
    completion = expected.outputs[0]
    (block,) = message.content
    assert block.type == "text" and block.text == completion.text
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg")
    assert message.model == server.model_name
    assert message.usage.input_tokens == len(expected.prompt_token_ids)
    assert message.usage.output_tokens == len(completion.token_ids)
    assert message.stop_reason == ("max_tokens" if completion.finish_reason == "length" else "end_turn")
    counted = client.messages.count_tokens(model=server.model_name, system="Be brief.",
                                           messages=[{"role": "user", "content": "Say something."}])
    assert counted.input_tokens == message.usage.input_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(client, server, offline):
    conversation = [{"role": "user", "content": "Tell me a story."}]
    text = _offline_chat(offline, conversation, 40).outputs[0].text
    stop = text[10:12]
    message = client.messages.create(model=server.model_name, max_tokens=40, extra_body=GREEDY, messages=conversation,
                                     stop_sequences=[stop, "never in the text \u2603"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[:text.index(stop)]


def test_streamed_events_build_the_same_message(client, server):
    asked = dict(model=server.model_name, max_tokens=12, extra_body=GREEDY,
                 messages=[{"role": "user", "content": "Tell me a story."}])
    whole = client.messages.create(**asked)
    with client.messages.stream(**asked) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type != "text"]       # the SDK adds a "text" event per delta
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == whole.content[0].text == final.content[0].text and len(deltas) > 1
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens and final.stop_reason == whole.stop_reason


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_is_called_and_its_result_answered(client, server, offline, stream):
    question = {"role": "user", "content": "Weather in Rome?"}
    asked = dict(model=server.model_name, max_tokens=200, messages=[question], tools=[WEATHER],
                 tool_choice={"type": "tool", "name": "get_weather"})
    if stream:
        with client.messages.stream(**asked) as events:
            called = events.get_final_message()
    else:
        called = client.messages.create(**asked)
    (call,) = called.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input["city"] in ("Rome", "Oslo")
    assert called.stop_reason == "tool_use"

    answered = client.messages.create(model=server.model_name, max_tokens=8, extra_body=GREEDY, tools=[WEATHER],
                                      tool_choice={"type": "none"}, messages=[
                                          question,
                                          {"role": "assistant", "content": [call.model_dump()]},
                                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                                        "content": "sunny"}]}])
    tool = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                             "parameters": WEATHER["input_schema"]}}
    arguments = json.dumps(call.input)
    expected = offline.chat([question,
                             {"role": "assistant", "content": None, "tool_calls": [
                                 {"id": call.id, "type": "function",
                                  "function": {"name": "get_weather", "arguments": arguments}}]},
                             {"role": "tool", "tool_call_id": call.id, "content": "sunny"}],
                            SamplingParams(temperature=0, max_tokens=8), tools=[tool], use_tqdm=False)[0]
    assert answered.content[0].text == expected.outputs[0].text
    assert answered.usage.input_tokens == len(expected.prompt_token_ids)


def test_an_output_format_makes_the_reply_follow_its_schema(client, server):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    message = client.messages.create(model=server.model_name, max_tokens=40, messages=[
        {"role": "user", "content": "Is the sea wet?"}], output_config={"format": {"type": "json_schema",
                                                                                   "schema": schema}})
    assert json.loads(message.content[0].text)["answer"] in ("yes", "no")


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    (dict(messages=[{"role": "system", "content": "x"}]), anthropic.BadRequestError, "must be user or assistant"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), anthropic.BadRequestError,
     "source must be"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]), anthropic.BadRequestError,
     "takes no images"),
    (dict(system=[{"type": "image", "source": {}}]), anthropic.BadRequestError, "images only in a user's message"),
    (dict(model="claude-9"), anthropic.NotFoundError, "does not exist"),
    (dict(max_tokens=0), anthropic.BadRequestError, "max_tokens"),
    (dict(tool_choice={"type": "any"}), anthropic.BadRequestError, "tool_choice needs tools"),
    (dict(extra_body={"output_config": {"format": {"type": "xml"}}}), anthropic.BadRequestError, "json_schema"),
])
def test_bad_requests_get_anthropic_errors(client, server, kwargs, error, message):
    asked = dict(model=server.model_name, max_tokens=4, messages=[{"role": "user", "content": "hi"}]) | kwargs
    with pytest.raises(error) as info:
        client.messages.create(**asked)
    body = info.value.body
    assert body["type"] == "error" and message in body["error"]["message"]
    assert body["error"]["type"] == ("not_found_error" if error is anthropic.NotFoundError
                                     else "invalid_request_error")


def test_the_api_key_is_taken_as_anthropic_sends_it(server):
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=server.model_name, max_tokens=2, messages=[{"role": "user", "content": "hi"}])


def test_a_users_image_blocks_become_image_url_parts_in_order():
    from pagedllm.entrypoints.openai.serving_messages import _chat_messages

    content = [{"type": "text", "text": "a"}, {"type": "image", "source": {"type": "url", "url": "http://x/1.png"}},
               {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "QUJD"}}]
    (message,) = _chat_messages(0, {"role": "user", "content": content})
    assert message["content"] == [{"type": "text", "text": "a"},
                                  {"type": "image_url", "image_url": {"url": "http://x/1.png"}},
                                  {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,QUJD"}}]
