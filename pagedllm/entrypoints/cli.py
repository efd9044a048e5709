"""The `pagedllm` command: `pagedllm serve [MODEL]`, `pagedllm run-batch -i IN -o OUT`, `pagedllm chat` and
`pagedllm complete` (clients of a running server), `pagedllm collect-env` (for a bug report), `pagedllm bench COMMAND`
(throughput, accuracy, ...: see pagedllm/bench/cli.py), `pagedllm plan [MODEL]` and `pagedllm simulate`.

`serve` leaves OpenMP's wait policy as it finds it: with the default, idle workers spin a while before they sleep,
and one served stream takes 16 ms a token on the 2-core Xeon of docs/benchmarks.md, against 36 ms with
`OMP_WAIT_POLICY=PASSIVE`, where every kernel call wakes a sleeping worker. On a machine shared with busy
processes, export PASSIVE: spinning workers then compete with them for the cores.
"""

from __future__ import annotations

import argparse
import sys

from pagedllm.bench.cli import add_bench_parser
from pagedllm.entrypoints.client import add_client_parsers
from pagedllm.entrypoints.openai.api_server import DESCRIPTION, run_server
from pagedllm.entrypoints.openai.cli_args import (
    RUN_BATCH_DESCRIPTION,
    add_run_batch_args,
    add_server_args,
    with_config_file,
)
from pagedllm.memory.cli import add_memory_parsers


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="A PagedAttention LLM inference and serving engine.")
    parser.add_argument("--version", action="version", version=f"pagedllm {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                                  description=DESCRIPTION)
    add_server_args(serve, positional_model=True)
    serve.set_defaults(func=run_server)
    run_batch = subparsers.add_parser("run-batch", help="answer a file of OpenAI batch requests offline",
                                      description=RUN_BATCH_DESCRIPTION)
    add_run_batch_args(run_batch)
    run_batch.set_defaults(func=_run_batch)
    add_client_parsers(subparsers)
    collect_env = subparsers.add_parser("collect-env", help="print what a bug report needs: versions, CPU, memory",
                                        description="Print the versions, CPU features, kernels, cores, memory, GPU, "
                                                    "embedded model and pagedllm's environment variables.")
    collect_env.set_defaults(func=_collect_env)
    add_bench_parser(subparsers)
    add_memory_parsers(subparsers)
    return parser


def _run_batch(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.openai.run_batch import main as run_batch_main  # torch: only when it runs
    run_batch_main(args)


def _collect_env(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.collect_env import run  # torch: only when it runs
    run(args)


def _version() -> str:
    from pagedllm import __version__
    return __version__


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    flags = {"serve": lambda: add_server_args(argparse.ArgumentParser(), positional_model=True),
             "run-batch": lambda: add_run_batch_args(argparse.ArgumentParser())}
    if argv and argv[0] in flags:        # --config FILE: its flags, under the command line's own
        argv = [argv[0], *with_config_file(argv[1:], flags[argv[0]]())]
    args = make_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
