from __future__ import annotations

import pytest

from pagedllm.bench.args import parse_bytes
from pagedllm.bench.datasets import BenchRequest
from pagedllm.bench.measure import KVWaste, ModelDims, static_batch_kv_waste, useful_flops


def test_useful_flops_counts_layers_lm_head_and_attention():
    from tests.models.tiny import tiny_config

    # one layer of hidden 4: 2 query heads and 1 KV head of 2
    dims = ModelDims.from_hf_config(tiny_config("llama-gqa", num_hidden_layers=1, hidden_size=4, num_attention_heads=2,
                                                num_key_value_heads=1, head_dim=2, intermediate_size=8, vocab_size=10))
    assert dims.num_layer_params == 4 * 2 * (2 * 2 + 2 * 1) + 3 * 4 * 8
    # prompt 2, output 2: 3 tokens fed, 2 logits, keys seen 1 + 2 + 3.
    expected = 2 * dims.num_layer_params * 3 + 2 * 4 * 10 * 2 + 4 * 1 * 2 * 2 * 6
    assert useful_flops(dims, [BenchRequest([1, 2], 2)]) == expected


def test_a_mixture_of_experts_counts_the_experts_a_token_runs():
    from tests.models.tiny import tiny_config

    dense = ModelDims.from_hf_config(tiny_config("qwen3"))
    assert dense.intermediate_size == 128
    # 2 of 4 experts of 48, and Qwen2-MoE's shared expert of 96
    assert ModelDims.from_hf_config(tiny_config("qwen3-moe")).intermediate_size == 2 * 48
    assert ModelDims.from_hf_config(tiny_config("qwen2-moe")).intermediate_size == 2 * 48 + 96
    assert ModelDims.from_hf_config(tiny_config("mixtral")).intermediate_size == 2 * 128
    # ERNIE 4.5's two shared experts of 48 as one, Granite 4's shared MLP of 96
    assert ModelDims.from_hf_config(tiny_config("ernie4_5-moe")).intermediate_size == 2 * 48 + 2 * 48
    assert ModelDims.from_hf_config(tiny_config("granitemoeshared")).intermediate_size == 2 * 48 + 96


def test_latent_attention_counts_its_projections_and_its_heads_widths():
    """DeepSeek-V2-Lite's layout in small (hidden 64, 4 heads of 16 + 8 for q . k and 16 for p . v, a latent of 32,
    queries straight from x) and V3's (queries through a latent of 48); its experts: 2 of 48 and a shared one of 48."""
    from tests.models.tiny import tiny_config

    v2, v3 = (ModelDims.from_hf_config(tiny_config(kind)) for kind in ("deepseek-v2", "deepseek-v3"))
    kv = 64 * (32 + 8) + 32 * 4 * (16 + 16) + 4 * 16 * 64     # kv_a_proj_with_mqa, kv_b_proj, o_proj
    assert v2.attention_params == 64 * 4 * 24 + kv
    assert v3.attention_params == 64 * 48 + 48 * 4 * 24 + kv
    assert v2.key_width == v3.key_width == 4 * (24 + 16)
    assert v2.intermediate_size == 2 * 48 + 48


def test_an_ungated_mlp_counts_two_matrices():
    from tests.models.tiny import tiny_config

    gated, opt = ModelDims.from_hf_config(tiny_config("llama-gqa")), ModelDims.from_hf_config(tiny_config("opt"))
    assert (gated.intermediate_size, gated.mlp_matrices) == (opt.intermediate_size, opt.mlp_matrices + 1) == (128, 3)
    # 2 layers of q/k/v/o (4 heads of 16 each) and fc1/fc2 (64 x 128)
    assert opt.num_layer_params == 2 * (4 * 64 * 64 + 2 * 64 * 128)


def test_static_batch_kv_waste_counts_padding_and_overrun():
    # One batch: prompts 3 and 1, outputs 2 and 1. Step 1: 2 x 4 slots hold 4 + 2; step 2: 2 x 5 hold 5 + 2.
    waste = static_batch_kv_waste([BenchRequest([1, 2, 3], 2), BenchRequest([1], 1)], batch_size=2)
    assert (waste.num_steps, waste.total_allocated_slots, waste.total_waste_slots) == (2, 18, 5)
    assert waste.waste_pct == pytest.approx(100 * 5 / 18)
    assert static_batch_kv_waste([BenchRequest([1], 3)] * 2, batch_size=1).waste_pct == 0


def test_kv_waste_empty():
    assert KVWaste().waste_pct == 0 and KVWaste().mean_waste_slots == 0


@pytest.mark.parametrize("text, value", [("1024", 1024), ("4G", 4 << 30), ("512MiB", 512 << 20), ("1.5k", 1536)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_a_hybrids_mamba_layers_count_their_projections():
    """granite-4.0-h's layout in small: two Mamba-2 layers (in_proj of 2 x 128 + 2 x 16 + 4 rows: gate, x, one group's
    B and C, dt; out_proj 128 wide) and one attention layer, their mean per layer; keys only in the attention layer."""
    from tests.models.tiny import tiny_config

    dims = ModelDims.from_hf_config(tiny_config("granite4-hybrid-dense"))
    mixer = 64 * (2 * 128 + 2 * 16 + 4) + 128 * 64
    attention = 64 * 16 * (2 * 4 + 2 * 2)
    assert dims.attention_params == (2 * mixer + attention) // 3
    assert dims.key_width == 2 * 4 * 16 // 3



def test_a_gated_deltanet_hybrid_counts_its_projections_and_output_gate():
    """Qwen3.5's layout in small: two Gated DeltaNet layers (in_proj of 2 x 32 key rows, 2 x 64 value rows for v and
    z, 2 x 4 rows for b and a; out_proj 64 wide) and one attention layer whose q_proj gives an output gate as wide as
    its queries, their mean per layer; keys only in the attention layer."""
    from tests.models.tiny import tiny_config

    dims = ModelDims.from_hf_config(tiny_config("qwen3.5"))
    mixer = 64 * (2 * 32 + 2 * 64 + 2 * 4) + 64 * 64
    attention = 64 * 32 * (2 * 4 + 2 * 2) + 64 * 4 * 32
    assert dims.attention_params == (2 * mixer + attention) // 3
    assert dims.key_width == 2 * 4 * 32 // 3
