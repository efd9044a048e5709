"""`pagedllm bench serve`: online latency and throughput against any OpenAI-compatible server.

Each request streams `/v1/completions` with `max_tokens` = its output_len, `ignore_eos` and the sampling flags'
parameters (greedy by default; top_k, min_p and repetition_penalty are extra body fields that vLLM and pagedllm
accept, as `ignore_eos` is), so servers generate the same number of tokens the same way. Per request it records
the time to the first streamed chunk (TTFT), the gaps between chunks (ITL), and the end-to-end latency (E2EL); TPOT
is (E2EL - TTFT) / (output tokens - 1). The report follows vLLM's `benchmark_serving`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.bench.args import (
    add_dataset_args,
    add_sampling_args,
    describe_sampling,
    requests_from_args,
    sampling_kwargs,
)
from pagedllm.bench.datasets import BenchRequest


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser)
    add_sampling_args(parser)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    parser.add_argument("--tokenizer", default=None,
                        help="model folder or .gguf whose tokenizer builds the prompts (default: --model if it "
                             "resolves locally, else the embedded default model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: all)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default: inf, all at once)")
    parser.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                        help="send prompts as token ids or as decoded text")
    parser.add_argument("--output-json", default=None)
    parser.set_defaults(func=main)


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def main(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_main(args, sampling_kwargs(args)))   # (the sampling flags checked before any request)


async def _main(args: argparse.Namespace, sampling: dict[str, float | int]) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(None, connect=30.0)) as client:
        model = args.model or await _first_model(client)
        tokenizer = _load_tokenizer(args.tokenizer or model)
        requests = requests_from_args(tokenizer, args)
        prompts = [r.prompt_token_ids if args.prompt_format == "ids" else tokenizer.decode(r.prompt_token_ids)
                   for r in requests]
        print(f"Model: {model}; {len(requests)} requests; request rate {args.request_rate}; "
              f"max concurrency {args.max_concurrency}; {describe_sampling(sampling)}")
        test = await send_request(client, model, prompts[0], BenchRequest(requests[0].prompt_token_ids, 2), sampling)
        if not test.success:
            raise RuntimeError(f"the initial test request failed: {test.error}")
        start = time.perf_counter()
        results = await _run_all(client, model, prompts, requests, args, sampling)
        duration = time.perf_counter() - start
    result = summarise(results, duration)
    result.update(model=model, base_url=args.base_url, request_rate=args.request_rate,
                  max_concurrency=args.max_concurrency, dataset=args.dataset, sampling=sampling)
    print_report(result)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


async def _first_model(client) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def _load_tokenizer(model: str | None):
    from pagedllm.loader.resolve import resolve_model
    from pagedllm.tokenizer.tokenizer import load_tokenizer

    try:
        resolved = resolve_model(model)
    except (ValueError, FileNotFoundError):
        print(f"{model!r} does not resolve to a local model; building prompts with the embedded default's "
              "tokenizer (pass --tokenizer to choose)")
        resolved = resolve_model(None)
    return load_tokenizer(resolved.path, resolved.gguf_file)


async def _run_all(client, model: str, prompts: list, requests: list[BenchRequest], args: argparse.Namespace,
                   sampling: dict[str, float | int]) -> list[RequestResult]:
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed)

    async def one(prompt, request: BenchRequest) -> RequestResult:
        if limit is None:
            return await send_request(client, model, prompt, request, sampling)
        async with limit:
            return await send_request(client, model, prompt, request, sampling)

    tasks = []
    for prompt, request in zip(prompts, requests):
        tasks.append(asyncio.create_task(one(prompt, request)))
        if math.isfinite(args.request_rate):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    return list(await asyncio.gather(*tasks))


async def send_request(client, model: str, prompt: list[int] | str, request: BenchRequest,
                       sampling: dict[str, float | int]) -> RequestResult:
    """Stream one completion, drawn with `sampling` (see `sampling_kwargs`), and time its chunks."""
    payload = {"model": model, "prompt": prompt, "max_tokens": request.output_len, **sampling,
               "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    result = RequestResult(prompt_len=request.prompt_len)
    start = last = time.perf_counter()
    num_chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}"
                return result
            async for line in response.aiter_lines():
                chunk = _parse_sse(line)
                if chunk is None:
                    continue
                if chunk.get("usage"):
                    result.output_len = chunk["usage"].get("completion_tokens", 0)
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if num_chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last, num_chunks = now, num_chunks + 1
    except Exception as error:   # a benchmark counts failures instead of stopping at the first one
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency = time.perf_counter() - start
    result.output_len = result.output_len or num_chunks
    result.success = num_chunks > 0
    result.error = "" if result.success else "the stream held no completion chunk"
    return result


def _parse_sse(line: str) -> dict[str, Any] | None:
    """A `data: {...}` line's JSON; None for blank lines, comments and `data: [DONE]`."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    return None if data == "[DONE]" else json.loads(data)


# ---- results -----------------------------------------------------------------------------------------------------
def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    values_ms = sorted(v * 1000 for v in values_s) or [0.0]
    p99 = values_ms[min(len(values_ms) - 1, math.ceil(0.99 * len(values_ms)) - 1)]
    return {f"mean_{name}_ms": statistics.fmean(values_ms), f"median_{name}_ms": statistics.median(values_ms),
            f"std_{name}_ms": statistics.pstdev(values_ms), f"p99_{name}_ms": p99}


def summarise(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    summary = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "errors": sorted({r.error for r in results if not r.success})[:5],
    }
    summary |= _stats("ttft", [r.ttft for r in ok])
    summary |= _stats("tpot", [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1])
    summary |= _stats("itl", [gap for r in ok for gap in r.itl])
    summary |= _stats("e2el", [r.latency for r in ok])
    return summary


_SECTIONS = [("ttft", "Time to First Token", "TTFT"), ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
             ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL")]


def print_report(result: dict[str, Any]) -> None:
    """vLLM's benchmark_serving layout."""
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    for label, value in [("Successful requests:", result["completed"]), ("Failed requests:", result["failed"]),
                         ("Benchmark duration (s):", f"{result['duration']:.2f}"),
                         ("Total input tokens:", result["total_input_tokens"]),
                         ("Total generated tokens:", result["total_output_tokens"]),
                         ("Request throughput (req/s):", f"{result['request_throughput']:.2f}"),
                         ("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
                         ("Total Token throughput (tok/s):", f"{result['total_token_throughput']:.2f}")]:
        print(f"{label:<40}{value:<10}")
    for key, title, short in _SECTIONS:
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            label = f"{name} {short} (ms):"
            print(f"{label:<40}{result[f'{stat}_{key}_ms']:<10.2f}")
    print("=" * 50)
    for error in result["errors"]:
        print(f"error: {error}")
