"""The packed linear kernel (pagedllm/kernels/csrc/linear.cpp) against `F.linear` in float32.

The kernel widens bf16 exactly and accumulates in float32, so against the float32 reference it differs only by
the order of the sums (float32 output) or, on top of that, by one rounding to bf16 (bf16 output). An int8 weight's
reference is `F.linear` on its dequantised float32 weight (`dequantize_int8`): the kernel sums x times q and
scales once, so the two differ by float32 rounding only. GGUF weights (Q8_0, Q4_0, Q4_1, MXFP4 blocks) multiply
activations quantized to 16 bits per 32 k's (or 8, llama.cpp's): they give `gguf_reference`'s bits, within 1e-4 of
their dequantised weight's (`dequantize_gguf_packed`) float32 result (8 bits: ~1%). On a CPU with AVX512-BF16 they
also multiply x in bf16 by the blocks dequantised to bf16 (activation_bits=0), in AMX tiles where there are, else in
vectors: within float32 sums of `gguf_reference`'s float64 result, and the same bits for a row in any batch.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from pagedllm.kernels import cpu_kernels
from pagedllm.layers.gguf import dequantize_gguf_packed, pack_gguf_weight, pack_gguf_weight_reference
from pagedllm.layers.linear import (
    GGUF_BF16,
    dequantize_int8,
    gguf_reference,
    quantize_16bit_spans,
    quantize_int8,
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def kernels(isa_level: str) -> ModuleType:
    """The kernel module of each ISA level this CPU runs (see tests/conftest.py)."""
    return cpu_kernels()


def _linear(kernels: ModuleType, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    kernels.linear_packed(out, x, kernels.pack_linear_weight(weight), bias)
    return out


def _assert_matches_float32(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None) -> None:
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    # Sums of K products of N(0, 1) values are ~sqrt(K) in size; their float32 rounding ~1e-7 of that.
    scale = x.shape[1] ** 0.5
    rtol = 2**-8 if out.dtype == torch.bfloat16 else 1e-5  # bf16: one rounding (half an ulp, <= 2^-8 relative)
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=1e-5 * scale)


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 17, 64, 300])
# N: partial and whole 16-column blocks, one block (the threads split rows instead); K: below and above one
# K chunk (1001: two uneven chunks for 6-row tiles), odd sizes.
@pytest.mark.parametrize(("n", "k"), [(40, 72), (100, 13), (64, 576), (40, 100), (8, 40), (24, 1001)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_kernel_matches_float32_reference(kernels: ModuleType, x_dtype: torch.dtype,
                                                 weight_dtype: torch.dtype, m: int, n: int, k: int,
                                                 with_bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    weight = torch.randn(n, k, generator=g).to(weight_dtype)
    bias = torch.randn(n, generator=g).to(x_dtype) if with_bias else None
    _assert_matches_float32(_linear(kernels, x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 17, 300])
def test_linear_kernel_reads_strided_rows(kernels: ModuleType, x_dtype: torch.dtype, m: int) -> None:
    """x as a column slice of a wider tensor (rows 120 apart); out written into a slice of a wider tensor too."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 120, generator=g).to(x_dtype)[:, 8:108]
    weight = torch.randn(40, 100, generator=g).bfloat16()
    bias = torch.randn(40, generator=g).to(x_dtype)
    wide_out = torch.full((m, 50), 7.0, dtype=x_dtype)
    kernels.linear_packed(wide_out[:, 5:45], x, kernels.pack_linear_weight(weight), bias)
    _assert_matches_float32(wide_out[:, 5:45], x, weight, bias)
    assert (wide_out[:, :5] == 7).all() and (wide_out[:, 45:] == 7).all()  # nothing written outside out


