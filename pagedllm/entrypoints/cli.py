"""The `pagedllm` command: `pagedllm serve [MODEL]`, and `pagedllm bench ...` when pagedllm.bench is present.

Nothing heavy is imported before the arguments are parsed, so `pagedllm --help` answers at once.
"""

from __future__ import annotations

import argparse
import importlib

from pagedllm.entrypoints.openai.api_server import DESCRIPTION, run_server
from pagedllm.entrypoints.openai.cli_args import add_server_args


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="A PagedAttention LLM inference and serving engine.")
    parser.add_argument("--version", action="version", version=f"pagedllm {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                                  description=DESCRIPTION)
    add_server_args(serve, positional_model=True)
    serve.set_defaults(func=run_server)
    _add_bench_parser(subparsers)
    return parser


def _add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """`pagedllm bench ...` lives in pagedllm.bench.cli: `add_bench_parser(subparsers)` registers it (and sets
    `func` on its parsers). Skipped while that module does not exist."""
    try:
        bench_cli = importlib.import_module("pagedllm.bench.cli")
    except ModuleNotFoundError as exc:
        if exc.name in ("pagedllm.bench", "pagedllm.bench.cli"):
            return
        raise
    bench_cli.add_bench_parser(subparsers)


def _version() -> str:
    from pagedllm import __version__
    return __version__


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
