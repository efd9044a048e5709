"""The FastAPI app: OpenAI routes, errors in OpenAI's shape, API key, body limit, disconnects, /metrics.

`build_app(engine, ...)` makes an app around an AsyncEngine; the app's lifespan starts the engine thread on the
server's event loop and stops it on shutdown. Each app has its own Prometheus registry.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import pagedllm
from pagedllm.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    now,
)
from pagedllm.entrypoints.openai.serving_base import OpenAIServing, ServerLimits, error_for
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.metrics.prometheus import PrometheusStatLogger

logger = logging.getLogger(__name__)


def build_app(engine: AsyncEngine, *, served_model_names: Sequence[str] | None = None, api_key: str | None = None,
              limits: ServerLimits | None = None) -> FastAPI:
    """An OpenAI-compatible app serving `engine`.

    Args:
        engine: an AsyncEngine not yet started; the app's lifespan starts and stops it.
        served_model_names: names accepted in `model` (default: the engine's model name).
        api_key: when set, /v1/* requires `Authorization: Bearer <api_key>`.
        limits: per-request limits (default: ServerLimits()).
    """
    names = list(served_model_names or [engine.model_name])
    limits = limits or ServerLimits()
    stat_logger = PrometheusStatLogger(names[0])
    engine.add_stat_logger(stat_logger.record)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="pagedllm", version=pagedllm.__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.registry = stat_logger.registry
    _add_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_body_bytes)
    app.include_router(_v1_router(engine, names, limits, api_key))
    app.include_router(_utility_router(engine, names, stat_logger))
    return app


# ---- routes -----------------------------------------------------------------------------------------------------
def _v1_router(engine: AsyncEngine, names: list[str], limits: ServerLimits, api_key: str | None) -> APIRouter:
    dependencies = [Depends(_api_key_check(api_key))] if api_key else []
    dependencies.append(Depends(_refuse_while_draining(engine)))
    router = APIRouter(prefix="/v1", dependencies=dependencies)
    completion = OpenAIServingCompletion(engine, names, limits)
    chat = OpenAIServingChat(engine, names, limits)

    @router.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now(), "owned_by": "pagedllm", "root": engine.model_name,
             "parent": None, "max_model_len": engine.max_model_len} for name in names]}

    @router.post("/completions")
    async def completions(body: CompletionRequest, raw_request: Request) -> Response:
        return await _respond(raw_request, completion.create(body))

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await _respond(raw_request, chat.create(body))

    return router


def _utility_router(engine: AsyncEngine, names: list[str], stat_logger: PrometheusStatLogger) -> APIRouter:
    router = APIRouter()
    base = OpenAIServing(engine, names, ServerLimits())

    @router.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            raise OpenAIError(f"the engine is not running: {engine.error!r}", 503, code="engine_dead")
        if engine.is_draining:
            raise OpenAIError("the server is shutting down", 503, code="server_shutting_down")
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagedllm.__version__}

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(stat_logger.registry), media_type=CONTENT_TYPE_LATEST)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        base.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            chat = OpenAIServingChat(engine, names, base.limits)
            tokens = chat.render(ChatCompletionRequest(messages=body.messages,
                                                       add_generation_prompt=body.add_generation_prompt))
        else:
            tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        base.check_model(body.model)
        if any(not 0 <= t < engine.vocab_size for t in body.tokens):
            raise OpenAIError(f"tokens must be in [0, {engine.vocab_size})", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    return router


def _refuse_while_draining(engine: AsyncEngine):
    async def check() -> None:
        if engine.is_draining:
            raise OpenAIError("the server is shutting down and takes no new requests", 503,
                              code="server_shutting_down")
    return check


def _api_key_check(api_key: str):
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, expected):
            raise OpenAIError("Incorrect or missing API key: send 'Authorization: Bearer <key>'.", 401,
                              code="invalid_api_key")
    return check


# ---- responses and disconnects ------------------------------------------------------------------------------------
class SSEResponse(StreamingResponse):
    """A server-sent-events stream. Starlette cancels the stream when the client disconnects; closing the body
    iterator here then aborts the engine requests behind it at once, not whenever it is garbage collected."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def _respond(raw_request: Request, work: Awaitable[dict[str, Any] | AsyncIterator[str]]) -> Response:
    """Run a handler until it answers or the client disconnects (which cancels it and so aborts its requests)."""
    result = await _cancel_on_disconnect(raw_request, work)
    if result is None:
        return Response(status_code=499)    # nobody is listening
    if isinstance(result, dict):
        return JSONResponse(result)
    return SSEResponse(result)


async def _cancel_on_disconnect(raw_request: Request, work: Awaitable) -> Any:
    """The result of `work`, or None if the client went away first (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError, Exception):
        await task
    logger.debug("client disconnected; request aborted")
    return None


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


class BodySizeLimit:
    """Pure ASGI middleware (a BaseHTTPMiddleware would break disconnect detection): 413 for a body over
    `max_bytes`, whether it declares its length or arrives chunked."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        if declared is not None:
            await self.app(scope, receive, send)
            return
        # No declared length: read the body here, up to the limit, then replay it.
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._reject(send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()
        await self.app(scope, replay, send)

    async def _reject(self, send: Send) -> None:
        error = OpenAIError(f"the request body is larger than {self.max_bytes} bytes", 413, code="request_too_large")
        body = json.dumps(error.to_dict()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


# ---- errors -------------------------------------------------------------------------------------------------------
def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.to_dict(), status_code=error.status_code)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(OpenAIError(str(exc.detail), exc.status_code))

    async def mapped_error(_: Request, exc: Exception) -> JSONResponse:
        # error_for maps each kind to its status; an unexpected Exception is a bug, not bad input, and is still
        # answered in OpenAI's shape (error_for logs its traceback).
        return _error_response(error_for(exc))

    for kind in (EngineDeadError, ValueError, RequestFailedError, Exception):
        app.add_exception_handler(kind, mapped_error)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """FastAPI's 422 as OpenAI's 400, naming the first bad field."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return OpenAIError(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                           code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if not loc:
        return OpenAIError(f"the request body is invalid: {first['msg']}")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return OpenAIError(f"{'.'.join(loc)}: {first['msg']}{more}", param=loc[0])
