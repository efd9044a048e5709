"""Prompt forms as vLLM has them (pagedllm/inputs.py): parsing alone, then through the offline API on a tiny
random Llama with a byte tokenizer (one token per character)."""

from __future__ import annotations

import pytest

from pagedllm import (
    LLM,
    EngineArgs,
    LLMEngine,
    PoolingRequestOutput,
    RequestOutput,
    SamplingParams,
    TextPrompt,
    TokensPrompt,
)
from pagedllm.entrypoints.openai.tool_parsers import with_tools
from pagedllm.inputs import ParsedPrompt, as_prompt_list, parse_prompt
from tests.models.tiny import save_tiny_model


# ---- parsing --------------------------------------------------------------------------------------------------
def test_every_form_parses():
    assert parse_prompt("hi") == ParsedPrompt("hi", None)
    assert parse_prompt([5, 6]) == ParsedPrompt(None, [5, 6])
    assert parse_prompt({"prompt": "hi", "cache_salt": "s"}) == ParsedPrompt("hi", None, "s")
    assert parse_prompt({"prompt_token_ids": (5, 6)}) == ParsedPrompt(None, [5, 6])
    assert parse_prompt({"prompt_token_ids": [5], "prompt": "x"}) == ParsedPrompt("x", [5])


def test_one_prompt_or_a_list_of_any_forms():
    assert as_prompt_list("hi") == [ParsedPrompt("hi", None)]
    assert as_prompt_list([5, 6]) == [ParsedPrompt(None, [5, 6])]
    assert as_prompt_list({"prompt_token_ids": [5]}) == [ParsedPrompt(None, [5])]
    mixed = as_prompt_list(["a", [5], {"prompt": "b"}, {"prompt_token_ids": [6], "cache_salt": "s"}])
    assert mixed == [ParsedPrompt("a", None), ParsedPrompt(None, [5]), ParsedPrompt("b", None),
                     ParsedPrompt(None, [6], "s")]


@pytest.mark.parametrize(("prompts", "words"), [
    (["ok", {"prompt": "x", "temperature": 1}], ["prompt 1", "unknown key 'temperature'"]),
    ([{"prompt": "x", "multi_modal_data": {"image": 1}}], ["prompt 0", "'multi_modal_data'", "PIL image"]),
    (["a", "b", {"prompt_embeds": [0.1], "prompt": "x"}], ["prompt 2", "'prompt_embeds' goes alone"]),
    ([{"prompt": 5}], ["prompt 0", "key 'prompt'", "string"]),
    (["a", {"prompt_token_ids": "12"}], ["prompt 1", "key 'prompt_token_ids'"]),
    ([{"prompt_token_ids": [1, 2.5]}], ["prompt 0", "key 'prompt_token_ids'"]),
    ([{"prompt_token_ids": [True]}], ["prompt 0", "key 'prompt_token_ids'"]),
    ([{"prompt": "x", "cache_salt": 3}], ["prompt 0", "key 'cache_salt'"]),
    (["a", {"cache_salt": "s"}], ["prompt 1", "'prompt'", "'prompt_token_ids'"]),
    (["a", [1, "2"]], ["prompt 1", "token ids"]),
    (["a", None], ["prompt 1", "NoneType"]),
    ([], ["empty"]),
    (7, ["int"]),
])
def test_bad_prompts_name_their_index_and_key(prompts, words):
    with pytest.raises(ValueError) as info:
        as_prompt_list(prompts)
    for word in words:
        assert word in str(info.value)


