"""Request framing, over raw sockets: the body limit counts the bytes that arrive whatever the headers declare,
conflicting framing is refused, and a client without the API key is answered before any of its body is read."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import pytest

from pagedllm.entrypoints.openai.serving_base import ServerLimits
from tests.entrypoints.server_utils import API_KEY, start_server
from tests.reliability.tiny_server import build_tiny_engine

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    running = start_server(build_tiny_engine(tiny_model_dir, num_blocks=64), api_key=API_KEY,
                           limits=ServerLimits(max_request_body_bytes=LIMIT))
    yield running
    running.stop()


def _exchange(server, head: str, body_chunks: list[bytes] = (), timeout: float = 10.0) -> tuple[int, dict, float]:
    """Send a request head and body chunks on a fresh socket; (status, JSON body, seconds to the answer)."""
    url = urlparse(server.base_url)
    started = time.monotonic()
    with socket.create_connection((url.hostname, url.port), timeout=timeout) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode())
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before reading it all: what a limit should do
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _length(reply):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    head_part, _, body = reply.partition(b"\r\n\r\n")
    return int(head_part.split()[1]), json.loads(body or b"{}"), time.monotonic() - started


def _length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def _chunked(payload: bytes, size: int = 16 * 1024) -> list[bytes]:
    parts = [payload[i:i + size] for i in range(0, len(payload), size)]
    return [b"%x\r\n%s\r\n" % (len(p), p) for p in parts] + [b"0\r\n\r\n"]


def _head(extra: str, key: bool = True) -> str:
    auth = f"Authorization: Bearer {API_KEY}\n" if key else ""
    return f"POST /v1/completions HTTP/1.1\nHost: x\nContent-Type: application/json\n{auth}{extra}\n"


def test_a_small_declared_length_with_a_big_chunked_body_is_refused(server) -> None:
    payload = json.dumps({"prompt": "x" * (4 * LIMIT)}).encode()
    status, body, _ = _exchange(server, _head("Content-Length: 5\nTransfer-Encoding: chunked\n"), _chunked(payload))
    assert status == 400 and body["error"]["code"] == "conflicting_framing"


def test_a_chunked_body_is_counted_as_it_arrives(server) -> None:
    payload = json.dumps({"prompt": "x" * (4 * LIMIT)}).encode()
    status, body, _ = _exchange(server, _head("Transfer-Encoding: chunked\n"), _chunked(payload))
    assert status == 413 and body["error"]["code"] == "request_too_large"
    small = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    status, body, _ = _exchange(server, _head("Transfer-Encoding: chunked\n"), _chunked(small))
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_no_key_is_answered_before_the_body_is_read(server) -> None:
    # The head promises a body under the limit that never comes: only a server that checks the key first answers.
    status, body, seconds = _exchange(server, _head("Content-Length: 60000\n", key=False), [b'{"prompt": '])
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and seconds < 5
    status, _, _ = _exchange(server, _head("Transfer-Encoding: chunked\n", key=False),
                             _chunked(b"x" * (4 * LIMIT)))
    assert status == 401
