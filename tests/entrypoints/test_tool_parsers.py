"""The tool-call parsers, the forcing schemas and ToolCallStream, without a model; and how tools reach a chat
template that knows them and one that does not."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningStream
from pagedllm.entrypoints.openai.serving_base import ServerLimits
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    FunctionGemmaToolParser,
    GraniteToolParser,
    HermesToolParser,
    Lfm2ToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    OpenAIToolParser,
    Phi4MiniJsonToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
    ToolCallStream,
    required_tools_schema,
)
from tests.models.tiny import build_byte_tokenizer

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_reads_each_block_and_the_content_before():
    text = ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    content, calls = HermesToolParser().extract(text)
    assert content == "Let me check." and _calls(calls) == [("a", {"x": 1}), ("b", {})]
    assert HermesToolParser().extract('<tool_call>{"name": "a", "arguments": {"x": 1}}')[1]   # unclosed, at the end
    assert HermesToolParser().extract("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


@pytest.mark.parametrize("text, start", [("plain", None), ("abc <tool_call>{", 4), ("abc <tool_", 4), ("a <", 2)])
def test_hermes_tool_start_holds_back_a_marker_in_the_making(text, start):
    assert HermesToolParser().tool_start(text) == start


def test_llama3_json_reads_calls_separated_by_semicolons():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": "z"}}'
    assert _calls(Llama3JsonToolParser().extract(text)[1]) == [("a", {"x": 1}), ("b", {"y": "z"})]
    assert Llama3JsonToolParser().extract("Hello {there}") == ("Hello {there}", [])
    assert Llama3JsonToolParser().tool_start('  {"na') == 0 and Llama3JsonToolParser().tool_start("Hi") is None


def test_mistral_reads_a_json_list_or_a_call_per_marker_after_the_content():
    parser = MistralToolParser()
    listed = 'Checking. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    content, calls = parser.extract(listed)
    assert content == "Checking." and _calls(calls) == [("a", {"x": 1}), ("b", {})]
    v11 = '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}'        # Mistral's v11 tokenizer's form
    assert parser.extract(v11)[0] is None and _calls(parser.extract(v11)[1]) == [("a", {"x": 1}), ("b", {})]
    for broken in ("[TOOL_CALLS] not json", '[TOOL_CALLS]a[ARGS]["x"]', "[TOOL_CALLS][]", "no calls"):
        assert parser.extract(broken) == (broken, [])
    assert parser.tool_start("Sure [TOOL_") == 5 and parser.tool_start("Sure") is None


def test_pythonic_reads_a_list_of_calls_with_literal_arguments_and_runs_none():
    parser = PythonicToolParser()
    text = '[get_weather(city="Rome", days=[1, 2]), get_time()]'
    assert parser.extract(text)[0] is None
    assert _calls(parser.extract(text)[1]) == [("get_weather", {"city": "Rome", "days": [1, 2]}), ("get_time", {})]
    assert _calls(parser.extract('<|python_start|>[f(x=None)]<|python_end|>')[1]) == [("f", {"x": None})]
    for not_calls in ("[1, 2]", "[f(1)]", "[f(x=open('/etc/passwd'))]", "[f(**kw)]", "[os.system(x=1)]", "[]",
                      "Hello [f(x=1)]", "[f(x="):
        assert parser.extract(not_calls) == (not_calls, []), not_calls
    assert parser.tool_start(" [get") == 0 and parser.tool_start("<|python") == 0 and parser.tool_start("Hi") is None


def test_qwen3_coder_reads_xml_calls_typed_by_the_tools_schemas():
    tools = [{"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "nights": {"type": "integer"}, "pets": {"type": "boolean"},
        "room": {"type": "object"}, "note": {"type": ["string", "null"]}}}}}]
    text = ("I'll book it.\n<tool_call>\n<function=book>\n<parameter=city>\n42\n</parameter>\n"
            "<parameter=nights>\n3\n</parameter>\n<parameter=pets>\ntrue\n</parameter>\n"
            '<parameter=room>\n{"beds": 2}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n</function>\n'
            "</tool_call>\n<tool_call>\n<function=other>\n<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>")
    content, calls = Qwen3CoderToolParser(tools).extract(text)
    assert content == "I'll book it." and _calls(calls) == [
        ("book", {"city": "42", "nights": 3, "pets": True, "room": {"beds": 2}, "note": "null"}),
        ("other", {"n": "7"})]          # a tool the request does not have: its values stay text
    assert _calls(Qwen3CoderToolParser(tools).extract("<tool_call><function=book><parameter=nights>x")[1]) == [
        ("book", {"nights": "x"})]      # cut off, and not a number: the text
    assert Qwen3CoderToolParser().extract("no call") == ("no call", [])
    assert Qwen3CoderToolParser().tool_start("Sure <tool_") == 5


def test_granite_phi4_mini_lfm2_and_functiongemma_read_their_formats():
    granite = GraniteToolParser()
    for marker in ("<|tool_call|>", "<tool_call>"):
        text = f'Checking.{marker}[{{"name": "a", "arguments": {{"x": 1}}}}, {{"name": "b", "arguments": {{}}}}]'
        assert granite.extract(text)[0] == "Checking." and _calls(granite.extract(text)[1]) == [("a", {"x": 1}),
                                                                                               ("b", {})]
    assert granite.extract("<|tool_call|>not json") == ("<|tool_call|>not json", [])
    assert granite.tool_start("Hi <|tool") == 3 and granite.tool_start("Hi") is None
    phi = Phi4MiniJsonToolParser()
    text = 'functools[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "parameters": {"y": 2}}]'
    assert phi.extract(text)[0] is None and _calls(phi.extract(text)[1]) == [("a", {"x": 1}), ("b", {"y": 2})]
    assert phi.extract("functools[oops]") == ("functools[oops]", [])
    lfm2 = Lfm2ToolParser()
    text = 'Sure.<|tool_call_start|>[get_weather(location="Paris"), f()]<|tool_call_end|>It is sunny.'
    assert lfm2.extract(text)[0] == "Sure.\nIt is sunny."
    assert _calls(lfm2.extract(text)[1]) == [("get_weather", {"location": "Paris"}), ("f", {})]
    assert lfm2.extract("<|tool_call_start|>[os.system(x=1)]<|tool_call_end|>")[1] == []
    gemma = FunctionGemmaToolParser()
    text = ("<start_function_call>call:get_weather{city:<escape>Rome<escape>,days:<escape>3<escape>}"
            "<end_function_call><start_function_call>call:now{}<end_function_call>")
    assert gemma.extract(text)[0] is None
    assert _calls(gemma.extract(text)[1]) == [("get_weather", {"city": "Rome", "days": 3}), ("now", {})]
    assert gemma.extract("plain") == ("plain", [])


def test_openai_reads_gpt_oss_harmony_calls():
    """gpt-oss's calls: messages addressed to a function, the recipient after the channel or before it; the content
    the final channel's message, or the text before the first message; after --reasoning-parser openai_gptoss, whose
    answer opens with the call's header, the whole reply's calls."""
    parser = OpenAIToolParser()
    text = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Paris"}<|call|>')
    assert parser.extract(text)[0] is None and _calls(parser.extract(text)[1]) == [("get_weather", {"city": "Paris"})]
    text = ('Sure.<|start|>assistant to=functions.a<|channel|>commentary json<|message|>{"x": 1}<|call|>'
            '<|start|>assistant<|channel|>commentary to=functions.b<|message|>{}')      # cut short
    assert parser.extract(text)[0] == "Sure." and _calls(parser.extract(text)[1]) == [("a", {"x": 1}), ("b", {})]
    assert parser.extract("<|channel|>final<|message|>It is sunny.") == ("It is sunny.", [])
    assert parser.extract("plain") == ("plain", [])
    assert parser.tool_start("It is <|sta") == 6 and parser.tool_start("It is") is None
    reasoning, answer = ReasoningStream("openai_gptoss").final(
        "<|channel|>analysis<|message|>Need the weather.<|end|>" + text.removeprefix("Sure."))
    assert reasoning == "Need the weather." and _calls(parser.extract(answer)[1]) == [("a", {"x": 1}), ("b", {})]


def test_vllms_other_parser_names_read_the_same_formats():
    assert TOOL_PARSERS["llama4_pythonic"] is PythonicToolParser and TOOL_PARSERS["llama4_json"] is \
        Llama3JsonToolParser and TOOL_PARSERS["qwen3_json"] is TOOL_PARSERS["granite4"] is HermesToolParser
    assert TOOL_PARSERS["qwen3_xml"] is Qwen3CoderToolParser


def test_a_parser_whose_marker_is_a_special_token_keeps_special_tokens_in_the_reply():
    from pagedllm.sampling_params import SamplingParams

    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[TOOL])
    for parser, kept in (("mistral", True), ("hermes", False), ("pythonic", False), ("granite", True),
                         ("lfm2", True), ("functiongemma", True), ("qwen3_coder", False), ("openai", True)):
        params = _chat(build_byte_tokenizer(), parser)._force_tool_call(request, "auto", SamplingParams())
        assert params.skip_special_tokens is not kept, parser


def test_stream_sends_content_then_the_calls_at_the_end():
    stream = ToolCallStream(parser=HermesToolParser())
    deltas = [stream.delta(t, False) for t in ["Sure", ". <tool", '_call>{"name": "a", ', '"arguments": {}}']]
    last = stream.delta("</tool_call>", True)
    assert deltas == [{"content": "Sure"}, {"content": ". "}, {}, {}]
    [call] = last["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "a", "arguments": "{}"}


def test_without_parallel_calls_only_the_first_is_kept():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c.name for c in ToolCallStream(parser=HermesToolParser()).final(text)[1]] == ["a", "b"]
    single = ToolCallStream(parser=HermesToolParser(), parallel=False)
    assert [c.name for c in single.final(text)[1]] == ["a"]
    assert [c["function"]["name"] for c in single.delta(text, True)["tool_calls"]] == ["a"]


def test_stream_of_a_named_function_names_it_once_then_sends_arguments():
    stream = ToolCallStream(forced_name="f")
    first, second, third = stream.delta("", False), stream.delta('{"x":', False), stream.delta(" 1}", True)
    assert first["tool_calls"][0]["function"] == {"name": "f", "arguments": ""} and first["tool_calls"][0]["id"]
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": '{"x":'}}]}
    assert third == {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}
    assert _calls(stream.final('{"x": 1}')[1]) == [("f", {"x": 1})]


def test_required_schema_lists_calls_of_the_given_tools():
    schema = required_tools_schema([TOOL])
    assert schema["minItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    assert "maxItems" not in schema and required_tools_schema([TOOL], parallel=False)["maxItems"] == 1
    stream = ToolCallStream(required=True)
    assert _calls(stream.final('[{"name": "get_weather", "parameters": {"city": "Rome"}}]')[1]) == [
        ("get_weather", {"city": "Rome"})]


def _chat(tokenizer, parser: str | None = None) -> OpenAIServingChat:
    async def run_on_tokenizer_thread(fn, *args, **kwargs):   # the async engine's, on this thread
        return fn(*args, **kwargs)

    engine = SimpleNamespace(tokenizer=tokenizer, run_on_tokenizer_thread=run_on_tokenizer_thread)
    return OpenAIServingChat(engine, ["m"], ServerLimits(), parser)


def _render(tokenizer, request: ChatCompletionRequest) -> str:
    return tokenizer.decode(asyncio.run(_chat(tokenizer).render(request)))


def test_tools_go_into_the_system_message_of_a_template_that_knows_none():
    tokenizer = build_byte_tokenizer()
    messages = [{"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    prompt = _render(tokenizer, ChatCompletionRequest(messages=messages, tools=[TOOL]))
    assert prompt.startswith("<|im_start|>system\nYou can call functions.") and '"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in prompt
    assert "<|im_start|>tool\nsunny<|im_end|>" in prompt


def test_a_template_that_knows_tools_gets_them():
    template = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = template
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[TOOL])
    assert _render(tokenizer, request) == "TOOL get_weather\nuser: hi\n"


def test_auto_needs_the_servers_parser():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[TOOL])
    with pytest.raises(OpenAIError, match="--enable-auto-tool-choice"):
        _chat(build_byte_tokenizer())._tool_choice(request)
    assert _chat(build_byte_tokenizer(), "hermes")._tool_choice(request) == "auto"
