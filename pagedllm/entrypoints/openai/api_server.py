"""Run the OpenAI-compatible server: `python -m pagedllm.entrypoints.openai.api_server --model MODEL`
(vLLM's spelling; `pagedllm serve [MODEL]` does the same)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pagedllm.entrypoints.openai.cli_args import (
    add_server_args,
    configure_logging,
    engine_config_from_args,
    with_config_file,
)
from pagedllm.heap import freeze_startup_heap, paused_gc

logger = logging.getLogger(__name__)

DESCRIPTION = ("Serve a model over an OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/responses, "
               "/v1/chat/completions (with streaming), /v1/embeddings, Anthropic's /v1/messages, vLLM's /classify, "
               "/score and /rerank, /tokenize, /detokenize, /health, /version and /metrics (Prometheus).")


def build_app_from_args(args: argparse.Namespace):
    """Load the engine the flags describe and wrap it in the app (the engine thread starts with the server)."""
    from pagedllm.engine.admission import Admission
    from pagedllm.engine.data_parallel import build_async_engine
    from pagedllm.entrypoints.openai.cli_args import lora_modules_from_args
    from pagedllm.entrypoints.openai.server import CorsPolicy, build_app

    queue_limits = (args.max_num_queued_reqs, args.max_num_queued_tokens)
    config = engine_config_from_args(args)
    engine = build_async_engine(config, log_requests=args.enable_log_requests,
                                log_stats=not args.disable_log_stats, max_log_len=args.max_log_len,
                                admission=None if queue_limits == (None, None) else Admission(*queue_limits),
                                log_outputs=args.enable_log_outputs)
    return build_app(engine, served_model_names=args.served_model_name, api_key=args.api_key,
                     limits=limits_from_args(args), enable_auto_tool_choice=args.enable_auto_tool_choice,
                     tool_call_parser=args.tool_call_parser,
                     reasoning_parser=config.structured_outputs.reasoning_parser or None,
                     cors=CorsPolicy(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                                     args.allow_credentials), lora_modules=lora_modules_from_args(args),
                     root_path=args.root_path, docs=not args.disable_fastapi_docs,
                     options=frontend_options_from_args(args), request_id_headers=args.enable_request_id_headers,
                     server_load_tracking=args.enable_server_load_tracking,
                     tokenizer_info=args.enable_tokenizer_info_endpoint, middleware=args.middleware)


def limits_from_args(args: argparse.Namespace):
    """The ServerLimits the request-limit flags describe."""
    from pagedllm.entrypoints.openai.serving_base import ServerLimits

    return ServerLimits(max_request_body_bytes=args.max_request_body_bytes, max_n=args.max_n,
                        max_stop_strings=args.max_stop_strings, max_logprobs=args.max_logprobs,
                        max_choices=args.max_choices)


def frontend_options_from_args(args: argparse.Namespace):
    """The FrontendOptions the flags describe."""
    from pagedllm.entrypoints.openai.serving_base import FrontendOptions

    return FrontendOptions(response_role=args.response_role,
                           default_chat_template_kwargs=args.default_chat_template_kwargs,
                           return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                           force_include_usage=args.enable_force_include_usage,
                           trust_request_chat_template=args.trust_request_chat_template,
                           trust_request_mm_kwargs=args.trust_request_mm_kwargs,
                           exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                           chat_template_content_format=args.chat_template_content_format,
                           sse_keep_alive_interval=args.sse_keep_alive_interval,
                           enable_per_request_metrics=args.enable_per_request_metrics)


def run_server(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.openai.graceful import GracefulServer

    configure_logging(args)
    check_http_args(args)     # before the model loads, which takes a while
    try:
        with paused_gc():
            app = build_app_from_args(args)
    except ValueError as exc:    # a bad setting (e.g. a swap file on tmpfs): say so, without a traceback
        raise SystemExit(f"error: {exc}") from exc
    freeze_startup_heap()        # the engine and the app live as long as the process: pagedllm.heap
    names = ", ".join(args.served_model_name or [app.state.engine.model_name])
    logger.info("serving %s on %s (API key %s)", names, address(args), "required" if args.api_key else "not required")
    try:
        GracefulServer(uvicorn_config(app, args), app.state.engine, args.shutdown_timeout).run()
    finally:
        # The lifespan closes the engine on a graceful stop; a forced one (a second signal) skips the lifespan.
        app.state.engine.close()


def uvicorn_config(app, args: argparse.Namespace):
    """How uvicorn serves `app` under the flags: on a TCP port or a Unix socket (--uds), HTTPS with a key and a
    certificate."""
    import uvicorn

    config = uvicorn.Config(app, host=args.host, port=args.port, uds=args.uds, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log, timeout_keep_alive=5,
                            timeout_graceful_shutdown=5, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                            ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
                            h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                            **({} if args.ssl_ciphers is None else {"ssl_ciphers": args.ssl_ciphers}))
    if args.disable_access_log_for_endpoints:    # after uvicorn configured its loggers
        logging.getLogger("uvicorn.access").addFilter(AccessLogFilter(args.disable_access_log_for_endpoints))
    return config


class AccessLogFilter(logging.Filter):
    """Drops uvicorn's access-log lines for the paths of a comma-separated list (--disable-access-log-for-endpoints);
    a path matches with any query string."""

    def __init__(self, paths: str) -> None:
        super().__init__()
        self.paths = {path.strip() for path in paths.split(",") if path.strip()}

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: args (client, method, path with its query, HTTP version, status)
        args = record.args
        return not (isinstance(args, tuple) and len(args) > 2 and str(args[2]).split("?")[0] in self.paths)


def check_http_args(args: argparse.Namespace) -> None:
    """SystemExit for HTTPS flags that cannot serve: a key without a certificate or the reverse, a file missing, a
    --root-path that is not a path."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise SystemExit("error: HTTPS needs both --ssl-keyfile and --ssl-certfile")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path is not None and not os.path.isfile(path):
            raise SystemExit(f"error: {flag} {path}: no such file")
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise SystemExit(f"error: --root-path {args.root_path!r} must start with '/' and not end with one (e.g. /llm)")


def address(args: argparse.Namespace) -> str:
    """Where the flags have the server listen, for its log: an http(s) URL, or a Unix socket's path."""
    if args.uds is not None:
        return f"the Unix socket {args.uds}"
    return f"{'https' if args.ssl_certfile else 'http'}://{args.host}:{args.port}{args.root_path}"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.entrypoints.openai.api_server",
                                     description=DESCRIPTION)
    return add_server_args(parser, positional_model=False)


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    run_server(parser.parse_args(with_config_file(sys.argv[1:] if argv is None else list(argv), parser)))


if __name__ == "__main__":
    main()
