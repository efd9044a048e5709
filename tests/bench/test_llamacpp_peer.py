"""`--compare llamacpp` end to end against a stand-in `llama_cpp` package: llama-cpp-python is never installed for
the tests, but the child script, the job it gets (the GGUF file, sizes, threads, token ids) and the report are
the ones a real run uses. The stand-in records what it was given and, as llama.cpp's `Llama.generate` does,
yields tokens until the caller stops."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pagedllm.bench.cli import main
from pagedllm.loader.resolve import resolve_model
from tests.bench.conftest import python_with_packages

_FAKE_LLAMA_CPP = '''
import json, os
__version__ = "0.0-stand-in"

class Llama:
    def __init__(self, **kwargs):
        self.kwargs, self.prompts, self.sampling = kwargs, [], None

    def generate(self, tokens, **sampling):
        self.prompts.append(list(tokens))
        self.sampling = sampling
        with open(os.environ["FAKE_LLAMA_CPP_RECORD"], "w") as f:
            json.dump({"kwargs": self.kwargs, "sampling": self.sampling, "prompts": self.prompts}, f)
        while True:
            yield 2
'''


@pytest.fixture
def fake_llamacpp_python(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A `python` that runs this interpreter with the stand-in llama_cpp first on its path; and its record file."""
    python = python_with_packages(tmp_path, {"llama_cpp/__init__.py": _FAKE_LLAMA_CPP})
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_LLAMA_CPP_RECORD", str(record))
    return python, record


def test_compare_llamacpp_runs_the_gguf_file_on_the_same_token_ids(fake_llamacpp_python, capsys):
    python, record = fake_llamacpp_python
    result = main(["throughput", "--dataset", "random", "--num-prompts", "3", "--input-len", "10", "--output-len",
                   "4", "--compare", "llamacpp", "--llamacpp-python", str(python), "--kv-cache-memory", "16M",
                   "--max-model-len", "256", "--max-num-batched-tokens", "512", "--skip-gemm-peak"])
    seen = json.loads(record.read_text())
    warmup, *timed = seen["prompts"]
    assert len(timed) == 3 and all(len(ids) == 10 for ids in timed) and 0 < len(warmup) < 10
    assert seen["kwargs"]["model_path"] == str(resolve_model(None).gguf_path)
    assert seen["kwargs"]["n_ctx"] == 256 and seen["kwargs"]["n_batch"] == 256   # 14 tokens at most, in 256 steps
    assert seen["kwargs"]["n_threads"] == seen["kwargs"]["n_threads_batch"] == len(os.sched_getaffinity(0))
    assert seen["sampling"]["temp"] == 0.0 and seen["sampling"]["top_k"] == 1   # greedy
    llamacpp = result["llamacpp"]
    assert (llamacpp["backend"], llamacpp["total_output_tokens"]) == ("llamacpp", 12)   # stopped at 4 each, no EOS
    assert result["ratio"]["llamacpp"]["output_tokens_per_second"] == (result["output_tokens_per_second"]
                                                                      / llamacpp["output_tokens_per_second"])
    printed = capsys.readouterr().out
    assert "llama.cpp (llama-cpp-python 0.0-stand-in) on SmolLM2-135M-Instruct.Q4_1.gguf" in printed


def test_compare_llamacpp_needs_a_gguf_model_and_says_so_before_timing(tiny_model_dir, fake_llamacpp_python,
                                                                        capsys):
    python, _ = fake_llamacpp_python
    with pytest.raises(ValueError, match="must name a .gguf"):
        main(["throughput", "--model", tiny_model_dir, "--dataset", "random", "--num-prompts", "2", "--input-len",
              "5", "--output-len", "2", "--compare", "llamacpp", "--llamacpp-python", str(python),
              "--kv-cache-memory", "16M", "--dtype", "float32", "--skip-gemm-peak"])
    assert "Throughput" not in capsys.readouterr().out


def test_compare_llamacpp_without_its_environment_fails_before_timing(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="make bench-peers"):
        main(["throughput", "--compare", "llamacpp", "--llamacpp-python", str(tmp_path / "none" / "python")])
    assert "Throughput" not in capsys.readouterr().out


def test_compare_llamacpp_refuses_sampled_requests_before_timing(tmp_path, capsys):
    with pytest.raises(ValueError, match="llamacpp runs greedy requests"):
        main(["throughput", "--compare", "llamacpp", "--temperature", "0.8",
              "--llamacpp-python", str(tmp_path / "none" / "python")])
    assert "Throughput" not in capsys.readouterr().out
