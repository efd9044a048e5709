"""--reasoning-parser deepseek_r1: a reply's <think> part goes to `reasoning`, the rest to `content`, whole or
streamed (however the text is cut into deltas, no part of a tag leaks), and the tool parser reads the content.
The served tests steer a tiny random model into a reply with structured_outputs, as test_tool_calls.py does."""

from __future__ import annotations

import json

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningStream
from tests.entrypoints.server_utils import RunningServer, start_server
from tests.entrypoints.test_tool_calls import WEATHER, _literal
from tests.models.tiny import save_tiny_model

MESSAGES = [{"role": "user", "content": "Is it sunny?"}]
THINKING, ANSWER = "The sky looks clear.", "It is sunny."


@pytest.mark.parametrize(("text", "parts"), [
    ("<think>a</think>b", ("a", "b")),
    ("a</think>b", ("a", "b")),                 # the template opened <think>
    ("a</think>", ("a", None)),
    ("still thinking", ("still thinking", None)),   # cut before </think>: all reasoning
    ("</think>b", (None, "b")),
])
def test_a_whole_reply_splits_at_the_end_tag(text, parts):
    assert ReasoningStream().final(text) == parts


@pytest.mark.parametrize(("parser", "text", "parts"), [
    ("qwen3", "<think>a</think>b", ("a", "b")),
    ("qwen3", "<think>still thinking", ("still thinking", None)),
    ("qwen3", "a</think>b", (None, "a</think>b")),             # no <think> first: Qwen3 answered without thinking
    ("qwen3", "just the answer", (None, "just the answer")),
    ("mistral", "[THINK]a[/THINK]b", ("a", "b")),
    ("mistral", "[THINK]still thinking", ("still thinking", None)),
    ("mistral", "just the answer", (None, "just the answer")),     # no [THINK] first: an answer without thinking
    ("granite", "Here is my thought process: a Here is my response: b", (" a ", " b")),
    ("granite", "Here's my thought process:a\nHere's my response:b", ("a\n", "b")),       # the other spelling
    ("granite", "Here is my thought process: still", (" still", None)),
    ("granite", "Here is the answer", (None, "Here is the answer")),     # no thought process first: all answer
    ("seed_oss", "<seed:think>a</seed:think>b", ("a", "b")),
    ("seed_oss", "just the answer", (None, "just the answer")),
    ("olmo3", "a</think>b", ("a", "b")),                                 # its template opened <think>
    # gpt-oss's harmony channels: the analysis, then the final channel's message without its header
    ("openai_gptoss", "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b",
     ("a", "b")),
    ("openai_gptoss", "<|channel|>analysis<|message|>a<|end|>b", ("a", "b")),
    ("openai_gptoss", "<|channel|>analysis<|message|>still", ("still", None)),
    ("openai_gptoss", "<|channel|>final<|message|>b", (None, "b")),      # straight to the final channel
    ("openai_gptoss", "just the answer", (None, "just the answer")),
    ("openai_gptoss", "<|channel|>analysis<|message|>a<|end|><|start|>assi", ("a", "<|start|>assi")),   # cut short
])
def test_each_format_splits_whole_and_streamed_alike(parser, text, parts):
    assert ReasoningStream(parser).final(text) == parts
    for size in (1, 2, 3, 5):     # cut anywhere, markers included
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        stream = ReasoningStream(parser)
        deltas = [stream.delta(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
        assert ("".join(r for r, _ in deltas) or None, "".join(c for _, c in deltas) or None) == parts, size


@pytest.mark.parametrize(("parser", "kept"), [("mistral", True), ("deepseek_r1", False)])
def test_a_parser_whose_markers_are_special_tokens_keeps_them_in_the_reply(tmp_path, parser, kept):
    folder = save_tiny_model(tmp_path / "m", "llama-gqa")[0]
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(folder), dtype="float32"),
                                    cache=CacheConfig(block_size=16, num_blocks=64)))
    seen, add = [], engine.add_request
    engine.add_request = lambda request_id, prompt, params, **kwargs: (seen.append(params.skip_special_tokens),
                                                                       add(request_id, prompt, params, **kwargs))
    running = start_server(engine, api_key=None, reasoning_parser=parser)
    try:
        running.client().chat.completions.create(model=running.model_name, messages=MESSAGES, max_tokens=2)
    finally:
        running.stop()
    assert seen == [not kept]


text_chars = st.text(alphabet=st.sampled_from("ab </>thinkT"), max_size=12).filter(
    lambda s: "</think>" not in s and not s.startswith("<think>"))


@settings(max_examples=200, deadline=None)
@given(reasoning=text_chars, content=st.text(alphabet="ab </>thinkT", max_size=12), opened=st.booleans(),
       cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8))
def test_streamed_deltas_join_to_the_whole_split(reasoning, content, opened, cuts):
    text = ("<think>" if opened else "") + reasoning + "</think>" + content
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:])] or [""]
    stream = ReasoningStream()
    deltas = [stream.delta(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    assert "".join(r for r, _ in deltas) == reasoning
    assert "".join(c for _, c in deltas) == content


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> RunningServer:
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa", max_position_embeddings=2048)[0]
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(folder), dtype="float32", max_model_len=2048),
                                    cache=CacheConfig(block_size=16, num_blocks=512)))
    running = start_server(engine, api_key=None, tool_call_parser="hermes", reasoning_parser="deepseek_r1")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.client()


def _steered(reply: str) -> dict:
    return {"structured_outputs": {"regex": _literal(reply)}}


@pytest.mark.parametrize("include_reasoning", [True, False])
def test_the_reply_carries_its_reasoning_apart(client, server, include_reasoning):
    body = {**_steered(f"<think>{THINKING}</think>{ANSWER}"), "include_reasoning": include_reasoning}
    whole = client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=200,
                                           extra_body=body)
    message = whole.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra.get("reasoning") == (THINKING if include_reasoning else None)
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=200,
                                                stream=True, extra_body=body):
        for choice in chunk.choices:
            reasoning += choice.delta.model_extra.get("reasoning") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ((THINKING if include_reasoning else ""), ANSWER)


def test_a_reply_cut_while_thinking_is_all_reasoning(client, server):
    out = client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=12,
                                         extra_body=_steered(f"<think>{THINKING}</think>{ANSWER}"))
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "length" and message.content is None
    assert message.model_extra["reasoning"] == THINKING[:5]       # 12 tokens: "<think>" and 5 (bytes)


def test_tool_calls_are_read_from_the_content(client, server):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    out = client.chat.completions.create(model=server.model_name, messages=MESSAGES, tools=[WEATHER],
                                         max_tokens=300, extra_body=_steered(f"<think>{THINKING}</think>{call}"))
    message = out.choices[0].message
    assert message.model_extra["reasoning"] == THINKING and out.choices[0].finish_reason == "tool_calls"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "C"}
