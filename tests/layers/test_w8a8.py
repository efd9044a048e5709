"""The W8A8 kernel (pagedllm/kernels/csrc/linear_int8.cpp) against `w8a8_reference`, bit for bit.

The kernel quantizes x's rows as the reference does (a scale per span of 64 k's), sums each span's int8 x int8
products exactly in int32 and then does the reference's float32 operations in its order, so at every ISA level
(VNNI, AVX2's sign trick, plain C++; AMX tiles for 12 rows or more where the CPU has AMX-INT8) the output must be
*equal*, not close.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from pagedllm.kernels import cpu_kernels
from pagedllm.layers.linear import W8A8_SPAN, quantize_int8, w8a8_reference


@pytest.fixture
def kernels(isa_level: str) -> ModuleType:
    """The kernel module of each ISA level this CPU runs (see tests/conftest.py)."""
    return cpu_kernels()


def _x(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random rows, but rows 1-5: a zero row (scale 1), rows of huge and tiny magnitude, a row of exact ties for
    the rounding (x / s = 0.5, 1.5, 2.5, -2.5: ties go to even; every span holds a 127), and a row whose spans
    differ by 10^6 in magnitude (one of them zero)."""
    x = torch.randn(m, k, generator=g)
    x[1] = 0
    x[2], x[3] = x[0] * 1e30, x[0] * 1e-30
    x[4] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5] * k)[:k]
    x[5, :W8A8_SPAN] *= 1e3
    x[5, W8A8_SPAN:2 * W8A8_SPAN] *= 1e-3
    x[5, 3 * W8A8_SPAN:4 * W8A8_SPAN] = 0
    return x


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
# N: one partial block, whole and partial blocks (fewer blocks than threads: the threads split row tiles); K: a
# partial group of 4 in one partial span, SmolLM2's hidden size (9 spans), an odd size over 1,000 (a partial span).
@pytest.mark.parametrize(("n", "k"), [(9, 13), (40, 576), (72, 1001)])
def test_w8a8_kernel_gives_the_references_bits(kernels: ModuleType, x_dtype: torch.dtype, with_bias: bool, n: int,
                                               k: int) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    q, scale = quantize_int8(torch.randn(n, k, generator=g))
    packed, col_sums = kernels.pack_w8a8_weight(q)
    bias = torch.randn(n, generator=g).to(x_dtype) if with_bias else None
    x_all = _x(100, k, g).to(x_dtype)
    for m in (1, 2, 5, 8, 9, 12, 16, 17, 100):  # tiles of 4, 8 and (AMX, from 12 rows) 16 rows, full and partial
        x = x_all[:m]
        out = torch.empty(m, n, dtype=x_dtype)
        kernels.linear_w8a8(out, x, packed, col_sums, scale, bias)
        assert torch.equal(out, w8a8_reference(x, q, scale, bias)), m


@pytest.mark.parametrize("m", [11, 21])  # vector tiles; AMX tiles where the CPU has them
def test_w8a8_kernel_reads_strided_rows(kernels: ModuleType, m: int) -> None:
    """x as a column slice of a wider tensor; out written into a slice of a wider tensor, nothing outside it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, 120, generator=g)[:, 8:108]
    q, scale = quantize_int8(torch.randn(40, 100, generator=g))
    packed, col_sums = kernels.pack_w8a8_weight(q)
    wide_out = torch.full((m, 50), 7.0)
    kernels.linear_w8a8(wide_out[:, 5:45], x, packed, col_sums, scale)
    assert torch.equal(wide_out[:, 5:45], w8a8_reference(x, q, scale))
    assert (wide_out[:, :5] == 7).all() and (wide_out[:, 45:] == 7).all()


def test_w8a8_packed_layout(kernels: ModuleType) -> None:
    """[ceil(N/16), ceil(K/4), 64]: per block of 16 rows and group of 4 k's, column j's 4 k's at [4j, 4j + 4),
    zero-padded; and the column sums per block and span of 64 k's, [ceil(N/16), ceil(K/64), 16]."""
    q = (torch.arange(20 * 70) % 255 - 127).to(torch.int8).view(20, 70)
    packed, col_sums = kernels.pack_w8a8_weight(q)
    assert packed.shape == (2, 18, 64) and packed.dtype == torch.int8
    padded = torch.zeros(32, 72, dtype=torch.int8)
    padded[:20, :70] = q
    assert torch.equal(packed, padded.view(2, 16, 18, 4).permute(0, 2, 1, 3).reshape(2, 18, 64))
    assert packed[1, 0, 4 * 3:4 * 3 + 4].tolist() == q[19, :4].tolist()  # row 19: block 1, column 3
    spans = torch.stack([q[:, :64].int().sum(1), q[:, 64:].int().sum(1)], dim=1)  # [20, 2]
    assert col_sums.shape == (2, 2, 16) and col_sums.dtype == torch.int32
    assert torch.equal(col_sums.permute(0, 2, 1).reshape(32, 2)[:20], spans)
    assert not col_sums.permute(0, 2, 1).reshape(32, 2)[20:].any()


