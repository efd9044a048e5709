"""`tokenizer` (vLLM's `--tokenizer`): another tokenizer in place of the model's own, for a GGUF file without a
vocabulary (or one that converts badly), offline, on the server's command line and in the benches; and
`skip_tokenizer_init`: none at all, token ids in and out, offline and served."""

from __future__ import annotations

import argparse

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.args import add_engine_args, engine_kwargs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.cli_args import add_server_args, engine_config_from_args
from pagedllm.sampling_params import StructuredOutputsParams
from tests.entrypoints.server_utils import start_server
from tests.loader.test_gguf import write_model_gguf
from tests.models.tiny import save_tiny_model

PROMPTS = ["hello there", "the cat sat on"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    """A tiny Llama as a folder with its byte tokenizer, and the same weights as a GGUF file without a vocabulary."""
    folder = tmp_path_factory.mktemp("tok")
    hf_folder, hf_model = save_tiny_model(folder / "hf", "llama-gqa", seed=4)
    gguf_path = folder / "bare.gguf"
    write_model_gguf(hf_model, gguf_path, "llama")
    return str(hf_folder), str(gguf_path)


@pytest.fixture(scope="module")
def own(models) -> LLM:
    return LLM(models[0], dtype="float32")


def test_a_gguf_file_without_a_vocabulary_runs_with_a_named_tokenizer(models, own: LLM) -> None:
    hf_folder, gguf_path = models
    with pytest.raises(ValueError, match="holds no tokenizer.*tokenizer="):
        LLM(gguf_path, dtype="float32")
    named = LLM(gguf_path, dtype="float32", tokenizer=hf_folder)
    got, expected = named.generate(PROMPTS, GREEDY, use_tqdm=False), own.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in expected]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert named.get_tokenizer().get_vocab() == own.get_tokenizer().get_vocab()


def test_a_tokenizer_that_is_not_there_is_refused_naming_the_option(tmp_path) -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(tokenizer=str(tmp_path / "missing"))


def test_the_flag_reaches_the_model_config_on_the_server_and_in_the_benches(models) -> None:
    hf_folder, gguf_path = models
    parser = add_server_args(argparse.ArgumentParser(), positional_model=True)
    config = engine_config_from_args(parser.parse_args([gguf_path, "--tokenizer", hf_folder]))
    assert (config.model.model, config.model.tokenizer) == (gguf_path, hf_folder)
    bench = argparse.ArgumentParser()
    add_engine_args(bench)
    bench.add_argument("--seed", type=int, default=0)
    assert engine_kwargs(bench.parse_args(["--model", gguf_path, "--tokenizer", hf_folder]))["tokenizer"] == hf_folder


def test_skip_tokenizer_init_runs_on_token_ids_alone(models, own: LLM) -> None:
    """No tokenizer at all (a GGUF file without a vocabulary needs none then): token ids in, the same greedy
    token ids out with no text, the EOS id from the model config; what needs the tokenizer is refused, saying
    why."""
    bare = LLM(models[1], dtype="float32", skip_tokenizer_init=True)
    assert bare.engine.tokenizer is None and bare.engine.eos_token_id == own.engine.eos_token_id is not None
    prompts = [{"prompt_token_ids": own.get_tokenizer().encode(p)} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    got, expected = bare.generate(prompts, params, use_tqdm=False), own.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert all(o.outputs[0].text == "" for o in got)
    assert all(entry.decoded_token is None for o in got for position in o.outputs[0].logprobs
               for entry in position.values())
    for refused in (lambda: bare.generate("hello", GREEDY, use_tqdm=False),
                    lambda: bare.generate(prompts[0], SamplingParams(stop=["x"]), use_tqdm=False),
                    lambda: bare.generate(prompts[0], SamplingParams(bad_words=["x"]), use_tqdm=False),
                    lambda: bare.generate(prompts[0], SamplingParams(structured_outputs=StructuredOutputsParams(
                        choice=["a", "b"])), use_tqdm=False),
                    lambda: bare.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False),
                    bare.get_tokenizer):
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            refused()


def test_a_server_without_a_tokenizer_takes_and_gives_token_ids(models, own: LLM) -> None:
    """`serve --skip-tokenizer-init`: completions of token-id prompts give the offline greedy ids (logprobs name
    tokens by id); whatever needs text gets 400 naming its field."""
    args = add_server_args(argparse.ArgumentParser(), positional_model=True).parse_args(
        [models[1], "--dtype", "float32", "--skip-tokenizer-init"])
    bare = LLMEngine(engine_config_from_args(args))
    running = start_server(bare, api_key=None)
    try:
        ids = own.get_tokenizer().encode(PROMPTS[0])
        expected = own.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        body = {"model": running.model_name, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "logprobs": 1}
        choice = httpx.post(f"{running.base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["token_ids"] == expected and choice["text"] == ""
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in expected]
        for path, extra, param in (("/v1/completions", {"prompt": "hello"}, "prompt"),
                                   ("/v1/completions", {"prompt": ids, "echo": True}, "echo"),
                                   ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                                    "messages"),
                                   ("/tokenize", {"prompt": "hi"}, "prompt"),
                                   ("/detokenize", {"tokens": ids}, "tokens")):
            refused = httpx.post(f"{running.base_url}{path}", json={"model": running.model_name, **extra}, timeout=60)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (path, refused.text)
            assert "skip_tokenizer_init" in refused.json()["error"]["message"]
    finally:
        running.stop()
