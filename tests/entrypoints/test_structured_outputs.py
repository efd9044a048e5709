"""Structured outputs through the official openai SDK: response_format json_schema and json_object,
`chat.completions.parse(response_format=Model)`, vLLM's structured_outputs extra body, and clear 400s."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.entrypoints.server_utils import API_KEY, RunningServer

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Describe a fictional city as JSON."}]


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10**9)
    climate: Literal["cold", "mild", "hot"]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model(client, server):
    completion = client.chat.completions.parse(model=server.model_name, messages=MESSAGES, response_format=City,
                                               max_tokens=80, temperature=0.7, seed=1, n=2)
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, City)
        assert City.model_validate_json(choice.message.content, strict=True) == choice.message.parsed


def test_response_format_json_schema_streamed(client, server):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 10}},
              "required": ["answer", "score"], "additionalProperties": False}
    stream = client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, max_tokens=40, stream=True, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}})
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    assert chunks[-1].finish_reason == "stop"
    value = json.loads("".join(choice.delta.content or "" for choice in chunks))
    assert set(value) == {"answer", "score"} and value["answer"] in ("yes", "no") and isinstance(value["score"], int)


def test_response_format_json_object(client, server):
    messages = [{"role": "user", "content": "Give me a JSON object with the key 'color' set to a color name."}]
    out = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=200,
                                         temperature=0, response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content), dict)


@pytest.mark.parametrize("constraint, check", [
    ({"choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    # (llguidance's \d, like Rust's, takes any Unicode digit: ASCII digits are [0-9])
    ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)),
])
def test_vllm_structured_outputs_extra_body_on_completions(client, server, constraint, check):
    out = client.completions.create(model=server.model_name, prompt="My favourite:", max_tokens=20,
                                    temperature=0, extra_body={"structured_outputs": constraint})
    assert check(out.choices[0].text) and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     None, "invalid structured_outputs.json"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"structured_outputs": {"regex": "[0-9"}}, None, "invalid structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"yaml": "a"}}, "structured_outputs", "yaml"),
    ({"structured_outputs": {"json_object": True}, "ignore_eos": True}, "ignore_eos", "with structured_outputs"),
])
def test_a_bad_constraint_is_a_clear_400(client, server, body, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=5, extra_body=body)
    error = info.value.body
    assert message in error["message"] and error["param"] == param, error
