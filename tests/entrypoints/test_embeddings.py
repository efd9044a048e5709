"""Embeddings (vLLM's `LLM.embed` and /v1/embeddings) on a tiny random Llama (tests/models/tiny.py): the vector is
transformers' final hidden state at the prompt's last token (LAST pooling), L2-normalised unless asked otherwise,
whether the prompt ran in one step or in chunks, hit the prefix cache or shared its steps with generations; over
HTTP through the `openai` SDK (which asks for base64) the same vectors, with OpenAI's response shape and errors."""

from __future__ import annotations

import json
import logging
import shutil
import time

import httpx
import openai
import pytest
import torch

from pagedllm import LLM, PoolingParams, PoolingRequestOutput, SamplingParams
from tests.entrypoints.server_utils import RunningServer, metric, scrape, start_server
from tests.models.tiny import build_byte_tokenizer, build_tiny_hf_model, save_tiny_model
from tests.reliability.tiny_server import build_tiny_engine

PROMPTS = [[5, 17, 99, 3], list(range(20, 90)), [7] * 33]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa", initializer_range=0.5)


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(model=str(tiny[0]), dtype="float32", block_size=16, num_kv_blocks=256)


@pytest.fixture(scope="module")
def server(tiny):
    running = start_server(build_tiny_engine(tiny[0]), api_key=None)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.client()


def _hf_last_hidden(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = hf_model.model(torch.tensor([token_ids])).last_hidden_state   # after the final norm
    return out[0, -1].float()


def test_embed_is_the_normalised_last_hidden_state_of_transformers(tiny, llm):
    _, hf_model = tiny
    outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    raw = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(normalize=False), use_tqdm=False)
    for prompt, output, unnormalised in zip(PROMPTS, outputs, raw):
        expected = _hf_last_hidden(hf_model, prompt)
        assert output.prompt_token_ids == prompt and output.finished
        assert output.outputs.hidden_size == hf_model.config.hidden_size
        torch.testing.assert_close(torch.tensor(unnormalised.outputs.embedding), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding),
                                   torch.nn.functional.normalize(expected, dim=0), atol=1e-5, rtol=1e-4)
        assert abs(torch.tensor(output.outputs.embedding).norm().item() - 1) < 1e-5


def test_an_embedding_takes_no_product_with_the_lm_head(llm, monkeypatch):
    """The one token an embedding request samples is never seen: its row skips the LM head (token 0), while a
    generation beside it in the step still samples from its logits."""
    runner, rows = llm.engine.runner, []
    compute_logits = runner.compute_logits
    monkeypatch.setattr(runner, "compute_logits", lambda hidden: rows.append(len(hidden)) or compute_logits(hidden))
    llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    assert rows == []
    llm.engine.add_request("gen", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2, temperature=0))
    llm.engine.add_request("emb", {"prompt_token_ids": PROMPTS[1]}, PoolingParams())
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert rows == [1, 1]       # the generation's two tokens, one row each step, none for the embedding


def test_a_prompt_in_chunks_with_a_cache_hit_and_beside_generations_gives_the_same_vector(tiny):
    _, hf_model = tiny
    engine = build_tiny_engine(tiny[0], max_num_batched_tokens=24)     # a 70-token prompt runs in chunks
    llm = LLM.from_engine(engine)
    prompt = PROMPTS[1]
    expected = torch.nn.functional.normalize(_hf_last_hidden(hf_model, prompt), dim=0)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (alone,) = llm.generate({"prompt_token_ids": PROMPTS[2]}, greedy, use_tqdm=False)

    (first,) = llm.embed({"prompt_token_ids": prompt}, use_tqdm=False)
    engine.add_request("gen", {"prompt_token_ids": PROMPTS[2]}, greedy)
    engine.add_request("emb", {"prompt_token_ids": prompt}, PoolingParams())
    finals = {}
    while engine.has_unfinished_requests():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    assert first.num_cached_tokens == 0 and finals["emb"].num_cached_tokens >= 64   # the second hit the cache
    assert finals["emb"].outputs == [] and finals["gen"].embedding is None
    assert finals["gen"].outputs[0].token_ids == alone.outputs[0].token_ids
    for vector in (first.outputs.embedding, finals["emb"].embedding):
        torch.testing.assert_close(torch.tensor(vector), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2", "qwen3"])
def test_a_bare_decoder_checkpoint_embeds_as_transformers_does(tmp_path, kind):
    """An embedding model saved as the decoder alone (architectures LlamaModel, Qwen2Model, MistralModel: names
    without "model.", no LM head), as gte-Qwen2 and e5-mistral are: it loads and embeds as transformers' model does;
    it generates with its embedding matrix as the LM head where its config ties the two, and is refused otherwise
    (qwen2 here), rather than write text from a head it never had."""
    hf_model = build_tiny_hf_model(kind, 0, initializer_range=0.5).model
    hf_model.save_pretrained(tmp_path / "bare")
    build_byte_tokenizer().save_pretrained(tmp_path / "bare")
    assert hf_model.config.architectures[0].endswith("Model")
    llm = LLM(model=str(tmp_path / "bare"), dtype="float32", num_kv_blocks=64)
    for prompt, output in zip(PROMPTS, llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)):
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(output.outputs.embedding),
                                   torch.nn.functional.normalize(expected, dim=0), atol=1e-5, rtol=1e-4)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    if not hf_model.config.tie_word_embeddings:
        with pytest.raises(ValueError, match="saved without an LM head"):
            llm.generate([PROMPTS[0]], greedy, use_tqdm=False)
        return
    (generated,) = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPTS[0]])).last_hidden_state[0, -1] @ hf_model.embed_tokens.weight.T
    assert generated.outputs[0].token_ids[0] == int(logits.argmax())


