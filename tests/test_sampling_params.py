"""SamplingParams: vLLM's defaults, normalisation and validation."""

from __future__ import annotations

import pytest

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None and p.logprobs is None
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.skip_special_tokens and not p.include_stop_str_in_output and not p.ignore_eos
    assert not p.greedy


def test_stop_string_becomes_list_and_max_stop_len() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bcd")).max_stop_len() == 3
    assert SamplingParams().max_stop_len() == 0


def test_greedy_normalises_filters() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.greedy and (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).greedy


def test_logit_bias_keys_from_json_strings() -> None:
    assert SamplingParams(logit_bias={"42": 5, 7: -1.5}).logit_bias == {42: 5.0, 7: -1.5}


@pytest.mark.parametrize("kwargs", [
    {"n": 0}, {"n": 1.5}, {"n": True},
    {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")},
    {"top_p": 0.0}, {"top_p": 1.1}, {"top_k": -2}, {"top_k": 2.0}, {"top_k": True}, {"min_p": 1.5},
    {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0.0},
    {"seed": "1"}, {"seed": 1.0},
    {"max_tokens": 0}, {"max_tokens": False}, {"min_tokens": -1}, {"min_tokens": 5, "max_tokens": 4},
    {"logprobs": -1}, {"logprobs": True},
    {"stop": [""]}, {"stop": [1]}, {"stop_token_ids": [-1]}, {"stop_token_ids": ["1"]},
    {"logit_bias": {1: 101}}, {"logit_bias": {-1: 1}}, {"logit_bias": {"x": 1}}, {"logit_bias": {1.5: 1}},
    {"logit_bias": {1: "big"}},
    {"allowed_token_ids": []}, {"allowed_token_ids": [-1]}, {"allowed_token_ids": ["1"]},
    {"bad_words": [""]}, {"bad_words": ["  "]}, {"bad_words": [1]}, {"detokenize": False, "stop": ["x"]},
])
def test_rejects_invalid(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"top_k": -1}, {"top_k": 0}, {"top_k": 50}, {"max_tokens": None, "min_tokens": 100}, {"seed": 0},
    {"logprobs": 0}, {"temperature": 0}, {"presence_penalty": -2, "frequency_penalty": 2},
    {"stop_token_ids": (2, 3)}, {"logit_bias": {}}, {"allowed_token_ids": (5,)}, {"bad_words": "word"},
    {"detokenize": False, "stop_token_ids": [3]},
])
def test_accepts_valid(kwargs: dict) -> None:
    SamplingParams(**kwargs)


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of json, regex, choice, grammar, json_object"),
    ({"regex": "a+", "choice": ["a"]}, "exactly one of"),
    ({"json": "{not json"}, "invalid JSON"),
    ({"json": [1, 2]}, "structured_outputs.json must be a JSON schema"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "structured_outputs.choice must be a non-empty list"),
    ({"grammar": "  "}, "structured_outputs.grammar must be a non-empty Lark grammar"),
])
def test_structured_outputs_params_are_validated(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_structured_outputs_keys_ignore_dict_order_and_json_text() -> None:
    a = StructuredOutputsParams(json={"type": "object", "required": ["x"]})
    b = StructuredOutputsParams(json='{"required": ["x"], "type": "object"}')
    assert a.key() == b.key() and a.kind == "json" and b.json == a.json
    assert StructuredOutputsParams(choice=["a", "b"]).key() == ("choice", '["a", "b"]')


@pytest.mark.parametrize("fields", [{"ignore_eos": True}, {"min_tokens": 2}, {"allowed_token_ids": [1]},
                                    {"bad_words": ["a"]}])
def test_structured_outputs_refuse_what_would_fight_the_grammar(fields: dict) -> None:
    with pytest.raises(ValueError, match="with structured_outputs"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"), **fields)


def test_bad_words_resolve_as_vllms_do() -> None:
    """Each word as it stands and after a space, the second only when it is another sequence as long."""
    vocab = {"Paris": [7], " Paris": [8], "New York": [9, 10], " New York": [11, 10], "ab": [1, 2], " ab": [3, 1, 2]}
    params = SamplingParams(bad_words=["Paris", " New York", "ab"])
    params.resolve_bad_words(vocab.__getitem__)
    assert params.bad_words_token_ids == [[7], [8], [9, 10], [11, 10], [1, 2]]
    assert SamplingParams(bad_words="ab").bad_words == ["ab"]
