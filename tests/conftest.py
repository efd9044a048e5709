"""Shared fixtures. The embedded model is loaded once per session, in float32 so that batching changes no bits
that matter and greedy tokens can be compared exactly with Hugging Face transformers."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from pagedllm.cpu import MAX_ISA_ENV, runnable_levels
from pagedllm.kernels import cpu_kernels
from pagedllm.loader.huge_pages import HUGE_PAGES_ENV

MiB = 1 << 20

# Without a CUDA device, the Triton kernels' tests (tests/attention/test_triton_attention.py) run them on CPU
# tensors through Triton's interpreter. Triton reads TRITON_INTERPRET when it is first imported (its own library
# functions are decorated then), so it is set here, before anything can import triton; nothing else uses Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite's engines keep their weights in 4 KiB pages: each of its hundreds of engines would otherwise fault its
# weights into 2 MiB pages at start-up (+20% of the suite's time on the AMX Xeon). tests/loader/test_huge_pages.py
# turns the placement back on, and checks that it changes no token.
os.environ.setdefault(HUGE_PAGES_ENV, "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need a CUDA device: without one they are skipped, saying so. A kernel case runs at its
    ISA levels one after the other (pytest would run every case at the first level, then every case at the next),
    so that inputs a test module memoizes are built once for all of them (tests/attention/test_attention.py)."""
    items[:] = _isa_levels_together(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch sees none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _isa_levels_together(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` with each `isa_level` test placed right after the same case at the first level it runs at; every
    other test, and the order of the cases, as collected."""
    def case(item: pytest.Item) -> tuple:
        callspec = getattr(item, "callspec", None)
        if callspec is None or "isa_level" not in callspec.params:
            return (item.nodeid,)
        params = {k: v for k, v in callspec.params.items() if k != "isa_level"}
        return item.nodeid.split("[")[0], tuple(sorted((k, repr(v)) for k, v in params.items()))

    first: dict[tuple, int] = {}
    for index, item in enumerate(items):
        first.setdefault(case(item), index)
    return sorted(items, key=lambda item: first[case(item)])


@pytest.fixture(params=["native", *runnable_levels()])
def isa_level(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a kernel test once per ISA level this CPU runs: the native build (this CPU's own level), then each
    level below it, the AVX2 (-march=x86-64-v3) and baseline (-march=x86-64) builds, chosen through
    PAGEDLLM_MAX_CPU_ISA as a user would."""
    if request.param != "native":
        monkeypatch.setenv(MAX_ISA_ENV, request.param)
    assert cpu_kernels() is not None, f"the C++ kernels must build at the {request.param} level on the test machine"
    return request.param


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (GQA, a byte tokenizer) saved once a session, its weights large enough (initializer_range
    0.5) that its greedy tokens vary: for the tests that serve or run any small model."""
    from tests.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "m", "llama-gqa", initializer_range=0.5)[0]


@pytest.fixture(scope="session")
def smol_llm():
    from pagedllm import LLM

    return LLM(dtype="float32", kv_cache_memory=256 * MiB, max_model_len=2048)


@pytest.fixture(scope="session")
def smol_hf():
    """transformers' own model and tokenizer, loaded from the same GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.loader.resolve import resolve_model

    resolved = resolve_model(None)
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(resolved.path, gguf_file=resolved.gguf_file,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(resolved.path, gguf_file=resolved.gguf_file)
    return model.eval(), tokenizer


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses the file's metadata anew for its config, its weights and its tokenizer (~9 s each on a
    Zen 3 core), and rebuilds gguf's tensor-name map for each of ~400 modules (~11 s); both are pure functions of
    their arguments, so they are memoized while the oracle loads. The reader slices its file ~4 million times, each
    slice a `numpy.memmap` whose Python-level subclass hooks cost 3 times the slicing: it reads a plain array over
    the same mapping instead (2.9 -> 0.8 s of CPU on the AMX Xeon). What transformers computes is unchanged."""
    import functools
    from unittest import mock

    import gguf
    import numpy as np

    memmap, open_reader = np.memmap, gguf.GGUFReader

    def plain_map(path: str, mode: str = "r") -> np.ndarray:
        return memmap(path, mode=mode).view(np.ndarray)

    @functools.cache
    def reader(path: str, mode: str = "r") -> gguf.GGUFReader:
        with mock.patch.object(np, "memmap", plain_map):
            return open_reader(path, mode)

    with mock.patch.object(gguf, "GGUFReader", reader), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        yield


@pytest.fixture
def disk_tmp_path(tmp_path):
    """A fresh folder on a disk, for swap files (refused on a RAM-backed filesystem): tmp_path, or where that is
    tmpfs, a folder in pagedllm's cache directory, removed afterwards."""
    from pagedllm.paths import cache_dir
    from pagedllm.runner.kv_tensors import is_ram_backed

    if not is_ram_backed(str(tmp_path)):
        yield tmp_path
        return
    cache_dir().mkdir(parents=True, exist_ok=True)
    if is_ram_backed(str(cache_dir())):
        pytest.skip("neither the temporary nor the cache directory is on a disk")
    folder = tempfile.mkdtemp(prefix="test-swap-", dir=cache_dir())
    yield Path(folder)
    shutil.rmtree(folder)
