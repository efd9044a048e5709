"""The Triton backend against the reference, on every machine: compiled on a CUDA device when there is one,
otherwise through Triton's interpreter on CPU tensors (numpy; tiny shapes, ~0.1-0.5 s a call), which
tests/conftest.py selects before triton is imported. The reference runs on CPU copies of the same inputs."""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

import pytest
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import paged_attention_ref
from pagedllm.layers.alibi import geometric_slopes
from tests.attention.test_attention import BATCHES, _random_batch, random_sinks

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Few KV heads and sequences: the interpreter spends ~20 ms per program (one sequence, KV head and row tile).
TRITON_HEADS = {"mha": (2, 2), "gqa3": (9, 3), "mqa": (4, 1)}
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # the output's rounding
# Decodes first, then prefill chunks with and without a cached prefix, on 16-token blocks and head_dim 64: the
# context crosses blocks and 32-key tiles, and a chunk's rows (tokens x group) cross 64-row tiles.
LONG_BATCH = ([40, 7, 0, 29], [1, 1, 45, 21])


@pytest.fixture(scope="module")
def backend() -> ModuleType:
    """pagedllm.attention.triton_attention, its kernel interpreted exactly when there is no CUDA device."""
    from triton.runtime.interpreter import InterpretedFunction

    module = importlib.import_module("pagedllm.attention.triton_attention")
    interpreted = isinstance(module._paged_attention_kernel, InterpretedFunction)
    assert interpreted == (DEVICE == "cpu"), "triton was imported before tests/conftest.py set TRITON_INTERPRET"
    return module


def _run(backend: ModuleType, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
         meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
         alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The backend's paged_attention on DEVICE copies of the inputs, its output back on the CPU."""
    on_device = dataclasses.replace(meta, **{f: getattr(meta, f).to(DEVICE) for f in
                                             ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")})
    slopes, sinks = (None if x is None else x.to(DEVICE) for x in (alibi_slopes, sinks))
    return backend.paged_attention(query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), on_device,
                                   scale, window, softcap, slopes, sinks).cpu()


def _check(backend: ModuleType, heads: str, batch: tuple[list[int], list[int]], dtype: torch.dtype,
           window: int = 0, softcap: float = 0.0, alibi: bool = False, sinks: bool = False, **batch_options) -> None:
    num_heads, num_kv_heads = TRITON_HEADS[heads]
    query, k_cache, v_cache, meta, _ = _random_batch(*batch, num_heads, num_kv_heads, dtype, **batch_options)
    scale = query.shape[-1] ** -0.5
    slopes = geometric_slopes(num_heads) if alibi else None
    head_sinks = random_sinks(num_heads) if sinks else None
    actual = _run(backend, query, k_cache, v_cache, meta, scale, window, softcap, slopes, head_sinks)
    expected = paged_attention_ref(query, k_cache, v_cache, meta, scale, window, softcap, alibi_slopes=slopes,
                                   sinks=head_sinks)
    assert actual.dtype == query.dtype and actual.shape == query.shape
    tol = TOLERANCES[query.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("heads", list(TRITON_HEADS))
@pytest.mark.parametrize("batch", ["mixed", "decode"])
def test_triton_backend_matches_reference(backend: ModuleType, heads: str, batch: str) -> None:
    _check(backend, heads, BATCHES[batch], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_backend_matches_reference_in_half_precision(backend: ModuleType, dtype: torch.dtype) -> None:
    _check(backend, "gqa3", BATCHES["mixed"], dtype)


def test_triton_backend_runs_decodes_that_do_not_come_first_as_prefill_rows(backend: ModuleType) -> None:
    _check(backend, "mqa", BATCHES["unordered"], torch.float32)


@pytest.mark.parametrize(("heads", "dtype"), [("gqa3", torch.bfloat16), ("mqa", torch.float32)])
def test_triton_backend_crosses_blocks_and_tiles(backend: ModuleType, heads: str, dtype: torch.dtype) -> None:
    _check(backend, heads, LONG_BATCH, dtype, seed=5, head_dim=64, block_size=16)


@pytest.mark.parametrize("window", [5, 40])
def test_triton_backend_attends_over_sliding_windows(backend: ModuleType, window: int) -> None:
    """Windows shorter than a 32-key tile and longer: a tile's later rows see none of its first keys."""
    _check(backend, "gqa3", LONG_BATCH, torch.float32, window, seed=5, head_dim=64, block_size=16)


@pytest.mark.parametrize("window", [0, 40])
def test_triton_backend_soft_caps_the_scores(backend: ModuleType, window: int) -> None:
    _check(backend, "gqa3", LONG_BATCH, torch.float32, window, softcap=0.5, seed=5, head_dim=64, block_size=16)


@pytest.mark.parametrize("heads", ["gqa3", "mqa"])
def test_triton_backend_biases_the_scores_by_alibi(backend: ModuleType, heads: str) -> None:
    """Each row's head's slope, each key's distance from the row: decodes and chunks, across tiles."""
    _check(backend, heads, LONG_BATCH, torch.float32, alibi=True, seed=5, head_dim=64, block_size=16)


@pytest.mark.parametrize("window", [0, 9])
def test_triton_backend_adds_each_heads_sink_to_its_softmax(backend: ModuleType, window: int) -> None:
    _check(backend, "gqa3", LONG_BATCH, torch.float32, window, sinks=True, seed=6, head_dim=64, block_size=16)


def test_triton_decode_reads_a_cache_view_with_layer_strides(backend: ModuleType) -> None:
    """The runner hands the backend kv[layer, 0]: a view into one tensor holding every layer's K and V."""
    num_heads, num_kv_heads = TRITON_HEADS["mha"]
    query, k_cache, v_cache, meta, _ = _random_batch(*BATCHES["decode"], num_heads, num_kv_heads, torch.float32)
    kv = torch.stack([torch.stack([torch.randn_like(k_cache), torch.randn_like(v_cache)]),
                      torch.stack([k_cache, v_cache])])  # [layers=2, 2, blocks, bs, Hkv, D]
    scale = 16 ** -0.5
    kv = kv.to(DEVICE)
    actual = backend.decode_attention(query.to(DEVICE), kv[1, 0], kv[1, 1], meta.block_tables.to(DEVICE),
                                      meta.seq_lens.to(DEVICE), scale).cpu()
    expected = paged_attention_ref(query, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_triton_reads_an_int8_cache_as_the_reference_dequantizes_it(backend: ModuleType) -> None:
    """An int8 row is q * s, its scale in the row's last 4 bytes: the same floats the reference reads."""
    _check(backend, "gqa3", BATCHES["mixed"], torch.float32, seed=7, int8_cache=True)
