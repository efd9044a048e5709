"""`pagedllm run-batch -i requests.jsonl -o results.jsonl [--model MODEL] [flags]` (vLLM's `vllm run-batch`): a
file of requests in OpenAI's batch format, answered by the server's own /v1/chat/completions, /v1/completions,
/v1/responses and /v1/embeddings, and vLLM's /v1/classify, /v1/score and /v1/rerank (the same validation, defaults
and response bodies) without HTTP, all in one engine's continuous batches.

Input, a JSON object a line (blank lines are skipped):
    {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...], ...}}
Output, a line for each request, in the input's order (written as soon as the lines before it are):
    {"id": "batch_req_...", "custom_id": "request-1",
     "response": {"status_code": 200, "request_id": "chatcmpl-...", "body": {...the response...}}, "error": null}
A request the endpoint refuses gets its status and OpenAI error body in `response`, as over HTTP; a line that is no
request (not JSON, no custom_id, another method or url, `stream` true) gets `"response": null` and `"error":
{"code", "message"}`. Every line gets its answer: none stops the others.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Literal, TextIO

from pydantic import BaseModel, ConfigDict, ValidationError

from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.data_parallel import AsyncDataParallelEngine
from pagedllm.entrypoints.openai.cli_args import RUN_BATCH_DESCRIPTION, add_run_batch_args, with_config_file
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    EmbeddingRequest,
    OpenAIError,
    RerankRequest,
    ResponsesRequest,
    ScoreRequest,
    random_id,
    validation_error,
)
from pagedllm.entrypoints.openai.serving_base import (
    FrontendOptions,
    LoRAModules,
    ServerLimits,
    error_for,
    load_lora_modules,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_score import OpenAIServingScore

logger = logging.getLogger(__name__)


class BatchLine(BaseModel):
    """One line of the input file."""

    model_config = ConfigDict(extra="ignore")

    custom_id: str
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


@dataclass
class BatchCounts:
    succeeded: int = 0
    failed: int = 0
    failed_lines: list[str] = field(default_factory=list)   # the first few ("line N (custom_id)"), for the summary


Endpoint = tuple[type[BaseModel], Callable[[Any], Awaitable[Any]]]


def _in_the_batch(create: Callable[[ResponsesRequest], Awaitable[Any]]) -> Callable[[ResponsesRequest], Awaitable[Any]]:
    """The Responses API for a batch line: answered in the batch's output, so not in the background."""
    async def answer(request: ResponsesRequest) -> Any:
        if request.background:
            raise OpenAIError("a batch answers each line in its output file: background is not taken here",
                              param="background")
        return await create(request)
    return answer


async def run_batch(engine: AsyncEngine | AsyncDataParallelEngine, lines: Iterable[str], write: Callable[[str], None],
                    *, max_in_flight: int, served_model_names: list[str] | None = None,
                    limits: ServerLimits | None = None, tool_call_parser: str | None = None,
                    reasoning_parser: str | None = None, lora_modules: LoRAModules | None = None,
                    options: FrontendOptions | None = None) -> BatchCounts:
    """Answer every request of `lines` through the started `engine`, at most `max_in_flight` at once; `write` gets
    each output line (with its newline), in the input's order. `lora_modules`: adapters served by name, loaded
    (`load_lora_modules`) before the engine started; `options` as the server's (`FrontendOptions`)."""
    names = list(served_model_names or [engine.model_name])
    limits = limits or ServerLimits()
    chat = OpenAIServingChat(engine, names, limits, tool_call_parser, reasoning_parser, lora_modules, options)
    pooling = OpenAIServingPooling(chat)
    scoring = OpenAIServingScore(pooling)
    endpoints: dict[str, Endpoint] = {
        "/v1/chat/completions": (ChatCompletionRequest, chat.create),
        "/v1/completions": (CompletionRequest,
                            OpenAIServingCompletion(engine, names, limits, chat.lora_modules, chat.options).create),
        "/v1/responses": (ResponsesRequest, _in_the_batch(OpenAIServingResponses(chat).create)),
        "/v1/embeddings": (EmbeddingRequest, pooling.embeddings),
        "/v1/classify": (ClassificationRequest, pooling.classify),
        "/v1/score": (ScoreRequest, scoring.score),
        "/v1/rerank": (RerankRequest, scoring.rerank),
    }
    counts = BatchCounts()
    done: dict[int, tuple[int, dict[str, Any]]] = {}    # answered, waiting for the requests before them
    next_to_write = 0
    slots = asyncio.Semaphore(max_in_flight)

    async def answer(index: int, line_number: int, line: str) -> None:
        nonlocal next_to_write
        try:
            done[index] = line_number, await _answer(line, endpoints)
        finally:
            slots.release()
        while next_to_write in done:
            line_number, output = done.pop(next_to_write)
            response = output["response"]
            if response is not None and response["status_code"] == 200:
                counts.succeeded += 1
            else:
                counts.failed += 1
                if len(counts.failed_lines) < 5:
                    counts.failed_lines.append(f"line {line_number} ({output['custom_id']})")
            write(json.dumps(output, ensure_ascii=False) + "\n")
            next_to_write += 1

    tasks = []
    requests = ((number, line) for number, line in enumerate(lines, 1) if line.strip())
    for index, (line_number, line) in enumerate(requests):
        await slots.acquire()
        tasks.append(asyncio.create_task(answer(index, line_number, line)))
    await asyncio.gather(*tasks)
    return counts


