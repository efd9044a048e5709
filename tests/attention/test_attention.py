"""The CPU backend against the reference, and the reference against plain causal attention."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention import cpu, torch_ref
from pagedllm.attention.cpu import decode_attention, paged_attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import dequantize_kv, paged_attention_ref, quantize_kv, write_kv
from pagedllm.layers.alibi import geometric_slopes
from pagedllm.runner.kv_tensors import pool_view

BLOCK_SIZE = 4
HEAD_DIM = 16
HEADS = {"mha": (4, 4), "gqa": (4, 2), "gqa3": (9, 3), "mqa": (4, 1), "gqa5": (5, 1)}  # gqa5: no fixed-group path
# Larger groups, for the decode kernel's vector paths: one key a step (AVX2 from 4, AVX-512 from 8) and several
# passes over each value row (AVX2 from 2 at head_dim 64, AVX-512 from 8).
WIDE_GROUPS = {"gqa4": (8, 2), "gqa8": (16, 2)}


def _random_batch(num_computed: list[int], query_lens: list[int], num_heads: int, num_kv_heads: int,
                  dtype: torch.dtype, seed: int = 0, head_dim: int = HEAD_DIM, block_size: int = BLOCK_SIZE,
                  int8_cache: bool = False, shared_prefix: int = 0):
    """Random full sequences; their prefixes are written to a shuffled paged cache (int8 rows with their scales if
    `int8_cache`), new tokens queued. The first `shared_prefix` positions (whole blocks) of every sequence are the
    same keys and values in the same blocks, as the prefix cache shares a system prompt.

    Drawing the numbers takes most of a kernel test's time, and a kernel case runs at each ISA level in turn
    (tests/conftest.py): the last few batches are kept, and each caller gets its own copies of the tensors it may
    write (the query and the caches) and of the metadata."""
    drawn = _drawn_batch(tuple(num_computed), tuple(query_lens), num_heads, num_kv_heads, dtype, seed, head_dim,
                         block_size, int8_cache, shared_prefix)
    return Batch(drawn)


class Batch(tuple):
    """(query, k_cache, v_cache, meta, (q_full, k_full, v_full)): copies of a drawn batch's query, caches and
    metadata, its full sequences as drawn; and `reference`, the torch reference over it, kept with the draw."""

    def __new__(cls, drawn: tuple) -> Batch:
        query, k_cache, v_cache, meta, full, _ = drawn
        batch = super().__new__(cls, (query.clone(), k_cache.clone(), v_cache.clone(), dataclasses.replace(meta),
                                      full))
        batch.drawn = drawn
        return batch

    def reference(self, *args, **kwargs) -> torch.Tensor:
        """`paged_attention_ref` over the drawn batch with these arguments (tensors among them compared by value)."""
        query, k_cache, v_cache, meta, _, references = self.drawn
        as_key = lambda x: tuple(x.tolist()) if isinstance(x, torch.Tensor) else x  # noqa: E731
        key = tuple(map(as_key, args)), tuple(sorted((k, as_key(v)) for k, v in kwargs.items()))
        if key not in references:
            references[key] = paged_attention_ref(query, k_cache, v_cache, meta, *args, **kwargs)
        return references[key]


@functools.lru_cache(maxsize=4)
def _drawn_batch(num_computed: tuple[int, ...], query_lens: tuple[int, ...], num_heads: int, num_kv_heads: int,
                 dtype: torch.dtype, seed: int, head_dim: int, block_size: int, int8_cache: bool,
                 shared_prefix: int):
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(num_computed, query_lens)]
    blocks_needed = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 stays a null block
    shared_blocks = [perm.pop() for _ in range(shared_prefix // block_size)]
    shared_kv = [torch.randn(shared_prefix, num_kv_heads, head_dim, generator=g) for _ in range(2)]
    tables, k_full, v_full, q_full = [], [], [], []
    for n, s in zip(blocks_needed, seq_lens):
        tables.append(shared_blocks + [perm.pop() for _ in range(n - len(shared_blocks))])
        k, v = (torch.cat([kv, torch.randn(s - shared_prefix, num_kv_heads, head_dim, generator=g)]).to(dtype)
                for kv in shared_kv)
        k_full.append(k)
        v_full.append(v)
        q_full.append(torch.randn(s, num_heads, head_dim, generator=g).to(dtype))
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)  # garbage
    v_cache = torch.randn_like(k_cache)
    if int8_cache:
        k_cache, v_cache = quantize_kv(k_cache), quantize_kv(v_cache)
    prefix = AttentionMetadata.build(tables, [0] * len(seq_lens), num_computed, block_size)
    write_kv(torch.cat([k[:c] for k, c in zip(k_full, num_computed)]),
             torch.cat([v[:c] for v, c in zip(v_full, num_computed)]), k_cache, v_cache, prefix.slot_mapping)
    meta = AttentionMetadata.build(tables, num_computed, query_lens, block_size)
    new = lambda xs: torch.cat([x[c:] for x, c in zip(xs, num_computed)])  # noqa: E731
    write_kv(new(k_full), new(v_full), k_cache, v_cache, meta.slot_mapping)
    return new(q_full), k_cache, v_cache, meta, (q_full, k_full, v_full), {}


BATCHES = {
    # decodes first (as the runner orders them), then a fresh prefill and a chunk with a cached prefix
    "mixed": ([9, 3, 0, 0, 5], [1, 1, 1, 7, 6]),
    # decodes that do not come first take the per-sequence path: still correct
    "unordered": ([0, 5, 9, 3, 0], [7, 6, 1, 1, 1]),
    "decode": ([3, 4, 11, 0, 8, 37], [1, 1, 1, 1, 1, 1]),
    "single_prefill": ([0], [13]),
}


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_matches_reference(heads: str, batch: str, dtype: torch.dtype) -> None:
    num_heads, num_kv_heads = HEADS[heads]
    query, k_cache, v_cache, meta, _ = _random_batch(*BATCHES[batch], num_heads, num_kv_heads, dtype)
    scale = HEAD_DIM ** -0.5
    expected = paged_attention_ref(query, k_cache, v_cache, meta, scale)
    actual = paged_attention(query, k_cache, v_cache, meta, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert actual.dtype == dtype and actual.shape == query.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64, 128, 256])  # 64, 128 and 256 take the kernel's unrolled paths
def test_decode_kernel_matches_the_torch_fallback_and_reference(heads: str, dtype: torch.dtype, head_dim: int,
                                                                 isa_level: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    num_heads, num_kv_heads = HEADS[heads]
    drawn = _random_batch(*BATCHES["decode"], num_heads, num_kv_heads, dtype, seed=3, head_dim=head_dim)
    query, k_cache, v_cache, meta, _ = drawn
    scale = head_dim ** -0.5
    kernel = decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
    fallback = decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    expected = drawn.reference(scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernel.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(fallback.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("heads", ["gqa3", "mqa", "gqa5", *WIDE_GROUPS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_decode_kernel_over_long_contexts(heads: str, dtype: torch.dtype, head_dim: int, block_size: int,
                                          isa_level: str) -> None:
    """Contexts of many blocks, ending mid-block and not on a multiple of the 4 keys the vector path scores
    together, so that its prefetches ahead, its 4-key steps and the keys left over all run; and, with AVX512-BF16,
    the value pairs, odd contexts' last key alone, and one-token blocks, whose keys are weighed one at a time."""
    num_heads, num_kv_heads = (HEADS | WIDE_GROUPS)[heads]
    drawn = _random_batch([70, 129, 6, 200], [1, 1, 1, 1], num_heads, num_kv_heads, dtype,
                          seed=5, head_dim=head_dim, block_size=block_size)
    query, k_cache, v_cache, meta, _ = drawn
    scale = head_dim ** -0.5
    kernel = decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    expected = drawn.reference(scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernel.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64, 128, 256])     # 64, 128 and 256 unrolled (256: Gemma's)
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_kernel_matches_the_torch_path_and_reference(heads: str, dtype: torch.dtype, head_dim: int,
                                                             block_size: int, isa_level: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Long chunks: several 16-key tiles and 16-token query tiles, fresh and after a cached prefix, with decodes
    first; more tasks than threads, of very different costs."""
    num_heads, num_kv_heads = HEADS[heads]
    num_computed, query_lens = [40, 7, 0, 0, 100, 33], [1, 1, 70, 1, 37, 18]
    drawn = _random_batch(num_computed, query_lens, num_heads, num_kv_heads, dtype,
                          seed=5, head_dim=head_dim, block_size=block_size)
    query, k_cache, v_cache, meta, _ = drawn
    scale = head_dim ** -0.5
    kernel = paged_attention(query, k_cache, v_cache, meta, scale)
    monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
    torch_path = paged_attention(query, k_cache, v_cache, meta, scale)
    expected = drawn.reference(scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernel.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(torch_path.float(), expected.float(), atol=tol, rtol=tol)


# The int8 cache's mixed batch: decodes first (the decode kernel), then fresh and cached-prefix prefill chunks and a
# late decode (the prefill kernel), crossing blocks, 16-key tiles and 16-token query tiles.
INT8_BATCH = ([20, 7, 0, 0, 40, 33], [1, 1, 35, 1, 20, 18])
INT8_HEADS = ["mha", "gqa3", "gqa5"]  # the kernels' fixed group sizes 1 and 3, and the generic path


def _int8_attention(heads: str, dtype: torch.dtype, head_dim: int) -> tuple[torch.Tensor, ...]:
    """(kernel or torch-path output, the two decodes alone, the dequantize-then-float reference)."""
    num_heads, num_kv_heads = HEADS[heads]
    query, k_cache, v_cache, meta, _ = _random_batch(*INT8_BATCH, num_heads, num_kv_heads, dtype, seed=7,
                                                     head_dim=head_dim, int8_cache=True)
    assert k_cache.dtype == torch.int8 and k_cache.shape[-1] == head_dim + 4
    scale = head_dim ** -0.5
    out = paged_attention(query, k_cache, v_cache, meta, scale)
    decodes = decode_attention(query[:2], k_cache, v_cache, meta.block_tables[:2], meta.seq_lens[:2], scale)
    return out, decodes, paged_attention_ref(query, k_cache, v_cache, meta, scale)


@pytest.mark.parametrize("heads", INT8_HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64, 128])
def test_int8_cache_kernels_match_the_dequantized_reference(heads: str, dtype: torch.dtype, head_dim: int,
                                                            isa_level: str) -> None:
    """The kernels read an int8 row as q * s, the floats `dequantize_kv` gives the reference: the same inputs, so
    the float tolerances hold (float32: summation order only; bf16: the output's rounding)."""
    out, decodes, expected = _int8_attention(heads, dtype, head_dim)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(decodes.float(), expected[:2].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("heads", INT8_HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_cache_torch_path_matches_the_dequantized_reference(heads: str, dtype: torch.dtype,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
    out, decodes, expected = _int8_attention(heads, dtype, 64)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(decodes.float(), expected[:2].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])
def test_int8_cache_attention_is_close_to_float_attention(head_dim: int) -> None:
    """Against the unquantized cache, loosely. A row's rounding error is at most s / 2 = max|x| / 254 per element,
    under 0.02 for N(0, 1) rows; V's error passes through the softmax's convex combination unchanged in bound, and
    K's moves a score by scale * q . dk, a few hundredths here, so each output stays within ~0.05 and the mean
    error is far smaller."""
    num_heads, num_kv_heads = HEADS["gqa"]
    query, k_cache, v_cache, meta, _ = _random_batch(*INT8_BATCH, num_heads, num_kv_heads, torch.float32, seed=7,
                                                     head_dim=head_dim)
    _, k_int8, v_int8, _, _ = _random_batch(*INT8_BATCH, num_heads, num_kv_heads, torch.float32, seed=7,
                                            head_dim=head_dim, int8_cache=True)
    scale = head_dim ** -0.5
    exact = paged_attention_ref(query, k_cache, v_cache, meta, scale)
    quantized = paged_attention(query, k_int8, v_int8, meta, scale)
    error = (quantized - exact).abs()
    assert error.max() < 0.05 and error.mean() < 0.005
    assert error.max() > 0  # it did read the int8 cache


# Cascade attention: decodes first, then chunks and a late decode, all after a shared prefix of whole blocks; the
# positions past it are each sequence's own: none yet (a question's first chunk), a few, or many (a long answer,
# several 64-key chunks). Sixteen sequences over 256 shared keys: a cascade on every path (paged_attention.cpp).
CASCADE_BATCH = ([0, 37, 5, 64, 0, 3, 9, 1, 20, 0, 90, 2, 11, 0, 6, 30], [1] * 10 + [40, 17, 33, 5, 64, 1])


def _cascade_batch(heads: str, dtype: torch.dtype, head_dim: int, block_size: int, shared_prefix: int,
                   int8_cache: bool = False):
    num_heads, num_kv_heads = (HEADS | WIDE_GROUPS)[heads]
    own, query_lens = CASCADE_BATCH
    return _random_batch([shared_prefix + c for c in own], query_lens, num_heads, num_kv_heads, dtype, seed=11,
                         head_dim=head_dim, block_size=block_size, int8_cache=int8_cache,
                         shared_prefix=shared_prefix)


@pytest.mark.parametrize("heads", ["mha", "gqa3", "gqa5", "gqa8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
def test_cascade_attention_matches_the_reference(heads: str, dtype: torch.dtype, head_dim: int, block_size: int,
                                                 isa_level: str) -> None:
    """Sequences sharing 256 keys and 3 blocks: the prefix pass takes 256 keys for every row at once, the decode
    and prefill kernels the shared blocks left and each sequence's own keys from its state."""
    shared = 256 + 3 * block_size
    drawn = _cascade_batch(heads, dtype, head_dim, block_size, shared)
    query, k_cache, v_cache, meta, _ = drawn
    assert cpu.cascade_prefix_len(query, k_cache, meta) == 256
    scale = head_dim ** -0.5
    expected = drawn.reference(scale)
    actual = paged_attention(query, k_cache, v_cache, meta, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("heads", INT8_HEADS)
def test_cascade_attention_over_an_int8_cache(heads: str, isa_level: str) -> None:
    drawn = _cascade_batch(heads, torch.bfloat16, 64, 16, 256, int8_cache=True)
    query, k_cache, v_cache, meta, _ = drawn
    assert cpu.cascade_prefix_len(query, k_cache, meta) == 256
    expected = drawn.reference(0.125)
    torch.testing.assert_close(paged_attention(query, k_cache, v_cache, meta, 0.125).float(), expected.float(),
                               atol=2e-2, rtol=2e-2)


# Sliding windows over decodes, fresh and cached-prefix prefill chunks and chunks long enough that their rows'
# windows begin in different 64-key chunks: windows of one key, shorter than a block, not a multiple of one, and
# longer than a key chunk.
WINDOW_BATCH = ([40, 7, 0, 0, 100, 33, 150], [1, 1, 70, 1, 37, 18, 130])
WINDOWS = [1, 5, 37, 100]


def test_a_window_shows_each_query_its_last_keys_alone() -> None:
    """The reference with a window is full attention over each query's last `window` keys: here the decodes'
    (position 40 of sequence 0 over keys 36-40) against SDPA over those keys, and a window changes the output."""
    query, k_cache, v_cache, meta, (q_full, k_full, v_full) = _random_batch(*WINDOW_BATCH, 4, 4, torch.float32)
    windowed = paged_attention_ref(query, k_cache, v_cache, meta, HEAD_DIM ** -0.5, window=5)
    keys, values = (x[0][36:41].transpose(0, 1) for x in (k_full, v_full))          # [H, 5, D]
    expected = F.scaled_dot_product_attention(q_full[0][40].unsqueeze(1), keys, values, scale=HEAD_DIM ** -0.5)
    torch.testing.assert_close(windowed[0], expected.squeeze(1), atol=1e-5, rtol=1e-5)
    whole = paged_attention_ref(query, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    assert not torch.allclose(windowed[0], whole[0], atol=1e-3)
    torch.testing.assert_close(paged_attention_ref(query, k_cache, v_cache, meta, HEAD_DIM ** -0.5, window=1000),
                               whole)                                                  # past every context: none


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", ["mha", "gqa3", "gqa5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64, 256])
def test_sliding_window_kernels_and_torch_path_match_the_reference(window: int, heads: str, dtype: torch.dtype,
                                                                    head_dim: int, isa_level: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    num_heads, num_kv_heads = HEADS[heads]
    drawn = _random_batch(*WINDOW_BATCH, num_heads, num_kv_heads, dtype, seed=7, head_dim=head_dim, block_size=16)
    query, k_cache, v_cache, meta, _ = drawn
    scale = head_dim ** -0.5
    expected = drawn.reference(scale, window)
    kernel = paged_attention(query, k_cache, v_cache, meta, scale, window)
    decodes = decode_attention(query[:2], k_cache, v_cache, meta.block_tables[:2], meta.seq_lens[:2], scale, window)
    monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
    torch_path = paged_attention(query, k_cache, v_cache, meta, scale, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for actual in (kernel, torch_path):
        torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(decodes.float(), expected[:2].float(), atol=tol, rtol=tol)


def test_a_window_turns_cascade_attention_off(isa_level: str) -> None:
    """Sequences sharing 256 keys, where a step without a window runs as a cascade: with one, each row sees its own
    part of the shared prefix, as the reference has it."""
    drawn = _cascade_batch("gqa3", torch.bfloat16, 64, 16, 256)
    query, k_cache, v_cache, meta, _ = drawn
    assert cpu.cascade_prefix_len(query, k_cache, meta) == 256
    expected = drawn.reference(0.125, window=100)
    torch.testing.assert_close(paged_attention(query, k_cache, v_cache, meta, 0.125, window=100).float(),
                               expected.float(), atol=2e-2, rtol=2e-2)


# Gemma 2's soft cap (50) is far above these random scores' (about +-3): 1.5 bends them all.
SOFTCAP = 1.5


def test_a_softcap_bends_each_score_by_tanh() -> None:
    """The reference with a soft cap is the softmax of cap * tanh(s / cap) over the scaled scores s: here the first
    decode's, against its scores worked out by hand; a cap far above every score changes nothing."""
    query, k_cache, v_cache, meta, (q_full, k_full, v_full) = _random_batch(*WINDOW_BATCH, 4, 4, torch.float32)
    capped = paged_attention_ref(query, k_cache, v_cache, meta, 0.5, softcap=SOFTCAP)
    scores = torch.einsum("hd,khd->hk", q_full[0][40], k_full[0][:41]) * 0.5
    probs = torch.softmax(SOFTCAP * torch.tanh(scores / SOFTCAP), dim=-1)
    torch.testing.assert_close(capped[0], torch.einsum("hk,khd->hd", probs, v_full[0][:41]), atol=1e-5, rtol=1e-5)
    whole = paged_attention_ref(query, k_cache, v_cache, meta, 0.5)
    assert not torch.allclose(capped, whole, atol=1e-2)
    torch.testing.assert_close(paged_attention_ref(query, k_cache, v_cache, meta, 0.5, softcap=1e6), whole)


@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("heads", ["mha", "gqa3", "gqa5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64, 256])
def test_soft_capped_kernels_and_torch_path_match_the_reference(window: int, heads: str, dtype: torch.dtype,
                                                                head_dim: int, isa_level: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes, fresh and cached chunks, with and without a window: the kernels cap each chunk's scores as they
    make them; without the kernels the reference runs (SDPA has no soft cap)."""
    num_heads, num_kv_heads = HEADS[heads]
    drawn = _random_batch(*WINDOW_BATCH, num_heads, num_kv_heads, dtype, seed=11, head_dim=head_dim, block_size=16)
    query, k_cache, v_cache, meta, _ = drawn
    scale = head_dim ** -0.5 * 2        # scores of about +-2 before the cap
    expected = drawn.reference(scale, window, SOFTCAP)
    kernel = paged_attention(query, k_cache, v_cache, meta, scale, window, SOFTCAP)
    monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
    torch_path = paged_attention(query, k_cache, v_cache, meta, scale, window, SOFTCAP)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for actual in (kernel, torch_path):
        torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_cascade_attention_matches_the_reference(dtype: torch.dtype, isa_level: str) -> None:
    """A soft cap keeps cascade attention: the prefix pass and each sequence's own keys cap their scores alike."""
    drawn = _cascade_batch("gqa3", dtype, 64, 16, 256)
    query, k_cache, v_cache, meta, _ = drawn
    assert cpu.cascade_prefix_len(query, k_cache, meta) == 256
    expected = drawn.reference(0.25, softcap=SOFTCAP)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(paged_attention(query, k_cache, v_cache, meta, 0.25, softcap=SOFTCAP).float(),
                               expected.float(), atol=tol, rtol=tol)


def test_alibi_lowers_each_score_by_its_heads_slope_times_the_keys_distance() -> None:
    """The reference with ALiBi's slopes is the softmax of s + slope_h (k - q) over the scaled scores s: here the
    first decode's, against its scores worked out by hand; slopes of 0 change nothing."""
    query, k_cache, v_cache, meta, (q_full, k_full, v_full) = _random_batch(*WINDOW_BATCH, 4, 4, torch.float32)
    slopes = geometric_slopes(4)     # 1/4, 1/16, 1/64, 1/256
    biased = paged_attention_ref(query, k_cache, v_cache, meta, 0.5, alibi_slopes=slopes)
    scores = torch.einsum("hd,khd->hk", q_full[0][40], k_full[0][:41]) * 0.5
    probs = torch.softmax(scores + slopes[:, None] * (torch.arange(41) - 40), dim=-1)
    torch.testing.assert_close(biased[0], torch.einsum("hk,khd->hd", probs, v_full[0][:41]), atol=1e-5, rtol=1e-5)
    whole = paged_attention_ref(query, k_cache, v_cache, meta, 0.5)
    assert not torch.allclose(biased, whole, atol=1e-2)
    torch.testing.assert_close(paged_attention_ref(query, k_cache, v_cache, meta, 0.5,
                                                   alibi_slopes=torch.zeros(4)), whole)


@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("heads", ["mha", "gqa3", "gqa5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64, 128])
def test_alibi_kernels_and_torch_path_match_the_reference(window: int, heads: str, dtype: torch.dtype, head_dim: int,
                                                          isa_level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes, fresh and cached chunks (up to 280 keys: distant keys matter with the small slopes of many heads),
    with and without a window: the kernels bias each chunk's scores as they make them, each row from its own
    position and head; without the kernels the reference runs (SDPA takes no per-head bias here)."""
    num_heads, num_kv_heads = HEADS[heads]
    drawn = _random_batch(*WINDOW_BATCH, num_heads, num_kv_heads, dtype, seed=13, head_dim=head_dim, block_size=16)
    query, k_cache, v_cache, meta, _ = drawn
    slopes = geometric_slopes(num_heads) / 4     # keys up to ~100 back still count for every head
    scale = head_dim ** -0.5
    expected = drawn.reference(scale, window, alibi_slopes=slopes)
    kernel = paged_attention(query, k_cache, v_cache, meta, scale, window, alibi_slopes=slopes)
    monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
    torch_path = paged_attention(query, k_cache, v_cache, meta, scale, window, alibi_slopes=slopes)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for actual in (kernel, torch_path):
        torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def test_alibi_turns_cascade_attention_off(isa_level: str) -> None:
    """Sequences sharing 256 keys, where a step without ALiBi runs as a cascade: with it, each row's biases run from
    its own position, as the reference has them (a cascade's prefix pass would see its rows as one)."""
    drawn = _cascade_batch("gqa3", torch.bfloat16, 64, 16, 256)
    query, k_cache, v_cache, meta, _ = drawn
    assert cpu.cascade_prefix_len(query, k_cache, meta) == 256
    slopes = geometric_slopes(9)
    expected = drawn.reference(0.125, alibi_slopes=slopes)
    torch.testing.assert_close(paged_attention(query, k_cache, v_cache, meta, 0.125, alibi_slopes=slopes).float(),
                               expected.float(), atol=2e-2, rtol=2e-2)


def test_the_kernels_refuse_slopes_of_another_head_count(isa_level: str) -> None:
    query, k_cache, v_cache, meta, _ = _random_batch(*WINDOW_BATCH, 4, 2, torch.float32)
    with pytest.raises(RuntimeError, match="one a query head"):
        paged_attention(query, k_cache, v_cache, meta, 0.5, alibi_slopes=geometric_slopes(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("views", [1, 2])
@pytest.mark.parametrize("batch", ["mixed", "decode"])
def test_latent_rows_viewed_as_several_kv_heads_match_the_reference(dtype: torch.dtype, views: int, batch: str,
                                                                    isa_level: str) -> None:
    """DeepSeek's latent attention (pagedllm.models.mla): 16 query heads over one 576-wide row a token, which the
    backend reads through views of it as two kv heads of 8 query heads each (stride 0: the kernels' fixed-size
    paths), or given as such views: decodes and prefill chunks, the reference's result over the one row."""
    drawn = _random_batch(*BATCHES[batch], 16, 1, dtype, seed=21, head_dim=576, block_size=8)
    query, k_cache, v_cache, meta, _ = drawn
    expected = drawn.reference(0.05)
    actual = paged_attention(query, k_cache.expand(-1, -1, views, -1), v_cache.expand(-1, -1, views, -1), meta, 0.05)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def random_sinks(num_heads: int, seed: int = 0) -> torch.Tensor:
    """Attention sinks [num_heads] float32 of the scores' size (|s| ~ 1 here), so that each takes a share of its
    rows' weights that an error in it would show."""
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2


def test_a_sink_is_one_more_logit_in_each_rows_softmax_whose_value_is_zero() -> None:
    """The reference with sinks: the first decode's output against its softmax over [scores, sink] worked out by
    hand, the sink's column dropped; sinks far below every score change nothing, a high one shrinks the output."""
    query, k_cache, v_cache, meta, (q_full, k_full, v_full) = _random_batch(*WINDOW_BATCH, 4, 4, torch.float32)
    sinks = random_sinks(4)
    out = paged_attention_ref(query, k_cache, v_cache, meta, 0.5, sinks=sinks)
    scores = torch.einsum("hd,khd->hk", q_full[0][40], k_full[0][:41]) * 0.5
    probs = torch.softmax(torch.cat([scores, sinks[:, None]], dim=-1), dim=-1)[:, :-1]
    torch.testing.assert_close(out[0], torch.einsum("hk,khd->hd", probs, v_full[0][:41]), atol=1e-5, rtol=1e-5)
    whole = paged_attention_ref(query, k_cache, v_cache, meta, 0.5)
    assert not torch.allclose(out, whole, atol=1e-2)
    torch.testing.assert_close(paged_attention_ref(query, k_cache, v_cache, meta, 0.5,
                                                   sinks=torch.full((4,), -1e4)), whole)
    high = paged_attention_ref(query, k_cache, v_cache, meta, 0.5, sinks=torch.full((4,), 50.0))
    assert high.abs().max() < 1e-6 * whole.abs().max()


@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("heads", ["mha", "gqa3", "gqa5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])
@pytest.mark.parametrize("int8_cache", [False, True])
def test_sinks_kernels_and_torch_path_match_the_reference(window: int, heads: str, dtype: torch.dtype, head_dim: int,
                                                          int8_cache: bool, isa_level: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes, fresh and cached chunks, with and without a window, over a float or an int8 cache: the decode and
    prefill kernels add each row's sink to its denominator as they make its output; without the kernels the
    reference runs (SDPA takes no sinks)."""
    num_heads, num_kv_heads = HEADS[heads]
    drawn = _random_batch(*WINDOW_BATCH, num_heads, num_kv_heads, dtype, seed=17,
                          head_dim=head_dim, block_size=16, int8_cache=int8_cache)
    query, k_cache, v_cache, meta, _ = drawn
    sinks = random_sinks(num_heads, seed=1)
    scale = head_dim ** -0.5
    expected = drawn.reference(scale, window, sinks=sinks)
    kernel = paged_attention(query, k_cache, v_cache, meta, scale, window, sinks=sinks)
    monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
    torch_path = paged_attention(query, k_cache, v_cache, meta, scale, window, sinks=sinks)
    tol = 1e-5 if dtype == torch.float32 and not int8_cache else 2e-2
    for actual in (kernel, torch_path):
        torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_keep_cascade_attention(dtype: torch.dtype, isa_level: str) -> None:
    """Sequences sharing 256 keys run as a cascade with sinks too: each row's sink joins its denominator once, after
    the prefix's keys and its own."""
    drawn = _cascade_batch("gqa3", dtype, 64, 16, 256)
    query, k_cache, v_cache, meta, _ = drawn
    assert cpu.cascade_prefix_len(query, k_cache, meta) == 256
    sinks = random_sinks(9, seed=2)
    expected = drawn.reference(0.125, sinks=sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(paged_attention(query, k_cache, v_cache, meta, 0.125, sinks=sinks).float(),
                               expected.float(), atol=tol, rtol=tol)


def test_the_kernels_refuse_sinks_of_another_head_count(isa_level: str) -> None:
    query, k_cache, v_cache, meta, _ = _random_batch(*WINDOW_BATCH, 4, 2, torch.float32)
    with pytest.raises(RuntimeError, match="sinks must be contiguous float32 on the CPU, one a query head"):
        paged_attention(query, k_cache, v_cache, meta, 0.5, sinks=random_sinks(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_without_cascades_gives_each_sequence_its_own_bits(dtype: torch.dtype, isa_level: str) -> None:
    """With `cascade` off (ModelConfig.disable_cascade_attn) a batch that would run as a cascade gives every
    sequence exactly what it gets attended alone (a cascade's sums run in another order: close, not equal); but for
    the decode after the chunks, which the prefill kernel takes in the batch and the decode kernel alone."""
    query, k_cache, v_cache, meta, _ = _cascade_batch("gqa3", dtype, 64, 16, 256)
    assert cpu.cascade_prefix_len(query, k_cache, meta) == 256
    meta.cascade = False
    assert cpu.cascade_prefix_len(query, k_cache, meta) == 0
    batch = paged_attention(query, k_cache, v_cache, meta, 0.125)
    qsl = meta.query_start_loc_cpu
    late_decode = meta.num_seqs - 1
    assert meta.num_decodes < late_decode and qsl[late_decode + 1] - qsl[late_decode] == 1
    for i in range(late_decode):
        one = AttentionMetadata(meta.slot_mapping[qsl[i]:qsl[i + 1]], torch.tensor([0, qsl[i + 1] - qsl[i]],
                                dtype=torch.int32), meta.seq_lens[i:i + 1], meta.block_tables[i:i + 1],
                                qsl[i + 1] - qsl[i], meta.seq_lens_cpu[i])
        alone = paged_attention(query[qsl[i]:qsl[i + 1]], k_cache, v_cache, one, 0.125)
        assert torch.equal(batch[qsl[i]:qsl[i + 1]], alone), i


def test_cascade_prefix_is_the_shared_blocks_every_query_sees_in_whole_chunks() -> None:
    def prefix(tables: list[list[int]], num_computed: list[int] | None = None, query_lens: list[int] | None = None,
               dtype: torch.dtype = torch.float32) -> int:
        num_computed = num_computed or [260] * len(tables)
        query_lens = query_lens or [1] * len(tables)
        meta = AttentionMetadata.build(tables, num_computed, query_lens, 16)
        query, k_cache = torch.zeros(sum(query_lens), 9, 64, dtype=dtype), torch.zeros(500, 16, 3, 64, dtype=dtype)
        return cpu.cascade_prefix_len(query, k_cache, meta)

    shared = list(range(1, 17))  # 16 blocks of 16: 256 positions
    tables = [shared + [100 + i] for i in range(32)]
    assert prefix(tables) == 256
    assert prefix(tables[:31] + [shared[:13] + list(range(200, 204))]) == 192  # 13 blocks in one table: 3 chunks
    assert prefix(tables, [200] + [260] * 31, [60] + [1] * 31) == 192  # seq 0's queries start at position 200
    assert prefix(tables[:31] + [[99] + shared[1:] + [115]]) == 0  # the first blocks differ
    assert prefix([shared[:3] + [100 + i] for i in range(32)], [49] * 32) == 0  # under one chunk shared
    # In vector code (float32) a cascade takes 16 sequences and 4096 keys' reads saved (sequences x prefix).
    assert prefix(tables[:16]) == 256
    assert prefix(tables[:15]) == 0
    assert prefix([shared[:8] + [100 + i] for i in range(16)], [129] * 16) == 0  # 16 x 128
    assert prefix([shared[:8] + [100 + i] for i in range(32)], [129] * 32) == 128  # 32 x 128
    # bf16 may take AMX tiles, where 8 sequences and 2048 keys suffice: these two hold on either path.
    assert prefix(tables[:16], dtype=torch.bfloat16) == 256
    assert prefix(tables[:4], dtype=torch.bfloat16) == 0


def test_quantize_kv_rows_and_write_kv_into_an_int8_cache() -> None:
    x = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(0)) * torch.arange(1.0, 7.0)[:, None, None]
    x[2, 1] = 0.0
    rows = quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (6, 2, 12)
    scales = rows[..., 8:].contiguous().view(torch.float32).squeeze(-1)
    torch.testing.assert_close(scales, x.abs().amax(-1) / 127)
    assert rows[..., :8].abs().amax(-1)[scales > 0].eq(127).all()  # each row's absmax maps to +-127
    error = (dequantize_kv(rows) - x).abs()
    assert (error <= scales.unsqueeze(-1) / 2 + 1e-6).all()
    assert dequantize_kv(rows)[2, 1].eq(0).all()  # a zero row (scale 0) stays zero, no NaN
    k_cache = torch.zeros(3, BLOCK_SIZE, 2, 12, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    write_kv(x[:3], -x[:3], k_cache, v_cache, torch.tensor([9, 10, 3]))
    assert torch.equal(k_cache[2, 1], rows[0]) and torch.equal(k_cache[0, 3], rows[2])
    torch.testing.assert_close(dequantize_kv(v_cache[2, 2]), -dequantize_kv(rows[1]))


@pytest.mark.parametrize("cache_dtype", ["float", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])
def test_write_kv_kernel_stores_the_reference_bits(cache_dtype: str, dtype: torch.dtype, head_dim: int,
                                                   isa_level: str) -> None:
    """The C++ write (one pass, int8 rows quantized as it goes) leaves the caches bit for bit as torch_ref's;
    key and value are views into one qkv row, as the model hands them, and a zero row keeps scale 0."""
    g = torch.Generator().manual_seed(7)
    tokens, heads = 150, 3  # past the kernel's 128-token task grain: two threads' worth
    qkv = (torch.randn(tokens, 4 * heads * head_dim, generator=g) * 3).to(dtype)
    key = qkv[:, heads * head_dim:2 * heads * head_dim].view(tokens, heads, head_dim)
    value = qkv[:, 2 * heads * head_dim:3 * heads * head_dim].view(tokens, heads, head_dim)
    key[5, 1] = 0
    width = head_dim + 4 if cache_dtype == "int8" else head_dim
    caches = torch.randn(2, 2, 40, 8, heads, width, generator=g).to(dtype)  # [layers, K/V, blocks, bs, H, D]
    if cache_dtype == "int8":
        caches = torch.randint(-128, 128, caches.shape, generator=g, dtype=torch.int8)
    expected = caches.clone()
    slots = torch.randperm(40 * 8, generator=g)[:tokens]
    cpu.write_kv(key, value, caches[1, 0], caches[1, 1], slots)
    torch_ref.write_kv(key, value, expected[1, 0], expected[1, 1], slots)
    assert torch.equal(caches, expected)


def test_write_kv_kernel_refuses_a_slot_outside_the_cache() -> None:
    k_cache = torch.zeros(3, BLOCK_SIZE, 1, 2)
    with pytest.raises(RuntimeError, match="slot 12 is outside the cache's 12"):
        cpu.write_kv(torch.ones(1, 1, 2), torch.ones(1, 1, 2), k_cache, k_cache.clone(), torch.tensor([12]))


def test_decode_kernel_reads_a_cache_view_with_layer_strides() -> None:
    """The runner hands the kernel kv[layer, 0]: a view into one tensor holding every layer's K and V."""
    num_heads, num_kv_heads = HEADS["gqa"]
    query, k_cache, v_cache, meta, _ = _random_batch(*BATCHES["decode"], num_heads, num_kv_heads, torch.float32)
    kv = torch.stack([torch.stack([torch.randn_like(k_cache), torch.randn_like(v_cache)]),
                      torch.stack([k_cache, v_cache])])  # [layers=2, 2, blocks, bs, Hkv, D]
    scale = HEAD_DIM ** -0.5
    actual = decode_attention(query, kv[1, 0], kv[1, 1], meta.block_tables, meta.seq_lens, scale)
    expected = paged_attention_ref(query, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """A copy of `cache` ([blocks, block_size, Hkv, D]) stored as a CPU pool stores it: each block head-major."""
    return pool_view(torch.empty(cache.numel(), dtype=cache.dtype), (1, 1, *cache.shape))[0, 0].copy_(cache)


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_read_and_write_a_head_major_pool(cache_dtype: str, dtype: torch.dtype, isa_level: str) -> None:
    """A CPU pool keeps one kv head's rows of a block together (kv_tensors.pool_view): the kernels and the torch
    reference read and write it by its strides, with the bits they give on a token-major cache."""
    num_heads, num_kv_heads = HEADS["gqa3"]
    query, k_cache, v_cache, meta, _ = _random_batch(*BATCHES["mixed"], num_heads, num_kv_heads, dtype,
                                                     int8_cache=cache_dtype == "int8")
    k_pool, v_pool = _head_major(k_cache), _head_major(v_cache)
    assert k_pool[5, :, 2].is_contiguous() and not k_pool[5].is_contiguous()
    scale = HEAD_DIM ** -0.5
    assert torch.equal(paged_attention(query, k_pool, v_pool, meta, scale),
                       paged_attention(query, k_cache, v_cache, meta, scale))
    g = torch.Generator().manual_seed(3)
    key, value = (torch.randn(6, num_kv_heads, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, generator=g)[:6]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    torch_ref.write_kv(key, value, expected_k, expected_v, slots)
    cpu.write_kv(key, value, k_pool, v_pool, slots)
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)
    k_pool, v_pool = _head_major(k_cache), _head_major(v_cache)
    torch_ref.write_kv(key, value, k_pool, v_pool, slots)
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)


@pytest.mark.parametrize("heads", list(HEADS))
def test_reference_matches_plain_causal_attention(heads: str) -> None:
    num_heads, num_kv_heads = HEADS[heads]
    num_computed, query_lens = BATCHES["mixed"]
    query, k_cache, v_cache, meta, (q_full, k_full, v_full) = _random_batch(
        num_computed, query_lens, num_heads, num_kv_heads, torch.float32, seed=1)
    scale = HEAD_DIM ** -0.5
    out = paged_attention_ref(query, k_cache, v_cache, meta, scale)
    qsl = meta.query_start_loc_cpu
    for i, (q, k, v) in enumerate(zip(q_full, k_full, v_full)):
        full = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], full[num_computed[i]:], atol=1e-5, rtol=1e-5)


def test_write_kv_slots() -> None:
    k_cache = torch.zeros(3, BLOCK_SIZE, 1, 2)
    v_cache = torch.zeros_like(k_cache)
    key = torch.arange(1.0, 7.0).reshape(3, 1, 2)
    write_kv(key, -key, k_cache, v_cache, torch.tensor([9, 10, 3]))  # block 2 offsets 1,2; block 0 offset 3
    assert k_cache[2, 1, 0].tolist() == [1.0, 2.0] and k_cache[2, 2, 0].tolist() == [3.0, 4.0]
    assert k_cache[0, 3, 0].tolist() == [5.0, 6.0] and v_cache[0, 3, 0].tolist() == [-5.0, -6.0]
    assert k_cache.count_nonzero() == 6


def test_metadata_build_slots_cross_blocks() -> None:
    meta = AttentionMetadata.build([[7, 2, 5], [1]], [3, 0], [4, 2], BLOCK_SIZE)
    assert meta.slot_mapping.tolist() == [31, 8, 9, 10, 4, 5]
    assert meta.query_start_loc_cpu == [0, 4, 6] and meta.seq_lens_cpu == [7, 2]
    assert meta.block_tables.tolist() == [[7, 2, 5], [1, 0, 0]]
    assert (meta.max_query_len, meta.max_seq_len) == (4, 7)


# Whole prompts, as an encoder's steps hold them: a prompt shorter than a window, one across several blocks, one
# of a single token; and runs of prompts of one length (equal documents), which share an SDPA call.
ENCODER_BATCH = ([0, 0, 0], [5, 41, 1])
ENCODER_RUNS = ([0] * 6, [7, 7, 7, 41, 7, 7])
ENCODER_NEAR = ([0] * 5, [30, 33, 27, 33, 31])      # lengths near one another: padded to the longest, in one call
ENCODER_EQUAL = ([0] * 4, [21] * 4)                  # one length, not a multiple of 16: its keys padded to 32


@pytest.mark.parametrize("window", [0, 3, 17])
def test_bidirectional_reference_shows_each_query_the_keys_around_it(window: int) -> None:
    """Without causality (an encoder's attention) each query row sees every key of its prompt, within `window`
    positions either side where one is given: here row 20 of the 41-token prompt against SDPA over those keys."""
    query, k_cache, v_cache, meta, (q_full, k_full, v_full) = _random_batch(*ENCODER_BATCH, 4, 2, torch.float32)
    out = paged_attention_ref(query, k_cache, v_cache, meta, 0.5, window, causal=False)
    seen = slice(20 - window + 1, 20 + window) if window else slice(0, 41)
    keys, values = (x[1][seen].repeat_interleave(2, dim=1).transpose(0, 1) for x in (k_full, v_full))
    expected = F.scaled_dot_product_attention(q_full[1][20].unsqueeze(1), keys, values, scale=0.5)
    torch.testing.assert_close(out[5 + 20], expected.squeeze(1), atol=1e-5, rtol=1e-5)
    causal = paged_attention_ref(query, k_cache, v_cache, meta, 0.5, window)
    torch.testing.assert_close(out[-1], causal[-1])             # a one-token prompt sees itself either way
    assert not torch.allclose(out[5:46], causal[5:46], atol=1e-3)


@pytest.mark.parametrize("window", [0, 3, 17, 100])
@pytest.mark.parametrize("heads", ["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [ENCODER_BATCH, ENCODER_RUNS, ENCODER_NEAR, ENCODER_EQUAL])
def test_bidirectional_attention_matches_the_reference(window: int, heads: str, dtype: torch.dtype,
                                                       batch: tuple[list[int], list[int]]) -> None:
    """The encoder's SDPA calls over the step's own K/V against the reference over a cache holding them: unmasked
    where a prompt fits in the window (the 41-token one in 100), banded where it does not, runs of equal prompts in
    one call, prompts of near lengths padded in one call (their keys to a multiple of 16), and so prompts of one
    length that is not such a multiple."""
    num_heads, num_kv_heads = HEADS[heads]
    query, k_cache, v_cache, meta, (_, k_full, v_full) = _random_batch(*batch, num_heads, num_kv_heads, dtype,
                                                                       seed=5, head_dim=64)
    expected = paged_attention_ref(query, k_cache, v_cache, meta, 0.125, window, causal=False)
    out = cpu.bidirectional_attention(query, torch.cat(k_full), torch.cat(v_full), meta, 0.125, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [0, 3, 17, 100])
@pytest.mark.parametrize("heads", ["mha", "gqa3", "gqa5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64, 256])
@pytest.mark.parametrize("batch", [ENCODER_RUNS, WINDOW_BATCH])
def test_bidirectional_kernels_match_the_reference(window: int, heads: str, dtype: torch.dtype, head_dim: int,
                                                   batch: tuple[list[int], list[int]], isa_level: str) -> None:
    """The kernels' bidirectional mode (the decoder stack's, for an encoder): each row over every key of its
    context within the window either side, whole prompts as an encoder's steps hold them, and (beyond what an
    encoder runs) decodes and chunks after a cached prefix, which see the whole context too."""
    num_heads, num_kv_heads = HEADS[heads]
    drawn = _random_batch(*batch, num_heads, num_kv_heads, dtype, seed=9, head_dim=head_dim, block_size=16)
    query, k_cache, v_cache, meta, _ = drawn
    scale = head_dim ** -0.5
    expected = drawn.reference(scale, window, causal=False)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(paged_attention(query, k_cache, v_cache, meta, scale, window, causal=False).float(),
                               expected.float(), atol=tol, rtol=tol)
