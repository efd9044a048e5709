"""Rotary embedding against transformers' rope init functions and apply_rotary_pos_emb."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagedllm.layers.rotary import compute_inv_freq, get_rope, rope_config

LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)


def _config(**rope) -> LlamaConfig:
    return LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072,
                       rope_parameters=rope or None)


def test_llama3_inv_freq_matches_transformers() -> None:
    config = _config(**LLAMA3)
    base, scaling = rope_config(config)
    assert base == 500000.0 and scaling["rope_type"] == "llama3"
    expected, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_scaling == 1.0
    torch.testing.assert_close(compute_inv_freq(128, base, scaling), expected, atol=0, rtol=1e-6)
    assert not torch.allclose(compute_inv_freq(128, base, None), expected)  # the scaling does something


@pytest.mark.parametrize("yarn", [dict(factor=4.0, original_max_position_embeddings=32768),   # Qwen's
                                  dict(factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                                       mscale_all_dim=0.707, beta_fast=32, beta_slow=1),  # DeepSeek's
                                  dict(factor=8.0, original_max_position_embeddings=8192, truncate=False,
                                       attention_factor=1.2)])
def test_yarn_inv_freq_and_attention_factor_match_transformers(yarn: dict) -> None:
    from pagedllm.layers.rotary import _yarn_attention_factor

    config = _config(rope_type="yarn", rope_theta=1000000.0, **yarn)
    base, scaling = rope_config(config)
    assert scaling is not None and scaling["rope_type"] == "yarn"
    expected, attention_scaling = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert torch.equal(compute_inv_freq(128, base, scaling), expected)
    assert _yarn_attention_factor(scaling) == attention_scaling
    rope = get_rope(128, 64, base, scaling)
    assert torch.equal(rope.cos_cache, LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(64)[None])[0][0])


def test_hunyuans_fixed_alpha_ntk_inv_freq_matches_transformers() -> None:
    from transformers import AutoConfig
    from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1RotaryEmbedding

    config = AutoConfig.for_model("hunyuan_v1_dense", hidden_size=512, num_attention_heads=4, head_dim=128,
                                  rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, alpha=1000.0,
                                                       factor=1.0))
    base, scaling = rope_config(config)
    assert scaling is not None and scaling["rope_type"] == "ntk_alpha"
    expected = HunYuanDenseV1RotaryEmbedding(config).inv_freq
    assert torch.equal(compute_inv_freq(128, base, scaling), expected)
    assert not torch.equal(compute_inv_freq(128, base, None), expected)


def test_default_inv_freq_matches_transformers() -> None:
    config = _config(rope_type="default", rope_theta=10000.0)
    base, scaling = rope_config(config)
    assert scaling is None
    expected = LlamaRotaryEmbedding(config).inv_freq
    assert torch.equal(compute_inv_freq(128, base, scaling), expected)


def test_old_style_config_fields() -> None:
    class Old:
        rope_theta = 1234.0
        rope_scaling = {"type": "linear", "factor": 2.0}
    base, scaling = rope_config(Old())
    assert base == 1234.0 and scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert rope_config(type("Plain", (), {})()) == (10000.0, None)


def test_unknown_rope_type_is_an_error() -> None:
    """Dynamic NTK that grows with the sequence (no fixed alpha) is not supported: an error naming it."""
    base, scaling = rope_config(_config(rope_type="dynamic", rope_theta=10000.0, factor=4.0))
    with pytest.raises(NotImplementedError, match="rope_type 'dynamic' is not supported"):
        get_rope(64, 16, base, scaling)


@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_apply_matches_transformers(scaling) -> None:
    head_dim, positions = 128, torch.tensor([0, 1, 7, 9000, 100000])
    config = _config(**(scaling or {"rope_type": "default", "rope_theta": 10000.0}))
    base, sc = rope_config(config)
    rope = get_rope(head_dim, config.max_position_embeddings, base, sc)
    q, k = torch.randn(5, 4, head_dim), torch.randn(5, 2, head_dim)
    q_rot, k_rot = rope(positions, q.clone(), k.clone())  # rotates in place
    inv_freq = LlamaRotaryEmbedding(config).inv_freq  # HF's own, default or llama3
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    eq, ek = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin(), unsqueeze_dim=1)  # q: [T, H, D]
    torch.testing.assert_close(q_rot, eq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_rot, ek, atol=1e-5, rtol=1e-5)
