"""Weight-name mapping: fused q/k/v and gate/up, ignored buffers, clear errors; the registry."""

from __future__ import annotations

import pytest
import torch

from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.registry import get_model_class, model_class_for_config
from tests.models.tiny import build_tiny_hf_model, tiny_config


def _hf_weights(kind: str) -> dict[str, torch.Tensor]:
    return dict(build_tiny_hf_model(kind).state_dict())


def test_fused_qkv_and_gate_up_hold_the_checkpoint_rows() -> None:
    weights = _hf_weights("qwen2")
    model = LlamaForCausalLM(tiny_config("qwen2"))
    model.load_weights(list(weights.items()) + [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4))])
    attn = model.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split([attn.qkv_proj.q_size, attn.qkv_proj.kv_size, attn.qkv_proj.kv_size])
    assert torch.equal(q, weights["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(v, weights["model.layers.1.self_attn.v_proj.weight"])
    qb, kb, _ = attn.qkv_proj.bias.split([attn.qkv_proj.q_size, attn.qkv_proj.kv_size, attn.qkv_proj.kv_size])
    assert torch.equal(kb, weights["model.layers.1.self_attn.k_proj.bias"])
    gate, up = model.model.layers[0].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(up, weights["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(model.lm_head.weight, weights["lm_head.weight"])  # qwen2 tiny model is untied


def test_tied_embeddings_share_one_tensor() -> None:
    model = LlamaForCausalLM(tiny_config("llama-gqa"))
    model.load_weights(_hf_weights("llama-gqa").items())  # may include lm_head.weight: skipped
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_unknown_name_is_an_error() -> None:
    model = LlamaForCausalLM(tiny_config("llama-gqa"))
    weights = list(_hf_weights("llama-gqa").items()) + [("model.layers.0.self_attn.q_norm.weight", torch.ones(4))]
    with pytest.raises(KeyError, match="q_norm"):
        model.load_weights(weights)


def test_a_zero_bias_for_a_layer_without_one_is_skipped_and_any_other_refused() -> None:
    """AutoGPTQ checkpoints hold a zero bias for every quantized layer, biased or not: it is no bias."""
    model = LlamaForCausalLM(tiny_config("llama-gqa"))
    weights = list(_hf_weights("llama-gqa").items())
    loaded = model.load_weights(weights + [("model.layers.0.self_attn.k_proj.bias", torch.zeros(32)),
                                           ("model.layers.1.mlp.down_proj.bias", torch.zeros(64))])
    assert not any(name.endswith(".bias") for name in loaded)
    with pytest.raises(KeyError, match="down_proj.bias"):
        model.load_weights(weights + [("model.layers.1.mlp.down_proj.bias", torch.full((64,), 0.5))])


def test_missing_parameters_are_an_error() -> None:
    model = LlamaForCausalLM(tiny_config("llama-gqa"))
    weights = [(n, t) for n, t in _hf_weights("llama-gqa").items() if ".k_proj." not in n and "norm" not in n]
    with pytest.raises(ValueError, match=r"qkv_proj.weight#k"):
        model.load_weights(weights)


def test_shape_mismatch_is_an_error() -> None:
    model = LlamaForCausalLM(tiny_config("llama-gqa"))
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.ones(3))])


def test_registry() -> None:
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "llama", "mistral", "qwen2",
                 "GPT2LMHeadModel", "PhiForCausalLM", "starcoder2", "BloomForCausalLM", "MPTForCausalLM"):
        assert get_model_class(name) is LlamaForCausalLM
    assert model_class_for_config(tiny_config("qwen2")) is LlamaForCausalLM
    with pytest.raises(ValueError, match="supported: .*LlamaForCausalLM"):
        get_model_class("RwkvForCausalLM")
