"""The C++ layer kernels (pagedllm/kernels/csrc/layers.cpp) against the torch reference of each layer.

Each layer's `forward` takes the kernel on the CPU and `forward_native` is the plain torch code; both must agree
in float32 to float rounding and in bfloat16/float16 to one rounding step of the storage type.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.activation import GeluAndMul, SiluAndMul
from pagedllm.layers.norm import LayerNorm, PreLayerNorm, RMSNorm
from pagedllm.layers.rotary import get_rope

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Row counts on either side of the kernels' per-thread grain; widths that are and are not multiples of a vector.
SHAPES = [(1, 576), (7, 40), (300, 576)]


def _tol(dtype: torch.dtype) -> dict:
    # float32: float rounding; half types: one rounding of the storage type (the kernels round where torch does,
    # but sums are taken in a different order, so a value on a rounding boundary may land on the other side).
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=8e-3),
            torch.float16: dict(atol=1e-3, rtol=1e-3)}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_kernel_matches_torch(dtype: torch.dtype, shape: tuple[int, int], isa_level: str) -> None:
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(*shape, generator=g).mul(3).to(dtype) for _ in range(2))
    norm = RMSNorm(shape[1], eps=1e-5, dtype=dtype)
    norm.weight.data.copy_(torch.randn(shape[1], generator=g))
    x_before, residual_before = x.clone(), residual.clone()
    torch.testing.assert_close(norm(x), norm.forward_native(x), **_tol(dtype))
    out, new_residual = norm(x, residual)
    expected_out, expected_residual = norm.forward_native(x, residual)
    assert torch.equal(new_residual, expected_residual)  # one rounded add: the same bits
    torch.testing.assert_close(out, expected_out, **_tol(dtype))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs untouched


def test_rms_norm_kernel_reads_strided_rows(isa_level: str) -> None:
    base = torch.randn(9, 80)
    x = base[:, 8:72]  # rows 80 apart
    norm = RMSNorm(64)
    torch.testing.assert_close(norm(x), norm.forward_native(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("act", [SiluAndMul(), GeluAndMul()], ids=["silu", "gelu_tanh"])
def test_gated_activation_kernels_match_torch(dtype: torch.dtype, shape: tuple[int, int], act: torch.nn.Module,
                                              isa_level: str) -> None:
    x = torch.randn(shape[0], 2 * shape[1], generator=torch.Generator().manual_seed(1)).mul(4).to(dtype)
    torch.testing.assert_close(act(x), act.forward_native(x), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_kernel_matches_torch(dtype: torch.dtype, shape: tuple[int, int], isa_level: str) -> None:
    """Alone, with the residual added first, and with a row broadcast as the residual (BERT's token type row)."""
    g = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(*shape, generator=g).mul(3).add(1).to(dtype) for _ in range(2))
    norm = LayerNorm(shape[1], eps=1e-12, dtype=dtype)
    norm.weight.data.copy_(torch.randn(shape[1], generator=g))
    norm.bias.data.copy_(torch.randn(shape[1], generator=g))
    x_before = x.clone()
    for extra in (None, residual, residual[0]):
        torch.testing.assert_close(norm(x, extra), norm.forward_native(x, extra), **_tol(dtype))
    assert torch.equal(x, x_before)
    # as a pre-norm decoder's (PreLayerNorm): the norm of the sum, and the sum in the model dtype
    pre = PreLayerNorm(shape[1], eps=1e-5, dtype=dtype)
    pre.load_state_dict(norm.state_dict())
    torch.testing.assert_close(pre(x), pre.forward_native(x), **_tol(dtype))
    (out, total), (out_ref, total_ref) = pre(x, residual), pre.forward_native(x, residual)
    torch.testing.assert_close(out, out_ref, **_tol(dtype))
    assert torch.equal(total, x + residual) and torch.equal(total_ref, x + residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 200])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("turned", [1.0, 0.75])
def test_rotary_kernel_matches_torch(dtype: torch.dtype, num_tokens: int, head_dim: int, turned: float,
                                     isa_level: str) -> None:
    """q and k are views into one qkv projection, as the attention layer hands them over; all of each head turned,
    or its first 3/4 (Phi-4-mini's partial_rotary_factor), the rest left as it was."""
    g = torch.Generator().manual_seed(2)
    rope = get_rope(int(head_dim * turned), 4096, 10000.0)
    heads, kv_heads = 9, 3
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g)

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim)

    expected_q, expected_k = rope.forward_native(positions, *split(qkv.clone()))
    qkv_kernel = qkv.clone()
    q, k = rope(positions, *split(qkv_kernel))
    torch.testing.assert_close(q, expected_q, **_tol(dtype))
    torch.testing.assert_close(k, expected_k, **_tol(dtype))
    v_offset = (heads + kv_heads) * head_dim
    assert torch.equal(qkv_kernel[:, v_offset:], qkv[:, v_offset:])  # v untouched


def test_rotary_kernel_rejects_a_position_outside_its_cache() -> None:
    rope = get_rope(16, 8, 10000.0)
    q, k = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    with pytest.raises(RuntimeError, match="outside the rotary cache"):
        rope(torch.tensor([3, 8]), q, k)


def test_layers_use_torch_when_kernels_are_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedllm.kernels as kernels

    monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
    monkeypatch.setattr(kernels, "cpu_kernels", lambda: pytest.fail("the kernels were used"))
    x = torch.randn(3, 8)
    norm = RMSNorm(8)
    assert torch.equal(norm(x), norm.forward_native(x))
    assert torch.equal(SiluAndMul()(x), SiluAndMul().forward_native(x))
    assert torch.equal(GeluAndMul()(x), GeluAndMul().forward_native(x))
    layer_norm = LayerNorm(8)
    assert torch.equal(layer_norm(x, x), layer_norm.forward_native(x, x))
    rope = get_rope(8, 4, 10000.0)
    q, k, positions = torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.tensor([1, 3])
    expected = rope.forward_native(positions, q, k)
    assert all(torch.equal(a, b) for a, b in zip(rope(positions, q, k), expected))


