"""`pagedllm run-batch`: OpenAI's batch format answered by the server's own handlers, on a tiny random Llama
(tests/models/tiny.py). Each request's body is what the offline API gives; every line gets an answer, in order."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.entrypoints.openai.run_batch import run_batch
from pagedllm.entrypoints.openai.serving_base import FrontendOptions
from tests.models.tiny import build_byte_tokenizer
from tests.reliability.tiny_server import build_tiny_engine, offline

MESSAGES = [{"role": "user", "content": "Say something."}]




@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> LLM:
    return offline(build_tiny_engine(tiny_llama_dir))


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _run(tiny_llama_dir, lines: list[str], max_in_flight: int = 8,
         options: FrontendOptions | None = None) -> tuple[list[dict], object]:
    """run_batch on a tiny engine of its own, started and shut down here; the output lines, parsed."""
    written: list[str] = []

    async def main():
        served = AsyncEngine(build_tiny_engine(tiny_llama_dir))
        served.start(asyncio.get_running_loop())
        try:
            return await run_batch(served, lines, written.append, max_in_flight=max_in_flight, options=options)
        finally:
            await asyncio.to_thread(served.shutdown)

    counts = asyncio.run(main())
    assert all(text.endswith("\n") and text.count("\n") == 1 for text in written)
    return [json.loads(text) for text in written], counts


def _greedy(llm: LLM, prompt, max_tokens: int, chat: bool = False) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.chat(prompt, params, use_tqdm=False) if chat else llm.generate(prompt, params, use_tqdm=False)
    return outputs[0].outputs[0].text


def test_requests_are_answered_as_the_offline_api_answers_them_in_the_input_order(tiny_llama_dir, reference):
    # a long request first: it finishes last, yet its answer is written first
    lines = [_line("long", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
                                               "ignore_eos": True}),
             "   ",
             _line("chat", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "temperature": 0,
                                                    "ignore_eos": True, "n": 2}),
             _line("short", "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2, "temperature": 0,
                                                "ignore_eos": True}),
             _line("response", "/v1/responses", {"input": MESSAGES, "max_output_tokens": 4, "temperature": 0}),
             _line("embedding", "/v1/embeddings", {"input": ["a", "b c"]}),
             _line("score", "/v1/score", {"text_1": "a", "text_2": ["b c", "a"]}),
             _line("rerank", "/v1/rerank", {"query": "a", "documents": ["b c", "a"], "top_n": 1})]
    outputs, counts = _run(tiny_llama_dir, lines)
    assert [o["custom_id"] for o in outputs] == ["long", "chat", "short", "response", "embedding", "score", "rerank"]
    assert (counts.succeeded, counts.failed) == (7, 0)
    for output in outputs:
        response = output["response"]
        assert output["error"] is None and output["id"].startswith("batch_req")
        assert response["status_code"] == 200 and response["request_id"] == response["body"]["id"]
    long, chat, short, response, embedding, score, rerank = (o["response"]["body"] for o in outputs)
    assert long["choices"][0]["text"] == _greedy(reference, "Once upon a time", 48)
    assert long["usage"]["completion_tokens"] == 48
    assert chat["object"] == "chat.completion" and len(chat["choices"]) == 2
    assert [c["message"]["content"] for c in chat["choices"]] == [_greedy(reference, MESSAGES, 4, chat=True)] * 2
    assert [c["text"] for c in short["choices"]] == [_greedy(reference, p, 2) for p in ("a", "b")]
    assert response["object"] == "response" and response["usage"]["output_tokens"] <= 4
    assert response["output"][0]["content"][0]["text"] == reference.chat(
        MESSAGES, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0].text
    expected = [o.outputs.embedding for o in reference.embed(["a", "b c"], use_tqdm=False)]
    assert [d["index"] for d in embedding["data"]] == [0, 1]
    for data, vector in zip(embedding["data"], expected):
        assert data["embedding"] == pytest.approx(vector, abs=1e-6)
    scores = [o.outputs.score for o in reference.score("a", ["b c", "a"], use_tqdm=False)]
    assert [d["score"] for d in score["data"]] == pytest.approx(scores, abs=1e-6)
    assert [(r["index"], r["document"]["text"]) for r in rerank["results"]] == [(1, "a")]   # "a" matches itself


@pytest.mark.parametrize("max_in_flight", [1, 3])
def test_every_line_gets_its_answer_bad_ones_included(tiny_llama_dir, max_in_flight):
    good = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    lines = [_line("ok-1", "/v1/completions", good),
             _line("bad-temperature", "/v1/completions", {**good, "temperature": -1}),
             _line("no-prompt", "/v1/completions", {"max_tokens": 2}),
             _line("other-model", "/v1/completions", {**good, "model": "gpt-4"}),
             _line("speech", "/v1/audio/speech", {"input": "hi"}),
             _line("streamed", "/v1/completions", {**good, "stream": True}),
             "not JSON",
             json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": good}),
             json.dumps({"method": "POST", "url": "/v1/completions", "body": good}),
             _line("ok-2", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})]
    outputs, counts = _run(tiny_llama_dir, lines, max_in_flight)
    assert [o["custom_id"] for o in outputs] == ["ok-1", "bad-temperature", "no-prompt", "other-model", "speech",
                                                 "streamed", None, "get", None, "ok-2"]
    assert (counts.succeeded, counts.failed) == (2, 8)
    assert counts.failed_lines[:2] == ["line 2 (bad-temperature)", "line 3 (no-prompt)"]
    by_id = {o["custom_id"]: o for o in outputs if o["custom_id"]}
    # refused by the endpoint: its status and OpenAI error body, as over HTTP
    for custom_id, status, param in [("bad-temperature", 400, "temperature"), ("no-prompt", 400, "prompt"),
                                     ("other-model", 404, "model")]:
        response = by_id[custom_id]["response"]
        assert by_id[custom_id]["error"] is None and response["status_code"] == status
        assert response["body"]["error"]["param"] == param, response
    # no request at all: no response, an error naming why
    assert by_id["speech"]["error"]["code"] == "invalid_url" and by_id["speech"]["response"] is None
    assert "stream" in by_id["streamed"]["error"]["message"]
    assert "POST" in by_id["get"]["error"]["message"]
    assert outputs[6]["error"]["code"] == "invalid_request" and "JSON" in outputs[6]["error"]["message"]
    assert "custom_id" in outputs[8]["error"]["message"]


def test_the_command_reads_and_writes_files(tiny_llama_dir, tmp_path):
    requests = tmp_path / "in.jsonl"
    requests.write_text("\n".join([
        _line("a", "/v1/completions", {"prompt": "Once", "max_tokens": 3, "temperature": 0, "ignore_eos": True}),
        _line("b", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "temperature": 0}),
        _line("c", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "chat_template": "x"})]) + "\n")
    results = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "run-batch", "-i", str(requests),
                           "-o", str(results), "--model", str(tiny_llama_dir), "--dtype", "float32",
                           "--kv-cache-memory", "16MiB", "--response-role", "bot"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    outputs = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(o["custom_id"], o["response"]["status_code"]) for o in outputs] == [("a", 200), ("b", 200), ("c", 400)]
    assert outputs[0]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert outputs[1]["response"]["body"]["choices"][0]["message"]["role"] == "bot"       # the serving flags hold
    assert "--trust-request-chat-template" in outputs[2]["response"]["body"]["error"]["message"]
    assert "batch done: 2 requests answered, 1 failed" in done.stderr


def test_a_background_response_in_a_batch_is_refused(tiny_llama_dir):
    line = _line("bg", "/v1/responses", {"input": "hi", "max_output_tokens": 2, "background": True})
    (output,), _ = _run(tiny_llama_dir, [line])
    assert output["response"]["status_code"] == 400, output
    assert output["response"]["body"]["error"]["param"] == "background", output


def test_a_trusted_batch_takes_its_own_chat_template(tiny_llama_dir):
    line = _line("t", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "return_token_ids": True,
                                               "chat_template": "{{ messages[0]['content'] }}"})
    (output,), _ = _run(tiny_llama_dir, [line], options=FrontendOptions(trust_request_chat_template=True))
    body = output["response"]["body"]
    assert output["response"]["status_code"] == 200 and body["prompt_token_ids"] == \
        build_byte_tokenizer().encode(MESSAGES[0]["content"], add_special_tokens=False)
