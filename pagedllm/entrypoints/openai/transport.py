"""The ASGI side of the server: SSE responses, cancelling a handler when its client disconnects, and the body
size limit. Nothing here knows the OpenAI API beyond the shape of its errors."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette._utils import get_route_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.protocol import OpenAIError

logger = logging.getLogger(__name__)


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


# an SSE comment line, which clients skip (vLLM's keep-alive)
SSE_KEEP_ALIVE = ": keep-alive\n\n"


async def with_keep_alive(events: AsyncIterator[str], interval: float) -> AsyncIterator[str]:
    """`events`, with an SSE comment whenever none came for `interval` seconds (vLLM's --sse-keep-alive-interval), so
    that a proxy with a read timeout keeps the stream open through a long queue, prefill or pause between tokens.
    One task advances `events` at a time (never cancelled by a timeout); closing this closes `events`."""
    pending = asyncio.ensure_future(anext(events))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield SSE_KEEP_ALIVE
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            yield event
            pending = asyncio.ensure_future(anext(events))
    finally:
        pending.cancel()
        with suppress(BaseException):
            await pending
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


async def respond(raw_request: Request, work: Awaitable[dict[str, Any] | AsyncIterator[str]],
                  keep_alive: float = 0.0) -> Response:
    """Run a handler until it answers or the client disconnects (which cancels it and so aborts its requests); a
    stream gets a keep-alive comment after each `keep_alive` seconds without an event, if not 0."""
    result = await cancel_on_disconnect(raw_request, work)
    if result is None:
        return Response(status_code=499)    # nobody is listening
    if isinstance(result, dict):
        return JSONResponse(result)
    return SSEResponse(with_keep_alive(result, keep_alive) if keep_alive > 0 else result)


async def cancel_on_disconnect(raw_request: Request, work: Awaitable) -> Any:
    """The result of `work`, or None if the client went away first (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(raw_request))
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


async def wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


# The routes that control the engine (vLLM's development and profiler routes: server.py's _dev_router and
# _profile_router), which vLLM leaves open and pagedllm puts behind the API key.
CONTROL_PATHS = ("/sleep", "/wake_up", "/is_sleeping", "/release_kv_cache_memory", "/pause", "/resume", "/is_paused",
                 "/reset_prefix_cache", "/get_world_size", "/collective_rpc", "/start_profile", "/stop_profile")


def needs_key(scope: Scope) -> bool:
    """Whether a request runs or controls the model, and so needs the API key: vLLM checks it on /v1/*; the
    classify, score, rerank and invocations routes it serves outside /v1 run the model too, and the control
    routes (CONTROL_PATHS) change it. The path is taken less any --root-path."""
    path = get_route_path(scope)
    return path.startswith(("/v1/", "/v2/")) or path in ("/classify", "/score", "/rerank", "/invocations",
                                                         *CONTROL_PATHS)


class RequestGate:
    """Pure ASGI middleware (a BaseHTTPMiddleware would break disconnect detection) that reads each request's body
    before the app does, counting the bytes as they arrive whatever the headers declare: 413 as soon as it passes
    `max_bytes`, 400 for a request that declares both Content-Length and Transfer-Encoding (h11 would honour the
    chunked framing and read past the declared length). The app then reads the buffered body.

    With `api_keys`, a request to a path that runs or controls the model (`needs_key`) without
    `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) for one of them gets its 401 before any of
    its body is read."""

    def __init__(self, app: ASGIApp, max_bytes: int, api_keys: Sequence[str] = ()) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.api_keys = [key.encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        error = self._refusal(scope, headers)
        if error is not None:
            await send_error(send, error)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await send_error(send, self._too_large())
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()
        await self.app(scope, replay, send)

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes]) -> OpenAIError | None:
        """The error to answer before reading the body, if any: bad key, conflicting framing, declared too big."""
        if self.api_keys and needs_key(scope):
            bearer, anthropic = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
            if not any(secrets.compare_digest(bearer, b"Bearer " + key) | secrets.compare_digest(anthropic, key)
                       for key in self.api_keys):     # each comparison in constant time
                return OpenAIError("Incorrect or missing API key: send 'Authorization: Bearer <key>' (or "
                                   "'x-api-key: <key>').", 401, code="invalid_api_key")
        declared = headers.get(b"content-length")
        if declared is not None and b"transfer-encoding" in headers:
            return OpenAIError("the request declares both Content-Length and Transfer-Encoding", 400,
                               code="conflicting_framing")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> OpenAIError:
        return OpenAIError(f"the request body is larger than {self.max_bytes} bytes", 413, code="request_too_large")


class RequestIdHeader:
    """Pure ASGI middleware (--enable-request-id-headers, vLLM's): every response carries `X-Request-Id`, the
    request's own if it sent one, else a new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = dict(scope.get("headers") or []).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)
        await self.app(scope, receive, with_id)


@dataclass
class Load:
    """The requests that run the model (`needs_key`'s paths) now in the server, from their arrival to their
    response's last byte: what vLLM's /load reports."""

    count: int = 0


class ServerLoad:
    """Pure ASGI middleware (--enable-server-load-tracking) that keeps `load` (event loop only)."""

    def __init__(self, app: ASGIApp, load: Load) -> None:
        self.app, self.load = app, load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not needs_key(scope):
            await self.app(scope, receive, send)
            return
        self.load.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.count -= 1


class RootPath:
    """Pure ASGI middleware for an app served under a proxy's path prefix (--root-path): it sets the requests'
    ASGI root_path, as FastAPI's (deprecated) root_path argument did, so that a path routes with or without the
    prefix (a proxy may strip it or pass it on) and the API docs link through it."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app, self.root_path = app, root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


async def send_error(send: Send, error: OpenAIError) -> None:
    """Answer with `error` in OpenAI's shape, straight on the ASGI channel."""
    body = json.dumps(error.to_dict()).encode()
    await send({"type": "http.response.start", "status": error.status_code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
