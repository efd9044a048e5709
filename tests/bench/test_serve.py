"""`bench serve` against a small in-process fake OpenAI server that streams one chunk per token."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.bench.cli import main
from pagedllm.bench.serve import RequestResult, summarise

FAIL_MAX_TOKENS = 3   # the fake server answers 500 to requests asking for this many tokens


def _fake_app(received: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        received.append(body)
        if body["max_tokens"] == FAIL_MAX_TOKENS:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)

        async def stream():
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.002)
                last = i == body["max_tokens"] - 1
                chunk = {"object": "text_completion", "model": body["model"],
                         "choices": [{"index": 0, "text": "x", "finish_reason": "length" if last else None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    received: list[dict] = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_fake_app(received), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", received
    server.should_exit = True
    thread.join(10)


def test_serve_reports_vllm_fields(fake_server, tiny_model_dir, tmp_path, capsys):
    base_url, received = fake_server
    received.clear()
    out = tmp_path / "serve.json"
    result = main(["serve", "--base-url", base_url, "--tokenizer", tiny_model_dir, "--dataset", "random",
                   "--num-prompts", "6", "--input-len", "8", "--output-len", "5", "--max-concurrency", "2",
                   "--request-rate", "200", "--output-json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["model"] == "fake-model"
    assert (result["completed"], result["failed"]) == (6, 0)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (48, 30)
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{name}_ms"] <= result[f"p99_{name}_ms"], name
        assert result[f"mean_{name}_ms"] > 0
    assert result["mean_e2el_ms"] > result["mean_ttft_ms"]
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    body = received[-1]   # after the initial test request
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 5
    assert body["temperature"] == 0.0 and "top_p" not in body     # greedy, nothing else set
    assert isinstance(body["prompt"], list) and len(body["prompt"]) == 8
    printed = capsys.readouterr().out
    assert " Serving Benchmark Result " in printed and "P99 ITL (ms):" in printed


def test_serve_counts_failures_and_sends_text(fake_server, tiny_model_dir, tmp_path):
    base_url, received = fake_server
    received.clear()
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "output_len": n})
                              for p, n in [("hello", 4), ("bad", FAIL_MAX_TOKENS), ("world", 2)]))
    result = main(["serve", "--base-url", base_url, "--model", "fake-model", "--tokenizer", tiny_model_dir,
                   "--dataset", "jsonl", "--dataset-path", str(path), "--prompt-format", "text",
                   "--temperature", "0.7", "--top-k", "20", "--repetition-penalty", "1.1"])
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (2, 1, 6)
    assert "HTTP 500" in result["errors"][0]
    assert {b["prompt"] for b in received} == {"hello", "bad", "world"}
    assert all((b["temperature"], b["top_k"], b["repetition_penalty"]) == (0.7, 20, 1.1) for b in received)
    assert result["sampling"] == {"temperature": 0.7, "top_k": 20, "repetition_penalty": 1.1}


def test_summarise_tpot_and_percentiles():
    results = [RequestResult(True, 4, 5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
               RequestResult(True, 4, 1, ttft=0.2, latency=0.2), RequestResult(error="x")]
    summary = summarise(results, duration=1.0)
    assert (summary["completed"], summary["failed"], summary["total_output_tokens"]) == (2, 1, 6)
    assert summary["mean_tpot_ms"] == pytest.approx(100)   # (0.5 - 0.1) / 4; the 1-token request has no TPOT
    assert summary["median_ttft_ms"] == pytest.approx(150) and summary["p99_ttft_ms"] == pytest.approx(200)
