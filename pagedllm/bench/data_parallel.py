"""`pagedllm bench dp`: data parallelism on a multi-prefix workload, in one run: one engine, then N replicas behind
the prefix-aware router, then N replicas round robin.

The workload is `--num-prefixes` system prompts (each the `prefix` bench's, from its own seed) with
`--num-prompts` questions spread over them, in a shuffled order, all given to `LLM.generate` at once. Before the
timed run each system prompt is served alone once (max_tokens=1, one after the other, routed as any request), as
a server that has seen them before would hold them: then what counts is where the router sends the questions
(the prefix cache shares no block between requests prefilled in the same step, so without the warm-up the first
step's misses would hide it). One engine
uses the process's intra-op threads; N replicas share them out (each gets threads / N) and step in N threads,
so that the comparison is at the same cores. The hit rate is prompt tokens served from a prefix cache (each
RequestOutput's `num_cached_tokens`) over all prompt tokens: a prefix that the router sends to both replicas is
computed twice.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path
from typing import Any

from pagedllm.bench.args import add_engine_args, engine_kwargs
from pagedllm.bench.datasets import BenchRequest, shared_prefix_requests
from pagedllm.bench.prefix import shared_prefix_len


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    group = parser.add_argument_group("workload")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=2, help="replicas of the DP runs")
    group.add_argument("--num-prefixes", type=int, default=4, help="distinct system prompts")
    group.add_argument("--num-prompts", type=int, default=32, help="requests, spread evenly over the prefixes")
    group.add_argument("--prefix-len", type=int, default=256, help="tokens of each system prompt")
    group.add_argument("--output-len", type=int, default=16)
    group.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.data_parallel_size < 2 or args.num_prefixes < 1 or args.num_prompts < args.num_prefixes:
        raise SystemExit("error: --data-parallel-size must be >= 2 and --num-prompts >= --num-prefixes >= 1")
    result: dict[str, Any] = {}
    for name, size, router in (("one_engine", 1, "prefix_aware"),
                               ("prefix_aware", args.data_parallel_size, "prefix_aware"),
                               ("round_robin", args.data_parallel_size, "round_robin")):
        result[name] = run_once(args, size, router)
        gc.collect()
    result["dp_speedup"] = (result["prefix_aware"]["output_tokens_per_second"]
                            / result["one_engine"]["output_tokens_per_second"])
    print_report(result)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def multi_prefix_requests(tokenizer, args: argparse.Namespace) -> tuple[list[BenchRequest], list[list[int]]]:
    """`num_prompts` requests over `num_prefixes` system prompts, shuffled; and each system prompt's tokens."""
    requests: list[BenchRequest] = []
    prefixes: list[list[int]] = []
    for group in range(args.num_prefixes):
        count = args.num_prompts // args.num_prefixes + (group < args.num_prompts % args.num_prefixes)
        group_requests = shared_prefix_requests(tokenizer, count, args.prefix_len, args.output_len, args.seed + group)
        prefixes.append(group_requests[0].prompt_token_ids[:shared_prefix_len(group_requests)])
        requests += group_requests
    random.Random(args.seed).shuffle(requests)
    return requests, prefixes


def run_once(args: argparse.Namespace, data_parallel_size: int, router: str) -> dict[str, Any]:
    """Build the engine(s), run the workload once, and return the figures; the engines are freed on return."""
    import torch

    from pagedllm import LLM, SamplingParams

    num_threads = torch.get_num_threads()
    try:
        with LLM(**engine_kwargs(args, data_parallel_size=data_parallel_size, data_parallel_router=router)) as llm:
            requests, prefixes = multi_prefix_requests(llm.get_tokenizer(), args)
            for prefix in prefixes:     # the warm-up: as a server that has seen each system prompt before
                llm.generate([prefix], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=r.output_len) for r in requests]
            start = time.perf_counter()
            outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
            elapsed = time.perf_counter() - start
    finally:
        torch.set_num_threads(num_threads)  # the replicas divided them
    num_prompt_tokens = sum(r.prompt_len for r in requests)
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_hit_tokens = sum(o.num_cached_tokens for o in outputs)
    return {
        "data_parallel_size": data_parallel_size, "router": router, "num_requests": len(requests),
        "total_prompt_tokens": num_prompt_tokens, "total_output_tokens": num_output_tokens,
        "elapsed_time": elapsed, "output_tokens_per_second": num_output_tokens / elapsed,
        "tokens_per_second": (num_prompt_tokens + num_output_tokens) / elapsed,
        "hit_rate": num_hit_tokens / num_prompt_tokens,
    }


def print_report(result: dict[str, Any]) -> None:
    runs = [result["one_engine"], result["prefix_aware"], result["round_robin"]]
    size = runs[1]["data_parallel_size"]
    print(f"Multi-prefix workload: {runs[0]['num_requests']} requests, {runs[0]['total_prompt_tokens']} prompt "
          f"tokens, {runs[0]['total_output_tokens']} output tokens")
    print(f"{'':<24}{'1 engine':>14}{f'DP={size} prefix':>14}{f'DP={size} RR':>14}")
    for label, key, fmt in [("Total tokens/s", "tokens_per_second", "{:.1f}"),
                            ("Output tokens/s", "output_tokens_per_second", "{:.1f}"),
                            ("Wall time (s)", "elapsed_time", "{:.2f}"),
                            ("Prefix-cache hit rate", "hit_rate", "{:.1%}")]:
        print(f"{label:<24}" + "".join(f"{fmt.format(run[key]):>14}" for run in runs))
    print(f"DP={size} (prefix-aware router) over one engine: {result['dp_speedup']:.2f}x")
