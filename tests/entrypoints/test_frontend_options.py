"""vLLM's frontend flags (FrontendOptions), on a server with vLLM's defaults and on one with each set: a request's own
chat template and processor arguments refused unless trusted, default template variables under a request's own,
the reply's role, tokens named by id in log-probabilities, usage forced onto streams, tools left out of a chat
whose tool_choice is "none", a message's content given to the template as typed parts, and keep-alive comments in an
idle stream, and per-request metrics on the responses."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.serving_base import FrontendOptions
from pagedllm.entrypoints.openai.transport import SSE_KEEP_ALIVE, with_keep_alive
from tests.entrypoints.server_utils import RunningServer, start_server
from tests.models.tiny import save_tiny_model

# The server's own template: `shout` and `tools` show in the prompt.
TEMPLATE = ("{% if shout %}LOUD {% endif %}{% if tools %}TOOLS {% endif %}"
            "{% if reasoning_effort %}EFFORT={{ reasoning_effort }} {% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for part in m['content'] %}<{{ part['text'] }}>{% endfor %}{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}reply: {% endif %}")
OPTIONS = FrontendOptions(response_role="bot", default_chat_template_kwargs={"shout": True},
                          return_tokens_as_token_ids=True, force_include_usage=True,
                          trust_request_chat_template=True, trust_request_mm_kwargs=True,
                          exclude_tools_when_tool_choice_none=True, chat_template_content_format="openai",
                          sse_keep_alive_interval=0.001, enable_per_request_metrics=True)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module", params=["defaults", "options"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder, _ = save_tiny_model(tmp_path_factory.mktemp("frontend") / "llama")
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(folder), dtype="float32", chat_template=TEMPLATE),
                                    cache=CacheConfig(block_size=16, num_blocks=128)))
    running = start_server(engine, api_key=None, options=OPTIONS if request.param == "options" else None)
    yield running, request.param == "options"
    running.stop()


def _chat(running: RunningServer, **body: Any) -> httpx.Response:
    body = {"model": running.model_name, "messages": HI, "max_tokens": 2, "ignore_eos": True, **body}
    return httpx.post(f"{running.base_url}/v1/chat/completions", json=body, timeout=60)


def _prompt(running: RunningServer, **body: Any) -> str:
    """The text of the prompt the server rendered for a chat request."""
    reply = _chat(running, return_token_ids=True, **body)
    assert reply.status_code == 200, reply.text
    return running.engine.tokenizer.decode(reply.json()["prompt_token_ids"])


def test_a_requests_own_template_and_processor_arguments_need_trust(server: Any) -> None:
    running, trusted = server
    own = {"chat_template": "{% for m in messages %}[{{ m['content'] if m['content'] is string "
                            "else m['content'][0]['text'] }}]{% endfor %}"}
    in_kwargs = {"chat_template_kwargs": {"chat_template": "x"}}
    processor = {"mm_processor_kwargs": {"do_resize": False}}
    if trusted:
        assert _prompt(running, **own) == "[hi]"
        assert _chat(running, **processor).status_code == 200
        return
    for body, param in ((own, "chat_template"), (in_kwargs, "chat_template"), (processor, "mm_processor_kwargs")):
        refused = _chat(running, **body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
        assert "--trust-request-" in refused.json()["error"]["message"]


def test_default_template_variables_go_under_the_requests_own(server: Any) -> None:
    running, options = server
    assert _prompt(running).startswith("LOUD ") == options
    assert not _prompt(running, chat_template_kwargs={"shout": False}).startswith("LOUD ")
    assert _prompt(running, chat_template_kwargs={"shout": True}).startswith("LOUD ")


def test_the_content_format_gives_the_template_text_or_typed_parts(server: Any) -> None:
    running, options = server
    prompt = _prompt(running)
    assert prompt.endswith("user: <hi>reply: " if options else "user: hireply: "), prompt


def test_the_replys_role(server: Any) -> None:
    running, options = server
    role = "bot" if options else "assistant"
    assert _chat(running).json()["choices"][0]["message"]["role"] == role
    first = _stream(running)[0]
    assert first["choices"][0]["delta"]["role"] == role
    # continuing the last message: its role, whatever --response-role says
    continued = _chat(running, messages=[*HI, {"role": "assistant", "content": "he"}], add_generation_prompt=False,
                      continue_final_message=True)
    assert continued.json()["choices"][0]["message"]["role"] == "assistant"


def _stream(running: RunningServer, **body: Any) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{running.base_url}/v1/chat/completions", timeout=60, json={
            "model": running.model_name, "messages": HI, "max_tokens": 2, "ignore_eos": True, "stream": True,
            **body}) as response:
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def test_usage_on_every_stream_when_forced(server: Any) -> None:
    running, options = server
    chunks = _stream(running)
    assert (chunks[-1].get("usage") is not None) == options
    if options:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    asked = _stream(running, stream_options={"include_usage": True})
    assert asked[-1]["usage"]["completion_tokens"] == 2


def test_tokens_named_by_id_unless_the_request_says(server: Any) -> None:
    running, options = server
    for asked, by_id in ((None, options), (False, False), (True, True)):
        extra = {} if asked is None else {"return_tokens_as_token_ids": asked}
        content = _chat(running, logprobs=True, top_logprobs=1, **extra).json()["choices"][0]["logprobs"]["content"]
        assert all(entry["token"].startswith("token_id:") == by_id for entry in content), (asked, content)
        completion = httpx.post(f"{running.base_url}/v1/completions", timeout=60, json={
            "model": running.model_name, "prompt": "hi", "max_tokens": 2, "logprobs": 1, **extra}).json()
        assert all(t.startswith("token_id:") == by_id for t in completion["choices"][0]["logprobs"]["tokens"])


def test_tools_left_out_when_tool_choice_is_none(server: Any) -> None:
    running, options = server
    assert _prompt(running, tools=[TOOL], tool_choice="none").find("TOOLS ") == (-1 if options else 0)
    assert "TOOLS " in _prompt(running, tools=[TOOL], tool_choice="required", ignore_eos=False)


def test_the_flags_make_the_options() -> None:
    from pagedllm.entrypoints.openai.api_server import frontend_options_from_args, make_parser

    assert frontend_options_from_args(make_parser().parse_args([])) == FrontendOptions()
    args = make_parser().parse_args([
        "--response-role", "bot", "--default-chat-template-kwargs", '{"shout": true}', "--return-tokens-as-token-ids",
        "--enable-force-include-usage", "--trust-request-chat-template", "--trust-request-mm-kwargs",
        "--exclude-tools-when-tool-choice-none", "--enable-prompt-tokens-details",
        "--chat-template-content-format", "openai", "--sse-keep-alive-interval", "0.001",
        "--enable-per-request-metrics"])
    assert frontend_options_from_args(args) == OPTIONS
    for bad in ("-1", "inf", "nan", "soon"):
        with pytest.raises(SystemExit):
            make_parser().parse_args(["--sse-keep-alive-interval", bad])


def test_an_idle_stream_gets_keep_alive_comments_and_closes_through_them() -> None:
    """A comment after each interval without an event, the events as they were; closing the stream closes the
    events' generator (which aborts the engine's requests), even while it waits for its next event."""
    closed = []

    async def events() -> AsyncIterator[str]:
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(0.25)
            yield "data: 2\n\n"
            await asyncio.sleep(10)
            yield "data: never\n\n"
        finally:
            closed.append(True)

    async def main() -> list[str]:
        stream = with_keep_alive(events(), 0.1)
        seen = [await anext(stream)]
        while seen[-1] != "data: 2\n\n":
            seen.append(await anext(stream))
        seen.append(await anext(stream))        # a keep-alive while the events wait 10 s
        await stream.aclose()
        return seen

    seen = asyncio.run(main())
    assert seen[0] == "data: 1\n\n" and seen[-2:] == ["data: 2\n\n", SSE_KEEP_ALIVE]
    assert len(seen) >= 4 and set(seen[1:-2]) == {SSE_KEEP_ALIVE}      # at least one in the 0.25 s pause
    assert closed == [True]


def test_clients_read_a_stream_with_keep_alive_comments(server: Any) -> None:
    """The OpenAI SDK skips the comments (an interval of 1 ms puts some between the tokens): the same text."""
    running, _ = server
    client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="none")
    body = dict(model=running.model_name, messages=HI, max_tokens=6, temperature=0.0)
    whole = client.chat.completions.create(**body).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        stream=True, **body) if chunk.choices)
    assert streamed == whole
    text = httpx.post(f"{running.base_url}/v1/completions", timeout=60, json={
        "model": running.model_name, "prompt": "hi", "max_tokens": 6, "stream": True}).text
    assert text.endswith("data: [DONE]\n\n")



def test_reasoning_effort_reaches_the_template_and_a_request_id_names_the_response(server: Any) -> None:
    running, _ = server
    assert "EFFORT=low " in _prompt(running, reasoning_effort="low")
    assert "EFFORT=high " in _prompt(running, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
    assert _chat(running, reasoning_effort="extreme").status_code == 400
    answered = httpx.post(f"{running.base_url}/v1/responses", timeout=60, json={
        "model": running.model_name, "input": "hi", "max_output_tokens": 2, "reasoning": {"effort": "medium"}})
    assert answered.status_code == 200 and answered.json()["reasoning"] == {"effort": "medium"}
    bad = httpx.post(f"{running.base_url}/v1/responses", timeout=60, json={
        "model": running.model_name, "input": "hi", "reasoning": {"effort": "extreme"}})
    assert bad.status_code == 400, bad.text
    assert _chat(running, request_id="order-42").json()["id"] == "chatcmpl-order-42"
    completion = httpx.post(f"{running.base_url}/v1/completions", timeout=60, json={
        "model": running.model_name, "prompt": "hi", "max_tokens": 1, "request_id": "order-43"}).json()
    assert completion["id"] == "cmpl-order-43"
    assert _chat(running, request_id="has space").status_code == 400


def test_per_request_metrics_on_a_response_of_one_choice(server: Any) -> None:
    """vLLM's --enable-per-request-metrics: a response of one choice carries its timings, streamed on the usage chunk;
    one of several choices, null; without the flag, no field."""
    running, options = server
    reply = _chat(running, max_tokens=5).json()
    if not options:
        assert "metrics" not in reply and "metrics" not in _stream(running, stream_options={"include_usage": True})[-1]
        return
    metrics = reply["metrics"]
    assert set(metrics) == {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
                            "tokens_per_second"}
    assert metrics["time_to_first_token_ms"] > 0 and metrics["queue_time_ms"] >= 0 and metrics["tokens_per_second"] > 0
    assert metrics["mean_itl_ms"] == pytest.approx(metrics["generation_time_ms"] / 4)     # 5 tokens: 4 gaps
    assert _chat(running, n=2).json()["metrics"] is None
    last = _stream(running, stream_options={"include_usage": True})[-1]
    assert last["choices"] == [] and last["metrics"]["tokens_per_second"] > 0
    completion = httpx.post(f"{running.base_url}/v1/completions", timeout=60, json={
        "model": running.model_name, "prompt": "hi", "max_tokens": 3}).json()
    assert completion["metrics"]["generation_time_ms"] >= 0