def _sentence_transformers_folder(tiny, folder, modes: dict) -> str:
    shutil.copytree(tiny[0], folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    return str(folder)


def _hf_pooled(hf_model, token_ids: list[int], pooling_type: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([token_ids])).last_hidden_state[0].float()
    pooled = {"MEAN": hidden.mean(0), "CLS": hidden[0], "LAST": hidden[-1]}[pooling_type]
    return torch.nn.functional.normalize(pooled, dim=0)


@pytest.mark.parametrize(("modes", "pooling_type"), [({"pooling_mode_mean_tokens": True}, "MEAN"),
                                                      ({"pooling_mode_cls_token": True}, "CLS"),
                                                      ({"pooling_mode_lasttoken": True}, "LAST")])
def test_embeddings_pool_as_the_sentence_transformers_config_says(tiny, tmp_path, modes, pooling_type):
    """vLLM reads a model's sentence-transformers pooling: MEAN over the prompt's tokens and CLS (its first token)
    gather every position, chunk by chunk (a 24-token budget cuts the 70-token prompt), and read nothing from the
    prefix cache; the same prompt twice gives the same vector."""
    _, hf_model = tiny
    llm = LLM(model=_sentence_transformers_folder(tiny, tmp_path / "st", modes), dtype="float32",
              num_kv_blocks=64, block_size=16, max_num_batched_tokens=24)
    assert llm.engine.pooling_type == pooling_type
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for outputs in (llm.embed(prompts, use_tqdm=False), llm.embed(prompts, use_tqdm=False)):
        for prompt, output in zip(PROMPTS, outputs):
            torch.testing.assert_close(torch.tensor(output.outputs.embedding),
                                       _hf_pooled(hf_model, prompt, pooling_type), atol=1e-5, rtol=1e-4)
    assert (outputs[1].num_cached_tokens > 0) == (pooling_type == "LAST")


def test_a_mean_pooled_prompt_preempted_midway_gathers_its_chunks_again(tiny):
    """Two generations decode beside a 150-token prompt embedded in 22-token chunks, in a pool too small for all
    three: the embedding, the latest, is preempted (recompute) while its chunks gather, and starts them again from
    its first position."""
    _, hf_model = tiny
    llm = LLM(model=str(tiny[0]), dtype="float32", num_kv_blocks=11, block_size=16, max_num_batched_tokens=24,
              pooler_config={"pooling_type": "MEAN"},      # 10 usable blocks: the embedding alone needs them all
              scheduler_reserve_full_isl=False)     # admitted on its first chunk, not once all of it fits
    engine = llm.engine
    for i in range(2):
        engine.add_request(f"gen{i}", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=60, ignore_eos=True))
    prompt = list(range(20, 170))
    engine.add_request("emb", {"prompt_token_ids": prompt}, PoolingParams())
    finals = {}
    while engine.has_unfinished_requests():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    assert engine.scheduler.num_preemptions > 0
    torch.testing.assert_close(torch.tensor(finals["emb"].embedding), _hf_pooled(hf_model, prompt, "MEAN"),
                               atol=1e-5, rtol=1e-4)


