"""What this CPU can do, read at run time: the one place every CPU fast path asks.

    cpu = cpu_info()
    cpu.isa_level          # "avx512", "avx2" or "baseline" on x86-64; "neon" on ARM
    cpu.native_bf16        # bf16 dot products in hardware (AVX512-BF16, AMX-BF16, ARM BF16)
    cpu.march              # the -march the C++ kernels are built with
    onednn_bf16_ok()       # torch's oneDNN can prepack and multiply bf16 weights here
    torch_bf16_is_native() # ... on bf16 instructions, so bf16 is the fastest dtype of torch's matmuls

`PAGEDLLM_MAX_CPU_ISA=avx2` (or `baseline`) makes this module report a smaller CPU, as `ONEDNN_MAX_CPU_ISA` does
for oneDNN: the kernels are then built for that level and no faster path is taken. It is how an AVX-512 machine
runs the AVX2 code, and how the tests reach every path on one machine. Torch's own checks read the CPU itself,
so nothing in pagedllm asks torch about features without going through here.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

# The features pagedllm's paths care about, as /proc/cpuinfo names them.
FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni",
            "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "bf16")
_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
X86_LEVELS = ("baseline", "avx2", "avx512")  # lowest first
# Each level's -march for the kernels (x86-64-v3 is AVX2 + FMA + F16C + BMI; v4 adds AVX-512 F/BW/VL/DQ/CD).
_MARCH = {"baseline": "x86-64", "avx2": "x86-64-v3", "avx512": "x86-64-v4"}
# What each capped level may still report (features above it are dropped).
_ALLOWED = {"baseline": frozenset(), "avx2": _AVX2, "avx512": _AVX2 | _AVX512 | {"avx512_vnni"}}
MAX_ISA_ENV = "PAGEDLLM_MAX_CPU_ISA"


@dataclass(frozen=True)
class CpuInfo:
    """One CPU as pagedllm sees it. `flags` holds the FEATURES it has, after any PAGEDLLM_MAX_CPU_ISA cap."""

    machine: str            # platform.machine(): "x86_64", "aarch64", "arm64", ...
    model_name: str
    flags: frozenset[str]
    capped: bool = False    # PAGEDLLM_MAX_CPU_ISA took features away

    @property
    def is_x86(self) -> bool:
        return self.machine.lower() in ("x86_64", "amd64", "i686", "i386")

    @property
    def isa_level(self) -> str:
        if not self.is_x86:
            return "neon" if self.machine.lower() in ("aarch64", "arm64") else "baseline"
        if _AVX512 <= self.flags:
            return "avx512"
        return "avx2" if _AVX2 <= self.flags else "baseline"

    @property
    def native_bf16(self) -> bool:
        return bool({"avx512_bf16", "amx_bf16", "bf16"} & self.flags)

    @property
    def bf16_dot_outruns_fma(self) -> bool:
        """Whether bf16 dot products here do more work per cycle than float32 FMAs, so that oneDNN's bf16 matmul
        beats pagedllm's kernel (bf16 widened, float32 FMAs): with AMX tiles, and where `bf16_vectors_at_fma_rate`.
        """
        return "amx_bf16" in self.flags or self.bf16_vectors_at_fma_rate

    @property
    def bf16_vectors_at_fma_rate(self) -> bool:
        """AMD's AVX512-BF16 (Zen 4 and later): VDPBF16PS at the FMA's rate, two products each (oneDNN measured ~3x
        the float32 FMA peak there). An Intel CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids, a VM that hides
        AMX) issues it at half its FMA's rate: pagedllm's kernel ran the mixed workload 1.27x faster than oneDNN on
        one, and value rows weighed with VDPBF16PS in decode attention 0.85-0.9x as fast as widened ones."""
        return "avx512_bf16" in self.flags and self.is_amd

    @property
    def int8_dot_products(self) -> bool:
        """AVX512-VNNI's VPDPBUSD: 64 byte products summed into int32 by one instruction, where pagedllm's GGUF and
        int8 kernels multiply integer weights by quantized activations. Without it (AVX2's VPMADDUBSW and VPMADDWD,
        plain C++) the same products take about as many instructions as float32 FMAs on widened weights, so 4-bit
        blocks save bytes but no arithmetic: on a Zen 3, one stream 1.41x faster than bf16 weights, a batch of ~50
        0.79x (docs/benchmarks.md)."""
        return self.isa_level == "avx512" and "avx512_vnni" in self.flags

    @property
    def is_amd(self) -> bool:
        """AMD's model names all start with "AMD"."""
        return self.model_name.startswith("AMD")

    @property
    def march(self) -> str:
        """-march for the C++ kernels: the CPU's own (native) unless capped, then the capped level's, with
        "+avx512vnni" (built with -mavx512vnni too) at the AVX-512 level where the CPU has VNNI: x86-64-v4 lacks it,
        and without it the cap ran the GGUF and W8A8 kernels' AVX2 paths where an Ice Lake runs `vpdpbusd`."""
        if not (self.capped and self.is_x86):
            return "native"
        vnni = self.isa_level == "avx512" and "avx512_vnni" in self.flags
        return _MARCH[self.isa_level] + ("+avx512vnni" if vnni else "")

    def describe(self) -> str:
        """One line for the start-up log, e.g. "AMD EPYC (x86_64, avx2: avx2 f16c fma; no native bf16)"."""
        features = " ".join(f for f in FEATURES if f in self.flags) or "none of interest"
        bf16 = "native bf16" if self.native_bf16 else "no native bf16"
        cap = f", capped by {MAX_ISA_ENV}" if self.capped else ""
        return f"{self.model_name} ({self.machine}, {self.isa_level}: {features}; {bf16}{cap})"