@pytest.mark.parametrize("weight_dtype", DTYPES)
def test_packed_weight_layout(kernels: ModuleType, weight_dtype: torch.dtype) -> None:
    """[ceil(N/16), K, 16], rows zero-padded; a bf16 block row pairs column j with column j + 8."""
    weight = torch.arange(1, 20 * 3 + 1, dtype=torch.float32).view(20, 3).to(weight_dtype)  # exact in bf16
    packed = kernels.pack_linear_weight(weight)
    assert packed.shape == (2, 3, 16) and packed.dtype == weight_dtype
    order = [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15] if weight_dtype == torch.bfloat16 else range(16)
    padded = torch.cat([weight, weight.new_zeros(12, 3)])  # [32, 3]
    expected = padded.view(2, 16, 3).transpose(1, 2)[:, :, list(order)]
    assert torch.equal(packed, expected)


def test_linear_kernel_rounds_bf16_output_once(kernels: ModuleType) -> None:
    """A bf16 output is the float32 sum rounded to nearest even, as `.to(torch.bfloat16)` rounds."""
    x = torch.tensor([[1.0, 2.0**-8, 2.0**-9]], dtype=torch.bfloat16)
    weight = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 1.0]], dtype=torch.bfloat16)
    out = _linear(kernels, x, weight, None)
    expected = torch.tensor([[1 + 2.0**-8, 1 + 2.0**-8 + 2.0**-9, 1 + 2.0**-9]]).bfloat16()
    assert torch.equal(out, expected)  # a tie (to even: down), above half (up), below half (down)


