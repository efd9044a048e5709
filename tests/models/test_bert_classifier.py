"""BERT-family sequence classifiers and cross-encoders (pagedllm/models/bert.py's `head`) against transformers on the
same tiny random weights: BERT's pooler and classifier and RoBERTa's classifier read the prompt's first token; a
BERT pair's second text has token type 1, given with the prompt (`token_type_ids`) or by the tokenizer to `score`,
offline and on the server; bad token types are refused."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from tokenizers import processors
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
)

from pagedllm import LLM, PoolingParams
from tests.entrypoints.server_utils import start_server
from tests.models.tiny import build_byte_tokenizer, save_tiny_model
from tests.reliability.tiny_server import TINY_CONTEXT as CONTEXT
from tests.reliability.tiny_server import build_tiny_engine

PROMPTS = [[5, 17, 99], list(range(20, 90)), list(range(3, 3 + CONTEXT))]


def _pair_tokenizer():
    """The byte tokenizer, joining a pair as BERT's does: <s> A </s> B </s>, B and its </s> of token type 1, which
    it gives as BERT's does (token_type_ids among its model inputs)."""
    tokenizer = build_byte_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", 1), ("</s>", 2)])
    tokenizer.model_input_names = tokenizer.init_kwargs["model_input_names"] = \
        ["input_ids", "token_type_ids", "attention_mask"]
    return tokenizer


def _save(folder: Path, kind: str, num_labels: int):
    """A tiny random BERT or XLM-RoBERTa sequence classifier and the pair tokenizer; returns the transformers model."""
    torch.manual_seed(0)
    shape = dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 num_labels=num_labels, initializer_range=0.2)
    if kind == "bert":
        model = BertForSequenceClassification(BertConfig(**shape, max_position_embeddings=CONTEXT))
    else:
        model = XLMRobertaForSequenceClassification(XLMRobertaConfig(**shape, max_position_embeddings=CONTEXT + 2,
                                                                     pad_token_id=1))
    model.eval().save_pretrained(folder)
    _pair_tokenizer().save_pretrained(folder)
    return model


def _hf_logits(model, token_ids: list[int], token_type_ids: list[int] | None = None) -> torch.Tensor:
    types = None if token_type_ids is None else torch.tensor([token_type_ids])
    with torch.no_grad():
        return model(torch.tensor([token_ids]), token_type_ids=types).logits[0].float()


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """One label, as ms-marco-MiniLM is saved: a BERT, whose two token types tell a pair's texts apart."""
    folder = tmp_path_factory.mktemp("bert-rerank") / "m"
    return folder, _save(folder, "bert", 1)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_encoder_classifies_as_transformers_does(tmp_path, kind, dtype):
    model = _save(tmp_path / "m", kind, 3)
    llm = LLM(model=str(tmp_path / "m"), dtype=dtype, max_num_batched_tokens=CONTEXT)
    assert llm.engine.class_labels == ["LABEL_0", "LABEL_1", "LABEL_2"]
    tol = 1e-5 if dtype == "float32" else 3e-2
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for params, activation in [(None, lambda x: x.softmax(0)),
                               (PoolingParams(task="classify", use_activation=False), lambda x: x)]:
        outputs = llm.classify(prompts, params, use_tqdm=False)
        for prompt, output in zip(PROMPTS, outputs):
            torch.testing.assert_close(torch.tensor(output.outputs.probs), activation(_hf_logits(model, prompt)),
                                       atol=tol, rtol=tol)
    (encoded,) = llm.encode(prompts[:1], pooling_task="classify", use_tqdm=False)    # vLLM's general call
    assert encoded.outputs.data.tolist() == llm.classify(prompts[:1], use_tqdm=False)[0].outputs.probs
    with pytest.raises(ValueError, match="reads the CLS token"):
        llm.classify("a", PoolingParams(task="classify", pooling_type="LAST"), use_tqdm=False)


def test_token_types_given_with_the_prompt_are_bert_s(cross_encoder):
    folder, model = cross_encoder
    llm = LLM(model=str(folder), dtype="float32")
    assert llm.llm_engine.get_supported_tasks() == ("embed", "classify")     # an encoder: it generates nothing
    ids, types = PROMPTS[1], [0] * 30 + [1] * 40
    with_types, without = llm.classify([{"prompt_token_ids": ids, "token_type_ids": types},
                                        {"prompt_token_ids": ids}], use_tqdm=False)
    assert with_types.outputs.probs[0] == pytest.approx(_hf_logits(model, ids, types).sigmoid().item(), abs=1e-5)
    assert without.outputs.probs[0] == pytest.approx(_hf_logits(model, ids).sigmoid().item(), abs=1e-5)
    assert abs(with_types.outputs.probs[0] - without.outputs.probs[0]) > 1e-3     # the types count
    (cut,) = llm.classify({"prompt_token_ids": ids, "token_type_ids": types}, truncate_prompt_tokens=50,
                          use_tqdm=False)
    assert cut.outputs.probs[0] == pytest.approx(_hf_logits(model, ids[:50], types[:50]).sigmoid().item(),
                                                 abs=1e-5)     # the first 50: the tokenizer truncates on the right


