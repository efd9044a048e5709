"""Structured outputs end to end on a tiny random model: every output parses and validates, with n > 1, under
preemption and on a prefix-cache hit; bad constraints fail at add time with a clear error."""

from __future__ import annotations

import json
import re
import threading
from typing import Annotated, Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from tests.models.tiny import save_tiny_model


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]
    tags: list[Annotated[str, Field(max_length=4)]] = Field(max_length=2)


EMAIL = r"[a-z]{2,5}@[a-z]{1,4}\.(com|org)"
SUM_GRAMMAR = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'
PROMPTS = ["hello there", "abc def ghi jkl", "x"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa", seed=5)[0])


@pytest.fixture(scope="module")
def llm(folder: str) -> LLM:
    return LLM(model=folder, dtype="float32", block_size=4, num_kv_blocks=256, max_model_len=256)


def _texts(llm: LLM, constraint: StructuredOutputsParams, n: int = 2, prompts: list[str] = PROMPTS,
           **kwargs) -> list[str]:
    kwargs = {"temperature": 1.0, "seed": 7, "max_tokens": 200, **kwargs}
    params = SamplingParams(n=n, structured_outputs=constraint, **kwargs)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    texts = [c.text for o in outputs for c in o.outputs]
    assert all(c.finish_reason == "stop" for o in outputs for c in o.outputs), texts
    return texts


def _valid_person(text: str) -> bool:
    return isinstance(Person.model_validate_json(text, strict=True), Person)     # raises if not


CASES = {
    "json": (StructuredOutputsParams(json=Person.model_json_schema()), _valid_person),
    "regex": (StructuredOutputsParams(regex=EMAIL), lambda text: re.fullmatch(EMAIL, text) is not None),
    "choice": (StructuredOutputsParams(choice=["yes", "no", "maybe"]), lambda text: text in ("yes", "no", "maybe")),
    "grammar": (StructuredOutputsParams(grammar=SUM_GRAMMAR),
                lambda text: re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", text) is not None),
    "json_object": (StructuredOutputsParams(json_object=True), lambda text: isinstance(json.loads(text), dict)),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_every_output_follows_its_constraint_with_n_2(llm: LLM, kind: str) -> None:
    constraint, valid = CASES[kind]
    # A random model writes endless strings into a free-form object; a bias towards closing them (which the mask,
    # applied first, keeps from breaking the grammar) ends the objects within max_tokens.
    closing = {t: 8.0 for t in llm.get_tokenizer().encode('"}', add_special_tokens=False)}
    texts = _texts(llm, constraint, logit_bias=closing if kind == "json_object" else None)
    assert len(texts) == 2 * len(PROMPTS)
    assert all(valid(text) for text in texts), texts
    assert len(set(texts)) > 1 or kind == "choice"       # the forks sample on their own


def test_greedy_rows_follow_the_constraint(llm: LLM) -> None:
    constraint, valid = CASES["json"]
    texts = _texts(llm, constraint, n=1, temperature=0.0)
    assert all(valid(text) for text in texts), texts


def test_constrained_and_free_requests_share_a_batch(llm: LLM) -> None:
    constraint, valid = CASES["regex"]
    free = SamplingParams(temperature=0.0, max_tokens=8)
    constrained = SamplingParams(temperature=0.0, max_tokens=50, structured_outputs=constraint)
    outputs = llm.generate(PROMPTS + PROMPTS, [constrained] * 3 + [free] * 3, use_tqdm=False)
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    assert all(valid(o.outputs[0].text) for o in outputs[:3])
    assert [o.outputs[0].token_ids for o in outputs[3:]] == [o.outputs[0].token_ids for o in alone]


def test_preemption_keeps_each_matcher_in_step_with_its_tokens(folder: str, llm: LLM) -> None:
    """Recompute preemption keeps the output tokens, so each matcher must keep its state too: the squeezed
    engine gives the same (valid) outputs as the roomy one."""
    constraint, valid = CASES["json"]
    prompts = [f"prompt number {i} " * 3 for i in range(8)]
    squeezed = LLM(model=folder, dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=256,
                   max_num_batched_tokens=64)
    texts = _texts(squeezed, constraint, prompts=prompts)
    assert squeezed.engine.scheduler.num_preemptions > 0
    assert all(valid(text) for text in texts), texts
    assert texts == _texts(llm, constraint, prompts=prompts)


def test_a_prefix_cache_hit_changes_nothing(llm: LLM) -> None:
    constraint, valid = CASES["grammar"]
    prompt = ["a long shared prompt that fills several blocks of four tokens"]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=100, structured_outputs=constraint)
    first, second = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    assert second.num_cached_tokens > 0
    assert valid(second.outputs[0].text) and second.outputs[0].text == first.outputs[0].text


def test_grammars_are_compiled_once_per_constraint(llm: LLM) -> None:
    manager = llm.engine.structured_output
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    reordered = {"properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "type": "object"}
    first = manager.compile(StructuredOutputsParams(json=schema))
    assert manager.compile(StructuredOutputsParams(json=json.dumps(reordered))) is first
    assert manager.new_matcher(StructuredOutputsParams(json=schema)) is not first


def test_the_bitmask_is_made_on_the_callers_thread_and_only_filled_beside_it(llm: LLM, monkeypatch) -> None:
    """A torch op on the fill thread would start a second OpenMP team (pagedllm/engine/engine_thread.py)."""
    manager = llm.engine.structured_output
    made_on: list[str] = []
    full = torch.full

    def spy(*args, **kwargs):
        made_on.append(threading.current_thread().name)
        return full(*args, **kwargs)

    monkeypatch.setattr(torch, "full", spy)
    matcher = manager.new_matcher(StructuredOutputsParams(choice=["yes", "no"]))
    bitmask = manager.fill_bitmask_async([matcher, matcher.deep_copy()]).result(10)
    assert made_on == [threading.current_thread().name]
    assert bitmask.shape == (2, (manager.vocab_size + 31) // 32) and torch.equal(bitmask[0], bitmask[1])
    assert (bitmask != 0).any() and (bitmask != -1).any()      # some tokens allowed, not all


@pytest.mark.parametrize("constraint, message", [
    (StructuredOutputsParams(json={"type": "no-such-type"}), "invalid structured_outputs.json"),
    (StructuredOutputsParams(regex="[a-z"), "invalid structured_outputs.regex"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "invalid structured_outputs.grammar"),
])
def test_a_bad_constraint_fails_at_add_time(llm: LLM, constraint: StructuredOutputsParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", "hi", SamplingParams(structured_outputs=constraint))
    assert not llm.engine.has_unfinished_requests()


def test_with_speculative_decoding_a_constrained_request_gets_no_drafts(folder: str):
    """n-gram speculation finds drafts in this repetitive prompt (the unconstrained request gets some), but a
    constrained request gets none, so its grammar alone decides each token: the same tokens as without speculation."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    constraint, valid = CASES["regex"]
    constrained = SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint)
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tokens, drafts = {}, {}
    for speculative_config in (None, spec):
        llm = LLM(model=folder, dtype="float32", block_size=4, num_kv_blocks=256, max_model_len=256,
                  speculative_config=speculative_config)
        for name, params in (("constrained", constrained), ("free", free)):
            (output,) = llm.generate(["abcabcabc abcabc"], params, use_tqdm=False)
            tokens[name, speculative_config is not None] = output.outputs[0].token_ids
            texts = output.outputs[0].text
            if speculative_config is not None:
                drafts[name] = llm.engine.make_stats().spec_decoding.num_drafts - sum(drafts.values())
                assert name == "free" or valid(texts)
    assert drafts == {"constrained": 0, "free": drafts["free"]} and drafts["free"] > 0
    assert tokens["constrained", True] == tokens["constrained", False]