# ---- through the offline API ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", block_size=4, num_kv_blocks=256)


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _run(llm: LLM, prompts) -> list[tuple[str | None, list[int], list[int]]]:
    return [(o.prompt, o.prompt_token_ids, o.outputs[0].token_ids)
            for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_every_prompt_form_gives_the_same_completion(llm):
    ids = llm.get_tokenizer().encode("hello there")
    (text_out,) = _run(llm, "hello there")
    assert text_out[0] == "hello there" and text_out[1] == ids
    completion = text_out[2]
    assert _run(llm, ids) == [(None, ids, completion)]
    assert _run(llm, {"prompt": "hello there"}) == [("hello there", ids, completion)]
    assert _run(llm, {"prompt_token_ids": ids}) == [(None, ids, completion)]
    assert _run(llm, {"prompt_token_ids": ids, "prompt": "hello there"}) == [("hello there", ids, completion)]
    # vLLM's typed forms, imported from the package as from vllm's
    assert _run(llm, [TextPrompt(prompt="hello there"), TokensPrompt(prompt_token_ids=ids)]) == \
        [("hello there", ids, completion), (None, ids, completion)]
    many = _run(llm, ["hello there", ids, {"prompt": "hello there"}, {"prompt_token_ids": ids, "cache_salt": "a"}])
    assert [out[2] for out in many] == [completion] * 4


def test_a_dict_cache_salt_isolates_the_prefix_cache(llm):
    prompt = "a shared system prompt, long enough for several blocks"
    llm.generate({"prompt": prompt, "cache_salt": "alice"}, GREEDY, use_tqdm=False)
    bob = llm.generate({"prompt": prompt, "cache_salt": "bob"}, GREEDY, use_tqdm=False)[0]
    alice = llm.generate({"prompt": prompt, "cache_salt": "alice"}, GREEDY, use_tqdm=False)[0]
    assert bob.num_cached_tokens == 0 and alice.num_cached_tokens > 0
    assert alice.outputs[0].token_ids == bob.outputs[0].token_ids


def test_a_bad_prompt_in_a_list_fails_before_any_runs(llm):
    with pytest.raises(ValueError, match=r"prompt 1: unknown key 'propmt'"):
        llm.generate(["fine", {"propmt": "typo"}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_chat_takes_one_conversation_or_many(llm):
    first = [{"role": "user", "content": "Hi"}]
    second = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    (one,) = llm.chat(first, GREEDY, use_tqdm=False)
    both = llm.chat([first, second], GREEDY, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    assert one.prompt_token_ids == tokenizer.apply_chat_template(first, add_generation_prompt=True, return_dict=False)
    assert [o.prompt_token_ids for o in both] == [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in (first, second)]
    assert both[0].outputs[0].token_ids == one.outputs[0].token_ids


def test_chat_template_kwargs_reach_the_template(llm):
    template = "{{ greeting }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    (out,) = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False, chat_template=template,
                      chat_template_kwargs={"greeting": "Hello! "})
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "Hello! [user]Hi"


def test_chat_renders_tools_as_the_server_does(tmp_path):
    """The tiny model's ChatML template knows no tools: they go into the system message in the Hermes format,
    exactly as `/v1/chat/completions` renders them, for every conversation. (A longer context: the byte
    tokenizer spends ~450 tokens on the tools' system message.)"""
    folder, _ = save_tiny_model(tmp_path / "m", "llama-gqa", max_position_embeddings=1024)
    llm = LLM(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=512)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    conversations = [[{"role": "user", "content": "Weather in Rome?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And Oslo?"}]]
    outputs = llm.chat(conversations, GREEDY, use_tqdm=False, tools=[tool])
    tokenizer = llm.get_tokenizer()
    for conversation, output in zip(conversations, outputs):
        expected = tokenizer.apply_chat_template(with_tools(conversation, [tool], tokenizer.chat_template)[0],
                                                 add_generation_prompt=True, return_dict=False)
        assert output.prompt_token_ids == expected
        prompt = tokenizer.decode(output.prompt_token_ids)
        assert prompt.startswith("<|im_start|>system\n") and '"name": "get_weather"' in prompt
    assert "Be brief." in tokenizer.decode(outputs[1].prompt_token_ids)     # the system message is kept


@pytest.mark.parametrize(("messages", "words"), [
    ([], "messages must be"),
    ("hi", "messages must be"),
    ([[{"role": "user", "content": "a"}], "b"], "conversation 1"),
    ([[{"role": "user", "content": "a"}], []], "conversation 1"),
])
def test_chat_refuses_what_is_not_a_conversation(llm, messages, words):
    with pytest.raises(ValueError, match=words):
        llm.chat(messages, GREEDY, use_tqdm=False)


def test_code_written_for_vllms_llm_runs(llm, tmp_path):
    """What callers written for vLLM pass: lora_request=None, trust_remote_code; what is not a LoRARequest is
    refused (tests/test_lora.py runs adapters)."""
    plain = llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate("Hello", GREEDY, use_tqdm=False, lora_request=None)[0].outputs[0].token_ids == plain
    assert llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False, lora_request=None)
    for call in (lambda: llm.generate("Hello", GREEDY, lora_request=object()),
                 lambda: llm.chat([{"role": "user", "content": "Hi"}], GREEDY, lora_request=object())):
        with pytest.raises(ValueError, match="lora_request must be a LoRARequest or None"):
            call()
    folder, _ = save_tiny_model(tmp_path / "m", "llama-gqa")
    trusting = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, trust_remote_code=True)
    assert trusting.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_vllms_loading_arguments_are_taken_and_what_does_not_apply_refused(tiny_llama_dir, caplog):
    """lm-evaluation-harness's vLLM backend passes tokenizer_mode, revision and tokenizer_revision; RL frameworks
    download_dir, hf_token, enable_sleep_mode and vLLM's name of the pool's size."""
    folder = tiny_llama_dir
    with pytest.raises(ValueError, match="tokenizer_mode must be 'auto' or 'hf', got 'slow'"):
        LLM(model=str(folder), tokenizer_mode="slow")
    with pytest.raises(ValueError, match="pipeline_parallel_size must be 1, got 2"):
        LLM(model=str(folder), pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="num_kv_blocks and num_gpu_blocks_override are one setting"):
        LLM(model=str(folder), num_kv_blocks=64, num_gpu_blocks_override=32)
    caplog.set_level("WARNING", logger="pagedllm")
    llm = LLM(model=str(folder), dtype="float32", num_gpu_blocks_override=64, tokenizer_mode="hf", revision="main",
              tokenizer_revision=None, download_dir="/models", hf_token="hf_secret", pipeline_parallel_size=1,
              enable_sleep_mode=True)
    said = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
    assert said == [f"{what} is not used: pagedllm never fetches from the Hugging Face hub; {folder} is read as it "
                    "is on disk" for what in ("revision='main'", "download_dir='/models'", "hf_token")]
    assert not any("hf_secret" in r.getMessage() for r in caplog.records), "the token is never logged"
    assert llm.engine.kv_cache_manager.num_usable_blocks == 63     # 64 less the null block
    assert len(llm.generate("hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_the_engine_by_vllms_name_runs_requests_step_by_step(llm):
    """vLLM's LLMEngine loop through `llm.llm_engine`: add requests, step until none is unfinished."""
    engine = llm.llm_engine
    assert engine is llm.engine and engine.get_tokenizer() is llm.get_tokenizer()
    expected = [o.outputs[0].token_ids for o in llm.generate(["hello", "there"], GREEDY, use_tqdm=False)]
    engine.add_request("a", "hello", GREEDY)
    engine.add_request("b", "there", GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    assert [finished["a"], finished["b"]] == expected


def test_enqueued_requests_run_at_wait_for_completion_and_none_is_lost(llm):
    """vLLM 0.32's enqueue / enqueue_chat / wait_for_completion: queued requests run only when asked, or beside a
    generate call, which returns only its own outputs; the queued ones' outputs come back in queued order."""
    chat = [{"role": "user", "content": "Hi"}]
    longer = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(["hello", "there"], GREEDY, use_tqdm=False)]
    expected_chat = llm.chat(chat, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    expected_own = llm.generate("abc", longer, use_tqdm=False)[0].outputs[0].token_ids
    queued = llm.enqueue(["hello", "there"], GREEDY) + llm.enqueue_chat(chat, GREEDY)
    assert llm.llm_engine.get_num_unfinished_requests() == 3 and len(set(queued)) == 3
    (own,) = llm.generate("abc", longer, use_tqdm=False)      # the queued ones (6 tokens) finish during it
    assert own.outputs[0].token_ids == expected_own and not llm.engine.has_unfinished_requests()
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == queued
    assert [o.outputs[0].token_ids for o in outputs] == expected + [expected_chat]
    assert llm.wait_for_completion() == []
    # queued and run by wait_for_completion alone; the expected type checked
    llm.enqueue("hello", GREEDY, priority=0)
    assert [o.outputs[0].token_ids for o in llm.wait_for_completion(RequestOutput)] == expected[:1]
    llm.enqueue("hello", GREEDY)
    with pytest.raises(TypeError, match="expected .*PoolingRequestOutput, got RequestOutput"):
        llm.wait_for_completion(PoolingRequestOutput)
    # a bad prompt queues nothing
    with pytest.raises(ValueError, match=r"prompt 1: unknown key 'propmt'"):
        llm.enqueue(["fine", {"propmt": "typo"}], GREEDY)
    assert not llm.engine.has_unfinished_requests() and llm.wait_for_completion() == []


def test_generate_takes_vllms_priority_and_tokenization_arguments(llm):
    """vLLM's generate(priority=int, tokenization_kwargs={"truncate_prompt_tokens": k}) and chat's."""
    ids = llm.get_tokenizer().encode("hello there")
    cut = llm.generate("hello there", GREEDY, use_tqdm=False, priority=0,
                       tokenization_kwargs={"truncate_prompt_tokens": 4, "truncation_side": "left"})[0]
    assert cut.prompt_token_ids == ids[-4:]
    assert cut.outputs[0].token_ids == llm.generate(ids[-4:], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    chat = [{"role": "user", "content": "Hi"}]
    full = llm.chat(chat, GREEDY, use_tqdm=False)[0].prompt_token_ids
    assert llm.chat(chat, GREEDY, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 5}
                    )[0].prompt_token_ids == full[:5]
    with pytest.raises(ValueError, match="priority"):
        llm.generate("hello", GREEDY, use_tqdm=False, priority=1)     # scheduling_policy "fcfs"
    with pytest.raises(ValueError, match="tokenization_kwargs takes truncate_prompt_tokens"):
        llm.generate("hello", GREEDY, use_tqdm=False, tokenization_kwargs={"padding": True})
    assert not llm.engine.has_unfinished_requests()


def test_collective_rpc_and_apply_model_reach_the_worker(llm):
    """vLLM's collective_rpc and apply_model on one rank (tests/distributed: on two, and on Ray's actors)."""
    runner = llm.engine.runner
    assert llm.get_world_size() == llm.get_world_size(include_dp=False) == 1
    assert llm.apply_model(lambda model: model is runner.model) == [True]
    assert llm.collective_rpc("weight_bytes") == [runner.weight_bytes()]
    assert llm.collective_rpc(lambda worker, a, b=0: (worker.tp_rank, a + b), args=(1,), kwargs={"b": 2}) == [(0, 3)]
    with pytest.raises(AttributeError, match="no_such_method"):
        llm.collective_rpc("no_such_method")


def test_vllms_engine_args_build_the_engine_they_describe(tiny_llama_dir):
    """`EngineArgs` (a dataclass, as vLLM's: fields set after construction count), LLM.from_engine_args and
    LLMEngine.from_engine_args; LLM's keywords are its fields."""
    args = EngineArgs(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, block_size=4)
    args.max_model_len = 128
    llm = LLM.from_engine_args(args)
    assert (llm.engine.max_model_len, llm.engine.config.cache.block_size) == (128, 4)
    expected = llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine = LLMEngine.from_engine_args(args)
    engine.add_request("a", "hello", GREEDY)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert finished[0].outputs[0].token_ids == expected
    with pytest.raises(ValueError, match="an LLMEngine is one replica"):
        LLMEngine.from_engine_args(EngineArgs(str(tiny_llama_dir), data_parallel_size=2))
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_modle_len'"):
        LLM(str(tiny_llama_dir), max_modle_len=128)


def test_tokenization_kwargs_can_leave_out_the_tokenizers_special_tokens(tmp_path):
    """vLLM's `tokenization_kwargs={"add_special_tokens": False}` (a prompt that already carries its BOS, say), on
    generate and embed alike; truncation then cuts the tokens so made."""
    from tokenizers import processors

    from tests.models.tiny import build_byte_tokenizer

    folder, _ = save_tiny_model(tmp_path / "m", "llama-gqa", initializer_range=0.5, with_tokenizer=False)
    tokenizer = build_byte_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", 1)])
    tokenizer.save_pretrained(folder)
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64)
    bare = tokenizer.encode("hello", add_special_tokens=False)
    assert llm.generate("hello", GREEDY, use_tqdm=False)[0].prompt_token_ids == [1, *bare]
    (plain,) = llm.generate("hello", GREEDY, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False})
    assert plain.prompt == "hello" and plain.prompt_token_ids == bare
    assert plain.outputs[0].token_ids == llm.generate(bare, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    (cut,) = llm.embed("hello", use_tqdm=False, tokenization_kwargs={"add_special_tokens": False,
                                                                      "truncate_prompt_tokens": 3})
    assert cut.prompt_token_ids == bare[:3]
    with pytest.raises(ValueError, match="add_special_tokens \\(a bool\\)"):
        llm.generate("hello", GREEDY, tokenization_kwargs={"add_special_tokens": "no"})


def test_a_request_may_skip_reading_the_prefix_cache(llm):
    """vLLM's skip_reading_prefix_cache, on SamplingParams and PoolingParams: that request computes its whole
    prompt, and still leaves its blocks for the next."""
    from pagedllm import PoolingParams

    prompt = "a prompt long enough to fill several blocks of four tokens"
    llm.reset_prefix_cache()
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    skipping = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, skip_reading_prefix_cache=True)
    skipped = llm.generate(prompt, skipping, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert (first.num_cached_tokens, skipped.num_cached_tokens) == (0, 0) and again.num_cached_tokens > 0
    assert skipped.outputs[0].token_ids == first.outputs[0].token_ids == again.outputs[0].token_ids
    (embedded,) = llm.embed(prompt, PoolingParams(skip_reading_prefix_cache=True), use_tqdm=False)
    assert embedded.num_cached_tokens == 0
    assert llm.embed(prompt, use_tqdm=False)[0].num_cached_tokens > 0
