"""vLLM's structured_outputs_config: JSON's whitespace and additional properties as it says, and, with a reasoning
parser, a constraint that waits out the reply's thought (its end marker generated, or already in the prompt) unless
enable_in_reasoning."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.config import StructuredOutputsConfig
from pagedllm.structured_output.manager import StructuredOutputManager
from tests.models.tiny import build_byte_tokenizer, save_tiny_model

EMAIL = r"[a-z]{2,5}@[a-z]{1,4}\.(com|org)"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "object", "properties": {}}}}


def _accepts(manager: StructuredOutputManager, constraint: StructuredOutputsParams, text: str) -> bool:
    matcher = manager.new_matcher(constraint)
    return all(matcher.consume_token(t) for t in manager._hf_tokenizer.encode(text, add_special_tokens=False)) \
        and matcher.is_accepting()


@pytest.mark.parametrize(("options", "spaced", "extra_key"), [
    ({}, False, True),                                      # pagedllm's default: compact
    ({"disable_any_whitespace": False}, True, True),        # vLLM's default: whitespace allowed
    ({"disable_any_whitespace": True, "disable_additional_properties": True}, False, False),
])
def test_json_compiles_as_the_config_says(options: dict, spaced: bool, extra_key: bool) -> None:
    manager = StructuredOutputManager(build_byte_tokenizer(), 384, StructuredOutputsConfig.from_dict(options))
    constraint = StructuredOutputsParams(json=SCHEMA)
    assert _accepts(manager, constraint, '{"a":1,"b":{}}')
    assert _accepts(manager, constraint, '{ "a": 1, "b": {} }') == spaced
    assert _accepts(manager, constraint, '{"a":1,"c":2}') == extra_key
    assert _accepts(manager, constraint, '{"b":{"z":1}}') == extra_key     # nested objects closed too


def test_a_bad_config_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown keys \\['reasoning_parser_plugin'\\]"):
        StructuredOutputsConfig.from_dict({"reasoning_parser_plugin": "x.py"})
    with pytest.raises(ValueError, match="backend must be one of"):
        StructuredOutputsConfig.from_dict({"backend": "regex-magic"})
    assert StructuredOutputsConfig.from_dict({"backend": "xgrammar"}).backend == "xgrammar"    # taken by name


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose vocabulary has <think> and </think> tokens."""
    folder, _ = save_tiny_model(tmp_path_factory.mktemp("thinker") / "llama", "llama-gqa", initializer_range=0.5)
    tokenizer = build_byte_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(folder)
    return folder


def _outputs(llm: LLM, prompt_suffix: list[str], seed: int = 3) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("Mail?", add_special_tokens=False) + tokenizer.convert_tokens_to_ids(prompt_suffix)
    end = tokenizer.convert_tokens_to_ids("</think>")
    # the thought is ended soon enough: a bias towards </think>, which the constraint's mask takes away after it
    params = SamplingParams(n=4, temperature=1.0, seed=seed, max_tokens=60, logit_bias={end: 4.0},
                            structured_outputs=StructuredOutputsParams(regex=EMAIL))
    (output,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return [c.token_ids for c in output.outputs]


def test_the_constraint_waits_out_the_thought(thinker: Path) -> None:
    llm = LLM(str(thinker), dtype="float32", num_kv_blocks=256, structured_outputs_config={"reasoning_parser": "qwen3"})
    tokenizer = llm.get_tokenizer()
    end = tokenizer.convert_tokens_to_ids("</think>")
    thoughts = []
    for ids in _outputs(llm, ["<think>"]):        # the template opened the thought
        assert end in ids, ids
        cut = ids.index(end)
        thoughts.append(tokenizer.decode(ids[:cut]))
        assert re.fullmatch(EMAIL, tokenizer.decode(ids[cut + 1:], skip_special_tokens=True)), tokenizer.decode(ids)
    assert any(not re.fullmatch(r"[a-z@.]*", thought) for thought in thoughts), thoughts     # the thought ran free
    # a prompt that closed its thought (a template with thinking off): constrained from the first token
    for ids in _outputs(llm, ["<think>", "</think>"]):
        assert re.fullmatch(EMAIL, tokenizer.decode(ids, skip_special_tokens=True)), tokenizer.decode(ids)


@pytest.mark.parametrize("config", [None, {"reasoning_parser": "deepseek_r1", "enable_in_reasoning": True}])
def test_without_a_reasoning_parser_or_with_enable_in_reasoning_the_thought_is_constrained(thinker: Path,
                                                                                           config) -> None:
    llm = LLM(str(thinker), dtype="float32", num_kv_blocks=256, structured_outputs_config=config)
    tokenizer = llm.get_tokenizer()
    for ids in _outputs(llm, ["<think>"]):
        assert re.fullmatch(EMAIL, tokenizer.decode(ids, skip_special_tokens=True)), tokenizer.decode(ids)