def test_a_cross_encoder_scores_pairs_with_the_tokenizers_token_types(cross_encoder):
    folder, model = cross_encoder
    tokenizer = _pair_tokenizer()
    llm = LLM(model=str(folder), dtype="float32")
    docs = ["paged blocks", "a kv cache", "bread"]
    for output, doc in zip(llm.score("query", docs, use_tqdm=False), docs):
        encoded = tokenizer("query", doc)
        assert 1 in encoded["token_type_ids"] and output.prompt_token_ids == encoded["input_ids"]
        expected = _hf_logits(model, encoded["input_ids"], encoded["token_type_ids"]).sigmoid().item()
        assert output.outputs.score == pytest.approx(expected, abs=1e-5)
    # token ids: the first's of type 0, the second's of type 1
    (output,) = llm.score({"prompt_token_ids": [1, 50, 51, 2]}, {"prompt_token_ids": [60, 61, 2]}, use_tqdm=False)
    expected = _hf_logits(model, [1, 50, 51, 2, 60, 61, 2], [0, 0, 0, 0, 1, 1, 1]).sigmoid().item()
    assert output.outputs.score == pytest.approx(expected, abs=1e-5)


def test_a_tokenizer_that_gives_no_token_types_leaves_them_0(tmp_path):
    """As vLLM and sentence-transformers run such a cross-encoder: the model's types are all 0."""
    model = _save(tmp_path / "m", "bert", 1)
    build_byte_tokenizer().save_pretrained(tmp_path / "m")      # no token_type_ids among its model inputs
    (output,) = LLM(model=str(tmp_path / "m"), dtype="float32").score("query", "a document", use_tqdm=False)
    ids = build_byte_tokenizer()("query", "a document")["input_ids"]
    assert output.outputs.score == pytest.approx(_hf_logits(model, ids).sigmoid().item(), abs=1e-5)


def test_served_cross_encoder_scores_equal_offline_ones(cross_encoder):
    folder, _ = cross_encoder
    query, docs = "paged attention", ["blocks of the KV cache", "paged attention kernels", "a recipe for bread"]
    offline = LLM(model=str(folder), dtype="float32")
    scores = [o.outputs.score for o in offline.score(query, docs, use_tqdm=False)]
    cut = [o.outputs.score for o in offline.score(query, docs, truncate_prompt_tokens=12, use_tqdm=False)]
    server = start_server(build_tiny_engine(folder), api_key=None)
    try:
        body = httpx.post(f"{server.base_url}/score", json={"text_1": query, "text_2": docs}, timeout=30).json()
        assert [d["score"] for d in body["data"]] == pytest.approx(scores, abs=1e-6)
        body = httpx.post(f"{server.base_url}/v1/rerank", json={"query": query, "documents": docs,
                                                                "truncate_prompt_tokens": 12}, timeout=30).json()
        assert {r["index"]: r["relevance_score"] for r in body["results"]} == pytest.approx(dict(enumerate(cut)),
                                                                                            abs=1e-6)
        assert body["usage"]["prompt_tokens"] == 36
    finally:
        server.stop()


def test_bad_token_types_are_refused(cross_encoder, tmp_path):
    folder, _ = cross_encoder
    llm = LLM(model=str(folder), dtype="float32")
    for prompt, message in [({"prompt_token_ids": [5, 6], "token_type_ids": [0, 2]}, r"in \[0, 2\)"),
                            ({"prompt_token_ids": [5, 6], "token_type_ids": [0]}, "one type per token"),
                            ({"prompt": "ab", "token_type_ids": [0, 0]}, "needs 'prompt_token_ids'"),
                            ({"prompt_token_ids": [5, 6], "token_type_ids": [0, True]}, "token_type_ids")]:
        with pytest.raises(ValueError, match=message):
            llm.classify(prompt, use_tqdm=False)
    decoder, _ = save_tiny_model(tmp_path / "lm", "llama-gqa")
    with pytest.raises(ValueError, match="takes no token_type_ids"):
        LLM(model=str(decoder), dtype="float32", num_kv_blocks=32).embed(
            {"prompt_token_ids": [5, 6], "token_type_ids": [0, 0]}, use_tqdm=False)