def test_a_pooling_the_config_asks_for_is_taken_per_model_and_per_request(tiny, tmp_path, caplog):
    _, hf_model = tiny
    llm = LLM(model=str(tiny[0]), dtype="float32", num_kv_blocks=64, pooler_config={"pooling_type": "MEAN"})
    (mean,) = llm.embed({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False)
    (cls,) = llm.embed({"prompt_token_ids": PROMPTS[1]}, PoolingParams(pooling_type="CLS"), use_tqdm=False)
    for output, pooling_type in ((mean, "MEAN"), (cls, "CLS")):
        torch.testing.assert_close(torch.tensor(output.outputs.embedding),
                                   _hf_pooled(hf_model, PROMPTS[1], pooling_type), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="pooler_config"):
        LLM(model=str(tiny[0]), pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        PoolingParams(pooling_type="max")
    logger = logging.getLogger("pagedllm")     # it does not propagate to the root, where caplog listens
    logger.addHandler(caplog.handler)
    try:        # a mode pagedllm does not run: warned of, and LAST taken
        unrun = LLM(model=_sentence_transformers_folder(tiny, tmp_path / "max", {"pooling_mode_max_tokens": True}),
                    dtype="float32", num_kv_blocks=16)
    finally:
        logger.removeHandler(caplog.handler)
    assert unrun.engine.pooling_type == "LAST"
    assert any("pools by max_tokens, which pagedllm does not run" in r.getMessage() for r in caplog.records)


def test_a_prompt_may_fill_the_context_to_embed_as_in_vllm(tiny):
    """A prompt of max_model_len tokens embeds (vLLM's pooling takes the whole context) and gives transformers'
    vector; generating from it, or embedding one token more, is refused; the server's truncate_prompt_tokens=-1
    keeps the whole context for an embedding (the first tokens, the tokenizer's side; the last with
    truncation_side "left")."""
    llm = LLM(model=str(tiny[0]), dtype="float32", block_size=16, num_kv_blocks=64, max_model_len=48)
    full = list(range(30, 78))                                          # 48 tokens
    (output,) = llm.embed({"prompt_token_ids": full}, PoolingParams(normalize=False), use_tqdm=False)
    torch.testing.assert_close(torch.tensor(output.outputs.embedding), _hf_last_hidden(tiny[1], full), atol=1e-4,
                               rtol=1e-4)
    with pytest.raises(ValueError, match="leave room for at least one generated token"):
        llm.generate({"prompt_token_ids": full}, use_tqdm=False)
    with pytest.raises(ValueError, match="at most max_model_len tokens long, to embed"):
        llm.embed({"prompt_token_ids": [*full, 5]}, use_tqdm=False)
    running = start_server(llm.engine, api_key=None)
    try:
        client = running.client()
        for tokens, side in (([*full, 4, 4], None), ([4, 4, *full], "left")):
            cut = client.embeddings.create(model=running.model_name, input=tokens, encoding_format="float",
                                           extra_body={"truncate_prompt_tokens": -1, "normalize": False,
                                                       "truncation_side": side})
            assert cut.usage.prompt_tokens == 48
            assert cut.data[0].embedding == pytest.approx(output.outputs.embedding, rel=1e-5, abs=1e-6)
    finally:
        running.stop()


def test_truncate_prompt_tokens_keeps_the_tokenizers_side_as_vllm_does(llm, monkeypatch):
    """vLLM 0.32 keeps the first k tokens where the tokenizer truncates on the right (transformers' default, this
    one's), the last k where it truncates on the left."""
    tokenizer = llm.engine.tokenizer
    long = list(range(20, 20 + llm.engine.max_model_len + 30))      # longer than the context
    (kept,) = llm.embed({"prompt_token_ids": long}, use_tqdm=False, truncate_prompt_tokens=-1)
    assert tokenizer.truncation_side == "right" and kept.prompt_token_ids == long[:llm.engine.max_model_len]
    (first,) = llm.embed({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False, truncate_prompt_tokens=9)
    (alone,) = llm.embed({"prompt_token_ids": PROMPTS[1][:9]}, use_tqdm=False)
    assert first.prompt_token_ids == PROMPTS[1][:9] and first.outputs.embedding == alone.outputs.embedding
    (scored,) = llm.score("abc", "xyzw", use_tqdm=False, truncate_prompt_tokens=2)
    assert scored.prompt_token_ids == tokenizer.encode("abc")[:2] + tokenizer.encode("xyzw")[:2]
    # vLLM 0.32's tokenization_kwargs say the same, and may name the side
    (also,) = llm.embed({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False,
                        tokenization_kwargs={"truncate_prompt_tokens": 9})
    (left,) = llm.embed({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False,
                        tokenization_kwargs={"truncate_prompt_tokens": 9, "truncation_side": "left"})
    assert also.prompt_token_ids == PROMPTS[1][:9] and left.prompt_token_ids == PROMPTS[1][-9:]
    with pytest.raises(ValueError, match="tokenization_kwargs takes truncate_prompt_tokens, truncation_side"):
        llm.embed("abc", use_tqdm=False, tokenization_kwargs={"padding": "max_length"})
    with pytest.raises(ValueError, match="truncate_prompt_tokens is 2 and tokenization_kwargs' 3: give one"):
        llm.embed("abc", use_tqdm=False, truncate_prompt_tokens=2, tokenization_kwargs={"truncate_prompt_tokens": 3})
    monkeypatch.setattr(tokenizer, "truncation_side", "left")
    (last,) = llm.embed({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False, truncate_prompt_tokens=9)
    assert last.prompt_token_ids == PROMPTS[1][-9:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or in"):
        llm.embed("abc", use_tqdm=False, truncate_prompt_tokens=0)


def test_embed_refuses_bad_prompts_before_running_any(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.embed([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_params has 1 entries for 2 prompts"):
        llm.embed(["a", "b"], [PoolingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="normalize"):
        PoolingParams(normalize="yes")


def test_a_matryoshka_model_gives_its_first_dimensions_normalised_again(tiny, llm):
    """vLLM's PoolingParams(dimensions=k) (the server's `dimensions`): the first k values of the embedding, then
    normalized, from a model whose config says it was trained for them; refused, saying why, otherwise."""
    matryoshka = LLM(model=str(tiny[0]), dtype="float32", num_kv_blocks=64,
                     hf_overrides={"matryoshka_dimensions": [16, 32]})
    (full,) = matryoshka.embed(PROMPTS[:1], PoolingParams(normalize=False), use_tqdm=False)
    (short,) = matryoshka.embed(PROMPTS[:1], PoolingParams(dimensions=16), use_tqdm=False)
    expected = torch.nn.functional.normalize(torch.tensor(full.outputs.embedding[:16]), dim=0)
    assert short.outputs.embedding == pytest.approx(expected.tolist(), abs=1e-6)
    with pytest.raises(ValueError, match=r"dimensions must be one of .*\[16, 32\], got 8"):
        matryoshka.embed(PROMPTS[:1], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be unset: .* does not support Matryoshka embeddings"):
        llm.embed(PROMPTS[:1], PoolingParams(dimensions=16), use_tqdm=False)
    any_length = LLM(model=str(tiny[0]), dtype="float32", num_kv_blocks=64, hf_overrides={"is_matryoshka": True})
    assert len(any_length.embed(PROMPTS[:1], PoolingParams(dimensions=5), use_tqdm=False)[0].outputs.embedding) == 5
    with pytest.raises(ValueError, match=r"dimensions must be in \[1, 64\]"):
        any_length.embed(PROMPTS[:1], PoolingParams(dimensions=65), use_tqdm=False)
    for bad in (dict(dimensions=0), dict(dimensions=True), dict(task="classify", dimensions=4)):
        with pytest.raises(ValueError, match="dimensions is an embedding's length"):
            PoolingParams(**bad)


def test_served_embeddings_equal_offline_ones(client, server, llm):
    texts = ["Once upon a time", "in a paged cache, blocks"]
    expected = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    as_base64 = client.embeddings.create(model=server.model_name, input=texts)     # the SDK asks for base64
    as_floats = client.embeddings.create(model=server.model_name, input=texts, encoding_format="float")
    for response in (as_base64, as_floats):
        assert response.object == "list" and response.model == server.model_name
        assert [d.index for d in response.data] == [0, 1] and {d.object for d in response.data} == {"embedding"}
        for data, vector in zip(response.data, expected):
            torch.testing.assert_close(torch.tensor(data.embedding), torch.tensor(vector), atol=1e-6, rtol=1e-5)
    prompt_tokens = sum(len(llm.engine.tokenizer.encode(t)) for t in texts)
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == prompt_tokens
    # /metrics counts an embedding's prompt tokens, and no generated token
    before = scrape(server.base_url)
    client.embeddings.create(model=server.model_name, input=texts, encoding_format="float")
    deadline = time.monotonic() + 5
    while (grew := metric(scrape(server.base_url), "pagedllm:prompt_tokens_total")
           - metric(before, "pagedllm:prompt_tokens_total")) < prompt_tokens and time.monotonic() < deadline:
        time.sleep(0.02)
    assert grew == prompt_tokens
    assert metric(scrape(server.base_url), "pagedllm:generation_tokens_total") == \
        metric(before, "pagedllm:generation_tokens_total")

    by_ids = client.embeddings.create(model=server.model_name, input=PROMPTS[0], encoding_format="float")
    (offline,) = llm.embed({"prompt_token_ids": PROMPTS[0]}, use_tqdm=False)
    torch.testing.assert_close(torch.tensor(by_ids.data[0].embedding), torch.tensor(offline.outputs.embedding),
                               atol=1e-6, rtol=1e-5)
    raw = client.embeddings.create(model=server.model_name, input="x y", encoding_format="float",
                                   extra_body={"normalize": False})
    assert abs(torch.tensor(raw.data[0].embedding).norm().item() - 1) > 1e-3


def test_chat_messages_embed_as_their_rendered_prompt(client, server):
    messages = [{"role": "user", "content": "Embed this message"}]
    tokens = httpx.post(f"{server.base_url}/tokenize",
                        json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    as_chat = client.embeddings.create(model=server.model_name, input=[], encoding_format="float",
                                       extra_body={"input": None, "messages": messages})
    as_ids = client.embeddings.create(model=server.model_name, input=tokens, encoding_format="float")
    assert as_chat.usage.prompt_tokens == len(tokens)
    # The second runs after a prefix-cache hit: the same floats on a CPU, whose kernels work row by row; a GPU's
    # matrix products may round a shorter step's rows differently.
    assert as_chat.data[0].embedding == pytest.approx(as_ids.data[0].embedding, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(("kwargs", "param", "status"), [
    (dict(input=[]), "input", 400),
    (dict(input="hi", dimensions=8), "dimensions", 400),
    (dict(input=[[1, 2], [10 ** 9]]), "input", 400),
    (dict(input="hi", model="not-served"), "model", 404),
    (dict(input="hi", extra_body={"messages": [{"role": "user", "content": "hi"}]}), "input", 400),
    (dict(input=[], extra_body={"input": None, "messages": [{"role": "nobody"}]}), "messages", 400),
])
def test_bad_embedding_requests_get_openai_errors(client, server, kwargs, param, status):
    with pytest.raises(openai.APIStatusError) as info:
        client.embeddings.create(**{"model": server.model_name, **kwargs})
    assert info.value.status_code == status
    assert info.value.body["param"] == param


def test_vllm_runner_and_convert_switches_are_taken_and_others_refused(tiny):
    from pagedllm.entrypoints.openai.api_server import make_parser

    llm = LLM(model=str(tiny[0]), dtype="float32", num_kv_blocks=64, runner="pooling", convert="embed")
    (output,) = llm.embed([[1, 2, 3]], use_tqdm=False)
    assert len(output.outputs.embedding) == tiny[1].config.hidden_size
    # vLLM's general call: the same vector as a float32 tensor; a task pagedllm has not, refused
    (encoded,) = llm.encode([[1, 2, 3]], pooling_task="embed", use_tqdm=False)
    assert encoded.outputs.data.dtype == torch.float32 and encoded.prompt_token_ids == [1, 2, 3]
    assert encoded.outputs.data.tolist() == output.outputs.embedding
    assert isinstance(output, PoolingRequestOutput)     # embed's kind of encode's output, as in vLLM
    for task in (None, "token_embed"):
        with pytest.raises(ValueError, match=f"LLM.encode needs pooling_task 'embed' or 'classify', got {task!r}"):
            llm.encode([[1, 2, 3]], pooling_task=task)
    with pytest.raises(ValueError, match="runner must be one of auto, generate, pooling, got 'draft'"):
        LLM(model=str(tiny[0]), runner="draft")
    with pytest.raises(ValueError, match="convert must be one of auto, none, embed, got 'classify'"):
        LLM(model=str(tiny[0]), convert="classify")
    args = make_parser().parse_args(["--runner", "pooling", "--convert", "embed"])
    assert (args.runner, args.convert) == ("pooling", "embed")
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--convert", "reward"])


# ---- scores: vLLM's LLM.score, /score and /rerank for an embedding model ----------------------------------------
def _hf_cosine(hf_model, first: list[int], second: list[int]) -> float:
    return torch.nn.functional.cosine_similarity(_hf_last_hidden(hf_model, first),
                                                 _hf_last_hidden(hf_model, second), dim=0).item()


def test_score_is_the_cosine_of_transformers_embeddings(tiny, llm):
    _, hf_model = tiny
    query, docs = PROMPTS[0], PROMPTS
    one_to_n = llm.score({"prompt_token_ids": query}, [{"prompt_token_ids": d} for d in docs], use_tqdm=False)
    assert [o.prompt_token_ids for o in one_to_n] == [query + d for d in docs]
    for output, doc in zip(one_to_n, docs):
        assert output.finished and output.outputs.score == pytest.approx(_hf_cosine(hf_model, query, doc), abs=1e-5)
    assert one_to_n[0].outputs.score == pytest.approx(1.0)     # the query against itself

    firsts = [{"prompt_token_ids": p} for p in PROMPTS]
    seconds = [{"prompt_token_ids": p} for p in reversed(PROMPTS)]
    pairwise = llm.score(firsts, seconds, use_tqdm=False)
    for output, first, second in zip(pairwise, PROMPTS, reversed(PROMPTS)):
        assert output.outputs.score == pytest.approx(_hf_cosine(hf_model, first, second), abs=1e-5)
    with pytest.raises(ValueError, match="1:1, 1:N or N:N, got 2:3"):
        llm.score(firsts[:2], seconds, use_tqdm=False)


def test_served_scores_and_reranks_equal_offline_scores(server, llm):
    query = "paged attention"
    docs = ["blocks of the KV cache", "paged attention kernels", "a recipe for bread"]
    expected = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    num_tokens = sum(len(llm.engine.tokenizer.encode(query)) + len(llm.engine.tokenizer.encode(d)) for d in docs)
    for path in ("/score", "/v1/score"):
        body = httpx.post(f"{server.base_url}{path}", json={"text_1": query, "text_2": docs}, timeout=30).json()
        assert body["object"] == "list" and body["model"] == server.model_name and body["id"].startswith("score-")
        assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"score"}
        assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-6)
        assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}
    pairwise = httpx.post(f"{server.base_url}/score", json={"text_1": docs, "text_2": docs[::-1]}, timeout=30)
    assert [d["score"] for d in pairwise.json()["data"]] == pytest.approx(
        [o.outputs.score for o in llm.score(docs, docs[::-1], use_tqdm=False)], abs=1e-6)

    best_first = sorted(range(len(docs)), key=lambda i: expected[i], reverse=True)
    for path, top_n in (("/rerank", 0), ("/v1/rerank", 2), ("/v2/rerank", 5)):
        body = httpx.post(f"{server.base_url}{path}", json={"query": query, "documents": docs, "top_n": top_n},
                          timeout=30).json()
        kept = best_first[:top_n or None]
        assert [r["index"] for r in body["results"]] == kept, path
        assert [r["document"]["text"] for r in body["results"]] == [docs[i] for i in kept]
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([expected[i] for i in kept],
                                                                                 abs=1e-6)
        assert body["usage"]["total_tokens"] == num_tokens and body["id"].startswith("rerank-")


@pytest.mark.parametrize(("path", "body", "param", "status"), [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", 400),
    ("/score", {"text_1": [], "text_2": ["c"]}, "text_1", 400),
    ("/rerank", {"query": "q", "documents": []}, "documents", 400),
    ("/rerank", {"query": "", "documents": ["d"]}, "query", 400),
    ("/rerank", {"query": "q", "documents": ["d"], "model": "not-served"}, "model", 404),
    ("/rerank", {"query": "q", "documents": ["d"], "truncate_prompt_tokens": 10 ** 6}, "truncate_prompt_tokens", 400),
    ("/v1/score", {"text_1": "a", "text_2": ["b", 3]}, None, 400),
])
def test_bad_score_requests_get_openai_errors(server, path, body, param, status):
    response = httpx.post(f"{server.base_url}{path}", json=body, timeout=30)
    assert response.status_code == status, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param
