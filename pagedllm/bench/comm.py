"""`pagedllm bench comm`: what tensor parallelism's collectives cost per forward pass, on this machine.

N processes join a group as the engine's ranks do (pagedllm/distributed, with the same threads per rank), and run
one forward pass's collectives for the model's shapes, without the model: 2 x layers + 1 all-reduces of
[T, hidden] in the model's dtype (after attention and after the MLP in every layer, and the vocab-parallel
embedding), then the gather of the LM head's float32 vocabulary slices of the rows sampled to rank 0; over gloo,
then over the shared-memory segment the engine uses on one machine (pagedllm/distributed/communicator.py). The
time per pass is the median over --repeats, taken on rank 0 after a barrier; the bytes are those of one rank's
tensors. Set this against the step times of `pagedllm bench throughput -tp N` (docs/scale-out.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from pagedllm.bench.measure import ModelDims

_TOKENS = [1, 8, 32, 256, 512]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="whose shapes (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=_TOKENS,
                        help="tokens per forward pass; a decode step of B requests runs B, and samples B rows")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output-json", default=None, help="write the results to this file")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    from pagedllm.distributed import free_port, threads_per_rank
    from pagedllm.distributed.communicator import create_segment, new_segment_path, remove_segment
    from pagedllm.loader import load_hf_config, resolve_dtype, resolve_model

    if args.tensor_parallel_size < 2:
        raise SystemExit("error: --tensor-parallel-size must be at least 2 (one rank has nothing to communicate)")
    resolved = resolve_model(args.model)
    hf_config = load_hf_config(resolved)
    dims = ModelDims.from_hf_config(hf_config)
    dtype = resolve_dtype(args.dtype)
    job = dict(size=args.tensor_parallel_size, init_method=f"tcp://127.0.0.1:{free_port()}",
               threads=threads_per_rank(args.tensor_parallel_size), hidden=dims.hidden_size, layers=dims.num_layers,
               vocab=dims.vocab_size, dtype=dtype, tokens=args.tokens, repeats=args.repeats,
               segment_path=new_segment_path())
    create_segment(job["segment_path"], job["size"])
    context = mp.get_context("spawn")
    others = [context.Process(target=_rank_main, args=(rank, job), daemon=True)
              for rank in range(1, args.tensor_parallel_size)]
    for process in others:
        process.start()
    threads = torch.get_num_threads()
    try:
        rows = _rank_main(0, job)
    finally:
        remove_segment(job["segment_path"])
        torch.set_num_threads(threads)
        for process in others:
            process.join()
    result = {"model": resolved.name, "dtype": str(dtype).removeprefix("torch."),
              "tensor_parallel_size": args.tensor_parallel_size, "threads_per_rank": job["threads"], "passes": rows}
    print_report(result)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def _rank_main(rank: int, job: dict[str, Any]) -> list[dict[str, Any]]:
    """One rank's passes; rank 0 (this process) returns the timings."""
    import torch
    import torch.distributed as dist

    from pagedllm.distributed.communicator import Communicator, close_communicator, init_communicator

    torch.set_num_threads(job["threads"])
    dist.init_process_group("gloo", init_method=job["init_method"], rank=rank, world_size=job["size"])
    transports = {"gloo": Communicator(rank, job["size"])}
    shared = init_communicator(rank, job["size"], job["segment_path"], timedelta(seconds=120))
    if shared.kind != "gloo":
        transports["shm"] = shared
    num_all_reduces = 2 * job["layers"] + 1
    vocab_slice = -(-job["vocab"] // job["size"])
    rows = []
    for tokens in job["tokens"]:
        hidden = torch.randn(tokens, job["hidden"]).to(job["dtype"])
        logits = torch.randn(tokens, vocab_slice)
        row: dict[str, Any] = dict(tokens=tokens, all_reduces=num_all_reduces,
                                   all_reduce_bytes=num_all_reduces * hidden.numel() * hidden.element_size(),
                                   gather_bytes=logits.numel() * logits.element_size())
        for name, transport in transports.items():
            times = []
            for _ in range(job["repeats"] + 1):             # the first pass pays the connections' set-up
                dist.barrier()
                start = time.perf_counter()
                for _ in range(num_all_reduces):
                    transport.all_reduce(hidden)
                all_reduced = time.perf_counter()
                transport.gather_to_first(logits)
                times.append((all_reduced - start, time.perf_counter() - all_reduced))
            all_reduce_s = statistics.median(t for t, _ in times[1:])
            row[name] = dict(all_reduce_ms=1e3 * all_reduce_s, us_per_all_reduce=1e6 * all_reduce_s / num_all_reduces,
                             gather_ms=1e3 * statistics.median(g for _, g in times[1:]))
        rows.append(row)
    close_communicator()
    dist.destroy_process_group()
    return rows


def print_report(result: dict[str, Any]) -> None:
    transports = [name for name in ("gloo", "shm") if name in result["passes"][0]]
    print(f"{result['model']} ({result['dtype']}), {result['tensor_parallel_size']} ranks, "
          f"{result['threads_per_rank']} thread(s) each; per forward pass (all-reduces, then the gather):")
    header = "".join(f" {name + ' ms':>10} {name + ' us each':>13} {name + ' gather ms':>16}" for name in transports)
    print(f"{'tokens':>7} {'all-reduces':>12} {'bytes':>10}{header} {'gather bytes':>13}")
    for row in result["passes"]:
        cells = "".join(f" {row[name]['all_reduce_ms']:>10.2f} {row[name]['us_per_all_reduce']:>13.1f}"
                        f" {row[name]['gather_ms']:>16.2f}" for name in transports)
        print(f"{row['tokens']:>7} {row['all_reduces']:>12} {row['all_reduce_bytes']:>10}{cells}"
              f" {row['gather_bytes']:>13}")
