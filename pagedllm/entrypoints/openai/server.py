"""The FastAPI app: OpenAI routes, errors in OpenAI's shape, the API key, /metrics. The ASGI transport (SSE,
disconnects, the body limit) is in transport.py.

`build_app(engine, ...)` makes an app around an AsyncEngine; the app's lifespan starts the engine thread on the
server's event loop and stops it on shutdown. Each app has its own Prometheus registry.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from pagedllm.engine.data_parallel import AsyncDataParallelEngine
from pagedllm.entrypoints.openai.dashboard import dashboard_router
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CollectiveRPCRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    OpenAIError,
    RerankRequest,
    ResponsesRequest,
    ScoreRequest,
    StartProfileRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    now,
    validation_error,
)
from pagedllm.entrypoints.openai.serving_base import FrontendOptions, ServerLimits, error_for, load_lora_modules
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_messages import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    OpenAIServingMessages,
    anthropic_error,
)
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_score import OpenAIServingScore
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.entrypoints.openai.transport import (
    Load,
    RequestGate,
    RequestIdHeader,
    RootPath,
    ServerLoad,
    respond,
)
from pagedllm.logger import init_logger
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.prometheus import PrometheusStatLogger

logger = init_logger(__name__)


@dataclass(frozen=True)
class CorsPolicy:
    """Which web pages' scripts may call the server from a browser (vLLM's --allowed-origins and the rest). The
    default lets none: a page from another origin cannot read the server's answers."""

    origins: Sequence[str] = ()
    methods: Sequence[str] = ("*",)
    headers: Sequence[str] = ("*",)
    credentials: bool = False


def build_app(engine: AsyncEngine | AsyncDataParallelEngine, *, served_model_names: Sequence[str] | None = None,
              api_key: str | Sequence[str] | None = None, limits: ServerLimits | None = None,
              enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None, reasoning_parser: str | None = None,
              cors: CorsPolicy | None = None, lora_modules: Sequence[LoRARequest] = (), root_path: str = "",
              docs: bool = True, options: FrontendOptions | None = None, request_id_headers: bool = False,
              server_load_tracking: bool = False, tokenizer_info: bool = False,
              middleware: Sequence[str] = ()) -> FastAPI:
    """An OpenAI-compatible app serving `engine`.

    Args:
        engine: an AsyncEngine not yet started, or data-parallel replicas behind one (AsyncDataParallelEngine);
            the app's lifespan starts and stops it.
        served_model_names: names accepted in `model` (default: the engine's model name).
        api_key: a key, or several (vLLM's --api-key takes a list): /v1/* then requires `Authorization: Bearer
            <key>` for one of them, and /dashboard `?key=<key>`.
        limits: per-request limits (default: ServerLimits()).
        enable_auto_tool_choice: allow tool_choice "auto" (the model decides whether to call a tool).
        tool_call_parser: how the model writes tool calls (a name of TOOL_PARSERS); needed by the above.
        reasoning_parser: how the model marks its thinking (a name of REASONING_PARSERS): replies then carry it in
            `reasoning`, apart from `content`.
        cors: the origins whose pages may call the server (default: none).
        lora_modules: LoRA adapters served beside the base model, each under its `lora_name` as `model` (the engine
            needs LoRA on); each is loaded now, so that a bad one stops the start.
        root_path: the path prefix a proxy in front serves the app under (vLLM's --root-path): requests are routed
            with or without it, and the API docs link through it.
        docs: serve the API's OpenAPI schema and its pages (/openapi.json, /docs, /redoc); False: 404.
        options: how requests are answered beyond the limits (default: vLLM's defaults, `FrontendOptions`).
        request_id_headers: every response carries `X-Request-Id` (the request's own, else a new one).
        server_load_tracking: serve vLLM's /load: `{"server_load": N}`, the requests running the model now.
        tokenizer_info: serve vLLM's /tokenizer_info (the tokenizer's settings and the chat template).
        middleware: ASGI middleware to add, by import path (vLLM's --middleware): a class is added around the app,
            a coroutine function as an HTTP middleware (`@app.middleware("http")`); inside the root path, outside
            the API key check.
    """
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    names = list(served_model_names or [engine.model_name])
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    loras = load_lora_modules(engine, lora_modules, names)
    limits = limits or ServerLimits()
    stat_logger = PrometheusStatLogger(names[0], swap_space_bytes=engine.swap_space_bytes,
                                       data_parallel_size=engine.data_parallel_size,
                                       max_model_len=engine.max_model_len)
    engine.add_stat_logger(stat_logger.record)
    if getattr(engine, "admission", None) is not None:
        engine.admission.on_refusal.append(stat_logger.record_admission_rejection)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="pagedllm", version=pagedllm.__version__, lifespan=lifespan,
                  **({} if docs else {"openapi_url": None, "docs_url": None, "redoc_url": None}))
    app.state.engine = engine
    app.state.registry = stat_logger.registry
    _add_error_handlers(app)
    app.add_middleware(RequestGate, max_bytes=limits.max_request_body_bytes, api_keys=api_keys)
    load = Load()
    if server_load_tracking:
        app.add_middleware(ServerLoad, load=load)
    if request_id_headers:
        app.add_middleware(RequestIdHeader)
    if cors is not None and cors.origins:
        # outside the gate: a browser's preflight (OPTIONS, which carries no API key) is answered here
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.origins), allow_methods=list(cors.methods),
                           allow_headers=list(cors.headers), allow_credentials=cors.credentials)
    for path in middleware:
        _add_middleware(app, path)
    if root_path:
        app.add_middleware(RootPath, root_path=root_path)     # outermost: the gate checks the path less it
    chat = OpenAIServingChat(engine, names, limits, tool_call_parser if enable_auto_tool_choice else None,
                             reasoning_parser, loras, options)
    completion = OpenAIServingCompletion(engine, names, limits, loras, chat.options)
    pooling = OpenAIServingPooling(chat)
    scoring = OpenAIServingScore(pooling)
    app.include_router(_v1_router(completion, chat, pooling))
    app.include_router(_pooling_router(pooling, scoring))
    app.include_router(_invocations_router(completion, chat, pooling, scoring))
    if isinstance(engine, AsyncEngine) and runtime_lora_updating():    # loading answers 400 with LoRA off
        app.include_router(_lora_router(engine, chat))
    app.include_router(_utility_router(OpenAIServingTokenization(chat), stat_logger,
                                       load if server_load_tracking else None, tokenizer_info))
    app.include_router(dashboard_router(engine, api_keys))
    if server_dev_mode():
        app.include_router(_dev_router(engine))
    if engine.profiles:
        app.include_router(_profile_router(engine))
    return app


