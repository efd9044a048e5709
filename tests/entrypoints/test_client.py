"""`pagedllm chat` and `pagedllm complete` against a real server on a tiny random model whose generation config
makes its replies greedy and short, so that the terminal's text can be compared with the offline API's."""

from __future__ import annotations

import io
import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import CacheConfig, EngineConfig, ModelConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.cli import make_parser
from tests.entrypoints.server_utils import API_KEY, start_server
from tests.models.tiny import save_tiny_model

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa", initializer_range=0.5)[0]
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": MAX_TOKENS}))
    return folder


@pytest.fixture(scope="module")
def server(folder):
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(folder), dtype="float32"),
                                    cache=CacheConfig(block_size=16, num_blocks=256)))
    running = start_server(engine)          # with the API key
    yield running
    running.stop()


@pytest.fixture(scope="module")
def offline(folder) -> LLM:
    return LLM(model=str(folder), dtype="float32", block_size=16, num_kv_blocks=256)


def _run(server, *argv: str, stdin: str = "") -> str:
    args = make_parser().parse_args([*argv, "--url", f"{server.base_url}/v1", "--api-key", API_KEY])
    out = io.StringIO()
    args.func(args, stdin=io.StringIO(stdin), stdout=out)
    return out.getvalue()


def _chat(offline: LLM, messages: list[dict]) -> str:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return offline.chat(messages, greedy, use_tqdm=False)[0].outputs[0].text


def test_chat_keeps_the_conversation(server, offline):
    printed = _run(server, "chat", "--system-prompt", "Be brief.", stdin="Hello\n\nHow are you?\n")
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    first = _chat(offline, conversation)
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": "How are you?"}]
    assert printed == first + "\n" + _chat(offline, conversation) + "\n"      # the blank line is skipped
    assert _run(server, "chat", "-q", "Hello") == _chat(offline, [{"role": "user", "content": "Hello"}]) + "\n"


def test_complete_prints_each_completion(server, offline):
    expected = offline.generate("Once upon", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert _run(server, "complete", "--max-tokens", "3", "-q", "Once upon") == expected[0].outputs[0].text + "\n"


@pytest.mark.parametrize(("argv", "words"), [
    (["complete", "--model-name", "nope", "-q", "hi"], "404: The model `nope` does not exist"),
    (["complete", "--max-tokens", "0", "-q", "hi"], "400: max_tokens must be"),
])
def test_a_refusal_ends_the_program_with_the_servers_message(server, argv, words):
    with pytest.raises(SystemExit, match=words):
        _run(server, *argv)


def test_no_server_is_a_clear_error():
    args = make_parser().parse_args(["chat", "--url", "http://127.0.0.1:9/v1", "-q", "hi"])
    with pytest.raises(SystemExit, match=r"cannot reach http://127.0.0.1:9/v1 .*pagedllm serve"):
        args.func(args)
