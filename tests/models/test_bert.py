"""BERT-family encoders (pagedllm/models/bert.py) against transformers on the same tiny random weights: BERT and
XLM-RoBERTa (whose positions start after its padding id), float32 and bf16, MEAN, CLS and LAST pooling over prompts up
to the whole context; a sentence-transformers folder as all-MiniLM's; a task head's checkpoint (`bert.` names);
generation and prompts past the context refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, PoolingParams, SamplingParams
from tests.models.tiny import build_byte_tokenizer

CONTEXT = 128
PROMPTS = [[5, 17, 99], list(range(20, 90)), list(range(3, 3 + CONTEXT))]


def _save(folder: Path, kind: str, head: bool = False):
    """A tiny random BERT or XLM-RoBERTa (with a masked-LM head if `head`: names under `bert.`) and the byte
    tokenizer; returns the transformers encoder."""
    from transformers import BertConfig, BertForMaskedLM, BertModel, XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(0)
    shape = dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    if kind == "bert":
        config = BertConfig(**shape, max_position_embeddings=CONTEXT)
        model = BertForMaskedLM(config) if head else BertModel(config, add_pooling_layer=False)
    else:   # two position rows before the context's: the padding id's and its own
        config = XLMRobertaConfig(**shape, max_position_embeddings=CONTEXT + 2, pad_token_id=1)
        model = XLMRobertaModel(config)
    model.eval().save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return model.bert if head else model


def _hf_hidden(encoder, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return encoder(torch.tensor([prompt])).last_hidden_state[0].float()


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param) / "m"
    return folder, _save(folder, request.param)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_encoder_embeds_as_transformers_does(model, dtype):
    folder, encoder = model
    llm = LLM(model=str(folder), dtype=dtype, max_num_batched_tokens=64)
    assert llm.engine.max_model_len == CONTEXT and not llm.engine.generates
    tol = 1e-5 if dtype == "float32" else 3e-2
    for pooling_type, pool in [("MEAN", lambda h: h.mean(0)), ("CLS", lambda h: h[0]), ("LAST", lambda h: h[-1])]:
        outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(pooling_type=pooling_type),
                            use_tqdm=False)
        for prompt, output in zip(PROMPTS, outputs):
            expected = torch.nn.functional.normalize(pool(_hf_hidden(encoder, prompt)), dim=0)
            torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=tol, rtol=tol)


def test_an_encoder_refuses_to_generate_and_prompts_past_its_context(model):
    folder, _ = model
    llm = LLM(model=str(folder), dtype="float32")
    with pytest.raises(ValueError, match="is an encoder"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=str(CONTEXT)):
        llm.embed({"prompt_token_ids": list(range(3, 4 + CONTEXT))}, use_tqdm=False)


def test_a_sentence_transformers_bert_folder_pools_as_its_config_says(tmp_path):
    """all-MiniLM-L6-v2's folder: the encoder, mean pooling, a norm."""
    encoder = _save(tmp_path / "m", "bert")
    (tmp_path / "m" / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "m" / "1_Pooling").mkdir()
    (tmp_path / "m" / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    llm = LLM(model=str(tmp_path / "m"), dtype="float32")
    assert llm.engine.pooling_type == "MEAN"
    (output,) = llm.embed({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False)
    torch.testing.assert_close(torch.tensor(output.outputs.embedding),
                               torch.nn.functional.normalize(_hf_hidden(encoder, PROMPTS[1]).mean(0), dim=0),
                               atol=1e-5, rtol=1e-5)


def test_a_task_heads_checkpoint_loads_its_encoder(tmp_path):
    """A BertForMaskedLM checkpoint: its `bert.` weights are the encoder's, its head's are not read."""
    encoder = _save(tmp_path / "m", "bert", head=True)
    llm = LLM(model=str(tmp_path / "m"), dtype="float32")
    (output,) = llm.embed({"prompt_token_ids": PROMPTS[1]}, PoolingParams(pooling_type="CLS"), use_tqdm=False)
    torch.testing.assert_close(torch.tensor(output.outputs.embedding),
                               torch.nn.functional.normalize(_hf_hidden(encoder, PROMPTS[1])[0], dim=0),
                               atol=1e-5, rtol=1e-5)