async def _answer(line: str, endpoints: dict[str, Endpoint]) -> dict[str, Any]:
    """The output line of one input line."""
    try:
        request = BatchLine.model_validate_json(line)
    except ValidationError as exc:
        return _not_a_request(_custom_id_of(line), "invalid_request", validation_error(exc.errors()).message)
    if request.url not in endpoints:
        return _not_a_request(request.custom_id, "invalid_url",
                              f"url {request.url!r} is not one of {', '.join(sorted(endpoints))}")
    schema, create = endpoints[request.url]
    try:
        body = schema.model_validate(request.body)
        if getattr(body, "stream", False):
            return _not_a_request(request.custom_id, "invalid_request", "stream is not available in a batch")
        response = await create(body)
    except ValidationError as exc:
        error = validation_error(exc.errors())
    except Exception as exc:  # noqa: BLE001 - every request gets its answer, as the server's handlers give it
        error = error_for(exc)
    else:
        return _output(request.custom_id, {"status_code": 200, "request_id": response["id"], "body": response})
    return _output(request.custom_id, {"status_code": error.status_code, "request_id": random_id("batch"),
                                       "body": error.to_dict()})


def _custom_id_of(line: str) -> str | None:
    try:
        custom_id = json.loads(line).get("custom_id")
    except (ValueError, AttributeError):
        return None
    return custom_id if isinstance(custom_id, str) else None


def _output(custom_id: str | None, response: dict[str, Any] | None,
            error: dict[str, str] | None = None) -> dict[str, Any]:
    return {"id": random_id("batch_req"), "custom_id": custom_id, "response": response, "error": error}


def _not_a_request(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    return _output(custom_id, None, {"code": code, "message": message})


# ---- the command (its flags: cli_args.add_run_batch_args) -------------------------------------------------------
def make_parser() -> argparse.ArgumentParser:
    """`python -m pagedllm.entrypoints.openai.run_batch` (vLLM's spelling of `pagedllm run-batch`)."""
    return add_run_batch_args(argparse.ArgumentParser(prog="python -m pagedllm.entrypoints.openai.run_batch",
                                                      description=RUN_BATCH_DESCRIPTION))


def main(args: argparse.Namespace) -> None:
    from pagedllm.engine.data_parallel import build_async_engine
    from pagedllm.entrypoints.openai.api_server import frontend_options_from_args, limits_from_args
    from pagedllm.entrypoints.openai.cli_args import configure_logging, engine_config_from_args, lora_modules_from_args

    configure_logging(args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("error: --enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    with ExitStack() as files:
        source = sys.stdin if args.input_file == "-" else files.enter_context(open(args.input_file, encoding="utf-8"))
        sink = sys.stdout if args.output_file == "-" else files.enter_context(
            open(args.output_file, "w", encoding="utf-8"))
        try:
            config = engine_config_from_args(args)
            engine = build_async_engine(config, log_requests=args.enable_log_requests,
                                        log_stats=not args.disable_log_stats, max_log_len=args.max_log_len,
                                        log_outputs=args.enable_log_outputs)
            lora_modules = load_lora_modules(engine, lora_modules_from_args(args),
                                             args.served_model_name or [engine.model_name])
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from exc
        counts = asyncio.run(_run(engine, source, sink, 2 * config.scheduler.max_num_seqs, args,
                                  limits_from_args(args), lora_modules, frontend_options_from_args(args),
                                  config.structured_outputs.reasoning_parser or None))
    more = ", ..." if counts.failed > len(counts.failed_lines) else ""
    logger.info("batch done: %d requests answered, %d failed%s", counts.succeeded, counts.failed,
                f": {', '.join(counts.failed_lines)}{more}" if counts.failed else "")


async def _run(engine: AsyncEngine | AsyncDataParallelEngine, source: TextIO, sink: TextIO, max_in_flight: int,
               args: argparse.Namespace, limits: ServerLimits, lora_modules: LoRAModules,
               options: FrontendOptions, reasoning_parser: str | None) -> BatchCounts:
    engine.start(asyncio.get_running_loop())
    try:
        return await run_batch(engine, source, lambda text: (sink.write(text), sink.flush()),
                               max_in_flight=max_in_flight, served_model_names=args.served_model_name,
                               limits=limits,
                               tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                               reasoning_parser=reasoning_parser, lora_modules=lora_modules, options=options)
    finally:
        await asyncio.to_thread(engine.shutdown)


if __name__ == "__main__":
    batch_parser = make_parser()
    main(batch_parser.parse_args(with_config_file(sys.argv[1:], batch_parser)))
