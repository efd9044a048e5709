"""Run the OpenAI-compatible server: `python -m pagedllm.entrypoints.openai.api_server --model MODEL`
(vLLM's spelling; `pagedllm serve [MODEL]` does the same)."""

from __future__ import annotations

import argparse
import logging

from pagedllm.entrypoints.openai.cli_args import add_server_args, engine_config_from_args
from pagedllm.heap import freeze_startup_heap, paused_gc

logger = logging.getLogger(__name__)

DESCRIPTION = ("Serve a model over an OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/responses, "
               "/v1/chat/completions (with streaming), /v1/embeddings, Anthropic's /v1/messages, vLLM's /classify, "
               "/score and /rerank, /tokenize, /detokenize, /health, /version and /metrics (Prometheus).")


def build_app_from_args(args: argparse.Namespace):
    """Load the engine the flags describe and wrap it in the app (the engine thread starts with the server)."""
    from pagedllm.engine.data_parallel import build_async_engine
    from pagedllm.entrypoints.openai.cli_args import lora_modules_from_args
    from pagedllm.entrypoints.openai.server import CorsPolicy, build_app

    engine = build_async_engine(engine_config_from_args(args), log_requests=args.enable_log_requests,
                                log_stats=not args.disable_log_stats)
    return build_app(engine, served_model_names=args.served_model_name, api_key=args.api_key,
                     limits=limits_from_args(args), enable_auto_tool_choice=args.enable_auto_tool_choice,
                     tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                     cors=CorsPolicy(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                                     args.allow_credentials), lora_modules=lora_modules_from_args(args))


def limits_from_args(args: argparse.Namespace):
    """The ServerLimits the request-limit flags describe."""
    from pagedllm.entrypoints.openai.serving_base import ServerLimits

    return ServerLimits(max_request_body_bytes=args.max_request_body_bytes, max_n=args.max_n,
                        max_stop_strings=args.max_stop_strings, max_logprobs=args.max_logprobs,
                        max_choices=args.max_choices)


def run_server(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.openai.graceful import GracefulServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with paused_gc():
            app = build_app_from_args(args)
    except ValueError as exc:    # a bad setting (e.g. a swap file on tmpfs): say so, without a traceback
        raise SystemExit(f"error: {exc}") from exc
    freeze_startup_heap()        # the engine and the app live as long as the process: pagedllm.heap
    names = ", ".join(args.served_model_name or [app.state.engine.model_name])
    logger.info("serving %s on http://%s:%d (API key %s)", names, args.host, args.port,
                "required" if args.api_key else "not required")
    try:
        GracefulServer(uvicorn_config(app, args), app.state.engine, args.shutdown_timeout).run()
    finally:
        # The lifespan closes the engine on a graceful stop; a forced one (a second signal) skips the lifespan.
        app.state.engine.close()


def uvicorn_config(app, args: argparse.Namespace):
    """How uvicorn serves `app` under the flags."""
    import uvicorn

    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                          access_log=not args.disable_uvicorn_access_log, timeout_keep_alive=5,
                          timeout_graceful_shutdown=5)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.entrypoints.openai.api_server",
                                     description=DESCRIPTION)
    return add_server_args(parser, positional_model=False)


def main(argv: list[str] | None = None) -> None:
    run_server(make_parser().parse_args(argv))


if __name__ == "__main__":
    main()