def cpu_info(max_isa: str | None = None) -> CpuInfo:
    """This machine's CPU, capped at `max_isa` (default: $PAGEDLLM_MAX_CPU_ISA) when that is set.

    A cap at or below the CPU's level reports exactly that level's features (and its -march); a cap that takes
    no feature away (AVX2 on a Zen 3, whose native build runs the AVX2 paths), a cap above the CPU's level, or one
    on a CPU that is not x86, changes nothing.
    """
    machine, model_name, flags = _read_cpu()
    cpu = CpuInfo(machine, model_name, flags)
    cap = max_isa or os.environ.get(MAX_ISA_ENV)
    if not cap:
        return cpu
    if cap not in X86_LEVELS:
        raise ValueError(f"{MAX_ISA_ENV} must be one of {', '.join(X86_LEVELS)}, got {cap!r}")
    if not cpu.is_x86 or X86_LEVELS.index(cap) > X86_LEVELS.index(cpu.isa_level) or cpu.flags <= _ALLOWED[cap]:
        return cpu
    return CpuInfo(machine, model_name, flags & _ALLOWED[cap], capped=True)


def runnable_levels() -> list[str]:
    """The x86 levels this CPU runs below its own, highest first ("avx2", "baseline"); none off x86. A level is
    below when its cap takes features away: a Zen 3's native build is its AVX2 level, not built and tested twice.

    Each is a PAGEDLLM_MAX_CPU_ISA value whose kernels are built and tested beside the native ones.
    """
    cpu = cpu_info()
    if not cpu.is_x86:
        return []
    return [level for level in ("avx2", "baseline") if not cpu.flags <= _ALLOWED[level]]


def onednn_bf16_ok() -> bool:
    """True when torch's oneDNN runs bf16 linears here (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT).

    Torch is asked, not second-guessed; a cap below AVX-512 says no whatever torch finds. (Imported here: the rest of
    this module does not need torch, and `pagedllm --help` builds its parsers from modules that import this one.)
    """
    import torch

    if cpu_info().isa_level != "avx512" or not torch.backends.mkldnn.is_available():
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def torch_bf16_is_native() -> bool:
    """Whether torch's bf16 matmuls (oneDNN's) run on bf16 instructions here, which makes bf16 the fastest dtype of
    the peers that multiply in torch (transformers, vLLM-CPU). Where oneDNN runs bf16 without them (AVX-512 without
    AVX512-BF16: Ice Lake, Skylake), it converts and multiplies in float32, about 2x slower than float32 itself
    (vLLM-CPU on an Ice Lake Xeon: 61 against 131 output tok/s on the mixed workload)."""
    return onednn_bf16_ok() and cpu_info().native_bf16


@functools.cache  # the CPU does not change under a process; the kernels ask on every call
def _read_cpu() -> tuple[str, str, frozenset[str]]:
    machine = platform.machine() or "unknown"
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: name the machine, assume no optional feature (ARM still gets NEON, its baseline)
        return machine, platform.processor() or machine, frozenset()
    return (machine, *parse_cpuinfo(text, default_name=machine))


def parse_cpuinfo(text: str, default_name: str = "unknown") -> tuple[str, frozenset[str]]:
    """(model name, the FEATURES listed) from /proc/cpuinfo's text: x86 lists "flags", ARM "Features"."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    words = set((fields.get("flags") or fields.get("features") or "").split())
    return fields.get("model name") or default_name, frozenset(words) & set(FEATURES)
