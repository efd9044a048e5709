"""The `pagedllm` command: `pagedllm serve [MODEL]`, `pagedllm bench COMMAND` (throughput, accuracy, ...: see
pagedllm/bench/cli.py), `pagedllm plan [MODEL]` and `pagedllm simulate`.

Nothing heavy is imported before the arguments are parsed, so `pagedllm --help` answers at once, and so that
`serve` can set OpenMP's wait policy before torch loads.
"""

from __future__ import annotations

import argparse
import os

from pagedllm.bench.cli import add_bench_parser
from pagedllm.entrypoints.openai.api_server import DESCRIPTION, run_server
from pagedllm.entrypoints.openai.cli_args import add_server_args
from pagedllm.memory.cli import add_memory_parsers


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="A PagedAttention LLM inference and serving engine.")
    parser.add_argument("--version", action="version", version=f"pagedllm {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                                  description=DESCRIPTION)
    add_server_args(serve, positional_model=True)
    serve.set_defaults(func=run_server)
    add_bench_parser(subparsers)
    add_memory_parsers(subparsers)
    return parser


def _version() -> str:
    from pagedllm import __version__
    return __version__


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    if args.command == "serve":
        # The server's event loop shares the cores with torch's OpenMP threads; spinning idle threads starve it
        # (and on a busy 2-core box slow the forward pass several times over). Sleeping threads cost a few percent.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args.func(args)


if __name__ == "__main__":
    main()
