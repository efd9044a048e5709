"""vLLM's start_profile / stop_profile (pagedllm/profiler.py): torch's profiler over the engine's steps, offline and
behind the server, on a tiny random Llama; the trace is a Chrome trace of the steps' ops."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, ProfilerConfig
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.api_server import make_parser
from pagedllm.entrypoints.openai.cli_args import engine_config_from_args
from pagedllm.entrypoints.openai.server import build_app
from tests.entrypoints.server_utils import start_server

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)




def _profiler(directory: Path, **fields) -> dict:
    return {"profiler": "torch", "torch_profiler_dir": str(directory), "torch_profiler_with_stack": False} | fields


def _traces(directory: Path, name: str) -> list[dict]:
    """Each trace file of session `name`, read."""
    paths = sorted(directory.glob(f"{name}.*.pt.trace.json.gz"))
    return [json.loads(gzip.decompress(path.read_bytes())) for path in paths]


def test_a_session_traces_the_steps_between_start_and_stop(tiny_llama_dir, tmp_path):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, profiler_config=_profiler(tmp_path))
    expected = llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.start_profile("session")
    assert llm.engine.profiler.running
    assert llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    llm.stop_profile()
    llm.stop_profile()      # a stop without a session: nothing (vLLM's)
    (trace,) = _traces(tmp_path, "session")
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any(name.startswith("aten::") for name in names), "the steps' ops are in the trace"


def test_delay_and_max_iterations_bound_the_session_by_steps(tiny_llama_dir, tmp_path):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64,
              profiler_config=_profiler(tmp_path, delay_iterations=2))
    profiler, engine = llm.engine.profiler, llm.llm_engine
    llm.start_profile("bounded", max_iterations=3)      # the config's delay, this session's limit
    llm.enqueue("hello", GREEDY)
    engine.step()
    assert profiler.active and not profiler.running, "the first step is within the delay"
    engine.step()
    assert profiler.running
    for _ in range(3):
        engine.step()
    assert not profiler.active and not profiler.running, "three steps recorded end the session"
    assert len(_traces(tmp_path, "bounded")) == 1
    assert llm.wait_for_completion(use_tqdm=False)[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_iterations must be an int >= 0"):
        llm.start_profile(max_iterations=-1)


@pytest.mark.parametrize(("config", "words"), [
    ({"profiler": "cuda", "torch_profiler_dir": "x"}, "profiler_config.profiler must be 'torch' or None"),
    ({"profiler": "torch"}, "torch_profiler_dir must be the folder for the traces"),
    ({"profiler": "torch", "torch_profiler_dir": "x", "torch_profiler_activities": ["GPU"]}, "activities"),
    ({"profiler": "torch", "torch_profiler_dir": "x", "max_iterations": -1}, "max_iterations must be >= 0"),
    ({"profiler": "torch", "torch_profiler_dir": "x", "proton_profiler_dir": "y"}, "unknown keys"),
])
def test_a_bad_profiler_config_is_refused(config, words):
    with pytest.raises(ValueError, match=words):
        ProfilerConfig.from_dict(config)


def test_without_a_profiler_start_profile_says_what_it_needs(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="start_profile needs a profiler: profiler_config="):
        llm.start_profile()
    llm.stop_profile()


def test_the_server_serves_the_profile_routes_with_a_profiler(tiny_llama_dir, tmp_path):
    args = make_parser().parse_args(["--profiler-config", json.dumps(_profiler(tmp_path))])
    assert engine_config_from_args(args).profiler == ProfilerConfig(**_profiler(tmp_path))
    plain = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
                                   cache=CacheConfig(num_blocks=64)))
    assert "/start_profile" not in build_app(AsyncEngine(plain)).openapi()["paths"]
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
                                    cache=CacheConfig(num_blocks=64), profiler=ProfilerConfig(**_profiler(tmp_path))))
    server = start_server(engine, api_key=None)
    try:
        base = server.base_url
        assert httpx.post(f"{base}/start_profile", json={"profile_prefix": "served"}, timeout=30).status_code == 200
        body = {"model": server.model_name, "prompt": "hello", "max_tokens": 4}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 200
        assert httpx.post(f"{base}/stop_profile", timeout=30).status_code == 200
        assert len(_traces(tmp_path, "served")) == 1
        response = httpx.post(f"{base}/start_profile", json={"max_iterations": -2}, timeout=30)
        assert response.status_code == 400 and "max_iterations" in response.text
    finally:
        server.stop()
