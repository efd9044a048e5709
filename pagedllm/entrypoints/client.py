"""`pagedllm chat` and `pagedllm complete` (vLLM's `vllm chat` and `vllm complete`): talk to a running server from
the terminal, its replies streamed as they come.

    pagedllm chat [--url URL] [--model-name NAME] [--api-key KEY] [--system-prompt TEXT] [-q MESSAGE]
    pagedllm complete [--url URL] [--model-name NAME] [--api-key KEY] [--max-tokens N] [-q PROMPT]

Without -q each reads a message (a prompt) a line from standard input until it ends (Ctrl-D); a chat keeps the
conversation. The model defaults to the server's first. Plain HTTP from the standard library: no SDK needed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, TextIO

DEFAULT_URL = "http://localhost:8000/v1"


class ClientError(Exception):
    """The server could not be reached, or answered with an error."""


def add_client_parsers(subparsers: argparse._SubParsersAction) -> None:
    chat = subparsers.add_parser("chat", help="chat with a running server from the terminal",
                                 description="Chat with a running pagedllm (or any OpenAI-compatible) server.")
    _add_common_args(chat, "MESSAGE", "send one message, print the reply and exit")
    chat.add_argument("--system-prompt", default=None, help="a system message to start the conversation with")
    chat.set_defaults(func=run_chat)
    complete = subparsers.add_parser("complete", help="complete prompts with a running server from the terminal",
                                     description="Complete prompts with a running pagedllm (or any OpenAI-compatible) "
                                                 "server.")
    _add_common_args(complete, "PROMPT", "complete one prompt, print the completion and exit")
    complete.add_argument("--max-tokens", type=int, default=None,
                          help="most tokens a completion may have (default: the server's)")
    complete.set_defaults(func=run_complete)


def _add_common_args(parser: argparse.ArgumentParser, what: str, quick_help: str) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help="the server's /v1 URL (default: %(default)s)")
    parser.add_argument("--model-name", default=None, help="the model to ask for (default: the server's first)")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"),
                        help="the server's API key (default: $PAGEDLLM_API_KEY)")
    parser.add_argument("-q", "--quick", default=None, metavar=what, help=quick_help)


def run_chat(args: argparse.Namespace, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> None:
    messages: list[dict[str, str]] = []
    if args.system_prompt is not None:
        messages.append({"role": "system", "content": args.system_prompt})

    def reply(client: _Client, message: str) -> None:
        messages.append({"role": "user", "content": message})
        text = _stream_to(stdout, client, "/chat/completions", {"messages": messages},
                          lambda choice: choice["delta"].get("content"))
        messages.append({"role": "assistant", "content": text})

    _converse(args, reply, stdin)


def run_complete(args: argparse.Namespace, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> None:
    extra = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}

    def reply(client: _Client, prompt: str) -> None:
        _stream_to(stdout, client, "/completions", {"prompt": prompt, **extra}, lambda choice: choice["text"])

    _converse(args, reply, stdin)


def _converse(args: argparse.Namespace, reply: Callable[[_Client, str], None], stdin: TextIO) -> None:
    """One -q message, or a message a line until the input ends; a server error ends the program with it."""
    try:
        client = _Client(args.url, args.api_key, args.model_name)
        if args.quick is not None:
            reply(client, args.quick)
            return
        for line in stdin:
            if line.strip():
                reply(client, line.rstrip("\n"))
    except ClientError as exc:
        raise SystemExit(f"error: {exc}") from None
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:        # the reader went away (`| head`): stop quietly, as the docs of `signal` advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


class _Client:
    def __init__(self, url: str, api_key: str | None, model: str | None) -> None:
        self.url, self.api_key = url.rstrip("/"), api_key
        self.model = model or self._first_model()

    def _request(self, path: str, body: dict[str, Any] | None = None):
        headers = {"Content-Type": "application/json"} | (
            {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})
        data = None if body is None else json.dumps(body).encode()
        try:
            return urllib.request.urlopen(urllib.request.Request(self.url + path, data, headers))  # noqa: S310
        except urllib.error.HTTPError as exc:
            raise ClientError(f"{exc.code}: {_error_message(exc.read())}") from None
        except urllib.error.URLError as exc:
            raise ClientError(f"cannot reach {self.url} ({exc.reason}); is a server running there (pagedllm "
                              "serve)?") from None

    def _first_model(self) -> str:
        with self._request("/models") as response:
            models = json.load(response)["data"]
        if not models:
            raise ClientError(f"{self.url} serves no model")
        return models[0]["id"]

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The streamed chunks of one request (server-sent events, up to [DONE])."""
        with self._request(path, {**body, "model": self.model, "stream": True}) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    raise ClientError(chunk["error"].get("message", chunk["error"]))
                yield chunk


def _stream_to(stdout: TextIO, client: _Client, path: str, body: dict[str, Any],
               text_of: Callable[[dict[str, Any]], str | None]) -> str:
    """Print a reply as it streams in, then a newline; return its text."""
    parts = []
    for chunk in client.stream(path, body):
        for choice in chunk.get("choices", []):
            text = text_of(choice)
            if text:
                parts.append(text)
                stdout.write(text)
                stdout.flush()
    stdout.write("\n")
    return "".join(parts)


def _error_message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:500]
