"""`pagedllm plan` and `pagedllm simulate`: their flags and what they print (a table, or JSON with --json)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pagedllm.config import DEFAULT_BLOCK_SIZE
from pagedllm.entrypoints.openai.cli_args import parse_bytes

_PLAN_HELP = "KV bytes per token, blocks and sequences that fit a memory budget, paged vs contiguous"
_SIMULATE_HELP = "replay a trace through the scheduler and block pool under allocation policies; no model runs"


def add_memory_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add `plan` and `simulate` to a `pagedllm` command's subparsers."""
    plan = subparsers.add_parser("plan", help=_PLAN_HELP, description=_PLAN_HELP + ". Reads the model's config, "
                                 "never its weights, and sizes the pool as the engine does.")
    plan.add_argument("model", nargs="?", default=None, metavar="MODEL",
                      help="a Hugging Face model folder, a .gguf file, or none for the embedded default")
    plan.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                      help="the KV pool's size, e.g. 512MiB or 16GiB (default: the engine's default on a CPU)")
    plan.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per block (default: 8)")
    plan.add_argument("--context-len", type=int, default=None,
                      help="tokens per sequence for the 'how many fit' columns (default: 500, capped by "
                           "max_model_len)")
    plan.add_argument("--max-model-len", type=int, default=None, help="context length cap (default: the model's)")
    plan.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    plan.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                      help="K/V storage: the model's dtype, or int8 with a float32 scale per row (default: auto)")
    plan.add_argument("--json", action="store_true", help="print JSON for scripts")
    plan.set_defaults(func=run_plan)

    simulate = subparsers.add_parser("simulate", help=_SIMULATE_HELP, description=_SIMULATE_HELP + ".")
    _add_simulate_args(simulate)
    simulate.set_defaults(func=run_simulate)


def _add_simulate_args(parser: argparse.ArgumentParser) -> None:
    from pagedllm.memory.simulate import DEFAULT_NUM_SLOTS, DEFAULT_POLICIES, SimConfig

    defaults = SimConfig()
    parser.add_argument("--trace", action="append", default=None, metavar="NAME|CSV",
                        help="sharegpt, alpaca, or a CSV file with arrival_s,prompt_len,output_len; repeat for "
                             "several (default: sharegpt and alpaca)")
    parser.add_argument("--policy", action="append", default=None, metavar="POLICY",
                        help=f"max, pow2, oracle or paged-B; repeat (default: {' '.join(DEFAULT_POLICIES)})")
    parser.add_argument("--kv-tokens", type=int, default=DEFAULT_NUM_SLOTS,
                        help="the KV budget in token slots (default: %(default)s, OPT-13B's 800 KiB per token in "
                             "12 GiB, the paper's A100-40GB)")
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--step-seconds", type=float, default=defaults.step_seconds,
                        help="virtual time one engine step takes (default: %(default)s)")
    parser.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write a PNG chart (needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


def run_plan(args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm.memory.plan import format_plan, make_plan

    try:
        plan = make_plan(args.model, args.kv_cache_memory, args.block_size, args.context_len, args.max_model_len,
                         args.dtype, args.kv_cache_dtype)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"error: {error}") from None
    print(json.dumps(plan.to_json(), indent=2) if args.json else format_plan(plan))
    return plan.to_json()


def run_simulate(args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm.memory.simulate import DEFAULT_POLICIES, SimConfig, format_results, paged_block_size, simulate
    from pagedllm.memory.traces import load_trace

    try:
        for policy in args.policy or ():
            paged_block_size(policy)   # a bad name fails before anything runs
        config = SimConfig(args.kv_tokens, args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens,
                           args.step_seconds)
        traces = {name: load_trace(name) for name in args.trace or ["sharegpt", "alpaca"]}
        results = {name: [simulate(trace, policy, config) for policy in args.policy or DEFAULT_POLICIES]
                   for name, trace in traces.items()}
    except (ValueError, OSError) as error:
        raise SystemExit(f"error: {error}") from None
    if args.plot is not None:
        from pagedllm.memory.plot import plot_results

        plot_results(results, args.plot)
    report = {name: [r.to_json() for r in trace_results] for name, trace_results in results.items()}
    print(json.dumps(report, indent=2) if args.json else format_results(results, config))
    return report