def test_w8a8_reference_scales_each_span_on_its_own() -> None:
    """A span 1,000x larger than the rest of its row leaves the others' precision alone: the product of the whole row
    is the products of the large span and of the small ones, each quantized on its own, up to float32 rounding (one
    scale a row would round every small value to zero)."""
    g = torch.Generator().manual_seed(1)
    q, scale = quantize_int8(torch.randn(32, 4 * W8A8_SPAN, generator=g))
    x = torch.randn(3, 4 * W8A8_SPAN, generator=g)
    large, small = x.clone(), x.clone()
    large[:, W8A8_SPAN:] = small[:, :W8A8_SPAN] = 0
    large[:, :W8A8_SPAN] *= 1e3
    parts = w8a8_reference(large, q, scale), w8a8_reference(small, q, scale)
    whole = w8a8_reference(large + small, q, scale)
    assert (whole - parts[0] - parts[1]).abs().max() < 1e-3 * parts[1].abs().max()


def test_w8a8_kernel_rejects_bad_input(kernels: ModuleType) -> None:
    q, scale = quantize_int8(torch.randn(40, 72))
    packed, col_sums = kernels.pack_w8a8_weight(q)
    x, out = torch.randn(3, 72), torch.empty(3, 40)
    cases = [
        (lambda: kernels.pack_w8a8_weight(torch.full((4, 4), -128, dtype=torch.int8)), r"\[-127, 127\]"),
        (lambda: kernels.pack_w8a8_weight(q.float()), "int8"),
        (lambda: kernels.linear_w8a8(out, torch.randn(3, 68), packed, col_sums, scale), "K=68"),
        (lambda: kernels.linear_w8a8(out, x, kernels.pack_linear_weight(q), col_sums, scale), "pack_w8a8_weight"),
        (lambda: kernels.linear_w8a8(out, x, packed, col_sums.view(-1), scale), "col_sums"),
        (lambda: kernels.linear_w8a8(out, x, packed, col_sums[:, :1], scale), "col_sums"),
        (lambda: kernels.linear_w8a8(out, x, packed, col_sums, scale[:39]), "w_scale"),
        (lambda: kernels.linear_w8a8(out, x.half(), packed, col_sums, scale), "float32 or bfloat16"),
        (lambda: kernels.linear_w8a8(torch.empty(3, 16), x, packed, col_sums, scale), "N in"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


@pytest.mark.parametrize("kind", ["w8a8", "gguf Q8_0", "gguf Q4_1"])
def test_a_nan_or_inf_in_x_comes_out_nan(kernels: ModuleType, kind: str) -> None:
    """A NaN or an infinity in an activation row makes that row's outputs NaN, as in float32, at every ISA level and
    in the references: its span gets a non-finite scale (a NaN is not dropped by the span's max, nor cast to int8).
    The other rows keep their values."""
    from gguf import GGMLQuantizationType

    from pagedllm.layers.gguf import pack_gguf_weight
    from pagedllm.layers.linear import gguf_reference

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 128, generator=g)
    x[0, 5], x[1, 70] = float("nan"), float("inf")
    out = torch.empty(3, 24)
    if kind == "w8a8":
        q, scale = quantize_int8(torch.randn(24, 128, generator=g))
        kernels.linear_w8a8(out, x, *kernels.pack_w8a8_weight(q), scale)
        expected = w8a8_reference(x, q, scale)
    else:
        ggml_type = GGMLQuantizationType[kind.split()[1]]
        rows = torch.randint(0, 256, (24, 4, 34 if ggml_type == GGMLQuantizationType.Q8_0 else 20), generator=g,
                             dtype=torch.uint8)
        rows[..., :2] = torch.full((24, 4, 1), 0.01).half().view(torch.uint8)  # d (and Q4_1's m) finite
        if ggml_type == GGMLQuantizationType.Q4_1:
            rows[..., 2:4] = torch.full((24, 4, 1), -0.05).half().view(torch.uint8)
        packed = pack_gguf_weight(rows.view(24, -1), ggml_type)
        kernels.linear_gguf(out, x, packed, int(ggml_type))
        expected = gguf_reference(x, packed, ggml_type, 24)
    assert out[:2].isnan().all() and out[2].isfinite().all()
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


def test_quantize_int8_gives_a_row_with_a_nan_a_nan_scale() -> None:
    q, scale = quantize_int8(torch.tensor([[1.0, float("nan"), 2.0], [1.0, float("inf"), 2.0], [0.0, 0.0, 0.0]]))
    assert scale[0].isnan() and scale[1].isinf() and scale[2] == 1 and not q.any()
