"""Command-line flags shared by the bench commands: the engine's, and the dataset's."""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagedllm.bench.datasets import BenchRequest, load_requests
from pagedllm.config import DEFAULT_BLOCK_SIZE
from pagedllm.entrypoints.openai.cli_args import parse_json_object
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams

_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'4294967296', '4G', '4GiB', '512MB' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 4294967296, 4G or 512MiB, got {text!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def add_engine_args(parser: argparse.ArgumentParser, prefix_caching_flag: bool = True,
                    quantization_flag: bool = True) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="HF model folder, .gguf file, or the embedded default (SmolLM2-135M-Instruct) if unset")
    group.add_argument("--tokenizer", default=None,
                       help="a tokenizer (or model) folder, or a .gguf file, whose tokenizer builds the requests "
                            "and runs in every engine, in place of the model's own")
    group.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    group.add_argument("--device", default="auto",
                       help="auto (CUDA when torch sees a device, else the CPU), cpu, cuda or cuda:N")
    if quantization_flag:
        group.add_argument("--quantization", "-q", default=None, choices=["int8", "w8a8", "gguf"],
                           help="int8: weights stored as int8 with per-row scales; w8a8: those weights times "
                                "activations quantized to int8 (a scale per 64 values); gguf: a .gguf file's Q4_0/"
                                "Q4_1/Q8_0 blocks kept packed, a .gguf file's default under --dtype auto with "
                                "VNNI (pagedllm only: peers run --dtype, so name one to compare them on the same "
                                "dequantised weights)")
        group.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                           help="int8: K/V stored as int8 with a float32 scale per row (pagedllm only)")
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                       help="bytes for the KV pool, e.g. 2G (default: the engine's own budget)")
    group.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    if prefix_caching_flag:
        group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="worker processes sharing each layer (docs/scale-out.md)")
    group.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                       help="tensor-parallel workers as local processes (mp, the default) or Ray actors; with ray, "
                            "data-parallel replicas run in Ray actors too")
    group.add_argument("--speculative-config", type=parse_json_object, default=None,
                       help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    group.add_argument("--enforce-eager", action="store_true",
                       help="run pagedllm's modules one by one from Python, not its decoder layers in one C++ call "
                            "(or CUDA graphs on a GPU)")
    group.add_argument("--disable-cascade-attn", action="store_true",
                       help="never run a step's attention as cascade attention over a shared prefix")


def engine_kwargs(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """The `LLM(...)` keyword arguments named by the engine flags, then `overrides`."""
    kwargs = dict(model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
                  max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
                  enable_prefix_caching=getattr(args, "enable_prefix_caching", True), seed=args.seed,
                  quantization=getattr(args, "quantization", None),
                  kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"), speculative_config=args.speculative_config,
                  tensor_parallel_size=args.tensor_parallel_size,
                  distributed_executor_backend=args.distributed_executor_backend, enforce_eager=args.enforce_eager,
                  disable_cascade_attn=args.disable_cascade_attn)
    if getattr(args, "lora_path", None):
        kwargs |= dict(enable_lora=True, max_lora_rank=lora_rank(args.lora_path))
    return kwargs | overrides


def lora_rank(lora_path: str) -> int:
    """The rank in a PEFT adapter's adapter_config.json (ValueError if the folder has none)."""
    config = Path(lora_path) / "adapter_config.json"
    if not config.is_file():
        raise ValueError(f"--lora-path {lora_path}: no adapter_config.json there")
    return int(json.loads(config.read_text(encoding="utf-8"))["r"])


def bench_lora_request(args: argparse.Namespace) -> LoRARequest | None:
    """The LoRARequest every request of the run names (--lora-path), or None."""
    return LoRARequest("bench", 1, args.lora_path) if getattr(args, "lora_path", None) else None


def add_dataset_args(parser: argparse.ArgumentParser,
                     datasets: tuple[str, ...] = ("mixed", "random", "jsonl", "grounded"),
                     default: str = "mixed") -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset", default=default, choices=datasets)
    group.add_argument("--dataset-path", default=None, help="the file of --dataset jsonl")
    group.add_argument("--num-prompts", type=int, default=None,
                       help="requests to run (default: 50 for mixed, 100 for random, 32 for grounded, the whole "
                            "file for jsonl)")
    group.add_argument("--input-len", type=int, default=256, help="prompt tokens of --dataset random")
    group.add_argument("--output-len", type=int, default=128,
                       help="output tokens of --dataset random, and of jsonl lines without output_len")
    group.add_argument("--seed", type=int, default=0)


def dataset_argv(args: argparse.Namespace) -> list[str]:
    """The dataset and model flags again, to rebuild the same requests (and run on the same device) in a child
    process."""
    argv = ["--dataset", args.dataset, "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--seed", str(args.seed), "--dtype", args.dtype, "--device", args.device]
    for flag, value in (("--dataset-path", args.dataset_path), ("--num-prompts", args.num_prompts),
                        ("--model", args.model), ("--tokenizer", args.tokenizer)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def bench_tokenizer(args: argparse.Namespace):
    """The tokenizer the requests are built with, pagedllm's and its peers' alike: --tokenizer's, else the model's."""
    from pagedllm.loader.resolve import resolve_model
    from pagedllm.tokenizer.tokenizer import model_tokenizer

    return model_tokenizer(resolve_model(args.model), args.tokenizer)


_SAMPLING_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                      "presence_penalty": 0.0, "frequency_penalty": 0.0}   # greedy, nothing filtered or penalised


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sampling", "every request draws with these (vLLM's SamplingParams names), on pagedllm's side and each "
                    "peer's: greedy by default; top-k 0 is off")
    for name, default in _SAMPLING_DEFAULTS.items():
        group.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)


def sampling_kwargs(args: argparse.Namespace) -> dict[str, float | int]:
    """The requests' sampling parameters, in vLLM's SamplingParams names: the temperature, and each other one set
    away from its default (the temperature alone, 0, where a command has no sampling flags). ValueError, before
    anything runs, where `SamplingParams` refuses them."""
    values = {name: getattr(args, name, default) for name, default in _SAMPLING_DEFAULTS.items()}
    kwargs = {name: value for name, value in values.items()
              if name == "temperature" or value != _SAMPLING_DEFAULTS[name]}
    SamplingParams(**kwargs)
    return kwargs


def describe_sampling(sampling: dict[str, float | int]) -> str:
    """'greedy', or the parameters as `name=value` pairs, for a report."""
    if sampling == {"temperature": 0.0}:
        return "greedy"
    return " ".join(f"{name}={value:g}" for name, value in sampling.items())


def sampling_argv(args: argparse.Namespace) -> list[str]:
    """The sampling flags again, for a child process."""
    return [arg for name, value in sampling_kwargs(args).items() for arg in ("--" + name.replace("_", "-"), str(value))]


def add_repeat_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=_at_least_one, default=1,
                        help="time the batch this many times in one engine, pagedllm's and vLLM's (not the other "
                             "peers'), its prefix cache emptied and the warm-up served again before each run: the "
                             "figures are the median run's (of an even number, the slower middle one), and each "
                             "run's output tokens/s is listed (one vLLM start-up for several runs on a noisy "
                             "machine)")


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run_repeated(llm, repeat: int, warmup: Callable[[], object], timed: Callable[[], list]) -> tuple[list, list[float]]:
    """`timed()` on `llm` (an engine the caller warmed up) `repeat` times, the prefix cache emptied and `warmup()`
    served again before every run but the first (the bench commands' --repeat; vllm_child.py does the same in
    vLLM): the last run's outputs and each run's seconds."""
    seconds = []
    for run in range(repeat):
        if run:
            if not llm.reset_prefix_cache():
                raise RuntimeError("the prefix cache could not be emptied between runs: requests still hold blocks")
            warmup()
        start = time.perf_counter()
        outputs = timed()
        seconds.append(time.perf_counter() - start)
    return outputs, seconds


def print_runs(columns: list[tuple[str, dict[str, Any]]]) -> None:
    """For each (name, figures) timed more than once (--repeat), its runs' output tokens/s, of which the figures are
    the median's."""
    for name, figures in columns:
        runs = figures.get("runs_output_tokens_per_second", [])
        if len(runs) > 1:
            print(f"{name}: the median of {len(runs)} runs, output tokens/s " + ", ".join(f"{r:.1f}" for r in runs))


def requests_from_args(tokenizer, args: argparse.Namespace) -> list[BenchRequest]:
    return load_requests(tokenizer, args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
                         output_len=args.output_len, dataset_path=args.dataset_path, seed=args.seed)
