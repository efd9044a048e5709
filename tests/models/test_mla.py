"""DeepSeek's multi-head latent attention (pagedllm.models.mla): its cache rows, the checkpoint tensors it skips,
its routers' groups of experts, and the configurations refused; its models against transformers run in
tests/models/test_moe.py (greedy tokens through chunks, prefix hits and preemption; bf16, int8, W8A8) and
test_llama_fidelity.py (logits)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.layers.moe import Routing, route
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.mla import mla_scale, rope_rows_to_halves
from pagedllm.runner.model_runner import model_shape
from tests.models.tiny import hf_greedy, save_tiny_model, tiny_config

PROMPT = [5, 17, 42, 99, 3, 250, 7]


def test_the_cache_holds_one_row_a_token_its_latent_and_rotary_key():
    """One row of kv_lora_rank + qk_rope_head_dim (32 + 8) a token a layer, for all four heads, where the config's
    head_dim is the rope's (8)."""
    config = tiny_config("deepseek-v2")
    assert config.head_dim == 8
    shape = model_shape(config)
    assert (shape.num_kv_heads, shape.head_dim) == (1, 40)


def test_yarns_mscale_scales_the_scores_and_interleaved_rows_go_to_halves():
    config = tiny_config("deepseek-v2")
    mscale = 0.1 * 0.707 * torch.log(torch.tensor(4.0)).item() + 1
    assert mla_scale(config) == pytest.approx(24 ** -0.5 * mscale * mscale)
    assert mla_scale(tiny_config("deepseek-v3")) == pytest.approx(24 ** -0.5)      # no rope scaling
    rows = torch.arange(2 * 6).float()      # two heads of 2 plain rows and 4 rotary ones
    assert rope_rows_to_halves(rows, 2, 2, 4).tolist() == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]


def test_v3s_multi_token_prediction_layers_are_not_read(tmp_path):
    """DeepSeek-V3's checkpoints hold a prediction layer after their last (model.layers.N, N = num_hidden_layers),
    which transformers ignores: so does the loader."""
    folder, model = save_tiny_model(tmp_path / "m", "deepseek-v3", seed=5)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.2.self_attn.kv_b_proj.weight"] = torch.zeros(4 * 32, 32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=4) as llm:
        tokens = llm.generate([{"prompt_token_ids": PROMPT}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens == hf_greedy(model, [PROMPT], 6)[0]


def test_what_latent_attention_models_refuse():
    """A rank's slice of the heads (the latent is every head's), and groups of experts that cannot give a token its
    experts."""
    with pytest.raises(ValueError, match="latent attention \\(DeepSeek's\\) runs on one rank"):
        LlamaForCausalLM(tiny_config("deepseek-v3"), tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="8 experts in 3 groups, 2 kept, cannot give a token 2 experts"):
        LlamaForCausalLM(tiny_config("deepseek-v3", **{**GROUPED["deepseek-v3"], "n_group": 3}))


# DeepSeek-V2's and V3's full-size routers (n_group 8, topk_group 3 and 4) in small: 8 experts in 4 groups of 2, a
# token's 2 chosen in its best group (V2's, a group scored by its best expert: in its best two, a token's best two
# experts always are) or among its 2 best groups (V3's, a group scored by its best two's sum)
GROUPED = {"deepseek-v2": dict(n_routed_experts=8, n_group=4, topk_group=1, topk_method="group_limited_greedy"),
           "deepseek-v3": dict(n_routed_experts=8, n_group=4, topk_group=2)}


@pytest.mark.parametrize("kind", ["deepseek-v2", "deepseek-v3"])
def test_a_router_chooses_among_its_best_groups_of_experts_as_transformers(kind):
    """`route` with DeepSeek's groups: transformers' router's experts and weights, token by token, where the same
    logits without the groups choose otherwise for some tokens."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = tiny_config(kind, **GROUPED[kind])
    router = (DeepseekV3TopkRouter if kind == "deepseek-v3" else DeepseekV2TopkRouter)(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        bias = router.e_score_correction_bias.uniform_(-0.3, 0.3) if kind == "deepseek-v3" else None
        logits, expected_weights, expected_ids = router(torch.randn(64, config.hidden_size))
    routing = Routing.of(config)
    assert (routing.groups, routing.kept_groups, routing.group_top2) == \
        (4, GROUPED[kind]["topk_group"], kind == "deepseek-v3")
    weights, ids = route(logits, routing, bias)
    order, expected_order = ids.argsort(dim=-1), expected_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), expected_ids.gather(1, expected_order))
    torch.testing.assert_close(weights.gather(1, order), expected_weights.gather(1, expected_order))
    ungrouped = route(logits, dataclasses.replace(routing, groups=1, kept_groups=1), bias)[1].sort(dim=-1).values
    assert not torch.equal(ungrouped, ids.sort(dim=-1).values)


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("kind", ["deepseek-v2", "deepseek-v3"])
def test_a_model_with_groups_of_experts_gives_transformers_greedy_tokens(tmp_path, kind, kernels, monkeypatch):
    """The grouped routers in a model, through the C++ kernels' MoEWeights and the torch modules."""
    if not kernels:
        monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
    folder, model = save_tiny_model(tmp_path / "m", kind, seed=5, **GROUPED[kind])
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [PROMPT, [200, 13, 9, 77, 150, 151, 40, 41, 42, 8] * 2]
    with LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=4) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model, prompts, 8)


@pytest.mark.parametrize("kind", ["deepseek-v2", "deepseek-v3"])
def test_a_quantized_deepseek2_gguf_keeps_its_blocks_rotary_rows_reordered(tmp_path, kind, monkeypatch):
    """llama.cpp's `deepseek2` files (its absorbed layout: kv_b_proj split by head): their q and kv_a rows, the
    rotary ones interleaved, reordered into halves as whole rows of Q8_0 blocks, which stay packed: the dequantised
    model within the 16-bit activations' noise."""
    from gguf import GGMLQuantizationType as Q

    from pagedllm.config import ModelConfig
    from pagedllm.loader import load_model
    from tests.loader.test_gguf import _assert_gguf_reference_near_the_dense_model, write_model_gguf
    from tests.models.tiny import build_tiny_hf_model

    path = tmp_path / f"{kind}-q8.gguf"
    ranks = dict(q_lora_rank=64) if kind == "deepseek-v3" else {}     # (whole blocks of 32 along its input)
    write_model_gguf(build_tiny_hf_model(kind, 5, **ranks), path, "deepseek2", Q.Q8_0)
    packed = load_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf")).model
    dense = load_model(ModelConfig(model=str(path), dtype="float32")).model
    attention = packed.model.layers[0].self_attn
    assert (attention.q_proj or attention.q_b_proj).weight.dtype == torch.uint8
    assert attention.kv_a_proj_with_mqa.weight.dtype == torch.uint8
    _assert_gguf_reference_near_the_dense_model(packed, dense, PROMPT, monkeypatch)
