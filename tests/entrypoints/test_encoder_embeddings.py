"""An encoder embedding model as EmbeddingGemma is saved: a Gemma 3 decoder (Gemma3TextModel) whose attention is
bidirectional (`use_bidirectional_attention`: a token sees the tokens after it too, its local layers those within
the window either side), and a sentence-transformers folder that mean-pools the final hidden states and passes the
mean through Dense layers before normalising. The oracle is transformers' model on the same weights, with the Dense
layers applied by hand from their files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, PoolingParams, SamplingParams
from pagedllm.bench.random_model import save_sentence_transformers_modules
from tests.entrypoints.server_utils import start_server
from tests.models.tiny import build_byte_tokenizer, build_tiny_hf_model
from tests.reliability.tiny_server import build_tiny_engine

# a prompt within the local window, ones across it and across blocks, and one as long as the context
PROMPTS = [[5, 17, 99], list(range(20, 90)), [7] * 33 + list(range(40, 60)), list(range(3, 259))]
CONTEXT = 256       # the tiny models' max_position_embeddings
# 2_Dense: 64 -> 96, no bias, no activation (EmbeddingGemma's two are both so); 3_Dense: 96 -> 48 with a bias and
# sentence-transformers' default Tanh
DENSE = [("2_Dense", 96, False, "torch.nn.modules.linear.Identity"),
         ("3_Dense", 48, True, "torch.nn.modules.activation.Tanh")]


def save_encoder(folder: Path, dense: list[tuple[str, int, bool, str]] = DENSE) -> tuple[Path, object, list]:
    """Save the tiny encoder with its sentence-transformers modules; returns (folder, transformers model, the Dense
    layers' (weight, bias, activation))."""
    hf_model = build_tiny_hf_model("gemma3", 0, initializer_range=0.5, use_bidirectional_attention=True).model
    hf_model.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Gemma3TextModel"]
    build_byte_tokenizer().save_pretrained(folder)
    weights = save_sentence_transformers_modules(folder, hf_model.config.hidden_size, dense, seed=3)
    return folder, hf_model, [(w["linear.weight"], w.get("linear.bias"), layer[3]) for w, layer in zip(weights, dense)]


def _hf_hidden(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).last_hidden_state[0].float()     # after the final norm


def _hf_embedding(hf_model, layers: list, token_ids: list[int]) -> torch.Tensor:
    vector = _hf_hidden(hf_model, token_ids).mean(0)
    for weight, bias, activation in layers:
        vector = vector @ weight.T + (bias if bias is not None else 0)
        vector = torch.tanh(vector) if activation.endswith("Tanh") else vector
    return torch.nn.functional.normalize(vector, dim=0)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return save_encoder(tmp_path_factory.mktemp("embeddinggemma") / "m")


@pytest.fixture(scope="module")
def llm(encoder) -> LLM:
    # a budget of 16 tokens asked, which an encoder raises to the context: each prompt runs whole
    return LLM(model=str(encoder[0]), dtype="float32", block_size=16, num_kv_blocks=128, max_num_batched_tokens=16)


def test_an_encoder_embeds_as_transformers_and_its_dense_layers_do(encoder, llm):
    """Mean pooling over every token, each seeing those after it (within 7 either side in the local layer), then
    the two Dense layers and the norm: transformers' model and the layers by hand give the same vector, for prompts
    from within the window to the whole context, batched together, twice (no prefix-cache hit on the second)."""
    _, hf_model, layers = encoder
    assert hf_model.config.sliding_window == 7          # the file's 12, as transformers reads a bidirectional one
    engine = llm.engine
    assert engine.pooling_type == "MEAN" and not engine.generates
    assert not engine.config.cache.enable_prefix_caching and not engine.config.scheduler.enable_chunked_prefill
    assert engine.config.scheduler.max_num_batched_tokens == CONTEXT
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for outputs in (llm.embed(prompts, use_tqdm=False), llm.embed(prompts, use_tqdm=False)):
        for prompt, output in zip(PROMPTS, outputs):
            assert output.outputs.hidden_size == 48 and output.num_cached_tokens == 0
            torch.testing.assert_close(torch.tensor(output.outputs.embedding),
                                       _hf_embedding(hf_model, layers, prompt), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_encoders_modules_embed_as_its_decoder_stack_does(encoder, dtype):
    """With enforce_eager the layers run as modules, their attention SDPA's over each step's own K/V (equal prompts
    in one call), not the kernels' bidirectional mode over the cache: transformers' vectors either way."""
    _, hf_model, layers = encoder
    prompts = PROMPTS + [list(range(100, 140))] * 3
    tol = 1e-4 if dtype == "float32" else 2e-2
    for enforce_eager in (True, False):
        llm = LLM(model=str(encoder[0]), dtype=dtype, enforce_eager=enforce_eager)
        assert (llm.engine.runner.model.model.stacks is None) == enforce_eager
        for prompt, output in zip(prompts, llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)):
            torch.testing.assert_close(torch.tensor(output.outputs.embedding),
                                       _hf_embedding(hf_model, layers, prompt), atol=tol, rtol=tol)


@pytest.mark.parametrize("pooling_type", ["LAST", "CLS"])
def test_a_request_may_pool_otherwise_and_the_dense_layers_still_run(encoder, llm, pooling_type):
    _, hf_model, layers = encoder
    (output,) = llm.embed({"prompt_token_ids": PROMPTS[1]}, PoolingParams(pooling_type=pooling_type),
                          use_tqdm=False)
    vector = _hf_hidden(hf_model, PROMPTS[1])[-1 if pooling_type == "LAST" else 0]
    expected = torch.tanh((vector @ layers[0][0].T) @ layers[1][0].T + layers[1][1])
    torch.testing.assert_close(torch.tensor(output.outputs.embedding), torch.nn.functional.normalize(expected, dim=0),
                               atol=1e-5, rtol=1e-4)


def test_an_encoder_refuses_to_generate(llm):
    with pytest.raises(ValueError, match="is an encoder"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_served_embeddings_of_an_encoder_equal_offline_ones(encoder, llm):
    running = start_server(build_tiny_engine(encoder[0], max_num_batched_tokens=16), api_key=None)
    try:
        client = running.client()
        response = client.embeddings.create(model=running.model_name, input=[PROMPTS[1], PROMPTS[3]],
                                            encoding_format="float")
        offline = llm.embed([{"prompt_token_ids": p} for p in (PROMPTS[1], PROMPTS[3])], use_tqdm=False)
        for data, output in zip(response.data, offline):
            assert len(data.embedding) == 48
            torch.testing.assert_close(torch.tensor(data.embedding), torch.tensor(output.outputs.embedding),
                                       atol=1e-6, rtol=1e-5)
        with pytest.raises(Exception, match="is an encoder"):
            client.completions.create(model=running.model_name, prompt="hi", max_tokens=2)
    finally:
        running.stop()


def test_a_dense_activation_pagedllm_does_not_know_is_refused_at_load(tmp_path):
    folder, _, _ = save_encoder(tmp_path / "m", [("2_Dense", 32, True, "torch.nn.modules.activation.Softplus")])
    with pytest.raises(ValueError, match="Dense activation torch.nn.modules.activation.Softplus is not supported"):
        LLM(model=str(folder), dtype="float32", num_kv_blocks=64)


def test_an_encoder_takes_a_pool_of_one_steps_slots(encoder):
    """No step reads another's K/V: by default its pool holds one step's prompts (the default budget of 2,048 tokens in
    blocks of 8, a partly filled block for each of 256 sequences, and the null block), not gigabytes."""
    _, hf_model, layers = encoder
    llm = LLM(model=str(encoder[0]), dtype="float32")
    assert llm.engine.config.cache.num_blocks == 2048 // 8 + 256 + 1
    outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS * 3], use_tqdm=False)
    for prompt, output in zip(PROMPTS * 3, outputs):
        torch.testing.assert_close(torch.tensor(output.outputs.embedding),
                                   _hf_embedding(hf_model, layers, prompt), atol=1e-5, rtol=1e-4)
