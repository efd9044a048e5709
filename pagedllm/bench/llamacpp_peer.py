"""The llama.cpp peer of `--compare llamacpp`: llama-cpp-python's `Llama` on the same GGUF file and token ids, in
the same run (issue 15's peer for quantized weights: llama.cpp multiplies the GGUF's 4- and 8-bit blocks as they
are, with activations quantized to 8 bits).

llama-cpp-python is never a dependency of pagedllm: `make bench-peers` builds `.peers/llamacpp` (pip compiles
llama.cpp for this CPU, -march=native), or name another with `--llamacpp-python`. Its child process
(`llamacpp_child.py`) runs the requests one after the other, as `Llama` serves one sequence at a time, on as many
threads as this process may use; for a single-stream comparison run pagedllm with `--max-num-seqs 1` as well.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from pagedllm.bench.datasets import BenchRequest
from pagedllm.bench.peers import peer_python, run_child

DEFAULT_LLAMACPP_PYTHON = ".peers/llamacpp/bin/python"
_CHILD = Path(__file__).with_name("llamacpp_child.py")


def add_llamacpp_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--llamacpp-python", default=DEFAULT_LLAMACPP_PYTHON,
                        help="the Python of an environment with llama-cpp-python, for --compare llamacpp "
                             "(make bench-peers)")


def llamacpp_python(args: argparse.Namespace) -> Path:
    """The peer environment's Python, checked before any timing starts."""
    return peer_python(args.llamacpp_python, "--llamacpp-python", "llama.cpp")


def llamacpp_gguf(model: str | None) -> Path:
    """The model's GGUF file, which llama.cpp runs (checked before any timing starts too)."""
    from pagedllm.loader.resolve import resolve_model

    gguf_path = resolve_model(model).gguf_path
    if gguf_path is None:
        raise ValueError("--compare llamacpp runs the model's GGUF file: --model must name a .gguf (the default "
                         "model is one)")
    return gguf_path


def llamacpp_job(gguf_path: Path, requests: list[BenchRequest], warmup_prompt_token_ids: list[int], seed: int,
                 max_num_batched_tokens: int) -> dict[str, Any]:
    """The child's job: a context that holds the longest request (in 256-token steps), prompts fed
    `max_num_batched_tokens` at a time as pagedllm's are, one thread per CPU this process may use."""
    longest = max([len(warmup_prompt_token_ids) + 1] + [r.prompt_len + r.output_len for r in requests])
    n_ctx = -(-longest // 256) * 256
    return {"model_path": str(gguf_path), "n_ctx": n_ctx, "n_batch": min(n_ctx, max_num_batched_tokens),
            "n_threads": len(os.sched_getaffinity(0)), "seed": seed,
            "warmup_prompt_token_ids": warmup_prompt_token_ids,
            "prompt_token_ids": [r.prompt_token_ids for r in requests],
            "output_lens": [r.output_len for r in requests]}


def run_llamacpp(args: argparse.Namespace, requests: list[BenchRequest], warmup_prompt_token_ids: list[int]
                 ) -> dict[str, Any]:
    """Time llama.cpp on `requests` (after one warm-up request) with the model's own GGUF file."""
    python, gguf_path = llamacpp_python(args), llamacpp_gguf(args.model)
    job = llamacpp_job(gguf_path, requests, warmup_prompt_token_ids, args.seed, args.max_num_batched_tokens)
    print(f"Running the llama.cpp peer ({python}, {gguf_path.name}, {job['n_threads']} threads)", flush=True)
    result = run_child(python, _CHILD, job, None, "llama.cpp")
    result.update(model_file=gguf_path.name, n_threads=job["n_threads"])
    return result
