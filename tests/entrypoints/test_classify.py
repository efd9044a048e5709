"""Classification and cross-encoder scores (vLLM's `LLM.classify`, `/classify`, and `LLM.score`, `/score`,
`/rerank` with a one-label classifier) on tiny random sequence classifiers saved by transformers
(`*ForSequenceClassification`): the probabilities are transformers' own, from the head at the prompt's last token,
whether the prompt ran in one step or in chunks; a pair is scored as one prompt, joined as the tokenizer joins a
text pair."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from pagedllm import LLM, PoolingParams
from tests.entrypoints.server_utils import start_server
from tests.models.tiny import build_byte_tokenizer, save_tiny_model, tiny_config
from tests.reliability.tiny_server import build_tiny_engine

PROMPTS = [[5, 17, 99, 3], list(range(20, 90)), [7] * 33]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _save_classifier(folder, kind: str, **overrides):
    torch.manual_seed(0)
    config = tiny_config(kind, initializer_range=0.5, **overrides)
    hf_model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    hf_model.save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return folder, hf_model


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """Three labels, named: a Llama with a classification head."""
    return _save_classifier(tmp_path_factory.mktemp("cls") / "m", "llama-gqa", id2label=LABELS,
                            label2id={v: k for k, v in LABELS.items()})


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """One label, as rerankers are saved: a Qwen2 with a one-logit head."""
    return _save_classifier(tmp_path_factory.mktemp("rerank") / "m", "qwen2", num_labels=1)


def _hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0]


def test_classify_gives_transformers_probabilities_and_logits(classifier):
    folder, hf_model = classifier
    # a 24-token budget: the 70-token prompt runs in chunks, and the third hits the second's cached blocks
    llm = LLM(model=str(folder), dtype="float32", block_size=16, num_kv_blocks=64, max_num_batched_tokens=24)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS] + [{"prompt_token_ids": PROMPTS[1] + [9]}]
    probs = llm.classify(prompts, use_tqdm=False)
    logits = llm.classify(prompts, PoolingParams(task="classify", use_activation=False), use_tqdm=False)
    assert logits[-1].num_cached_tokens > 0
    for prompt, with_probs, raw in zip(prompts, probs, logits):
        expected = _hf_logits(hf_model, prompt["prompt_token_ids"])
        assert with_probs.outputs.num_classes == 3 and with_probs.prompt_token_ids == prompt["prompt_token_ids"]
        torch.testing.assert_close(torch.tensor(raw.outputs.probs), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(with_probs.outputs.probs), expected.softmax(0), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="score needs an embedding model or a cross-encoder"):
        llm.score("a", "b", use_tqdm=False)
    with pytest.raises(ValueError, match="task 'classify'"):
        llm.classify("a", PoolingParams(), use_tqdm=False)
    # vLLM's get_supported_tasks: this classifier's config ties its embeddings to an LM head: it generates too
    assert llm.llm_engine.get_supported_tasks() == ("generate", "embed", "classify")


def test_a_model_without_a_classification_head_cannot_classify(tmp_path):
    folder, _ = save_tiny_model(tmp_path / "lm", "llama-gqa")
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="has no classification head"):
        llm.classify("a", use_tqdm=False)
    assert llm.llm_engine.get_supported_tasks() == ("generate", "embed")


def test_cross_encoder_scores_are_the_pairs_probabilities(cross_encoder):
    folder, hf_model = cross_encoder
    tokenizer = build_byte_tokenizer()
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64)
    docs = ["paged blocks", "a kv cache", "bread"]
    for first, second in (("query", docs), (docs, docs[::-1])):
        outputs = llm.score(first, second, use_tqdm=False)
        pairs = [(first, d) for d in second] if isinstance(first, str) else list(zip(first, second))
        for output, (a, b) in zip(outputs, pairs):
            ids = tokenizer(a, b)["input_ids"]
            assert output.prompt_token_ids == ids
            assert output.outputs.score == pytest.approx(_hf_logits(hf_model, ids).sigmoid().item(), abs=1e-5)


@pytest.mark.parametrize("kind", ["qwen3", "llama-untied"])    # the LM head tied to the embedding, or its own
def test_a_causal_lm_classifies_from_its_lm_heads_rows_as_vllm_serves_qwen3_reranker(tmp_path, kind):
    """hf_overrides (vLLM's) make a causal LM a classifier whose head is its LM head's rows of the given tokens:
    with two tokens and is_original_qwen3_reranker, one label whose probability is the second token's in a softmax
    over the two (Qwen3-Reranker's "yes" against "no"); otherwise one class per token."""
    folder, hf_model = save_tiny_model(tmp_path / "lm", kind, initializer_range=0.5)
    tokenizer = build_byte_tokenizer()
    no, yes = tokenizer.convert_tokens_to_ids(["n", "y"])
    reranker = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, runner="pooling", hf_overrides={
        "architectures": [tiny_config(kind).model_type.capitalize() + "ForSequenceClassification"],
        "classifier_from_token": ["n", "y"], "is_original_qwen3_reranker": True})
    for output, (a, b) in zip(reranker.score("query", ["doc one", "doc two"], use_tqdm=False),
                              [("query", "doc one"), ("query", "doc two")]):
        logits = _hf_causal_logits(hf_model, tokenizer(a, b)["input_ids"])
        assert output.outputs.score == pytest.approx(logits[[no, yes]].softmax(0)[1].item(), abs=1e-5)

    three = LLM(model=str(folder), dtype="float32", num_kv_blocks=64, hf_overrides={
        "architectures": [tiny_config(kind).model_type.capitalize() + "ForSequenceClassification"],
        "classifier_from_token": ["a", "b", "c"]})
    (output,) = three.classify({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False)
    ids = tokenizer.convert_tokens_to_ids(["a", "b", "c"])
    torch.testing.assert_close(torch.tensor(output.outputs.probs), _hf_causal_logits(hf_model, PROMPTS[1])[ids]
                               .softmax(0), atol=1e-5, rtol=1e-4)
    assert three.engine.class_labels == ["a", "b", "c"]
    with pytest.raises(ValueError, match="not tokens of this model's vocabulary"):
        LLM(model=str(folder), dtype="float32", num_kv_blocks=64, hf_overrides={
            "architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["n", "not a token"]})


def _hf_causal_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0, -1]


def test_served_classifications_and_cross_encoder_scores_equal_offline_ones(classifier, cross_encoder):
    texts = ["a fine day", "the worst step"]
    folder, _ = classifier
    expected = [o.outputs.probs for o in LLM(model=str(folder), dtype="float32", num_kv_blocks=64)
                .classify(texts, use_tqdm=False)]
    server = start_server(build_tiny_engine(folder), api_key=None)
    try:
        for path in ("/classify", "/v1/classify"):
            body = httpx.post(f"{server.base_url}{path}", json={"input": texts}, timeout=30).json()
            assert body["object"] == "list" and body["id"].startswith("classify-")
            for i, (data, probs) in enumerate(zip(body["data"], expected)):
                assert data["index"] == i and data["num_classes"] == 3
                assert data["probs"] == pytest.approx(probs, abs=1e-6)
                assert data["label"] == LABELS[max(range(3), key=probs.__getitem__)]
        score = httpx.post(f"{server.base_url}/score", json={"text_1": "a", "text_2": "b"}, timeout=30)
        assert score.status_code == 400 and "use /classify" in score.json()["error"]["message"]
    finally:
        server.stop()

    folder, _ = cross_encoder
    query, docs = "paged attention", ["blocks of the KV cache", "paged attention kernels", "a recipe for bread"]
    scores = [o.outputs.score for o in LLM(model=str(folder), dtype="float32", num_kv_blocks=64)
              .score(query, docs, use_tqdm=False)]
    server = start_server(build_tiny_engine(folder), api_key=None)
    try:
        body = httpx.post(f"{server.base_url}/score", json={"text_1": query, "text_2": docs}, timeout=30).json()
        assert [d["score"] for d in body["data"]] == pytest.approx(scores, abs=1e-6)
        tokenizer = build_byte_tokenizer()
        assert body["usage"]["prompt_tokens"] == sum(len(tokenizer(query, d)["input_ids"]) for d in docs)
        body = httpx.post(f"{server.base_url}/rerank", json={"query": query, "documents": docs, "top_n": 2},
                          timeout=30).json()
        best = sorted(range(3), key=scores.__getitem__, reverse=True)[:2]
        assert [(r["index"], r["relevance_score"]) for r in body["results"]] == [(i, pytest.approx(scores[i], abs=1e-6))
                                                                                  for i in best]
    finally:
        server.stop()
