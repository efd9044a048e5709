"""How the server listens, under vLLM's flags, each served by uvicorn as `serve` configures it: HTTPS
(--ssl-keyfile, --ssl-certfile; client certificates with --ssl-ca-certs and --ssl-cert-reqs), a Unix socket (--uds),
a proxy's path prefix (--root-path, the API key still checked behind it), no API docs (--disable-fastapi-docs),
several API keys, X-Request-Id headers, /load, prompts logged no longer than --max-log-len, access-log lines left
out. Flags that cannot serve stop the start before the model loads."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import trustme
import uvicorn

from pagedllm.entrypoints.openai.api_server import (
    AccessLogFilter,
    address,
    build_app_from_args,
    check_http_args,
    make_parser,
    uvicorn_config,
)
from pagedllm.entrypoints.openai.cli_args import configure_logging
from pagedllm.entrypoints.openai.transport import Load, ServerLoad
from pagedllm.tokenizer.tokenizer import load_tokenizer
from tests.models.tiny import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("http-flags") / "llama")[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def _serving(model_dir: Path, *flags: str) -> Iterator[object]:
    """`serve`'s app and uvicorn config for the flags (a tiny model, a free port), running in a thread."""
    args = make_parser().parse_args(["--model", str(model_dir), "--dtype", "float32", "--kv-cache-memory", "4MiB",
                                     "--port", str(_free_port()), "--uvicorn-log-level", "warning", *flags])
    check_http_args(args)
    server = uvicorn.Server(uvicorn_config(build_app_from_args(args), args))
    thread = threading.Thread(target=server.run, daemon=True, name="test-uvicorn")
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield args
    finally:
        server.should_exit = True
        thread.join(30)


def test_https_with_a_certificate_and_client_certificates(model_dir: Path, tmp_path: Path) -> None:
    ca = trustme.CA()
    served = ca.issue_cert("127.0.0.1")
    key, cert, ca_file = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "ca.pem"
    served.private_key_pem.write_to_path(str(key))
    served.cert_chain_pems[0].write_to_path(str(cert))
    ca.cert_pem.write_to_path(str(ca_file))
    with _serving(model_dir, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)) as args:
        url = address(args)
        assert url.startswith("https://127.0.0.1:")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                               http_client=httpx.Client(verify=ssl.create_default_context(cafile=str(ca_file))))
        completion = client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=3,
                                               extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 3
        with pytest.raises(httpx.HTTPError):           # plain HTTP on the HTTPS port gets no answer
            httpx.get(url.replace("https", "http") + "/health", timeout=5)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):   # nor a client that checks
            httpx.get(f"{url}/health", timeout=5)
    # client certificates required: one the CA signed gets in, none does not
    with _serving(model_dir, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--ssl-ca-certs", str(ca_file),
                  "--ssl-cert-reqs", "2") as args:
        trusted = ssl.create_default_context(cafile=str(ca_file))
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{address(args)}/health", verify=trusted, timeout=5)
        ca.issue_cert("client@example.com").configure_cert(trusted)
        assert httpx.get(f"{address(args)}/health", verify=trusted, timeout=5).status_code == 200


