"""Linear layers' tensor-parallel weight loaders and prepacked weights, RMSNorm, SiluAndMul, the vocab embedding."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedllm.cpu import MAX_ISA_ENV, cpu_info, onednn_bf16_ok
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.embedding import ParallelLMHead, VocabEmbedding
from pagedllm.layers.linear import (
    BF16_KERNEL_ENV,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    bf16_kernel,
    brgemm_bf16_available,
    linear_packing,
    pack_linear_weights,
)
from pagedllm.layers.norm import RMSNorm


def _load(layer, name: str, loaded: torch.Tensor, *shard) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, loaded, *shard)


def test_column_and_row_shard_by_rank() -> None:
    w = torch.randn(8, 6)
    col = ColumnParallelLinear(6, 8, bias=True, tp_rank=1, tp_size=2)
    _load(col, "weight", w)
    _load(col, "bias", torch.arange(8.0))
    assert torch.equal(col.weight, w[4:]) and col.bias.tolist() == [4.0, 5.0, 6.0, 7.0]
    row = RowParallelLinear(6, 8, bias=True, tp_rank=1, tp_size=2)
    _load(row, "weight", w)
    _load(row, "bias", torch.arange(8.0))
    assert torch.equal(row.weight, w[:, 3:]) and row.bias.shape == (8,)


def test_single_rank_layers_compute_linear() -> None:
    x, w, b = torch.randn(3, 6), torch.randn(8, 6), torch.randn(8)
    col, row = ColumnParallelLinear(6, 8, bias=True), RowParallelLinear(6, 8, bias=True)
    for layer in (col, row):
        _load(layer, "weight", w)
        _load(layer, "bias", b)
        torch.testing.assert_close(layer(x), F.linear(x, w, b))


def test_qkv_loader_places_shards() -> None:
    q, k, v = torch.randn(8, 5), torch.randn(4, 5), torch.randn(4, 5)  # 4 q heads, 2 kv heads, head_dim 2
    layer = QKVParallelLinear(5, 2, num_heads=4, num_kv_heads=2)
    for shard_id, t in (("q", q), ("k", k), ("v", v)):
        _load(layer, "weight", t, shard_id)
    assert torch.equal(layer.weight, torch.cat([q, k, v]))
    rank1 = QKVParallelLinear(5, 2, num_heads=4, num_kv_heads=2, tp_rank=1, tp_size=2)
    for shard_id, t in (("q", q), ("k", k), ("v", v)):
        _load(rank1, "weight", t, shard_id)
    assert torch.equal(rank1.weight, torch.cat([q[4:], k[2:], v[2:]]))


def test_qkv_replicates_kv_heads_when_fewer_than_ranks() -> None:
    q, k, v = torch.randn(8, 5), torch.randn(2, 5), torch.randn(2, 5)  # MQA: one kv head, head_dim 2
    for rank in (0, 1):
        layer = QKVParallelLinear(5, 2, num_heads=4, num_kv_heads=1, tp_rank=rank, tp_size=2)
        for shard_id, t in (("q", q), ("k", k), ("v", v)):
            _load(layer, "weight", t, shard_id)
        assert torch.equal(layer.weight, torch.cat([q[rank * 4:(rank + 1) * 4], k, v]))


def test_merged_column_loader() -> None:
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    layer = MergedColumnParallelLinear(4, [6, 6])
    _load(layer, "weight", up, 1)
    _load(layer, "weight", gate, 0)
    assert torch.equal(layer.weight, torch.cat([gate, up]))
    rank1 = MergedColumnParallelLinear(4, [6, 6], tp_rank=1, tp_size=2)
    _load(rank1, "weight", gate, 0)
    _load(rank1, "weight", up, 1)
    assert torch.equal(rank1.weight, torch.cat([gate[3:], up[3:]]))


def test_rmsnorm_matches_transformers_with_fused_residual() -> None:
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x, res, w = torch.randn(5, 32).to(dtype), torch.randn(5, 32).to(dtype), torch.randn(32).to(dtype)
        hf = LlamaRMSNorm(32, eps=1e-5).to(dtype)
        hf.weight.data.copy_(w)
        ours = RMSNorm(32, eps=1e-5, dtype=dtype)
        ours.weight.data.copy_(w)
        torch.testing.assert_close(ours(x), hf(x), atol=tol, rtol=tol)
        out, new_res = ours(x, res)
        torch.testing.assert_close(new_res, x + res)
        torch.testing.assert_close(out, hf(x + res), atol=tol, rtol=tol)


def test_silu_and_mul() -> None:
    x = torch.randn(3, 10)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])


def test_embedding_and_lm_head() -> None:
    w = torch.randn(10, 4)
    emb = VocabEmbedding(10, 4)
    emb.weight.weight_loader(emb.weight, w)
    ids = torch.tensor([0, 9, 3])
    assert torch.equal(emb(ids), w[ids])
    head = ParallelLMHead(10, 4, dtype=torch.bfloat16)
    head.weight.weight_loader(head.weight, w)
    hidden = torch.randn(2, 4).bfloat16()
    logits = head(hidden)       # as the bf16 matmul rounds them: the sampler widens them where it needs to
    assert logits.shape == (2, 10) and logits.dtype == torch.bfloat16
    assert torch.equal(logits, hidden @ w.bfloat16().T)
    shard = VocabEmbedding(10, 4, tp_rank=1, tp_size=3)  # 4 rows each, the last rank padded
    shard.weight.weight_loader(shard.weight, w)
    assert torch.equal(shard.weight, w[4:8])
    last = VocabEmbedding(10, 4, tp_rank=2, tp_size=3)
    last.weight.weight_loader(last.weight, w)
    assert torch.equal(last.weight[:2], w[8:]) and not last.weight[2:].any()


def _packable_model(g: torch.Generator) -> torch.nn.ModuleDict:
    model = torch.nn.ModuleDict({
        "qkv": QKVParallelLinear(64, 16, num_heads=4, num_kv_heads=2, bias=True, dtype=torch.bfloat16),
        "down": RowParallelLinear(96, 64, bias=True, dtype=torch.bfloat16),
        "head": ParallelLMHead(100, 64, dtype=torch.bfloat16),
        "fp32": ColumnParallelLinear(64, 32, dtype=torch.float32),
    })
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g))
    return model


def _run(model: torch.nn.ModuleDict, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return model["qkv"](x), model["down"](y), model["head"](x)


@pytest.fixture(params=["brgemm", "onednn", "pagedllm"])
def packing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each packing this machine can run: torch's brgemm blocks where it packs bf16, oneDNN's where it has bf16
    instructions, pagedllm's everywhere (an AVX2 cap hides oneDNN's bf16 from pagedllm, as on a CPU without
    AVX-512)."""
    if request.param != "pagedllm" and not onednn_bf16_ok():
        pytest.skip("oneDNN has no bf16 path on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    if request.param == "brgemm" and not brgemm_bf16_available():
        pytest.skip("torch's brgemm does not pack bf16 on this CPU (no AMX, no AVX512-BF16)")
    if request.param != "pagedllm":
        monkeypatch.setenv(BF16_KERNEL_ENV, request.param)  # whatever `bf16_kernel` picks on this CPU
    else:
        monkeypatch.setenv(MAX_ISA_ENV, "avx2")
    assert linear_packing(torch.bfloat16) == request.param and linear_packing(torch.float32) == "pagedllm"
    assert linear_packing(torch.float16) is None
    return request.param


def test_packed_linear_weights_match_the_plain_ones(packing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's packing gives F.linear's bits; pagedllm's and brgemm's are within one bf16 rounding of the float32
    product and give a row the same bits whatever the batch around it."""
    g = torch.Generator().manual_seed(0)
    model = _packable_model(g)
    inputs = {m: (torch.randn(m, 64, generator=g).bfloat16(), torch.randn(m, 96, generator=g).bfloat16())
              for m in (1, 5, 300)}
    expected = {m: _run(model, x, y) for m, (x, y) in inputs.items()}
    exact_model = copy.deepcopy(model).float()
    exact = {m: _run(exact_model, x.float(), y.float()) for m, (x, y) in inputs.items()}
    with monkeypatch.context() as off:
        off.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
        assert pack_linear_weights(model) == 0
    assert pack_linear_weights(model) == 4  # the float32 layer too, by pagedllm's kernel
    assert model["fp32"].weight.dim() == 3
    x32 = inputs[5][0].float()
    torch.testing.assert_close(model["fp32"](x32), exact_model["fp32"](x32), atol=1e-5, rtol=1e-5)
    for m, (x, y) in inputs.items():
        for actual, plain, reference in zip(_run(model, x, y), expected[m], exact[m]):
            assert actual.dtype == plain.dtype and actual.shape == plain.shape
            if packing == "onednn":
                assert torch.equal(actual, plain)
            else:
                torch.testing.assert_close(actual.float(), reference, atol=2e-2, rtol=8e-3)
    if packing != "onednn":
        x, y = inputs[300]
        alone = _run(model, x[7:8], y[7:8])
        assert all(torch.equal(a[0], b[7]) for a, b in zip(alone, _run(model, x, y)))
    assert pack_linear_weights(model) == 0  # packing twice is a no-op


def test_a_tied_lm_head_gets_its_own_packed_copy(packing: str) -> None:
    emb = VocabEmbedding(10, 32, dtype=torch.bfloat16)
    emb.weight.data.copy_(torch.randn(10, 32))
    head = ParallelLMHead(10, 32, dtype=torch.bfloat16)
    head.tie(emb)
    x = torch.randn(3, 32).bfloat16()
    expected = head(x)
    assert pack_linear_weights(torch.nn.ModuleList([emb, head])) == 1
    assert head.weight is not emb.weight and emb.weight.dim() == 2 and not emb.weight.is_mkldnn
    torch.testing.assert_close(head(x), expected, atol=0 if packing == "onednn" else 2e-2,
                               rtol=0 if packing == "onednn" else 8e-3)
    assert torch.equal(emb(torch.tensor([3])), emb.weight[3:4])


def test_bf16_kernel_follows_the_cpu_unless_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN has bf16 instructions, bf16 weights go to torch's brgemm blocks with AMX tiles (where torch packs
    bf16 for them), to oneDNN if bf16 dot products otherwise outrun float32 FMAs here, and to pagedllm's kernel
    elsewhere, unless $PAGEDLLM_BF16_KERNEL names one; any other name is refused."""
    if not onednn_bf16_ok():
        pytest.skip("oneDNN has no bf16 path on this CPU: pagedllm's kernel is the only packing for bf16")
    monkeypatch.delenv(BF16_KERNEL_ENV, raising=False)
    if "amx_bf16" in cpu_info().flags and brgemm_bf16_available():
        expected = "brgemm"
    else:
        expected = "onednn" if cpu_info().bf16_dot_outruns_fma else "pagedllm"
    assert bf16_kernel() == expected == linear_packing(torch.bfloat16)
    for name in ("brgemm", "onednn", "pagedllm") if brgemm_bf16_available() else ("onednn", "pagedllm"):
        monkeypatch.setenv(BF16_KERNEL_ENV, name)
        assert bf16_kernel() == name == linear_packing(torch.bfloat16)
    if not brgemm_bf16_available():
        monkeypatch.setenv(BF16_KERNEL_ENV, "brgemm")
        with pytest.raises(ValueError, match="does not pack bf16 on this CPU"):
            bf16_kernel()
    monkeypatch.setenv(BF16_KERNEL_ENV, "mkl")
    with pytest.raises(ValueError, match="must be 'brgemm', 'onednn' or 'pagedllm', got 'mkl'"):
        bf16_kernel()
