"""pagedllm's C++ CPU kernels, compiled on first use and cached.

`torch.utils.cpp_extension.load` builds `csrc/paged_attention.cpp` for this machine (-O3 -march=native) into
pagedllm's cache folder; later processes load the built library in a fraction of a second. When no compiler
is available the kernels are reported missing and the torch backend is used instead.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path
from types import ModuleType

import torch

from pagedllm.paths import cache_dir

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled kernel module, or None if it cannot be built here."""
    from torch.utils import cpp_extension

    # Keyed by the source, torch and the CPU, since -march=native code is only valid on this kind of CPU.
    key = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode() + _cpu_signature().encode())
    build_dir = cache_dir() / "kernels" / key.hexdigest()[:16]
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(name="pagedllm_cpu_kernels", sources=[str(_SOURCE)],
                                  extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
                                  extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path"
        logger.warning("pagedllm's CPU kernels could not be built (%s); using the slower torch attention", exc)
        return None


def _cpu_signature() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + flags
