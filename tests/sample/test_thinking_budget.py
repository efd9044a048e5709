"""thinking_token_budget (vLLM's): once a completion has thought its budget of tokens since <think> (its own, or the
one its chat template opened), its next token is </think>; before that, and once it answers, nothing changes. The
rule on its own, then a tiny model given <think> and </think> tokens, offline and served."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sample.metadata import SamplingRow, thinking_end_due
from pagedllm.sampling_params import StructuredOutputsParams
from tests.entrypoints.server_utils import start_server
from tests.models.tiny import build_byte_tokenizer, save_tiny_model

START, END = 7, 8


def _due(prompt: list[int], output: list[int], budget: int | None) -> int | None:
    params = SamplingParams(thinking_token_budget=budget)
    params.thinking_token_ids = (START, END)
    return thinking_end_due(SamplingRow(params, prompt, output))


def test_the_budget_counts_from_the_last_open_thought():
    assert _due([1, START], [2, 3], 2) == END                     # the template opened it: 2 thought tokens
    assert _due([1, START], [2], 2) is None
    assert _due([1, START], [], 0) == END                         # no thinking at all
    assert _due([1], [2, 3, 4], 0) is None                        # it does not think
    assert _due([1], [START, 2, 3], 2) == END                     # its own <think>
    assert _due([1, START], [2, END, 3, 4, 5], 1) is None          # it answers now
    assert _due([1, START], [2, END, START, 4, 5], 2) == END      # thinking again: counted from the new <think>
    assert _due([1, START, 2, END], [3, 4, 5], 0) is None         # the prompt closed its thought
    assert _due([1, START], [2, 3], None) is None
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None     # vLLM's "no budget"
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-2)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LLM]:
    folder, _ = save_tiny_model(tmp_path_factory.mktemp("thinker") / "llama", "llama-gqa", initializer_range=0.5)
    tokenizer = build_byte_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(folder)
    return folder, LLM(model=str(folder), dtype="float32", num_kv_blocks=128)


def test_a_spent_budget_closes_the_thought_and_the_answer_goes_on(thinker: tuple[Path, LLM]):
    _, llm = thinker
    tokenizer = llm.get_tokenizer()
    end = tokenizer.convert_tokens_to_ids("</think>")
    prompt = {"prompt_token_ids": tokenizer.encode("Question?") + [tokenizer.convert_tokens_to_ids("<think>")]}
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    budget = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                 thinking_token_budget=5), use_tqdm=False)
    free_ids, ids = free[0].outputs[0].token_ids, budget[0].outputs[0].token_ids
    assert end not in free_ids[:6] and ids[:5] == free_ids[:5] and ids[5] == end and len(ids) == 12
    assert end not in ids[6:]                      # answering: no budget any more
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, thinking_token_budget=0, n=2)
    assert all(c.token_ids[0] == end for c in llm.generate(prompt, seeded, use_tqdm=False)[0].outputs)


def test_the_server_takes_a_budget_and_a_model_without_think_tokens_refuses_it(thinker: tuple[Path, LLM],
                                                                             tmp_path: Path):
    _, llm = thinker
    tokenizer = llm.get_tokenizer()
    running = start_server(llm.engine, api_key=None)
    try:
        prompt = tokenizer.encode("Question?") + [tokenizer.convert_tokens_to_ids("<think>")]
        reply = httpx.post(f"{running.base_url}/v1/completions", timeout=60, json={
            "model": running.model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "thinking_token_budget": 3, "return_token_ids": True}).json()
        assert reply["choices"][0]["token_ids"][3] == tokenizer.convert_tokens_to_ids("</think>")
        message = httpx.post(f"{running.base_url}/v1/messages", timeout=60, json={
            "model": running.model_name, "max_tokens": 6, "thinking": {"type": "enabled", "budget_tokens": 2},
            "messages": [{"role": "user", "content": "Question?"}]})
        assert message.status_code == 200, message.text
    finally:
        running.stop()
    plain = LLM(model=str(save_tiny_model(tmp_path / "plain")[0]), dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="between <think> and </think>"):
        plain.generate("hi", SamplingParams(thinking_token_budget=4), use_tqdm=False)
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=4, structured_outputs=StructuredOutputsParams(choice=["a"]))


def test_anthropics_thinking_budget_applies_to_a_model_that_thinks():
    """Messages' `thinking` enabled with budget_tokens: the chat request's thinking_token_budget where the model
    thinks between <think> tokens (vLLM's mapping); nothing where it does not, so that such a request still runs."""
    from pagedllm.entrypoints.openai.serving_messages import AnthropicMessagesRequest, _chat_request

    request = AnthropicMessagesRequest(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                       thinking={"type": "enabled", "budget_tokens": 1024})
    assert _chat_request(request, thinks=True).thinking_token_budget == 1024
    assert _chat_request(request, thinks=False).thinking_token_budget is None
    disabled = request.model_copy(update={"thinking": {"type": "disabled"}})
    assert _chat_request(disabled, thinks=True).thinking_token_budget is None


def test_magistrals_think_tokens_take_a_budget_too(tmp_path: Path):
    """A model that thinks between [THINK] and [/THINK] (Magistral's special tokens): the budget closes its thought
    with [/THINK]."""
    folder, _ = save_tiny_model(tmp_path / "llama", "llama-gqa", initializer_range=0.5)
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["[THINK]", "[/THINK]"]})
    tokenizer.save_pretrained(folder)
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64)
    start, end = tokenizer.convert_tokens_to_ids(["[THINK]", "[/THINK]"])
    prompt = {"prompt_token_ids": tokenizer.encode("Question?") + [start]}
    (output,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                    thinking_token_budget=3), use_tqdm=False)
    assert output.outputs[0].token_ids[3] == end and end not in output.outputs[0].token_ids[:3]