# ---- routes -----------------------------------------------------------------------------------------------------
def _invocations_router(completion: OpenAIServingCompletion, chat: OpenAIServingChat, pooling: OpenAIServingPooling,
                        scoring: OpenAIServingScore) -> APIRouter:
    """SageMaker's /invocations, as vLLM serves it: one route that answers a body as the API whose fields it has
    (behind the API key, unlike vLLM's)."""
    router = APIRouter(dependencies=[Depends(_refuse_while_draining(chat.engine))])
    apis: list[tuple[str, type[BaseModel], Callable[[Any], Any]]] = [
        ("messages", ChatCompletionRequest, chat.create), ("prompt", CompletionRequest, completion.create),
        ("input", EmbeddingRequest, pooling.embeddings), ("documents", RerankRequest, scoring.rerank),
        ("text_1", ScoreRequest, scoring.score)]

    @router.post("/invocations")
    async def invocations(body: dict[str, Any], raw_request: Request) -> Response:
        for field, request_type, create in apis:
            if field in body:
                try:
                    request = request_type.model_validate(body)
                except ValidationError as exc:
                    raise RequestValidationError(exc.errors()) from None
                return await respond(raw_request, create(request), chat.options.sse_keep_alive_interval)
        raise OpenAIError("/invocations answers a body by its fields: messages (chat completions), prompt "
                          "(completions), input (embeddings), query and documents (rerank), text_1 and text_2 "
                          "(score); this one has none of them", 400)

    return router



