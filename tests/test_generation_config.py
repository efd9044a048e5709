"""A model's generation_config.json, read as vLLM reads it (`generation_config`): its sampling defaults for
requests that set none, offline and served, and its other EOS ids as stop ids; "vllm" turns it off."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import CacheConfig, EngineConfig, ModelConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.loader.generation_config import read_generation_config
from pagedllm.loader.resolve import ResolvedModel
from tests.entrypoints.server_utils import start_server
from tests.models.tiny import save_tiny_model

PROMPT = "Once upon a time"
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 7}


def _write(folder: Path, **fields) -> None:
    (folder / "generation_config.json").write_text(json.dumps(fields))


def test_reading_takes_the_fields_vllm_takes(tmp_path):
    resolved = ResolvedModel(tmp_path, None, "m")
    config = SimpleNamespace(eos_token_id=5)
    _write(tmp_path, eos_token_id=[2, 7], top_k=20, repetition_penalty=1.1, do_sample=True, num_beams=1,
           **DEFAULTS)
    read = read_generation_config("auto", resolved, config)
    assert read.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                             "max_tokens": 7}    # max_new_tokens is max_tokens; do_sample and num_beams are not taken
    assert read.eos_token_ids == (2, 7)
    assert read_generation_config("vllm", resolved, config) == read_generation_config("vllm", resolved, None)
    assert read_generation_config("vllm", resolved, config).sampling == {}
    assert read_generation_config(str(tmp_path), ResolvedModel(tmp_path / "other", None, "m"), config) == read
    without = tmp_path / "without"
    without.mkdir()
    assert read_generation_config("auto", ResolvedModel(without, None, "m"), config).eos_token_ids == (5,)
    with pytest.raises(ValueError, match="no generation_config.json"):
        read_generation_config(str(without), resolved, config)


def test_overrides_set_defaults_over_the_source(tmp_path):
    resolved = ResolvedModel(tmp_path, None, "m")
    _write(tmp_path, eos_token_id=3, **DEFAULTS)
    over = {"temperature": 0.2, "presence_penalty": 0.5, "max_new_tokens": 99}
    read = read_generation_config("auto", resolved, None, over)
    assert read.sampling == {"temperature": 0.2, "top_p": 0.9, "presence_penalty": 0.5, "max_tokens": 99}
    assert read.eos_token_ids == (3,)
    assert read_generation_config("vllm", resolved, None, over).sampling == {
        "temperature": 0.2, "presence_penalty": 0.5, "max_tokens": 99}        # alone under "vllm"
    with pytest.raises(ValueError, match=r"sets \['num_beams'\]"):
        read_generation_config("auto", resolved, None, {"num_beams": 4})
    llm = LLM(model=str(save_tiny_model(tmp_path / "m")[0]), dtype="float32", num_kv_blocks=16,
              generation_config="vllm", override_generation_config={"top_k": 5, "max_new_tokens": 3})
    assert llm.engine.default_sampling == {"top_k": 5, "max_tokens": 3}
    params = llm.get_default_sampling_params()
    assert (params.top_k, params.max_tokens) == (5, 3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa", initializer_range=0.5)[0]


def _llm(folder: Path, generation_config: str) -> LLM:
    return LLM(model=str(folder), dtype="float32", block_size=16, num_kv_blocks=256,
               generation_config=generation_config)


def test_the_models_other_eos_ids_end_its_replies(folder):
    greedy = SamplingParams(temperature=0, max_tokens=16)
    plain = _llm(folder, "vllm")
    eos = plain.get_tokenizer().eos_token_id
    base = plain.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length"
    other = base.token_ids[3]
    first = base.token_ids.index(other)
    _write(folder, eos_token_id=[eos, other])
    try:
        llm = _llm(folder, "auto")
        stopped = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0]
        assert stopped.token_ids == base.token_ids[:first + 1]
        assert (stopped.finish_reason, stopped.stop_reason) == ("stop", other)
        ignoring = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        assert llm.generate(PROMPT, ignoring, use_tqdm=False)[0].outputs[0].token_ids == base.token_ids
        assert greedy.stop_token_ids == []          # the caller's params are left as they were
    finally:
        (folder / "generation_config.json").unlink()


def test_sampling_defaults_apply_where_a_request_sets_none(folder, tmp_path):
    gen_folder = tmp_path / "gen"
    gen_folder.mkdir()
    _write(gen_folder, **DEFAULTS)
    llm = _llm(folder, str(gen_folder))
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.9, max_tokens=7)
    assert _llm(folder, "vllm").get_default_sampling_params() == SamplingParams()
    assert len(llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids) <= 7
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(folder), dtype="float32",
                                                      generation_config=str(gen_folder)),
                                    cache=CacheConfig(block_size=16, num_blocks=256)))
    server = start_server(engine, api_key=None)
    try:
        client = server.client()
        served = client.completions.create(model=server.model_name, prompt=PROMPT, seed=11,
                                           extra_body={"ignore_eos": True})
        # the defaults: temperature 0.6 and top_p 0.9, and at most 7 tokens (under the completions' own 16)
        expected = llm.generate(PROMPT, SamplingParams(temperature=0.6, top_p=0.9, seed=11, max_tokens=7,
                                                       ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert served.choices[0].text == expected.text and served.usage.completion_tokens == 7
        chat = client.chat.completions.create(model=server.model_name, temperature=0, max_tokens=30,
                                              messages=[{"role": "user", "content": "Hi"}],
                                              extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 7        # a request's own max_tokens is capped too, as in vLLM
        greedy = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=7,
                                                                              ignore_eos=True), use_tqdm=False)
        assert chat.choices[0].message.content == greedy[0].outputs[0].text
    finally:
        server.stop()
