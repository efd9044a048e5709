"""pagedllm.cpu: the features read from /proc/cpuinfo, the ISA level, and the PAGEDLLM_MAX_CPU_ISA cap."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm import cpu
from pagedllm.cpu import CpuInfo, cpu_info, onednn_bf16_ok, parse_cpuinfo, torch_bf16_is_native

ZEN4 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                  "avx512_vnni"})
ZEN3 = frozenset({"avx2", "fma", "f16c"})
ICE_LAKE = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"})


@pytest.fixture
def zen4(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this module see a Zen 4, whatever the test machine is."""
    monkeypatch.setattr(cpu, "_read_cpu", lambda: ("x86_64", "AMD EPYC 9R14", ZEN4))
    monkeypatch.delenv(cpu.MAX_ISA_ENV, raising=False)


def test_parse_x86_and_arm_cpuinfo() -> None:
    x86 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma f16c sha_ni avx512f\n\n" \
          "processor\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma f16c sha_ni avx512f\n"
    assert parse_cpuinfo(x86) == ("AMD EPYC", frozenset({"avx2", "fma", "f16c", "avx512f"}))
    arm = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes bf16 i8mm\nCPU part\t: 0xd40\n"
    assert parse_cpuinfo(arm, default_name="aarch64") == ("aarch64", frozenset({"asimd", "bf16"}))


def test_levels_and_marches() -> None:
    assert CpuInfo("x86_64", "zen4", ZEN4).isa_level == "avx512"
    assert CpuInfo("x86_64", "zen4", ZEN4).native_bf16
    zen3 = CpuInfo("x86_64", "zen3", ZEN3)
    assert (zen3.isa_level, zen3.native_bf16, zen3.march) == ("avx2", False, "native")
    assert CpuInfo("x86_64", "old", frozenset({"avx2"})).isa_level == "baseline"  # AVX2 without FMA is not v3
    arm = CpuInfo("aarch64", "graviton", frozenset({"asimd"}))
    assert (arm.isa_level, arm.is_x86, arm.march) == ("neon", False, "native")
    assert "no native bf16" in zen3.describe() and "avx2" in zen3.describe()


def test_bf16_dot_products_outrun_fmas_with_amx_and_on_amd() -> None:
    """In tiles (AMX) or in AMD's vectors; Intel's VDPBF16PS runs at half its FMA's rate, with AMX or without."""
    zen4 = CpuInfo("x86_64", "AMD EPYC 9R14 96-Core Processor", ZEN4)
    intel = CpuInfo("x86_64", "Intel(R) Xeon(R) Processor", ZEN4)  # AVX512-BF16, no AMX
    sapphire_rapids = CpuInfo("x86_64", "Intel(R) Xeon(R) Platinum 8480+", ZEN4 | {"amx_tile", "amx_bf16"})
    zen3 = CpuInfo("x86_64", "AMD EPYC 7R13", ZEN3)
    assert [cpu.bf16_dot_outruns_fma for cpu in (zen4, intel, sapphire_rapids, zen3)] == [True, False, True, False]
    assert [cpu.bf16_vectors_at_fma_rate for cpu in (zen4, intel, sapphire_rapids, zen3)] == [True, False, False, False]


def test_this_machine_matches_proc_cpuinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu.MAX_ISA_ENV, raising=False)     # the machine itself, also in a suite run under a cap
    info = cpu_info()
    try:
        flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text())[1]
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    assert info.flags == flags and not info.capped
    assert info.native_bf16 == bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def test_bf16_is_native_only_with_bf16_instructions(zen4, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer's bf16 is only fast where the CPU computes bf16: on a Zen 4 when torch's oneDNN runs bf16 at all (the
    real CPU answers that), never on an AVX-512 CPU without AVX512-BF16, where oneDNN emulates it."""
    assert torch_bf16_is_native() == onednn_bf16_ok()
    monkeypatch.setattr(cpu, "_read_cpu", lambda: ("x86_64", "Intel(R) Xeon(R) Processor", ICE_LAKE))
    assert cpu_info().isa_level == "avx512" and not cpu_info().native_bf16
    assert not torch_bf16_is_native()


def test_cap_to_avx2_hides_avx512(zen4, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_info().isa_level == "avx512" and cpu_info().march == "native"
    monkeypatch.setenv(cpu.MAX_ISA_ENV, "avx2")
    capped = cpu_info()
    assert (capped.isa_level, capped.march, capped.native_bf16, capped.capped) == ("avx2", "x86-64-v3", False, True)
    assert not onednn_bf16_ok()  # whatever torch finds on the real CPU
    assert "capped" in capped.describe()
    monkeypatch.setenv(cpu.MAX_ISA_ENV, "baseline")
    assert (cpu_info().isa_level, cpu_info().march, cpu_info().flags) == ("baseline", "x86-64", frozenset())
    monkeypatch.setenv(cpu.MAX_ISA_ENV, "avx512")   # Zen 4 at Ice Lake's level: AVX-512 and its VNNI, no bf16
    assert (cpu_info().isa_level, cpu_info().march, cpu_info().native_bf16) == ("avx512", "x86-64-v4+avx512vnni", False)
    monkeypatch.setattr(cpu, "_read_cpu", lambda: ("x86_64", "AMD EPYC", ZEN4 - {"avx512_vnni"}))
    assert cpu_info().march == "x86-64-v4"


def test_a_cap_above_the_cpu_or_taking_nothing_away_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "_read_cpu", lambda: ("x86_64", "AMD EPYC", ZEN3))
    monkeypatch.setenv(cpu.MAX_ISA_ENV, "avx512")
    assert cpu_info() == CpuInfo("x86_64", "AMD EPYC", ZEN3)
    at_level = cpu_info("avx2")  # an argument overrides the environment; AVX2 is all a Zen 3 has: its native build
    assert at_level == CpuInfo("x86_64", "AMD EPYC", ZEN3) and at_level.march == "native"
    below = cpu_info("baseline")
    assert (below.isa_level, below.march, below.capped) == ("baseline", "x86-64", True)


def test_runnable_levels(zen4, monkeypatch: pytest.MonkeyPatch) -> None:
    """The levels below the CPU's own: the native build runs its own level's code (a Zen 3's -march=native takes
    the AVX2 paths that -march=x86-64-v3 would), so building and testing that level again would repeat it."""
    assert cpu.runnable_levels() == ["avx2", "baseline"]
    monkeypatch.setattr(cpu, "_read_cpu", lambda: ("x86_64", "AMD EPYC", ZEN3))
    assert cpu.runnable_levels() == ["baseline"]
    monkeypatch.setenv(cpu.MAX_ISA_ENV, "baseline")   # capped to the lowest level: nothing below it
    assert cpu.runnable_levels() == []
    monkeypatch.delenv(cpu.MAX_ISA_ENV)
    monkeypatch.setattr(cpu, "_read_cpu", lambda: ("x86_64", "old", frozenset()))
    assert cpu.runnable_levels() == []
    monkeypatch.setattr(cpu, "_read_cpu", lambda: ("aarch64", "graviton", frozenset({"asimd"})))
    assert cpu.runnable_levels() == []


def test_a_bad_cap_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu.MAX_ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="PAGEDLLM_MAX_CPU_ISA must be one of baseline, avx2, avx512"):
        cpu_info()