def test_linear_kernel_rejects_bad_input(kernels: ModuleType) -> None:
    weight = torch.randn(40, 72)
    packed = kernels.pack_linear_weight(weight)
    int8_packed = kernels.pack_linear_weight(quantize_int8(weight)[0])
    x, out = torch.randn(3, 72), torch.empty(3, 40)
    cases = [
        (lambda: kernels.pack_linear_weight(weight.half()), "float32, bfloat16 or int8"),
        (lambda: kernels.pack_linear_weight(weight.t()), "contiguous"),
        (lambda: kernels.linear_packed(out, torch.randn(3, 64), packed, None), "K=64"),
        (lambda: kernels.linear_packed(out, x.half(), packed, None), "float32 or bfloat16"),
        (lambda: kernels.linear_packed(out.bfloat16(), x, packed, None), "out of x's dtype"),
        (lambda: kernels.linear_packed(torch.empty(3, 16), x, packed, None), "N in"),
        (lambda: kernels.linear_packed(out, x, weight, None), "pack_linear_weight"),
        (lambda: kernels.linear_packed(out, x, packed, torch.randn(41)), "bias"),
        (lambda: kernels.linear_packed(out, x.t().contiguous().t(), packed, None), "contiguous rows"),
        (lambda: kernels.linear_packed(out, x, packed, None, torch.ones(40)), "only an int8 weight"),
        (lambda: kernels.linear_packed(out, x, int8_packed, None), "needs its"),
        (lambda: kernels.linear_packed(out, x, int8_packed, None, torch.ones(40).double()), "scale must be"),
        (lambda: kernels.linear_packed(out, x, int8_packed, None, torch.ones(39)), "scale must be"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gets_the_same_bits_in_any_batch(kernels: ModuleType, dtype: torch.dtype) -> None:
    """Every output is one chain of sums in k order, whatever the tile and the thread that computes it, so
    batching never changes a row's result (and so never a greedy token)."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(100, 600, generator=g).to(dtype)
    packed = kernels.pack_linear_weight(weight)
    x = torch.randn(301, 600, generator=g).to(dtype)

    def run(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], 100, dtype=dtype)
        kernels.linear_packed(out, rows, packed, None)
        return out

    full = run(x)
    for m in (1, 2, 3, 5, 6, 7, 13, 64):
        for start in (0, 4, 300 - m + 1):
            assert torch.equal(run(x[start:start + m]), full[start:start + m]), (m, start)


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 17, 300])
@pytest.mark.parametrize(("n", "k"), [(40, 72), (100, 13), (64, 576), (24, 1001)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_kernel_matches_the_dequantised_reference(kernels: ModuleType, x_dtype: torch.dtype, m: int, n: int,
                                                       k: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    q, scale = quantize_int8(torch.randn(n, k, generator=g))
    bias = torch.randn(n, generator=g).to(x_dtype) if with_bias else None
    out = torch.empty(m, n, dtype=x_dtype)
    kernels.linear_packed(out, x, kernels.pack_linear_weight(q), bias, scale)
    _assert_matches_float32(out, x, dequantize_int8(q, scale), bias)


def test_int8_packed_layout_keeps_columns_in_order(kernels: ModuleType) -> None:
    weight = (torch.arange(20 * 3, dtype=torch.int8).view(20, 3) - 30)
    packed = kernels.pack_linear_weight(weight)
    expected = torch.cat([weight, weight.new_zeros(12, 3)]).view(2, 16, 3).transpose(1, 2)
    assert packed.dtype == torch.int8 and torch.equal(packed, expected)


def test_quantize_int8_maps_each_rows_largest_magnitude_to_127():
    weight = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.0, -2.0, 0.014]])
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q[0].tolist() == [64, -127, 32, 0] and q[1].tolist() == [0, 0, 0, 0] and scale[1] == 1
    assert q[2].tolist() == [127, 42, -85, 1]
    assert (dequantize_int8(q, scale) - weight).abs().le(scale[:, None] / 2 + 1e-7).all()  # round to nearest


GGUF_TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
              GGMLQuantizationType.MXFP4]


def _random_gguf_rows(ggml_type: GGMLQuantizationType, n: int, k: int, seed: int) -> torch.Tensor:
    """n rows of k values as GGUF blocks: random values, random f16 scales (and mins) in [-0.1, 0.1); MXFP4's
    exponents e in [118, 130), scales 2^(e - 127) of 2^-9 to 4, and one block's e = 1 (a subnormal d)."""
    g = torch.Generator().manual_seed(seed)
    block_bytes = GGML_QUANT_SIZES[ggml_type][1]
    blocks = torch.randint(0, 256, (n, k // 32, block_bytes), dtype=torch.uint8, generator=g)
    if ggml_type == GGMLQuantizationType.MXFP4:
        blocks[..., 0] = torch.randint(118, 130, (n, k // 32), dtype=torch.uint8, generator=g)
        blocks[0, 0, 0] = 1
        return blocks.view(n, -1)
    num_scales = 2 if ggml_type == GGMLQuantizationType.Q4_1 else 1
    scales = (torch.rand(n, k // 32, num_scales, generator=g) * 0.2 - 0.1).half()
    blocks[..., :2 * num_scales] = scales.view(torch.uint8)
    return blocks.view(n, -1)


@pytest.mark.parametrize("ggml_type", GGUF_TYPES)
@pytest.mark.parametrize("m", [1, 3, 9, 33, 300])  # tiles of 8 rows (AVX-512) or 4, whole and partial
@pytest.mark.parametrize(("x_dtype", "with_bias"), [(torch.float32, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("activation_bits", [16, 8])
def test_gguf_kernel_gives_the_references_bits(kernels: ModuleType, ggml_type: GGMLQuantizationType,
                                               x_dtype: torch.dtype, m: int, with_bias: bool, activation_bits: int
                                               ) -> None:
    """N = 40 (a partial block of 16), K = 160 (five groups). The random bytes hold every value (Q8_0's -128
    included), and each group's largest |x| becomes the largest 16-bit value, +-127 x 256."""
    g = torch.Generator().manual_seed(m)
    packed = pack_gguf_weight(_random_gguf_rows(ggml_type, 40, 160, seed=m), ggml_type)
    x = torch.randn(m, 160, generator=g).to(x_dtype)
    x[0, 32:64] = 0  # a zero group: scale 1, all q 0
    bias = torch.randn(40, generator=g).to(x_dtype) if with_bias else None
    out = torch.empty(m, 40, dtype=x_dtype)
    kernels.linear_gguf(out, x, packed, int(ggml_type), bias, activation_bits)
    assert torch.equal(out, gguf_reference(x, packed, ggml_type, 40, bias, activation_bits))
    weight = dequantize_gguf_packed(packed, ggml_type, 40)
    expected = F.linear(x.float(), weight, None if bias is None else bias.float())
    # 16-bit activations leave ~2e-5, a bf16 output adds its own rounding (~2e-3); 8-bit ones leave ~5e-3.
    tolerance = 2e-2 if activation_bits == 8 else 1e-4 if x_dtype == torch.float32 else 5e-3
    assert (out.float() - expected).norm() < tolerance * expected.norm()


def test_activations_are_quantized_to_16_bits_as_two_int8_halves():
    """x ~= s' qx (s' = s / 256, s = max |x| / 127 of the group) within s' / 2, or s' where v - hi is within 1/512
    of a half and lo clamps to +-127; qx = 256 hi + lo with hi and lo int8 in [-127, 127]."""
    x = torch.cat([torch.randn(2, 64, generator=torch.Generator().manual_seed(0)) * 10,
                   torch.tensor([[127.0, 2.5] + [0.0] * 30 + [0.0] * 32])])
    qx, scale = quantize_16bit_spans(x, 32)
    assert qx.shape == (3, 2, 32) and scale.shape == (3, 2)
    hi, lo = torch.round(qx / 256), qx - 256 * torch.round(qx / 256)
    assert hi.abs().le(127).all() and lo.abs().le(127).all()
    error = (x.view(3, 2, 32) - scale[..., None] * qx).abs()
    assert error[:2].le(scale[:2, :, None] * (1 + 1e-3)).all() and error[:2].mean() < scale[:2].mean() / 2
    assert qx[2, 0, :2].tolist() == [127 * 256, 2 * 256 + 127]         # 2.5: hi 2, lo 128 clamped to 127
    assert scale[2, 0] == 1 / 256 and scale[2, 1] == 1 / 256            # the zero group's s is 1


@pytest.mark.parametrize("ggml_type", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1])
@pytest.mark.parametrize("activation_bits", [16, 8])
def test_a_gguf_rows_result_does_not_depend_on_its_batch(kernels: ModuleType, ggml_type: GGMLQuantizationType,
                                                         activation_bits: int) -> None:
    """Each row's activations are quantized on their own and summed in a fixed order: a row alone, in a tile of
    others and in a prefill-sized batch gives the same bits (so a sequence's tokens do not depend on its company)."""
    packed = pack_gguf_weight(_random_gguf_rows(ggml_type, 40, 96, seed=1), ggml_type)
    x = torch.randn(300, 96, generator=torch.Generator().manual_seed(1))
    outs = []
    for rows in (x[:1], x[:5], x):
        out = torch.empty(rows.shape[0], 40)
        kernels.linear_gguf(out, rows, packed, int(ggml_type), None, activation_bits)
        outs.append(out[0])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.fixture
def bf16_kernels() -> ModuleType:
    """The native build of the kernels, where it multiplies GGUF blocks by x in bf16: in AMX-BF16 tiles, or in
    AVX512-BF16 vectors (the builds below native have neither: test_gguf_kernel_rejects_bad_input checks that they
    say so)."""
    kernels = cpu_kernels()
    if kernels is None or not kernels.gguf_bf16_available():
        pytest.skip("GGUF blocks times x in bf16 need a CPU with AVX512-BF16; the integer arithmetic above is what "
                    "runs here")
    return kernels


@pytest.mark.parametrize("ggml_type", GGUF_TYPES)
@pytest.mark.parametrize("m", [1, 5, 16, 17, 40, 300])  # one or two tiles of 16 rows, partial, pairs, a prefill
@pytest.mark.parametrize(("x_dtype", "with_bias"), [(torch.float32, False), (torch.bfloat16, True)])
# A partial block; one; 13 blocks (odd); 63, more than a panel of dequantised blocks for each thread (prefills).
@pytest.mark.parametrize(("n", "k"), [(40, 160), (16, 32), (200, 576), (1000, 576)])
def test_gguf_blocks_times_bf16_match_the_reference(bf16_kernels: ModuleType, ggml_type: GGMLQuantizationType, m: int,
                                             x_dtype: torch.dtype, with_bias: bool, n: int, k: int) -> None:
    """The float32 sums of bf16 products (in tiles or vectors) against the same products summed in float64: within
    float32 rounding of the sum of |products| (float32 out), plus one rounding to bf16 (bf16 out)."""
    g = torch.Generator().manual_seed(m + n)
    packed = pack_gguf_weight(_random_gguf_rows(ggml_type, n, k, seed=m), ggml_type)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    bias = torch.randn(n, generator=g).to(x_dtype) if with_bias else None
    out = torch.empty(m, n, dtype=x_dtype)
    bf16_kernels.linear_gguf(out, x, packed, int(ggml_type), bias, GGUF_BF16)
    expected = gguf_reference(x.float(), packed, ggml_type, n, None if bias is None else bias.float(), GGUF_BF16)
    weight = dequantize_gguf_packed(packed, ggml_type, n).bfloat16().double()
    magnitude = x.bfloat16().double().abs() @ weight.abs().T
    rounding = 2**-8 * expected.abs() if x_dtype == torch.bfloat16 else 0
    assert ((out.double() - expected.double()).abs() <= 1e-6 * magnitude + rounding + 1e-30).all()
    # Against the float32 weight itself: bf16's rounding of x and W, ~2^-9 of each product.
    exact = F.linear(x.float(), dequantize_gguf_packed(packed, ggml_type, n), None if bias is None else bias.float())
    assert (out.float() - exact).norm() < 1e-2 * exact.norm()


@pytest.mark.parametrize("ggml_type", GGUF_TYPES)
def test_a_rows_result_in_bf16_does_not_depend_on_its_batch(bf16_kernels: ModuleType,
                                                                   ggml_type: GGMLQuantizationType) -> None:
    """A row alone (a staged partial tile, or vectors streaming the blocks group by group), among a few (tiles:
    dequantised a pair of blocks at a time; vectors: streamed to a partial tile, or a panel dequantised whole) and
    in a prefill-sized batch (tiles: all blocks at once, rows read in place and in chunks) gives the same bits."""
    packed = pack_gguf_weight(_random_gguf_rows(ggml_type, 72, 96, seed=2), ggml_type)
    x = torch.randn(300, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    outs = []
    for rows in (x[:1], x[:5], x[:33], x, x[1:]):
        out = torch.empty(rows.shape[0], 72, dtype=torch.bfloat16)
        bf16_kernels.linear_gguf(out, rows, packed, int(ggml_type), None, GGUF_BF16)
        outs.append(out)
    assert all(torch.equal(outs[0][0], batch[0]) for batch in outs[1:4])
    assert torch.equal(outs[1], outs[3][:5])
    assert torch.equal(outs[3][1:], outs[4])  # every row of a batch, at another place in it
    for rows in (1, 33, 300):  # rows of a wider tensor (x's rows read in place, staged and transposed from it)
        wide = torch.zeros(rows, 160, dtype=torch.bfloat16)
        wide[:, 32:128] = x[:rows]
        out = torch.empty(rows, 72, dtype=torch.bfloat16)
        bf16_kernels.linear_gguf(out, wide[:, 32:128], packed, int(ggml_type), None, GGUF_BF16)
        assert torch.equal(out, outs[3][:rows])


@pytest.mark.parametrize("ggml_type", GGUF_TYPES)
@pytest.mark.parametrize("m", [1, 17, 40, 300])  # decode batches (x's tiles as B operands), a prefill (panels)
@pytest.mark.parametrize(("x_dtype", "with_bias"), [(torch.float32, True), (torch.bfloat16, False),
                                                    (torch.bfloat16, True)])
# Gate and up of 3 blocks each (odd: a thread's share ends mid-weight); 31 each, more than a thread's panel.
@pytest.mark.parametrize(("half", "k"), [(48, 64), (496, 576)])
def test_gated_bf16_gives_the_bits_of_the_linear_then_silu_and_mul(bf16_kernels: ModuleType,
                                                                    ggml_type: GGMLQuantizationType, m: int,
                                                                    x_dtype: torch.dtype, with_bias: bool,
                                                                    half: int, k: int) -> None:
    """linear_gguf_silu_and_mul (a gate_up projection with its SiLU-and-mul in the kernel's store) against
    linear_gguf's [gate, up] output and then silu_and_mul: the same bits."""
    g = torch.Generator().manual_seed(m + half)
    packed = pack_gguf_weight(_random_gguf_rows(ggml_type, 2 * half, k, seed=m), ggml_type)
    x = (torch.randn(m, k, generator=g) * 4).to(x_dtype)
    bias = torch.randn(2 * half, generator=g).to(x_dtype) if with_bias else None
    gate_up = torch.empty(m, 2 * half, dtype=x_dtype)
    bf16_kernels.linear_gguf(gate_up, x, packed, int(ggml_type), bias, GGUF_BF16)
    expected = torch.empty(m, half, dtype=x_dtype)
    bf16_kernels.silu_and_mul(expected, gate_up)
    out = torch.empty(m, half, dtype=x_dtype)
    bf16_kernels.linear_gguf_silu_and_mul(out, x, packed, int(ggml_type), bias)
    assert torch.equal(out, expected)


def test_gated_bf16_rejects_bad_input(kernels: ModuleType) -> None:
    q4_1 = GGMLQuantizationType.Q4_1
    packed = pack_gguf_weight(_random_gguf_rows(q4_1, 40, 64, seed=0), q4_1)  # 40 = 2 x 20: halves split a block
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="a multiple of 16"):
        kernels.linear_gguf_silu_and_mul(torch.empty(3, 20), x, packed, int(q4_1))
    packed = pack_gguf_weight(_random_gguf_rows(q4_1, 64, 64, seed=0), q4_1)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous \[2 N\]"):
        kernels.linear_gguf_silu_and_mul(torch.empty(3, 32), x, packed, int(q4_1), torch.randn(32))
    if not kernels.gguf_bf16_available():
        with pytest.raises(RuntimeError, match="AVX512-BF16, which this build of the kernels"):
            kernels.linear_gguf_silu_and_mul(torch.empty(3, 32), x, packed, int(q4_1))


def test_a_packed_mxfp4_weight_is_the_blocks_own() -> None:
    """MXFP4 packed (d = 2^(e - 128), each nibble looked up in MXFP4_VALUES, m = -12 d) stands for exactly the
    weight gguf-py's own dequantiser reads from the blocks, subnormal scales included."""
    mxfp4 = GGMLQuantizationType.MXFP4
    rows = _random_gguf_rows(mxfp4, 40, 160, seed=4)
    expected = torch.from_numpy(gguf_quants.dequantize(rows.numpy(), mxfp4)).float()
    assert torch.equal(dequantize_gguf_packed(pack_gguf_weight(rows, mxfp4), mxfp4, 40), expected)
    assert expected[0, 0] == 0 or expected[0, :32].abs().max() < 2**-120     # the block whose e is 1


@pytest.mark.parametrize("ggml_type", GGUF_TYPES)
@pytest.mark.parametrize("n", [1, 16, 40])   # a block of 16 rows partly filled, whole, and more than two
def test_the_kernels_pack_gguf_rows_as_the_torch_reference_does(kernels: ModuleType, ggml_type: GGMLQuantizationType,
                                                                  n: int) -> None:
    rows = _random_gguf_rows(ggml_type, n, 96, seed=n)
    assert torch.equal(kernels.pack_gguf_weight(rows, int(ggml_type)), pack_gguf_weight_reference(rows, ggml_type))
    assert torch.equal(pack_gguf_weight(rows, ggml_type), pack_gguf_weight_reference(rows, ggml_type))
    with pytest.raises(RuntimeError, match="rows must be a contiguous uint8"):
        kernels.pack_gguf_weight(rows[:, 1:], int(ggml_type))
    with pytest.raises(RuntimeError, match="ggml_type must be"):
        kernels.pack_gguf_weight(rows, 12)


def test_gguf_kernel_rejects_bad_input(kernels: ModuleType) -> None:
    q4_1 = GGMLQuantizationType.Q4_1
    packed = pack_gguf_weight(_random_gguf_rows(q4_1, 40, 64, seed=0), q4_1)
    x, out = torch.randn(3, 64), torch.empty(3, 40)
    cases = [
        (lambda: kernels.linear_gguf(out, x, packed, 12), "ggml_type must be"),
        (lambda: kernels.linear_gguf(out, x, packed, int(GGMLQuantizationType.Q8_0)), "pack_gguf_weight"),
        (lambda: kernels.linear_gguf(out, torch.randn(3, 96), packed, int(q4_1)), "K=96"),
        (lambda: kernels.linear_gguf(torch.empty(3, 16), x, packed, int(q4_1)), "N in"),
        (lambda: kernels.linear_gguf(out, x.half(), packed, int(q4_1)), "float32 or bfloat16"),
        (lambda: kernels.linear_gguf(out, x, packed, int(q4_1), torch.randn(41)), "bias"),
        (lambda: kernels.linear_gguf(out, x, packed, int(q4_1), None, 12), "activation_bits must be 16, 8 or 0"),
    ]
    if not kernels.gguf_bf16_available():  # every build below native, and every CPU without AVX512-BF16
        cases.append((lambda: kernels.linear_gguf(out, x, packed, int(q4_1), None, GGUF_BF16),
                      "AVX512-BF16, which this build of the kernels"))
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


def test_a_kernel_call_lets_other_python_threads_run() -> None:
    """The kernels release the GIL: while one thread is inside a long `linear_packed` call, another thread's
    Python loop keeps going (held, its longest pause would be the whole call)."""
    import threading
    import time

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("pagedllm's CPU kernels are disabled or not built here")
    x, weight = torch.randn(1024, 2048), torch.randn(4096, 2048)
    packed, out = kernels.pack_linear_weight(weight), torch.empty(1024, 4096)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started, call_span = threading.Event(), []

    def call() -> None:
        started.set()
        begin = time.perf_counter()
        kernels.linear_packed(out, x, packed)       # 17 GFLOP: a few hundred ms on one core
        call_span.extend([begin, time.perf_counter()])

    try:
        worker = threading.Thread(target=call)
        worker.start()
        started.wait()
        stamps = []
        while worker.is_alive():
            stamps.append(time.perf_counter())
        worker.join()
    finally:
        torch.set_num_threads(threads)
    # This thread's loop must have gone on *during* the call: held, the GIL would let it run only before or after.
    begin, end = call_span
    during = [begin] + [t for t in stamps if begin < t < end] + [end]
    longest_pause = max(b - a for a, b in zip(during, during[1:]))
    assert end - begin > 0.05 and longest_pause < (end - begin) / 2, (longest_pause, end - begin)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 96, 64), (70, 100, 128), (3, 32, 2), (150, 1000, 576)])
def test_brgemm_blocks_multiply_as_float32_sums_rounded_once(kernels: ModuleType, m: int, n: int, k: int) -> None:
    """bf16 weights in torch's brgemm blocks (where torch's brgemm packs bf16): x W^T + b within bf16's rounding of
    the float32 result, N past whole blocks, M past a call's 64 rows, panels of several blocks over several row
    tiles (the last case), and a row's bits the same alone as in its batch."""
    if not kernels.brgemm_bf16_available():
        pytest.skip("torch's brgemm does not pack bf16 on this CPU (no AMX, no AVX512-BF16)")
    w, x, b = (torch.randn(*shape).to(torch.bfloat16) for shape in ((n, k), (m, k), (n,)))
    packed = kernels.pack_brgemm_weight(w)
    assert packed.shape == (-(-n // 64), k // 2, 128)
    assert torch.equal(kernels.pack_brgemm_weight(w.T.contiguous().T), packed)   # a strided weight: the same blocks
    out = torch.empty(m, n, dtype=torch.bfloat16)
    kernels.linear_brgemm(out, x, packed, b)
    expected = x.float() @ w.float().T + b.float()
    torch.testing.assert_close(out.float(), expected, atol=1e-2 * expected.abs().max().item(), rtol=1e-2)
    alone = torch.empty(1, n, dtype=torch.bfloat16)
    kernels.linear_brgemm(alone, x[-1:], packed, b)
    assert torch.equal(alone[0], out[-1])
    with pytest.raises(RuntimeError, match="even K"):
        kernels.pack_brgemm_weight(torch.randn(32, 3).to(torch.bfloat16))
