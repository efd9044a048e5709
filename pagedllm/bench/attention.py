"""`pagedllm bench attention`: the decode attention kernel alone, over a model's shapes, in the engine's KV pool.

A decode step runs `pagedllm.attention.cpu.decode_attention` once a layer, one query row a sequence, reading each
sequence's K and V through its block table: a step of B sequences of L tokens reads B x L x the pool's bytes a
token, from memory (a real pool is far larger than the caches). This times that alone: a pool laid out as the
engine's (`allocate_kv`, the model's layers, KV heads, head size and dtype, --block-size), each sequence's blocks
next to each other as a fresh engine hands them out, or scattered over the pool (--scatter, as after a long run),
then every layer's call for each (sequences, context) of the grid, medians over --repeats. The rate is the K/V
bytes read over the time: what bounds the kernel is memory, so set it against the machine's read bandwidth.

With --shared-prefix P every sequence's table starts with the same blocks, P tokens that a system prompt cached by
the prefix cache would hold, followed by its own --context-len tokens, the last --query-len of them this step's
queries (1: a decode step; more: a prefill chunk). The step then runs `paged_attention`, as the engine's runner
does: cascade attention over the shared prefix where it pays (`cascade_prefix` in the results says where it ran).
Its rate is the attention's multiply-adds (q.k and p v, each query over the keys it sees) over the time: such a
step is bound by arithmetic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_SEQUENCES = [1, 4, 16, 32, 48]
_CONTEXTS = [350, 1000]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="whose shapes (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=_SEQUENCES, help="sequences a step")
    parser.add_argument("--context-len", type=int, nargs="+", default=_CONTEXTS, help="tokens each sequence reads")
    parser.add_argument("--pool-gib", type=float, default=4.0, help="the KV pool's size, as the engine's default")
    parser.add_argument("--scatter", action="store_true", help="blocks scattered over the pool, not in runs")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens (whole blocks) every sequence shares before its own: the step runs "
                             "paged_attention, a cascade where it pays (default 0: the decode kernel alone)")
    parser.add_argument("--query-len", type=int, default=1,
                        help="with --shared-prefix: each sequence's new tokens this step (1: a decode step)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None, help="write the results to this file")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pagedllm.cpu import cpu_info
    from pagedllm.loader import load_hf_config, resolve_dtype, resolve_model
    from pagedllm.runner.kv_tensors import KVLayout, allocate_kv, layer_caches
    from pagedllm.runner.model_runner import model_shape

    if args.shared_prefix % args.block_size or args.shared_prefix < 0:
        raise SystemExit(f"--shared-prefix must be whole blocks of {args.block_size} tokens, not {args.shared_prefix}")
    if args.shared_prefix and not 1 <= args.query_len <= min(args.context_len):
        raise SystemExit(f"--query-len must be 1 to the shortest --context-len, not {args.query_len}")
    resolved = resolve_model(args.model)
    config = load_hf_config(resolved)
    pool = model_shape(config)      # the engine's rows: a latent attention's (DeepSeek's) one row a token too
    layout = KVLayout(config.num_hidden_layers, pool.num_kv_heads, pool.head_dim, resolve_dtype(args.dtype),
                      args.kv_cache_dtype)
    bytes_per_block = layout.bytes_per_token * args.block_size
    shared_blocks = args.shared_prefix // args.block_size
    needed = shared_blocks + max(-(-context // args.block_size) for context in args.context_len) * max(args.num_seqs)
    num_blocks = max(needed, int(args.pool_gib * 2**30) // bytes_per_block)
    caches = layer_caches(allocate_kv(layout, num_blocks, args.block_size, torch.device("cpu")))
    generator = torch.Generator().manual_seed(args.seed)
    scale = layout.head_dim ** -0.5
    rows = []
    for context in args.context_len:
        per_seq = -(-context // args.block_size)
        for num_seqs in args.num_seqs:
            used = shared_blocks + num_seqs * per_seq
            ids = torch.randperm(num_blocks, generator=generator)[:used] if args.scatter else torch.arange(used)
            for k_cache, v_cache in caches:   # written: pages a kernel reads unwritten are one shared zero page
                k_cache[ids] = _random_rows(k_cache[ids].shape, layout, generator)
                v_cache[ids] = _random_rows(v_cache[ids].shape, layout, generator)
            shared, own = ids[:shared_blocks], ids[shared_blocks:].view(num_seqs, per_seq)
            run, rate = (_decode_step if not args.shared_prefix else _shared_prefix_step)(
                args, config, layout, caches, shared, own, context, scale, generator)
            seconds = statistics.median([_timed(run) for _ in range(1 + args.repeats)][1:])  # the first warms up
            rows.append(dict(num_seqs=num_seqs, context_len=context, ms_per_step=1e3 * seconds) | rate(seconds))
    result = {"model": resolved.name, "cpu": cpu_info().describe(), "dtype": str(layout.dtype).removeprefix("torch."),
              "kv_cache_dtype": args.kv_cache_dtype, "block_size": args.block_size, "layers": layout.num_layers,
              "kv_bytes_per_token": layout.bytes_per_token, "scatter": args.scatter,
              "shared_prefix": args.shared_prefix, "query_len": args.query_len if args.shared_prefix else 1,
              "steps": rows}
    print_report(result)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


# A step: (run every layer's attention once, the row's rate for the seconds that took).
_Step = tuple[Callable[[], None], Callable[[float], dict[str, Any]]]


def _timed(run: Callable[[], None]) -> float:
    """Seconds `run` takes."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _decode_step(args: argparse.Namespace, config: Any, layout: Any, caches: list[tuple[Any, Any]], shared: Any,
                 own: Any, context: int, scale: float, generator: Any) -> _Step:
    """The decode kernel alone, one query a sequence over its `context` tokens; the rate: K/V bytes read."""
    import torch

    from pagedllm.attention.cpu import decode_attention

    num_seqs = own.shape[0]
    block_tables = own.to(torch.int32)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    query = torch.randn(num_seqs, config.num_attention_heads, layout.head_dim, generator=generator).to(layout.dtype)

    def run() -> None:
        for k_cache, v_cache in caches:
            decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale)

    read = num_seqs * context * layout.bytes_per_token
    return run, lambda seconds: {"gb_per_s": read / seconds / 1e9}


