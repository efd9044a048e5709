"""pagedllm's C++ CPU kernels, compiled on first use and cached.

`torch.utils.cpp_extension.load` builds `csrc/*.cpp` for this machine (-O3 -march=native) into pagedllm's cache
folder; later processes load the built library in a fraction of a second. When no compiler is available, or
`PAGEDLLM_DISABLE_KERNELS=1`, the kernels are reported missing and every caller uses its torch path instead.

    kernels = kernels_for(x)        # None off the CPU, when disabled, or when the build failed
    if kernels is None:
        return torch_path(x)
    kernels.rms_norm(out, x, weight, eps)
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

import torch

from pagedllm.paths import cache_dir

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"


def kernels_disabled() -> bool:
    """PAGEDLLM_DISABLE_KERNELS=1: run plain torch everywhere (no C++ kernels, no prepacked weights)."""
    return os.environ.get("PAGEDLLM_DISABLE_KERNELS") == "1"


def kernels_for(tensor: torch.Tensor) -> ModuleType | None:
    """The kernel module if `tensor`'s computation should use it: on the CPU, not disabled, built."""
    if tensor.device.type != "cpu" or kernels_disabled():
        return None
    return cpu_kernels()


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled kernel module, or None if it cannot be built here."""
    from torch.utils import cpp_extension

    sources = sorted(_CSRC.glob("*.cpp"))
    # Keyed by the sources, torch and the CPU, since -march=native code is only valid on this kind of CPU.
    key = hashlib.sha256(torch.__version__.encode() + _cpu_signature().encode())
    for path in sorted(_CSRC.iterdir()):
        key.update(path.name.encode() + path.read_bytes())
    build_dir = cache_dir() / "kernels" / key.hexdigest()[:16]
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(name="pagedllm_cpu_kernels", sources=[str(s) for s in sources],
                                  extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
                                  extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path"
        logger.warning("pagedllm's CPU kernels could not be built (%s); using the slower torch paths", exc)
        return None


def _cpu_signature() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + flags
