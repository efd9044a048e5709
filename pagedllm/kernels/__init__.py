"""pagedllm's C++ CPU kernels, compiled on first use and cached.

`torch.utils.cpp_extension.load` builds `csrc/*.cpp` for this CPU (`-march` from pagedllm.cpu: native, or the
level PAGEDLLM_MAX_CPU_ISA caps it to) into pagedllm's cache folder; later processes load the built library in a
fraction of a second. When no compiler is available, or `PAGEDLLM_DISABLE_KERNELS=1`, the kernels are reported
missing and every caller uses its torch path instead. `python -m pagedllm.kernels` builds every level this CPU
can run (`make test` does, so that the tests of each level find it built).

    kernels = kernels_for(x)        # None off the CPU, when disabled, or when the build failed
    if kernels is None:
        return torch_path(x)
    kernels.rms_norm(out, x, weight, eps)

The sources keep each ISA's code behind the compiler's macros (`__AVX512F__`, `__AVX2__`, ...) with a plain C++
path beside it, so one source builds at every level.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import ModuleType

import torch

from pagedllm.cpu import MAX_ISA_ENV, cpu_info, runnable_levels
from pagedllm.paths import cache_dir

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_BUILT_MARKER = "pagedllm-built"  # written once a build has loaded; a killed build leaves none


# Within `kernels_fixed`: PAGEDLLM_DISABLE_KERNELS == "1" and PAGEDLLM_MAX_CPU_ISA, as read when it was entered.
_fixed_env: ContextVar[tuple[bool, str | None] | None] = ContextVar("pagedllm_kernel_env", default=None)


def _disabled_in_env() -> bool:
    return os.environ.get("PAGEDLLM_DISABLE_KERNELS") == "1"


def kernels_disabled() -> bool:
    """PAGEDLLM_DISABLE_KERNELS=1: run plain torch everywhere (no C++ kernels, no prepacked weights)."""
    fixed = _fixed_env.get()
    return fixed[0] if fixed is not None else _disabled_in_env()


def kernels_for(tensor: torch.Tensor) -> ModuleType | None:
    """The kernel module if `tensor`'s computation should use it: on the CPU, not disabled, built."""
    if tensor.device.type != "cpu" or kernels_disabled():
        return None
    return cpu_kernels()


def cpu_kernels() -> ModuleType | None:
    """The kernel module built for this CPU (or its PAGEDLLM_MAX_CPU_ISA cap), or None if it cannot be built."""
    fixed = _fixed_env.get()
    return _kernels_under_cap(fixed[1] if fixed is not None else os.environ.get(MAX_ISA_ENV))


@contextmanager
def kernels_fixed() -> Iterator[None]:
    """Within it (in this thread), `kernels_disabled`, `kernels_for` and `cpu_kernels` answer from one reading of
    the environment instead of one per call: a model step asks ~500 times, at ~1 us a reading. The runner holds it
    over each forward pass, so a change to PAGEDLLM_DISABLE_KERNELS or PAGEDLLM_MAX_CPU_ISA counts from the next."""
    token = _fixed_env.set((_disabled_in_env(), os.environ.get(MAX_ISA_ENV)))
    try:
        yield
    finally:
        _fixed_env.reset(token)


@functools.cache  # every kernel call asks: one dict lookup per cap, not a CpuInfo each time
def _kernels_under_cap(cap: str | None) -> ModuleType | None:
    return build_kernels(cpu_info(cap).march)


def kernel_marches() -> list[str]:
    """Every -march this CPU runs the kernels at: native, then each lower level's (x86-64-v3 = AVX2, x86-64)."""
    return ["native"] + [cpu_info(level).march for level in runnable_levels()]


@functools.cache
def build_kernels(march: str) -> ModuleType | None:
    """The kernels compiled with `-march=march` (each level its own cached build), or None if that fails; a march
    "base+feature" (`CpuInfo.march`) is `-march=base -mfeature`.

    A folder whose build once loaded is imported directly: its key covers everything ninja would check, and
    `torch.utils.cpp_extension` (setuptools with it) and ninja's up-to-date check cost ~0.2 s of a cold start.
    """
    sources = sorted(_CSRC.glob("*.cpp"))
    # -fno-trapping-math changes no result (pagedllm never reads the FP exception flags); without it GCC keeps a
    # select like `x < lo ? 0 : p * s` a branch where AVX2 has no masked ops, and the loop stays scalar.
    # -mprefer-vector-width=512: where the CPU has AVX-512, GCC vectorizes the plain loops (layers.cpp's norms and
    # gated activations) 16 floats wide instead of 8: 1.4-1.5x their bf16 rates on the AMX Xeon, ~7% of an encoder's
    # prefill; elsewhere it changes nothing.
    base, *features = march.split("+")
    cflags = ["-O3", f"-march={base}", *(f"-m{feature}" for feature in features), "-fopenmp", "-fno-math-errno",
              "-fno-trapping-math", "-mprefer-vector-width=512"]
    # Keyed by the sources and their folder (ninja rebuilds when the command line, which names them, changes),
    # the flags, torch and, for native, the CPU: native code is only valid on this CPU.
    signature = _cpu_signature() if march == "native" else ""
    key = hashlib.sha256(f"{torch.__version__}|{cflags}|{signature}|{_CSRC.resolve()}".encode())
    for path in sorted(_CSRC.iterdir()):
        key.update(path.name.encode() + path.read_bytes())
    build_dir = cache_dir() / "kernels" / key.hexdigest()[:16]
    build_dir.mkdir(parents=True, exist_ok=True)
    name = "pagedllm_cpu_kernels" + ("" if march == "native" else "_" + march.replace("-", "_").replace("+", "_"))
    built = build_dir / _BUILT_MARKER
    if built.exists():
        try:
            return _import_library(name, build_dir / f"{name}.so")
        except (ImportError, OSError):  # the library went missing or broken since: build it again
            built.unlink(missing_ok=True)
    from torch.utils import cpp_extension

    try:
        with _build_guard(build_dir):
            module = cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=cflags,
                                        extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
        built.touch()
        return module
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path"
        logger.warning("pagedllm's CPU kernels could not be built for -march=%s (%s); using the slower torch paths",
                       march, exc)
        return None


def _import_library(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@contextmanager
def _build_guard(build_dir: Path) -> Iterator[None]:
    """One builder per folder at a time, and no wait on a dead one.

    torch marks a build in progress with a `lock` file that only the builder removes: a build killed half-way
    (Ctrl-C, a timeout) leaves it behind, and every later process then waits on it forever. An flock is released
    by the kernel when its holder dies, however it dies; under it, a `lock` file left there is a dead builder's.
    """
    with open(build_dir / "pagedllm-build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def _cpu_signature() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return cpu_info().machine + flags