def _shared_prefix_step(args: argparse.Namespace, config: Any, layout: Any, caches: list[tuple[Any, Any]],
                        shared: Any, own: Any, context: int, scale: float, generator: Any) -> _Step:
    """`paged_attention` over tables that share the prefix's blocks, each sequence's last --query-len tokens its
    queries; the rate: the multiply-adds of q.k and p v over the keys each query sees (causal)."""
    import torch

    from pagedllm.attention import cpu
    from pagedllm.attention.metadata import AttentionMetadata

    num_seqs, q_len, prefix = own.shape[0], args.query_len, args.shared_prefix
    tables = [shared.tolist() + row.tolist() for row in own]
    meta = AttentionMetadata.build(tables, [prefix + context - q_len] * num_seqs, [q_len] * num_seqs,
                                   args.block_size)
    query = torch.randn(num_seqs * q_len, config.num_attention_heads, layout.head_dim, generator=generator
                        ).to(layout.dtype)
    cascade = cpu.cascade_prefix_len(query, caches[0][0], meta)

    def run() -> None:
        for k_cache, v_cache in caches:
            cpu.paged_attention(query, k_cache, v_cache, meta, scale)

    keys_seen = num_seqs * sum(prefix + context - q_len + j + 1 for j in range(q_len))
    flops = 4 * keys_seen * config.num_attention_heads * layout.head_dim * layout.num_layers
    return run, lambda seconds: {"gflop_per_s": flops / seconds / 1e9, "cascade_prefix": cascade}


def _random_rows(shape: Any, layout: Any, generator: Any) -> Any:
    """Random K or V rows of `shape` as the pool stores them: values in the model's dtype, or int8 values each row
    followed by its float32 scale (pagedllm.runner.kv_tensors.KVLayout)."""
    import torch

    if layout.kv_cache_dtype != "int8":
        return torch.randn(shape, generator=generator).to(layout.dtype)
    rows = torch.randint(-127, 128, shape, generator=generator, dtype=torch.int8)
    rows[..., layout.head_dim:] = torch.full((*shape[:-1], 1), 0.01).view(torch.int8)
    return rows


def print_report(result: dict[str, Any]) -> None:
    print(f"CPU: {result['cpu']}")
    shared = result["shared_prefix"]
    what = (f"{result['query_len']} queries a sequence after a shared prefix of {shared} tokens, paged_attention"
            if shared else "decode attention")
    print(f"{result['model']} ({result['dtype']}, KV {result['kv_cache_dtype']}, blocks of {result['block_size']}"
          f"{', scattered' if result['scatter'] else ''}): {what} over {result['layers']} layers a step")
    rate = f"{'GFLOP/s':>9} {'cascade':>8}" if shared else f"{'K/V GB/s':>9}"
    print(f"{'sequences':>10} {'context':>8} {'ms/step':>9} {rate}")
    for row in result["steps"]:
        rate = f"{row['gflop_per_s']:>9.1f} {row['cascade_prefix']:>8}" if shared else f"{row['gb_per_s']:>9.1f}"
        print(f"{row['num_seqs']:>10} {row['context_len']:>8} {row['ms_per_step']:>9.2f} {rate}")