def test_a_build_killed_half_way_does_not_block_the_next(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """torch's `lock` file, left behind by a build killed half-way, would make every later build wait on it
    forever; under pagedllm's flock (released when its holder dies) it is cleared before torch looks."""
    from torch.utils import cpp_extension

    from pagedllm.kernels import build_kernels

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    lock_seen = []

    def fake_load(build_directory: str, **kwargs) -> str:
        lock_seen.append((tmp_path / "kernels" / build_directory / "lock").exists())
        return "built"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert build_kernels.__wrapped__("x86-64") == "built"
    (build_dir,) = (tmp_path / "kernels").iterdir()
    (build_dir / "lock").touch()   # what a killed build leaves
    assert build_kernels.__wrapped__("x86-64") == "built"
    assert lock_seen == [False, False]


def test_a_build_that_loaded_once_is_imported_without_the_build_tools(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path) -> None:
    """Later processes import a loaded build's library directly (no cpp_extension, no ninja check); a library
    that no longer loads is built again rather than failing."""
    import shutil
    from pathlib import Path

    from torch.utils import cpp_extension

    from pagedllm.kernels import build_kernels

    real = build_kernels("x86-64")
    if real is None:
        pytest.skip("no C++ compiler here: the kernels cannot be built")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    builds = []

    def fake_load(name: str, build_directory: str, **kwargs):
        builds.append(name)
        library = Path(build_directory) / f"{name}.so"
        if name == "pagedllm_cpu_kernels_x86_64":
            shutil.copy(real.__file__, library)
        else:
            library.write_bytes(b"not a library")  # stands for one broken since it loaded
        return real

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert build_kernels.__wrapped__("x86-64") is real
    assert hasattr(build_kernels.__wrapped__("x86-64"), "linear_packed")
    assert builds == ["pagedllm_cpu_kernels_x86_64"]
    assert build_kernels.__wrapped__("x86-64-v2") is real
    assert build_kernels.__wrapped__("x86-64-v2") is real
    assert builds == ["pagedllm_cpu_kernels_x86_64"] + ["pagedllm_cpu_kernels_x86_64_v2"] * 2


def test_kernels_fixed_reads_the_environment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a forward pass the runner holds `kernels_fixed`: the layers' ~500 questions a step are answered from
    one reading of the environment, taken when it was entered; after it, and in other threads, the environment
    counts again."""
    import threading

    from pagedllm.kernels import cpu_kernels, kernels_disabled, kernels_fixed, kernels_for

    monkeypatch.delenv("PAGEDLLM_DISABLE_KERNELS", raising=False)
    built = cpu_kernels()
    if built is None:
        pytest.skip("pagedllm's CPU kernels are not built here")
    x = torch.zeros(2)
    seen_elsewhere = []
    with kernels_fixed():
        monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
        assert not kernels_disabled() and kernels_for(x) is built
        other = threading.Thread(target=lambda: seen_elsewhere.append(kernels_disabled()))
        other.start()
        other.join()
    assert seen_elsewhere == [True]
    assert kernels_disabled() and kernels_for(x) is None


@pytest.mark.parametrize(("n", "parts"), [(0, 2), (1, 2), (5, 2), (100, 2), (7, 3), (64, 1)])
def test_parallel_units_deals_every_unit_once(n: int, parts: int, isa_level: str) -> None:
    """parallel_units (ops.h), which deals the linear and attention kernels' work to the threads: each unit taken
    by exactly one thread, whatever the number of parts against threads (more parts than threads: a thread runs
    several)."""
    from pagedllm.kernels import cpu_kernels

    owners = cpu_kernels().parallel_units_owners(n, parts, 0.0)
    assert len(owners) == n and all(owner >= 0 for owner in owners), owners


def test_parallel_units_lets_a_fast_thread_take_a_slow_ones_units(isa_level: str) -> None:
    """Thread 0 sleeps 20 ms after each unit: thread 1 takes its own half, then thread 0's units from the back of
    thread 0's range, so that thread 0 runs a contiguous first few (none, when thread 1 is through before thread 0
    starts) and thread 1 all the rest."""
    from pagedllm.kernels import cpu_kernels

    if torch.get_num_threads() < 2:
        pytest.skip("needs two threads for the kernels: torch has one here")
    owners = cpu_kernels().parallel_units_owners(40, 2, 0.02)
    first = owners.count(0)
    assert owners == [0] * first + [1] * (40 - first), owners
    assert first < 20, f"thread 1 should have taken some of thread 0's 20 units: {owners}"


def test_the_build_command_builds_the_levels_asked_for_and_refuses_others() -> None:
    """`python -m pagedllm.kernels native` (what `make serve` runs) builds this CPU's own level alone; a -march this
    CPU does not run is refused, naming those it does, before anything is built."""
    import subprocess
    import sys

    from pagedllm.kernels import cpu_kernels, kernel_marches

    if cpu_kernels() is None:
        pytest.skip("no C++ compiler here: the kernels cannot be built")

    def run(*marches: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pagedllm.kernels", *marches], capture_output=True, text=True,
                              timeout=600)

    native = run("native")     # built by the set-up (make test): a load, not a compile
    assert native.returncode == 0 and native.stdout.strip() == "pagedllm kernels built for -march=native"
    refused = run("native", "znver9")
    assert refused.returncode == 1 and refused.stdout == ""
    assert f"runs the kernels at -march={', '.join(kernel_marches())}, not znver9" in refused.stderr
