"""Choosing the device: "auto", "cpu", "cuda", "cuda:N", resolved at start-up, with clear errors for CUDA that is
not there; and the attention backend each device runs. Runs without a GPU (CUDA's presence is faked where needed)."""

from __future__ import annotations

import argparse

import pytest
import torch

from pagedllm import LLM
from pagedllm.attention import cpu
from pagedllm.attention.selector import attention_backend, runs_in_cuda_graphs
from pagedllm.config import EngineConfig, ModelConfig, ParallelConfig
from pagedllm.device import describe_device, resolve_device, resolve_engine_device
from pagedllm.entrypoints.openai.api_server import run_server
from pagedllm.entrypoints.openai.cli_args import add_server_args, engine_config_from_args


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch sees one CUDA device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without CUDA")
def test_auto_is_the_cpu_and_cuda_is_a_clear_error_without_cuda() -> None:
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    for name in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match=rf"device '{name}' needs CUDA, but torch sees no CUDA device"):
            resolve_device(name)


def test_auto_picks_cuda_when_torch_sees_a_device(fake_cuda: None) -> None:
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:0") == "cuda:0"
    with pytest.raises(ValueError, match=r"device 'cuda:1': torch sees 1 CUDA device\(s\), cuda:0 to cuda:0"):
        resolve_device("cuda:1")


def test_a_device_name_is_checked_in_the_config() -> None:
    assert ModelConfig().device == "auto"
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu'"):
        ModelConfig(device="gpu")


def test_auto_keeps_what_runs_only_on_a_cpu_there_and_cuda_refuses_it(fake_cuda: None) -> None:
    cpu_only = [EngineConfig(model=ModelConfig(quantization="int8")),
                EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2))]
    for config in cpu_only:
        resolve_engine_device(config)
        assert config.model.device == "cpu"
    config = EngineConfig(model=ModelConfig(device="cuda"), parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="on cuda pagedllm runs one engine on one device"):
        resolve_engine_device(config)
    config = EngineConfig()
    resolve_engine_device(config)
    assert config.model.device == "cuda"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without CUDA")
def test_llm_and_serve_refuse_cuda_without_cuda_before_loading_anything() -> None:
    with pytest.raises(ValueError, match="needs CUDA"):
        LLM(device="cuda")
    args = add_server_args(argparse.ArgumentParser(), positional_model=False).parse_args(["--device", "cuda"])
    assert engine_config_from_args(args).model.device == "cuda"
    with pytest.raises(SystemExit, match="^error: device 'cuda' needs CUDA"):
        run_server(args)


def test_each_device_gets_its_attention_backend() -> None:
    assert attention_backend("cpu") is cpu.paged_attention
    assert attention_backend("cuda:0").__module__ == "pagedllm.attention.triton_attention"
    # Only the Triton kernel reads the sequences' lengths on the device, as a CUDA graph's replay needs.
    assert runs_in_cuda_graphs(attention_backend("cuda:0")) and not runs_in_cuda_graphs(attention_backend("cpu"))


def test_the_start_up_line_names_the_device_and_its_memory() -> None:
    assert describe_device(torch.device("cpu")).startswith("cpu (") and describe_device(
        torch.device("cpu")).endswith(" GiB RAM)")