def _v1_router(completion: OpenAIServingCompletion, chat: OpenAIServingChat,
               pooling: OpenAIServingPooling) -> APIRouter:
    """/v1/*. The API key is checked by RequestGate, before the body is read."""
    engine, names = chat.engine, chat.served_model_names
    responses_api = OpenAIServingResponses(chat)
    messages_api = OpenAIServingMessages(chat)
    keep_alive = chat.options.sse_keep_alive_interval
    router = APIRouter(prefix="/v1", dependencies=[Depends(_refuse_while_draining(engine))])

    def card(name: str, root: str, parent: str | None) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": now(), "owned_by": "pagedllm", "root": root,
                "parent": parent, "max_model_len": engine.max_model_len}

    def cards() -> dict[str, tuple[str, str, str | None]]:
        """The base model's names, then each LoRA adapter's (vLLM's cards: its folder as root, its base as
        parent), as served now."""
        return {name: (name, engine.model_name, None) for name in names} | {
            lora.lora_name: (lora.lora_name, lora.lora_path, lora.base_model_name or names[0])
            for lora in chat.lora_modules}

    @router.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card(*fields) for fields in cards().values()]}

    @router.get("/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        """OpenAI's retrieve (`client.models.retrieve`): one served name's card, or 404."""
        served = cards()
        if name not in served:
            raise OpenAIError(f"The model `{name}` does not exist. This server serves {', '.join(served)}.", 404,
                              param="model", code="model_not_found")
        return card(*served[name])

    @router.post("/completions")
    async def completions(body: CompletionRequest, raw_request: Request) -> Response:
        return await respond(raw_request, completion.create(body), keep_alive)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await respond(raw_request, chat.create(body), keep_alive)

    @router.post("/responses")
    async def responses(body: ResponsesRequest, raw_request: Request) -> Response:
        return await respond(raw_request, responses_api.create(body), keep_alive)

    @router.get("/responses/{response_id}")
    async def stored_response(response_id: str) -> dict[str, Any]:
        """OpenAI's retrieve (`client.responses.retrieve`): a response stored with `store` (the default)."""
        return responses_api.retrieve(response_id)

    @router.get("/responses/{response_id}/input_items")
    async def stored_response_input_items(response_id: str, limit: int = 20, order: str = "desc",
                                          after: str | None = None, before: str | None = None) -> dict[str, Any]:
        """OpenAI's input items list (`client.responses.input_items.list`): a stored response's input, paged."""
        return responses_api.input_items(response_id, limit, order, after, before)

    @router.delete("/responses/{response_id}")
    async def delete_stored_response(response_id: str) -> dict[str, Any]:
        """OpenAI's delete (`client.responses.delete`): the response is forgotten, and can no longer be continued."""
        return await responses_api.delete(response_id)

    @router.post("/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict[str, Any]:
        """OpenAI's cancel (`client.responses.cancel`): a background response stops, "cancelled"."""
        return await responses_api.cancel(response_id)

    @router.post("/messages")
    async def messages(body: AnthropicMessagesRequest, raw_request: Request) -> Response:
        """Anthropic's Messages API (`anthropic.Anthropic(base_url=...).messages.create`), as vLLM serves it."""
        return await respond(raw_request, messages_api.create(body), keep_alive)

    @router.post("/messages/count_tokens")
    async def count_message_tokens(body: AnthropicCountTokensRequest) -> dict[str, int]:
        return await messages_api.count_tokens(body)

    @router.post("/embeddings")
    async def embeddings(body: EmbeddingRequest, raw_request: Request) -> Response:
        return await respond(raw_request, pooling.embeddings(body))

    return router


def _pooling_router(pooling: OpenAIServingPooling, scoring: OpenAIServingScore) -> APIRouter:
    """vLLM's classify, score and rerank routes, at the root as vLLM puts them (they are not OpenAI's), and at the
    /v1 and /v2 paths its clients also call."""
    router = APIRouter(dependencies=[Depends(_refuse_while_draining(scoring.engine))])

    @router.post("/classify")
    @router.post("/v1/classify")
    async def classify(body: ClassificationRequest, raw_request: Request) -> Response:
        return await respond(raw_request, pooling.classify(body))

    @router.post("/score")
    @router.post("/v1/score")
    async def score(body: ScoreRequest, raw_request: Request) -> Response:
        return await respond(raw_request, scoring.score(body))

    @router.post("/rerank")
    @router.post("/v1/rerank")
    @router.post("/v2/rerank")
    async def rerank(body: RerankRequest, raw_request: Request) -> Response:
        return await respond(raw_request, scoring.rerank(body))

    return router


RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def _env_switch(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true")


def runtime_lora_updating() -> bool:
    """vLLM's switch for loading and unloading LoRA adapters while the server runs: $VLLM_ALLOW_RUNTIME_LORA_UPDATING
    set to true or 1."""
    return _env_switch(RUNTIME_LORA_ENV)


def server_dev_mode() -> bool:
    """vLLM's switch for the development endpoints (sleep mode, cache reset, collective_rpc): $VLLM_SERVER_DEV_MODE
    set to true or 1."""
    return _env_switch(DEV_MODE_ENV)


SleepMode = Literal["abort", "wait", "keep"]


def _dev_router(engine: AsyncEngine | AsyncDataParallelEngine) -> APIRouter:
    """vLLM's development endpoints, served with VLLM_SERVER_DEV_MODE=1 (behind the API key, unlike vLLM's):
    sleep mode (/sleep, /wake_up, /is_sleeping, /release_kv_cache_memory), its level 0 as the RL loop's /pause,
    /resume and /is_paused, /reset_prefix_cache, /get_world_size, and /collective_rpc by method name. Each runs on
    the engine thread between two steps (on every replica)."""
    router = APIRouter()

    async def control(call: Callable[[], Any]) -> Any:
        try:
            return await call()
        except ValueError as exc:
            raise OpenAIError(str(exc)) from exc

    @router.post("/sleep")
    async def sleep(level: Annotated[int, Query(ge=0, le=2)] = 1, mode: SleepMode = "abort") -> dict[str, Any]:
        await control(lambda: engine.sleep(level, mode))
        return {"status": "sleeping", "level": level}

    @router.post("/wake_up")
    async def wake_up(request: Request) -> dict[str, Any]:
        tags = request.query_params.getlist("tags") or None
        awake = await control(lambda: engine.wake_up(tags))
        return {"status": "awake" if awake else "sleeping", "tags": tags}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": engine.is_sleeping()}

    @router.post("/release_kv_cache_memory")
    async def release_kv_cache_memory() -> dict[str, str]:
        try:
            await engine.release_kv_cache_memory()
        except RuntimeError as exc:     # not paused first
            raise OpenAIError(str(exc)) from exc
        return {"status": "kv_cache_released"}

    @router.post("/pause")
    async def pause(mode: SleepMode = "abort", clear_cache: bool = True) -> dict[str, str]:
        await control(lambda: engine.pause_generation(mode, clear_cache))
        return {"status": "paused"}

    @router.post("/resume")
    async def resume() -> dict[str, str]:
        await engine.wake_up(["scheduling"])
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": engine.is_sleeping()}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False
                                 ) -> dict[str, bool]:
        del reset_external      # vLLM's external KV connector's: pagedllm has none
        return {"success": await engine.reset_prefix_cache(reset_running_requests)}

    @router.get("/get_world_size")
    async def get_world_size(include_dp: bool = True) -> dict[str, int]:
        return {"world_size": engine.tensor_parallel_size * (engine.data_parallel_size if include_dp else 1)}

    @router.post("/collective_rpc")
    async def collective_rpc(body: CollectiveRPCRequest) -> dict[str, list]:
        try:
            results = await engine.collective_rpc(body.method, body.timeout, tuple(body.args), body.kwargs)
        except (AttributeError, TypeError) as exc:     # no such method, or not its arguments
            raise OpenAIError(f"collective_rpc {body.method!r}: {exc}", param="method") from exc
        except (RuntimeError, TimeoutError) as exc:     # it failed, or gave no result in time, on some rank
            raise OpenAIError(f"collective_rpc {body.method!r}: {exc}", 500) from exc
        return {"results": [r if r is None or isinstance(r, dict | list) else str(r) for r in results]}

    return router


def _lora_router(engine: AsyncEngine, chat: OpenAIServingChat) -> APIRouter:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: the adapter is loaded (or dropped) on the engine
    thread between two steps; requests already running with an unloaded adapter finish with it."""
    router = APIRouter(prefix="/v1", dependencies=[Depends(_refuse_while_draining(engine))])
    loras, names = chat.lora_modules, chat.served_model_names

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        if loras.get(body.lora_name) is not None or body.lora_name in names:
            raise OpenAIError(f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name")
        lora = loras.new(body.lora_name, body.lora_path)
        await engine.call_in_engine(lambda llm_engine: llm_engine.add_lora(lora))
        loras.add(lora)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        lora = loras.remove(body.lora_name)
        if lora is None:
            raise OpenAIError(f"The lora adapter '{body.lora_name}' cannot be found.", 404, "lora_name",
                              "model_not_found")
        await engine.call_in_engine(lambda llm_engine: llm_engine.remove_lora(lora.lora_int_id))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router


def _profile_router(engine: AsyncEngine | AsyncDataParallelEngine) -> APIRouter:
    """vLLM's /start_profile (an optional body: `profile_prefix`, `delay_iterations`, `max_iterations`) and
    /stop_profile, served when the engine has a profiler (--profiler-config)."""
    router = APIRouter()
    logger.warning("the profiler's /start_profile and /stop_profile are served: for local development only")

    @router.post("/start_profile")
    async def start_profile(body: StartProfileRequest | None = None) -> Response:
        body = body or StartProfileRequest()
        try:
            await engine.start_profile(body.profile_prefix, body.delay_iterations, body.max_iterations)
        except ValueError as exc:
            raise OpenAIError(str(exc)) from exc
        return Response(status_code=200)

    @router.post("/stop_profile")
    async def stop_profile() -> Response:
        await engine.stop_profile()
        return Response(status_code=200)

    return router


def _add_middleware(app: FastAPI, path: str) -> None:
    """--middleware PATH: the class or coroutine function at import path `module.name`, added to `app`."""
    module_name, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"--middleware {path!r}: {exc}") from exc
    if inspect.isclass(found):
        app.add_middleware(found)
    elif inspect.iscoroutinefunction(found):
        app.middleware("http")(found)
    else:
        raise ValueError(f"--middleware {path!r} is neither a class nor a coroutine function")


def _utility_router(tokenization: OpenAIServingTokenization, stat_logger: PrometheusStatLogger,
                    load: Load | None, tokenizer_info: bool) -> APIRouter:
    """/health, /version, /metrics, /tokenize, /detokenize; /load where the server tracks its `load`,
    /tokenizer_info where it is asked to serve it."""
    engine = tokenization.engine
    router = APIRouter()
    if tokenizer_info:
        @router.get("/tokenizer_info")
        async def get_tokenizer_info() -> dict[str, Any]:
            return tokenization.tokenizer_info()
    if load is not None:
        @router.get("/load")
        async def server_load() -> dict[str, int]:
            return {"server_load": load.count}

    @router.get("/health")
    @router.get("/ping")            # vLLM's (and SageMaker's) name for the same check, GET or POST
    @router.post("/ping")
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
        return await tokenization.tokenize(body)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        return await tokenization.detokenize(body)

    return router


def _refuse_while_draining(engine: AsyncEngine):
    async def check() -> None:
        if engine.is_draining:
            raise OpenAIError("the server is shutting down and takes no new requests", 503,
                              code="server_shutting_down")
    return check


# ---- errors -------------------------------------------------------------------------------------------------------
def _error_response(request: Request, error: OpenAIError) -> JSONResponse:
    """OpenAI's error shape, or Anthropic's for Anthropic's Messages API (/v1/messages*)."""
    body = anthropic_error(error) if request.url.path.startswith("/v1/messages") else error.to_dict()
    return JSONResponse(body, status_code=error.status_code)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(request, validation_error(exc.errors()))  # FastAPI's 422 as OpenAI's 400

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(request, OpenAIError(str(exc.detail), exc.status_code))

    async def mapped_error(request: Request, exc: Exception) -> JSONResponse:
        # error_for maps each kind to its status; an unexpected Exception is a bug, not bad input, and is still
        # answered in the API's error shape (error_for logs its traceback).
        return _error_response(request, error_for(exc))

    for kind in (EngineDeadError, ValueError, RequestFailedError, Exception):
        app.add_exception_handler(kind, mapped_error)