class StampMiddleware:
    """An ASGI middleware class, as --middleware takes one: stamps every response."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        async def stamped(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-stamp", b"class")]
            await send(message)

        await self.app(scope, receive, send if scope["type"] != "http" else stamped)


async def timing_middleware(request, call_next):
    """An HTTP middleware coroutine function, as --middleware takes one."""
    response = await call_next(request)
    response.headers["x-timed"] = "yes"
    return response


def test_middleware_by_import_path_the_tokenizer_info_endpoint_and_ciphers(model_dir: Path) -> None:
    here = __name__
    with _serving(model_dir, "--middleware", f"{here}.StampMiddleware", "--middleware", f"{here}.timing_middleware",
                  "--enable-tokenizer-info-endpoint", "--api-key", "k") as args:
        url = address(args)
        refused = httpx.get(f"{url}/v1/models", timeout=5)     # outside the key check: stamped all the same
        assert refused.status_code == 401 and refused.headers["x-stamp"] == "class"
        info = httpx.get(f"{url}/tokenizer_info", timeout=5)
        assert info.status_code == 200 and (info.headers["x-stamp"], info.headers["x-timed"]) == ("class", "yes")
        tokenizer = load_tokenizer(str(model_dir))
        assert info.json()["tokenizer_class"] == type(tokenizer).__name__ and "vocab_file" not in info.json()
        assert info.json()["model_max_length"] == tokenizer.init_kwargs["model_max_length"]
    with _serving(model_dir) as args:
        assert httpx.get(f"{address(args)}/tokenizer_info", timeout=5).status_code == 404    # not asked for
    with pytest.raises(ValueError, match="--middleware 'no.such.Thing'"):
        build_app_from_args(make_parser().parse_args(["--model", str(model_dir), "--kv-cache-memory", "4MiB",
                                                      "--middleware", "no.such.Thing"]))
    args = make_parser().parse_args(["--ssl-ciphers", "ECDHE+AESGCM"])
    assert uvicorn_config(object(), args).ssl_ciphers == "ECDHE+AESGCM"


def test_a_unix_socket(model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "pagedllm.sock"
    with _serving(model_dir, "--uds", str(path)) as args:
        assert address(args) == f"the Unix socket {path}"
        client = httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://localhost")
        models = client.get("/v1/models").json()["data"]
        reply = client.post("/v1/completions", json={"model": models[0]["id"], "prompt": "hi", "max_tokens": 2,
                                                     "ignore_eos": True}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def test_a_root_path_routes_with_or_without_it_and_keeps_the_key(model_dir: Path) -> None:
    with _serving(model_dir, "--root-path", "/llm", "--api-key", "sesame", "--disable-fastapi-docs") as args:
        base = address(args).removesuffix("/llm")
        assert address(args).endswith("/llm")
        key = {"Authorization": "Bearer sesame"}
        for prefix in ("/llm", ""):      # a proxy that strips the prefix, and one that passes it on
            assert httpx.get(f"{base}{prefix}/v1/models", timeout=5).status_code == 401, prefix
            assert httpx.get(f"{base}{prefix}/v1/models", headers=key, timeout=5).status_code == 200, prefix
            assert httpx.get(f"{base}{prefix}/health", timeout=5).status_code == 200, prefix
        for page in ("/openapi.json", "/docs", "/redoc"):
            assert httpx.get(f"{base}{page}", timeout=5).status_code == 404, page
    with _serving(model_dir, "--root-path", "/llm") as args:
        base = address(args).removesuffix("/llm")
        schema = httpx.get(f"{base}/openapi.json", timeout=5).json()
        assert schema["servers"] == [{"url": "/llm"}] and "/v1/chat/completions" in schema["paths"]
        assert httpx.get(f"{base}/llm/docs", timeout=5).status_code == 200


@pytest.mark.parametrize(("flags", "error"), [
    (("--ssl-keyfile", "key.pem"), "needs both --ssl-keyfile and --ssl-certfile"),
    (("--ssl-keyfile", "/nonexistent/key.pem", "--ssl-certfile", "/nonexistent/cert.pem"), "no such file"),
    (("--root-path", "llm"), "must start with '/'"),
    (("--root-path", "/llm/"), "must start with '/'"),
])
def test_flags_that_cannot_serve_stop_the_start(flags: tuple[str, ...], error: str) -> None:
    with pytest.raises(SystemExit, match=error):
        check_http_args(make_parser().parse_args(list(flags)))


def test_several_api_keys_each_open_the_api(model_dir: Path) -> None:
    with _serving(model_dir, "--api-key", "first", "second") as args:
        url = address(args)
        for key, status in (("first", 200), ("second", 200), ("third", 401), ("firstsecond", 401)):
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"},
                             timeout=5).status_code == status, key
        assert httpx.get(f"{url}/v1/models", headers={"x-api-key": "second"}, timeout=5).status_code == 200
        assert httpx.post(f"{url}/invocations", json={"prompt": "hi"}, timeout=5).status_code == 401
        assert httpx.get(f"{url}/dashboard?key=second", timeout=5).status_code == 200
        assert httpx.get(f"{url}/dashboard?key=third", timeout=5).status_code == 401


def test_request_id_headers_and_the_server_load(model_dir: Path) -> None:
    with _serving(model_dir) as args:
        plain = httpx.get(f"{address(args)}/health", headers={"X-Request-Id": "abc"}, timeout=5)
        assert "x-request-id" not in plain.headers
        assert httpx.get(f"{address(args)}/load", timeout=5).status_code == 404
    with _serving(model_dir, "--enable-request-id-headers", "--enable-server-load-tracking") as args:
        url = address(args)
        assert httpx.get(f"{url}/health", headers={"X-Request-Id": "abc"}, timeout=5).headers["x-request-id"] == "abc"
        made = {httpx.get(f"{url}/health", timeout=5).headers["x-request-id"] for _ in range(2)}
        assert len(made) == 2 and all(len(request_id) == 32 for request_id in made)
        model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": model, "prompt": "hi", "max_tokens": 8, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as streaming:
            assert streaming.headers["x-request-id"] and len(list(streaming.iter_lines())) > 8
        assert httpx.get(f"{url}/load", timeout=5).json() == {"server_load": 0}     # each counted out again


def test_the_server_load_counts_model_requests_until_their_last_byte() -> None:
    load, gate = Load(), asyncio.Event()

    async def app(scope, receive, send) -> None:     # answers once the test opens the gate
        await gate.wait()

    async def main() -> list[int]:
        tracked = ServerLoad(app, load)
        requests = [asyncio.create_task(tracked({"type": "http", "path": path}, None, None))
                    for path in ("/v1/completions", "/v1/chat/completions", "/score", "/health", "/metrics")]
        await asyncio.sleep(0.01)
        seen = [load.count]
        gate.set()
        await asyncio.gather(*requests)
        return [*seen, load.count]
    assert asyncio.run(main()) == [3, 0]


def test_prompts_and_outputs_logged_no_longer_than_max_log_len(model_dir: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.async_engine"), \
            _serving(model_dir, "--enable-log-requests", "--enable-log-outputs", "--max-log-len", "12") as args:
        url = address(args)
        model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": model, "prompt": "abcdefghijklmnopqrstuvwxyz", "max_tokens": 1}
        httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()
        streamed = {**body, "max_tokens": 3, "n": 2, "stream": True, "ignore_eos": True, "prompt": "a"}
        chunks = httpx.post(f"{url}/v1/completions", json=streamed, timeout=60).text.splitlines()
    logged = [r.getMessage() for r in caplog.records if "prompt=" in r.getMessage()]
    assert len(logged) == 2, logged
    shown = re.search(r"prompt=(.*)\.\.\. \((\d+) more characters\) params=", logged[0])    # its token ids, clipped
    assert shown is not None and len(shown.group(1)) == 12 and int(shown.group(2)) > 50, logged
    outputs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("response ")]
    assert len(outputs) == 3 and all("finish_reason=length" in line for line in outputs), outputs   # 1 + n=2
    texts = {0: "", 1: ""}      # the stream's deltas, gathered, are what the log shows of each completion
    for line in chunks:
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            texts[choice["index"]] += choice["text"]
    for index, text in texts.items():
        assert any(f"(completion {index}): output={repr(text)[:12]}" in line for line in outputs[1:]), (texts, outputs)


def test_log_outputs_needs_log_requests() -> None:
    with pytest.raises(SystemExit, match="--enable-log-outputs needs --enable-log-requests"):
        configure_logging(make_parser().parse_args(["--enable-log-outputs"]))


def test_access_log_lines_dropped_for_the_named_paths() -> None:
    quiet = AccessLogFilter("/health, /metrics")

    def line(path: str) -> logging.LogRecord:    # as uvicorn's access logger makes them
        return logging.LogRecord("uvicorn.access", logging.INFO, "h11_impl.py", 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", "GET", path, "1.1", 200), None)
    assert [quiet.filter(line(p)) for p in ("/health", "/metrics?x=1", "/v1/models", "/healthz")] == \
        [False, False, True, True]
    args = make_parser().parse_args(["--disable-access-log-for-endpoints", "/ping", "--h11-max-incomplete-event-size",
                                     "1MiB"])
    assert uvicorn_config(object(), args).h11_max_incomplete_event_size == 1 << 20
    assert any(isinstance(f, AccessLogFilter) and f.paths == {"/ping"}
               for f in logging.getLogger("uvicorn.access").filters)
