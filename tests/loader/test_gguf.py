"""GGUF reading: header parsing against gguf.GGUFReader, every tensor type, the llama Q/K permutation, and
whole tiny models written as GGUF files compared with transformers."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from pagedllm.config import ModelConfig
from pagedllm.layers.gguf import PACKED_GGUF_TYPES, dequantize_gguf_packed, pack_gguf_weight, packed_type
from pagedllm.layers.rotary import interleaved_to_halves
from pagedllm.loader import load_model
from pagedllm.loader.gguf import (
    GGUFFile,
    gguf_block_rows,
    gguf_hf_config,
    gguf_to_hf_name,
    iterate_gguf,
    scaled_blocks,
)
from pagedllm.loader.pooling_config import model_pooling_type, sentence_transformers_projector
from pagedllm.loader.resolve import resolve_model
from pagedllm.models.llama import _intermediate_size
from tests.models.tiny import SimplePagedRunner, build_tiny_hf_model, use_gguf_reference

QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
RAW_ONLY = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K]  # no Python quantizer: random bytes, checked vs GGUFReader


def _encode(x: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype == Q.F32:
        return x
    if qtype in RAW_ONLY:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (x.shape[0], x.shape[1] // block_size * type_size), dtype=np.uint8)
        return raw
    return quantize(x, qtype)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random K-quant bytes hold NaN/inf f16 scales
def test_every_tensor_type_matches_gguf_reader(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    originals = {}
    for qtype in QUANTIZABLE + RAW_ONLY:
        x = rng.standard_normal((3, 512)).astype(np.float32)
        originals[qtype.name] = x
        data = _encode(x, qtype, rng)
        writer.add_tensor(qtype.name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = GGUFFile(path)
    assert ours.metadata["tokenizer.ggml.tokens"] is None  # string arrays skipped
    assert GGUFFile(path, keep_string_arrays=True).metadata["tokenizer.ggml.tokens"] == ["a", "bb", "ccc"]
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == t.tensor_type and info.offset == t.data_offset
        got = ours.read_tensor(info).float()
        expected = torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32))
        assert got.shape == (3, 512)
        torch.testing.assert_close(got, expected, atol=0, rtol=0, equal_nan=True)
        if t.tensor_type in QUANTIZABLE:  # and the round trip is close to the original
            err = (got - torch.from_numpy(originals[t.name])).abs().max().item()
            assert err < 0.35, (t.name, err)


_PERMUTED = ("llama", "smollm3", "granite", "granitemoe", "arcee", "olmo")    # whose Q/K rows the converter permutes


# The LayerNorm models' architectures -> their configs' field for its epsilon (the others' RMSNorms: rms_norm_eps)
_LAYER_NORM_EPS = {"stablelm": "layer_norm_eps", "phi2": "layer_norm_eps", "gptneox": "layer_norm_eps",
                   "command-r": "layer_norm_eps", "cohere2": "layer_norm_eps", "starcoder2": "norm_epsilon",
                   "nemotron": "norm_eps", "starcoder": "layer_norm_epsilon", "gpt2": "layer_norm_epsilon",
                   "bloom": "layer_norm_epsilon", "falcon": "layer_norm_epsilon", "mpt": "layer_norm_epsilon"}


def _permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """convert_hf_to_gguf.LlamaModel.permute, verbatim in torch."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    q, k = torch.randn(4 * 8, 16), torch.randn(2 * 8, 16)
    assert torch.equal(interleaved_to_halves(_permute(q, 4, 4), 4), q)
    assert torch.equal(interleaved_to_halves(_permute(k, 4, 2), 2), k)
    assert not torch.equal(_permute(q, 4, 4), q)


def test_name_mapping() -> None:
    assert gguf_to_hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert gguf_to_hf_name("blk.1.attn_k.bias") == "model.layers.1.self_attn.k_proj.bias"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    assert gguf_to_hf_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"    # Qwen3
    assert gguf_to_hf_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    # Gemma 3's norm before the MLP and its branches' output norms
    assert gguf_to_hf_name("blk.2.ffn_norm.weight", "gemma3") == "model.layers.2.pre_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.2.post_attention_norm.weight", "gemma3") == \
        "model.layers.2.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.2.post_ffw_norm.weight", "gemma3") == "model.layers.2.post_feedforward_layernorm.weight"
    with pytest.raises(KeyError, match="post_ffw_norm"):
        gguf_to_hf_name("blk.2.post_ffw_norm.weight")
    with pytest.raises(KeyError, match="blk.0.attn_sinks"):
        gguf_to_hf_name("blk.0.attn_sinks.weight")


def _gguf_tensors(hf_model, arch: str):
    """(GGUF name, tensor) of a transformers model's weights, named by gguf's own tensor name map (llama.cpp's
    converter's), the experts of a layer stacked [experts, rows, K] (transformers keeps gate and up stacked
    together), the shared expert's gate flattened to [H], ERNIE's and LFM2-MoE's selection biases to [E] as
    `exp_probs_b.bias`."""
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    arch_names = gguf.get_tensor_name_map(model_arch, hf_model.config.num_hidden_layers)
    llama_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, hf_model.config.num_hidden_layers)

    def gguf_name(hf_name: str) -> str:     # llama's for the tiny Qwen2-MoE's dense MLP, which real ones lack; some
        return (arch_names.get_name(hf_name) or llama_names.get_name(hf_name) or    # of BLOOM's without their prefix
                arch_names.get_name(hf_name.removeprefix("transformer.")))

    gpt_oss = hf_model.config.model_type == "gpt_oss"
    for name, t in hf_model.state_dict().items():
        base, kind = name.rsplit(".", 1)
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if gpt_oss and ".mlp.experts." in name:     # [E, in, out] (biases [E, out]), gate and up interleaved: as
            t = t if name.endswith("_bias") else t.transpose(1, 2)     # llama.cpp's converter splits them
            suffix = "bias" if name.endswith("_bias") else "weight"
            if "gate_up_proj" in name:
                yield f"blk.{layer}.ffn_gate_exps.{suffix}", t[:, 0::2].contiguous()
                yield f"blk.{layer}.ffn_up_exps.{suffix}", t[:, 1::2].contiguous()
            else:
                yield f"blk.{layer}.ffn_down_exps.{suffix}", t.contiguous()
        elif gpt_oss and kind == "sinks":
            yield f"blk.{layer}.attn_sinks.weight", t
        elif name.endswith("self_attn.kv_b_proj.weight"):     # DeepSeek's, split by head as llama.cpp's converter
            cfg = hf_model.config                                   # writes it: each head's key rows transposed
            heads = t.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
            yield f"blk.{layer}.attn_k_b.weight", heads[:, :cfg.qk_nope_head_dim].transpose(1, 2).contiguous()
            yield f"blk.{layer}.attn_v_b.weight", heads[:, cfg.qk_nope_head_dim:].contiguous()
        elif kind == "e_score_correction_bias" and hf_model.config.model_type == "deepseek_v3":
            yield f"blk.{layer}.exp_probs_b.bias", t
        elif name.endswith("experts.gate_up_proj"):      # stacked experts' names have no .weight (nor a map entry)
            layer = name.split(".")[2]      # (of model.layers.{layer}. names)
            gate, up = t.chunk(2, dim=1)
            yield f"blk.{layer}.ffn_gate_exps.weight", gate.contiguous()
            yield f"blk.{layer}.ffn_up_exps.weight", up.contiguous()
        elif name.endswith("experts.down_proj"):
            yield f"blk.{name.split('.')[2]}.ffn_down_exps.weight", t
        elif base.endswith("shared_mlp.input_linear"):      # Granite 4's shared MLP, gate and up fused: the
            gate, up = t.chunk(2)                           # shared expert beside experts, else the MLP
            shared = "_shexp" if getattr(hf_model.config, "num_local_experts", 0) else ""
            yield f"blk.{layer}.ffn_gate{shared}.{kind}", gate
            yield f"blk.{layer}.ffn_up{shared}.{kind}", up
        elif base.endswith("shared_mlp.output_linear") and not hf_model.config.num_local_experts:
            yield f"blk.{layer}.ffn_down.{kind}", t
        elif ".mamba." in name:     # a Mamba-2 layer's, as llama.cpp's converter writes them (A = -exp(A_log))
            mamba = {"dt_bias": ("ssm_dt.bias", t), "A_log": ("ssm_a", -t.exp()[:, None]), "D": ("ssm_d", t[:, None]),
                     "weight": None, "bias": None}[kind]
            if mamba is not None:
                yield f"blk.{layer}.{mamba[0]}", mamba[1]
            elif base.endswith(".conv1d"):
                yield f"{gguf_name(base)}.{kind}", t.squeeze(1) if kind == "weight" else t
            elif base.endswith(".norm"):
                groups = hf_model.config.mamba_n_groups
                yield f"{gguf_name(base)}.{kind}", t.view(groups, -1)
            else:
                yield f"{gguf_name(base)}.{kind}", t
        elif base.endswith("block_sparse_moe.router"):     # Granite MoE's, router.layer in its checkpoints
            yield f"{gguf_name(base + '.layer')}.{kind}", t
        elif base.endswith("mlp.shared_expert_gate"):
            yield f"{gguf_name(base)}.{kind}", t[0]
        elif kind == "e_score_correction_bias":      # (its module is the router's in transformers, not in gguf's map)
            yield gguf_name(base.replace(".gate.moe_statics", ".moe_statics.e_score_correction")) + ".bias", t[0]
        elif kind == "expert_bias":     # LFM2-MoE's, a parameter of its MoE block
            yield f"{gguf_name(name)}.bias", t
        else:
            yield f"{gguf_name(base)}.{kind}", t


def write_model_gguf(hf_model, path: Path, arch: str, qtype: Q = Q.F32, eot_token_id: int | None = None,
                     dense: tuple[torch.Tensor, ...] = (), tokens: list[str] | None = None,
                     merges: list[str] | None = None) -> None:
    """What llama.cpp's converter does, in miniature: metadata, renamed tensors, Q/K permuted for llama, Gemma's
    norms stored as the 1 + w they scale by, its global layers' rope and its window (EmbeddingGemma's as its
    config.json holds it, with its mean pooling and its `dense` layers' weights)."""
    cfg = hf_model.config
    # (StarCoder's learned positions: no rope, whose base the converter writes anyway)
    rope_parameters = getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    rope = rope_parameters.get("full_attention", rope_parameters)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_feed_forward_length(_intermediate_size(cfg))     # (LFM2's adjusted, GPT-2's n_inner, BLOOM's 4 x hidden)
    if arch in ("lfm2", "lfm2moe"):     # its convolution layers with no KV heads
        w.add_head_count_kv([0 if t == "conv" else cfg.num_key_value_heads for t in cfg.layer_types])
        w.add_shortconv_l_cache(cfg.conv_L_cache)
    elif arch == "granitehybrid":     # its Mamba-2 layers with no KV heads, their widths; no rope (NoPE)
        w.add_head_count_kv([0 if t == "linear_attention" else cfg.num_key_value_heads for t in cfg.layer_types])
        w.add_ssm_conv_kernel(cfg.mamba_d_conv)
        w.add_ssm_state_size(cfg.mamba_d_state)
        w.add_ssm_group_count(cfg.mamba_n_groups)
        w.add_ssm_inner_size(cfg.mamba_n_heads * cfg.mamba_d_head)
        w.add_ssm_time_step_rank(cfg.mamba_n_heads)
        w.add_rope_scaling_finetuned(cfg.position_embedding_type == "rope")
    elif arch == "deepseek2":   # its latent attention as llama.cpp's absorbed layout writes it: one KV head of the
        w.add_head_count_kv(1)  # latent and rotary key, the per-head widths under *_mla
        w.add_kv_lora_rank(cfg.kv_lora_rank)
        if cfg.q_lora_rank:
            w.add_q_lora_rank(cfg.q_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if cfg.model_type == "deepseek_v3" else
                                 gguf.ExpertGatingFuncType.SOFTMAX)
        if rope.get("mscale_all_dim"):
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    else:   # (GPT-BigCode's one KV head, or one a query head)
        w.add_head_count_kv(getattr(cfg, "num_key_value_heads", None) or
                            (1 if getattr(cfg, "multi_query", False) else cfg.num_attention_heads))
    if rope["rope_type"] == "dynamic":   # Hunyuan's fixed NTK alpha: its base stretched, as the converter writes it
        head_dim = cfg.head_dim
        w.add_rope_freq_base(rope["rope_theta"] * rope["alpha"] ** (head_dim / (head_dim - 2)))
    else:
        w.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch in ("gemma2", "gemma3", "gpt-oss"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma-embedding":      # transformers reads config.json's W as W // 2 + 1; the file holds W
        w.add_sliding_window((cfg.sliding_window - 1) * 2)
        w.add_pooling_type(gguf.PoolingType.MEAN)
        for name, weight in zip(("dense_2.weight", "dense_3.weight"), dense):
            w.add_tensor(name, weight.numpy())
    if arch in ("qwen2vl", "qwen3vl", "qwen3vlmoe"):     # the Qwen-VLs' M-RoPE sections; Qwen3-VL's DeepStack depth
        w.add_rope_dimension_sections([2, 3, 3, 0] if arch == "qwen2vl" else [6, 5, 5, 0])
        if arch != "qwen2vl":
            w.add_num_deepstack_layers(3)
    if arch == "exaone4" or (arch == "olmo2" and getattr(cfg, "sliding_window", None)):     # (OLMo 3's)
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if arch in ("granite", "granitemoe", "granitehybrid"):
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if arch in ("stablelm", "gptneox"):
        w.add_parallel_residual(cfg.use_parallel_residual)
    if arch in ("command-r", "cohere2"):
        w.add_logit_scale(cfg.logit_scale)
    if arch == "olmo" and cfg.clip_qkv is not None:
        w.add_clamp_kqv(cfg.clip_qkv)
    if arch == "mpt":   # its ALiBi's bias bound and its q/k/v's clamp
        w.add_max_alibi_bias(cfg.attn_config.alibi_bias_max)
        if cfg.attn_config.clip_qkv is not None:
            w.add_clamp_kqv(cfg.attn_config.clip_qkv)
    if arch == "cohere2":   # its window; its layers' pattern llama.cpp's fixed one (every fourth global), unwritten
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch in _LAYER_NORM_EPS:
        w.add_layer_norm_eps(getattr(cfg, _LAYER_NORM_EPS[arch]))
    else:
        w.add_layer_norm_rms_eps(cfg.norm_eps if arch in ("lfm2", "lfm2moe") else cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if rope["rope_type"] == "longrope":     # Phi-3's: the factors as tensors, the original context and the scale
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        original = rope["original_max_position_embeddings"]
        factor = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim if arch == "deepseek2" else head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if tokens is not None:     # a byte-level BPE vocabulary (`tokens`: each id's) and its merges
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<") else gguf.TokenType.NORMAL for t in tokens])
        w.add_token_merges(merges or [])
    if eot_token_id is not None:
        w.add_eot_token_id(eot_token_id)
    if getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None):
        w.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None) or arch == "gpt-oss":
            w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
        shared = getattr(cfg, "shared_expert_intermediate_size", None) or getattr(cfg, "shared_intermediate_size", None)
        if shared:
            w.add_expert_shared_feed_forward_length(shared)
    if arch == "ernie4_5-moe":      # as llama.cpp's converter writes it (its shared experts' width its own reckoning)
        w.add_interleave_moe_layer_step(cfg.moe_layer_interval)
        w.add_leading_dense_block_count(cfg.moe_layer_start_index)
        w.add_expert_shared_count(cfg.moe_num_shared_experts)
        w.add_expert_shared_feed_forward_length(cfg.intermediate_size // cfg.num_key_value_heads)
    if arch == "lfm2moe":       # its dense layers first, its experts scored by sigmoids
        w.add_leading_dense_block_count(cfg.num_dense_layers)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    for gname, t in _gguf_tensors(hf_model, arch):
        if gname == "output.weight" and cfg.tie_word_embeddings:
            continue
        if arch in _PERMUTED and ".attn_q." in gname:
            t = _permute(t, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch in _PERMUTED and ".attn_k." in gname:
            t = _permute(t, cfg.num_attention_heads, cfg.num_key_value_heads)
        elif arch in ("gemma", "gemma2", "gemma3", "gemma-embedding", "nemotron") and gname.endswith("norm.weight"):
            t = t + 1
        elif arch in ("lfm2", "lfm2moe") and gname.endswith("shortconv.conv.weight"):
            t = t.squeeze(1)
        elif arch == "gpt2" and gname.startswith("blk.") and gname.endswith(".weight") and t.dim() == 2:
            t = t.t().contiguous()     # Conv1D's [in, out] as nn.Linear's [out, in], as the converter writes it
        elif arch == "falcon" and ".attn_qkv." in gname:   # each KV head's group -> q's rows, k's, v's
            kv_heads = cfg.num_key_value_heads
            groups = t.unflatten(0, (kv_heads, cfg.num_attention_heads // kv_heads + 2, -1))
            t = torch.cat([groups[:, :-2].flatten(0, 2), groups[:, -2].flatten(0, 1), groups[:, -1].flatten(0, 1)])
        elif arch in ("gptneox", "bloom") and ".attn_qkv." in gname:    # head by head -> q's rows, k's, v's
            t = t.unflatten(0, (cfg.num_attention_heads, 3, -1)).transpose(0, 1).flatten(0, 2)
        data = t.numpy()
        if arch == "gpt-oss" and gname.endswith("_exps.weight"):    # its experts as released: MXFP4
            w.add_tensor(gname, quantize(data, Q.MXFP4), raw_dtype=Q.MXFP4)
        # llama.cpp keeps routers, and rows too short for a block (LFM2's convolution taps), as they are
        elif qtype != Q.F32 and t.dim() >= 2 and ".ffn_gate_inp." not in gname and t.shape[-1] % 32 == 0 and \
                not gname.endswith(("ssm_norm.weight", "ssm_a", "ssm_d")):
            w.add_tensor(gname, _quantize_q4_k(data) if qtype == Q.Q4_K else quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind,arch", [("llama-gqa", "llama"), ("llama-untied", "llama"), ("qwen2", "qwen2"),
                                       ("qwen2-yarn", "qwen2"),
                                       ("qwen3", "qwen3"), ("mixtral", "llama"), ("qwen2-moe", "qwen2moe"),
                                       ("qwen3-moe", "qwen3moe"), ("qwen2", "qwen2vl"), ("qwen3", "qwen3vl"),
                                       ("qwen3-moe", "qwen3vlmoe"), ("smollm3", "smollm3"), ("granite", "granite"),
                                       ("granitemoe", "granitemoe"), ("granitemoeshared", "granitemoe"),
                                       ("olmoe", "olmoe"), ("cohere", "command-r"),
                                       ("arcee", "arcee"), ("hunyuan", "hunyuan-dense"),
                                       ("seed-oss", "seed_oss"), ("nemotron", "nemotron"),
                                       ("gpt-bigcode", "starcoder"), ("gpt-bigcode-mha", "starcoder"), ("gpt2", "gpt2"),
                                       ("bloom", "bloom"), ("falcon", "falcon"), ("falcon-new", "falcon"),
                                       ("mpt", "mpt"), ("olmo", "olmo"),
                                       ("lfm2", "lfm2"), ("lfm2-moe", "lfm2moe"), ("olmo2", "olmo2"),
                                       ("exaone4", "exaone4"),
                                       ("ernie4_5", "ernie4_5"), ("ernie4_5-moe", "ernie4_5-moe"), ("glm4", "glm4"),
                                       ("stablelm", "stablelm"),
                                       ("stablelm-parallel", "stablelm"), ("starcoder2", "starcoder2"),
                                       ("phi", "phi2"), ("gpt-neox", "gptneox"), ("gpt-neox-sequential", "gptneox"),
                                       ("deepseek-v2", "deepseek2"), ("deepseek-v3", "deepseek2"),
                                       ("gemma", "gemma"), ("granite4-hybrid", "granitehybrid"),
                                       ("granite4-hybrid-dense", "granitehybrid")])
def test_tiny_gguf_model_matches_transformers(tmp_path: Path, kind: str, arch: str) -> None:
    # SmolLM3's files leave every fourth layer without a rotary embedding (llama.cpp's fixed step): four layers here;
    # ERNIE 4.5 MoE's (and Falcon 40B's) without biases, as llama.cpp reads their files; LFM2-MoE's experts unscaled, as
    # llama.cpp runs them; MPT's scores scaled by head_dim ** -0.5 (its files hold no softmax_scale)
    overrides = {"smollm3": {"no_rope_layer_interval": 4, "num_hidden_layers": 4}, "ernie4_5-moe": {"use_bias": False},
                 "lfm2-moe": {"routed_scaling_factor": 1.0}, "falcon-new": {"bias": False},
                 "mpt": {"attn_config": {"clip_qkv": 0.3}}}
    hf_model = build_tiny_hf_model(kind, **overrides.get(kind, {}))
    path = tmp_path / f"{kind}.gguf"
    write_model_gguf(hf_model, path, arch)
    config = gguf_hf_config(GGUFFile(path))
    assert config.model_type == hf_model.config.model_type.replace("llama", arch) and \
        config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    assert config.num_key_value_heads == \
        (getattr(hf_model.config, "num_key_value_heads", None) or hf_model.config.num_attention_heads)
    assert getattr(config, "no_rope_layers", None) == getattr(hf_model.config, "no_rope_layers", None)
    model = load_model(ModelConfig(model=str(path), dtype="float32")).model
    prompt = [1, 17, 250, 9, 33, 70, 5, 80, 81]
    logits = SimplePagedRunner(model).step({0: prompt})
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


# Gemma 3 as llama.cpp's files hold it: every sixth layer global (its fixed pattern), the local layers' rotary base
# 10,000, queries scaled by head_dim ** -0.5; the global layers' rope plain (1B) or scaled (4B and up: linear, 8x)
_GEMMA3_LAYERS = dict(num_hidden_layers=6, query_pre_attn_scalar=32,
                      layer_types=["sliding_attention"] * 5 + ["full_attention"])
_LOCAL_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _assert_greedy_steps_follow_transformers(path: Path, hf_model) -> None:
    """The file's model over a 30-token prompt, past a window of 12 (its local layers see their last 12), then three
    greedy steps: each step's logits transformers', within float32's noise."""
    runner = SimplePagedRunner(load_model(ModelConfig(model=str(path), dtype="float32")).model)
    tokens = [(7 * i + 3) % 300 for i in range(30)]
    logits = runner.step({0: tokens})
    for _ in range(3):
        with torch.inference_mode():
            expected = hf_model(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)
        tokens.append(int(expected.argmax()))
        logits = runner.step({0: tokens[-1:]})


@pytest.mark.parametrize("global_rope", [{"rope_type": "default", "rope_theta": 1e6},
                                         {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}],
                         ids=["1b", "4b-rope-scaled"])
def test_a_gemma3_gguf_matches_transformers_past_its_window(tmp_path: Path, global_rope: dict) -> None:
    hf_model = build_tiny_hf_model("gemma3", **_GEMMA3_LAYERS,
                                   rope_parameters={"full_attention": global_rope, "sliding_attention": _LOCAL_ROPE})
    path = tmp_path / "gemma3.gguf"
    write_model_gguf(hf_model, path, "gemma3", eot_token_id=5)
    config = gguf_hf_config(GGUFFile(path))
    assert config.model_type == "gemma3_text" and config.layer_types == hf_model.config.layer_types
    assert config.sliding_window == 12 and config.eos_token_id == [2, 5]
    norm = "model.layers.3.pre_feedforward_layernorm.weight"
    torch.testing.assert_close(dict(iterate_gguf(path))[norm], hf_model.state_dict()[norm])    # w, not 1 + w
    _assert_greedy_steps_follow_transformers(path, hf_model)


@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}],
                         ids=["7b", "32b-yarn"])
def test_an_olmo3_gguf_matches_transformers_past_its_window(tmp_path: Path, rope: dict | None) -> None:
    """OLMo 3 as llama.cpp's converter writes it: an `olmo2` file with a window and the layers it covers; its rope
    (a YaRN's in the 32B) its global layers', the local ones' plain, as transformers runs them."""
    hf_model = build_tiny_hf_model("olmo3", **({} if rope is None else {"rope_scaling": rope}))
    path = tmp_path / "olmo3.gguf"
    write_model_gguf(hf_model, path, "olmo2")
    config = gguf_hf_config(GGUFFile(path))
    assert config.model_type == "olmo3" and config.layer_types == hf_model.config.layer_types
    assert config.sliding_window == 12
    assert config.rope_parameters["sliding_attention"]["rope_type"] == "default"
    assert config.rope_parameters["full_attention"]["rope_type"] == ("default" if rope is None else "yarn")
    _assert_greedy_steps_follow_transformers(path, hf_model)


def test_a_cohere2_gguf_matches_transformers_past_its_window(tmp_path: Path) -> None:
    """Command R7B as llama.cpp's converter writes it (`cohere2`): its window, and no pattern of its layers, which
    llama.cpp fixes (three local layers, then a global one without a rotary embedding)."""
    hf_model = build_tiny_hf_model("cohere2", num_hidden_layers=4, layer_types=["sliding_attention"] * 3 +
                                   ["full_attention"])
    path = tmp_path / "cohere2.gguf"
    write_model_gguf(hf_model, path, "cohere2")
    config = gguf_hf_config(GGUFFile(path))
    assert config.model_type == "cohere2" and config.layer_types == hf_model.config.layer_types
    assert config.sliding_window == 12 and config.logit_scale == 0.5
    _assert_greedy_steps_follow_transformers(path, hf_model)


def test_an_embeddinggemma_gguf_is_the_encoder_with_its_pooling_and_dense_layers(tmp_path: Path) -> None:
    """EmbeddingGemma as llama.cpp's converter writes it (`gemma-embedding`): Gemma 3's layers as an encoder, its
    window as config.json holds it (12 here: keys within 6 either side for llama.cpp, within 7 exclusive for
    transformers), mean pooling, and the Dense layers' weights as dense_2 and dense_3. Its hidden states (through
    the tied head, past the window) are transformers' bidirectional model's."""
    hf_model = build_tiny_hf_model("gemma3", **_GEMMA3_LAYERS, use_bidirectional_attention=True)
    dense = (torch.randn(96, 64), torch.randn(48, 96))
    path = tmp_path / "embeddinggemma.gguf"
    write_model_gguf(hf_model, path, "gemma-embedding", dense=dense)
    config = gguf_hf_config(GGUFFile(path))
    assert config.model_type == "gemma3_text" and config.architectures == ["Gemma3TextModel"]
    assert config.use_bidirectional_attention and config.sliding_window == hf_model.config.sliding_window == 7
    resolved = resolve_model(str(path))
    assert model_pooling_type(resolved) == "MEAN"
    projector = sentence_transformers_projector(resolved)
    torch.testing.assert_close([layer.weight for layer in projector if hasattr(layer, "weight")], list(dense))
    runner = SimplePagedRunner(load_model(ModelConfig(model=str(path), dtype="float32")).model)
    tokens = [(7 * i + 3) % 300 for i in range(30)]
    with torch.inference_mode():
        expected = hf_model(torch.tensor([tokens])).logits[0, -1]
    torch.testing.assert_close(runner.step({0: tokens})[0], expected, atol=1e-4, rtol=0)


def test_a_gemma2_gguf_matches_transformers_past_its_window(tmp_path: Path) -> None:
    """Gemma 2 as llama.cpp's files hold it: every other layer global, queries scaled by head_dim ** -0.5, the soft
    caps of its scores and logits in the metadata."""
    hf_model = build_tiny_hf_model("gemma2", query_pre_attn_scalar=32)
    path = tmp_path / "gemma2.gguf"
    write_model_gguf(hf_model, path, "gemma2")
    config = gguf_hf_config(GGUFFile(path))
    assert config.model_type == "gemma2" and config.layer_types == ["sliding_attention", "full_attention"]
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (1.0, 3.0)
    runner = SimplePagedRunner(load_model(ModelConfig(model=str(path), dtype="float32")).model)
    tokens = [(7 * i + 3) % 300 for i in range(30)]
    with torch.inference_mode():
        expected = hf_model(torch.tensor([tokens])).logits[0, -1]
    torch.testing.assert_close(runner.step({0: tokens})[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["phi3", "phi3-longrope"])
def test_a_phi3_gguf_matches_transformers(tmp_path: Path, kind: str) -> None:
    """Phi-3 as llama.cpp's files hold it: q/k/v fused in attn_qkv, gate and up in ffn_up, longrope's factors as
    tensors; a 30-token prompt past an original context of 16 (long factors), over 3/4 of each head."""
    overrides = {"original_max_position_embeddings": 16} if kind == "phi3-longrope" else {}
    hf_model = build_tiny_hf_model(kind, **overrides)
    assert kind == "phi3" or hf_model.config.rope_parameters["original_max_position_embeddings"] == 16
    path = tmp_path / f"{kind}.gguf"
    write_model_gguf(hf_model, path, "phi3")
    config = gguf_hf_config(GGUFFile(path))
    assert config.model_type == "phi3" and config.head_dim == 16
    runner = SimplePagedRunner(load_model(ModelConfig(model=str(path), dtype="float32")).model)
    tokens = [(7 * i + 3) % 300 for i in range(30)]
    with torch.inference_mode():
        expected = hf_model(torch.tensor([tokens])).logits[0, -1]
    torch.testing.assert_close(runner.step({0: tokens})[0], expected, atol=1e-4, rtol=0)


def test_a_quantized_phi3_gguf_packs_its_fused_tensors_by_part(tmp_path: Path, monkeypatch) -> None:
    """attn_qkv's and ffn_up's blocks, split row by row into q/k/v and gate/up, pack as separate tensors' would."""
    path = tmp_path / "phi3-q8_0.gguf"
    write_model_gguf(build_tiny_hf_model("phi3-longrope"), path, "phi3", Q.Q8_0)
    packed = load_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf")).model
    dense = load_model(ModelConfig(model=str(path), dtype="float32")).model
    layer = packed.model.layers[1]
    assert layer.self_attn.qkv_proj.weight.ggml_type == layer.mlp.gate_up_proj.weight.ggml_type == Q.Q8_0
    _assert_gguf_reference_near_the_dense_model(packed, dense, [(7 * i + 3) % 300 for i in range(30)], monkeypatch)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q4_K])
def test_a_quantized_granite_gguf_takes_its_residual_multiplier_in_its_blocks_scales(tmp_path: Path, qtype: Q,
                                                                                   monkeypatch) -> None:
    """Granite's residual multiplier, folded into its o_proj's and down_proj's blocks' float16 scales (and mins):
    the packed model is the dequantised one (which folds it into the weights) within the activations' noise."""
    path = tmp_path / "granite.gguf"
    write_model_gguf(build_tiny_hf_model("granite", intermediate_size=256, hidden_size=256), path, "granite", qtype)
    packed = load_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf")).model
    dense = load_model(ModelConfig(model=str(path), dtype="float32")).model
    layer = packed.model.layers[0]
    assert layer.self_attn.o_proj.weight.dtype == layer.mlp.down_proj.weight.dtype == torch.uint8
    _assert_gguf_reference_near_the_dense_model(packed, dense, [1, 17, 250, 9, 33, 70, 5, 80, 81], monkeypatch)


def test_scaled_blocks_scale_every_value() -> None:
    rows = torch.randn(4, 256)
    for qtype in (Q.Q4_0, Q.Q8_0, Q.Q4_1, Q.Q4_K):
        raw = torch.from_numpy(_quantize_q4_k(rows.numpy()) if qtype == Q.Q4_K else quantize(rows.numpy(), qtype))
        before = torch.from_numpy(dequantize(raw.numpy(), qtype))
        after = torch.from_numpy(dequantize(scaled_blocks(raw, qtype, 0.22).numpy(), qtype))
        torch.testing.assert_close(after, before * 0.22, atol=1e-3 * float(before.abs().max()), rtol=2e-3)
        assert torch.equal(torch.from_numpy(dequantize(raw.numpy(), qtype)), before)     # the rows left as they were


def test_a_quantized_lfm2_gguf_packs_its_convolutions_projections(tmp_path: Path, monkeypatch) -> None:
    """LFM2's layers typed by their KV-head counts, and its convolutions' in and out projections multiplying their
    blocks (the dequantised model within the 16-bit activations' noise)."""
    path = tmp_path / "lfm2-q8.gguf"
    write_model_gguf(build_tiny_hf_model("lfm2", num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"]),
                     path, "lfm2", Q.Q8_0)
    config = gguf_hf_config(GGUFFile(path))
    assert (config.layer_types, config.conv_L_cache, config.num_key_value_heads) == \
        (["conv", "full_attention", "conv"], 3, 1)
    packed = load_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf")).model
    dense = load_model(ModelConfig(model=str(path), dtype="float32")).model
    conv = packed.model.layers[0].self_attn
    assert conv.in_proj.weight.dtype == conv.o_proj.weight.dtype == torch.uint8
    _assert_gguf_reference_near_the_dense_model(packed, dense, [1, 17, 250, 9, 33, 70, 5, 80, 81], monkeypatch)


def test_a_quantized_granite_hybrid_gguf_packs_its_mamba_layers_projections(tmp_path: Path, monkeypatch) -> None:
    """granite-4.0-h's layers typed by their KV-head counts, its Mamba-2 layers' in and out projections multiplying
    their blocks (out_proj's scales taking the residual multiplier), the dequantised model within the 16-bit
    activations' noise."""
    path = tmp_path / "granite4-h-q8.gguf"
    write_model_gguf(build_tiny_hf_model("granite4-hybrid-dense", hidden_size=128, mamba_n_heads=4, mamba_d_head=64,
                                         mamba_d_state=32, residual_multiplier=0.22), path, "granitehybrid", Q.Q8_0)
    config = gguf_hf_config(GGUFFile(path))
    assert (config.layer_types, config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups) == \
        (["linear_attention", "full_attention", "linear_attention"], 4, 64, 1)     # (as transformers names them)
    packed = load_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf")).model
    dense = load_model(ModelConfig(model=str(path), dtype="float32")).model
    mixer = packed.model.layers[0].self_attn
    assert mixer.in_proj.weight.dtype == mixer.o_proj.weight.dtype == torch.uint8
    _assert_gguf_reference_near_the_dense_model(packed, dense, [1, 17, 250, 9, 33, 70, 5, 80, 81], monkeypatch)


@pytest.mark.parametrize(("kind", "arch"), [("ernie4_5", "ernie4_5"), ("glm4", "glm4"), ("cohere", "command-r")])
def test_a_quantized_interleaved_gguf_keeps_its_blocks_reordered_by_row(tmp_path: Path, kind: str, arch: str,
                                                                        monkeypatch) -> None:
    """ERNIE 4.5's and Command R's interleaved q/k rows (GLM-4's in the rotary half of each head), reordered into
    halves as llama's files' are (whole rows of blocks), stay packed: the dequantised model within the 16-bit
    activations' noise."""
    path = tmp_path / f"{kind}-q8.gguf"
    write_model_gguf(build_tiny_hf_model(kind), path, arch, Q.Q8_0)
    packed = load_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf")).model
    dense = load_model(ModelConfig(model=str(path), dtype="float32")).model
    assert packed.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.uint8
    _assert_gguf_reference_near_the_dense_model(packed, dense, [1, 17, 250, 9, 33, 70, 5, 80, 81], monkeypatch)


@pytest.mark.parametrize(("kind", "arch"), [("gpt-bigcode", "starcoder"), ("gpt2", "gpt2"), ("bloom", "bloom"),
                                           ("falcon-new", "falcon"), ("mpt", "mpt")])
def test_a_quantized_gguf_splits_its_fused_qkv_blocks_by_row(tmp_path: Path, kind: str, arch: str,
                                                             monkeypatch) -> None:
    """StarCoder's attn_qkv (its queries' rows, then its one KV head's key and value), GPT-2's (stored as nn.Linear's
    [out, in], its checkpoints' Conv1D transposed), BLOOM's and Falcon 40B's (q's rows, k's, v's, as the converter
    reorders them) and MPT's (its Wqkv as it is)
    split into q, k and v rows of blocks, which stay packed: the dequantised model within the 16-bit activations'
    noise."""
    path = tmp_path / f"{arch}-q8.gguf"
    write_model_gguf(build_tiny_hf_model(kind), path, arch, Q.Q8_0)
    packed = load_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf")).model
    dense = load_model(ModelConfig(model=str(path), dtype="float32")).model
    assert packed.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.uint8
    _assert_gguf_reference_near_the_dense_model(packed, dense, [1, 17, 250, 9, 33, 70, 5, 80, 81], monkeypatch)


@pytest.mark.parametrize(("kind", "arch"), [("phi", "phi2"), ("gpt-neox", "gptneox")])
def test_a_gguf_of_an_architecture_transformers_reads_no_config_of_serves_with_its_own_tokenizer(
        tmp_path: Path, kind: str, arch: str) -> None:
    """Phi-2's and GPT-NeoX's files: transformers builds their byte-level BPE tokenizer from the vocabulary, though it
    reads no config of theirs; the engine encodes a prompt as the folder's tokenizer does and generates transformers'
    tokens."""
    from pagedllm import LLM, SamplingParams
    from tests.models.tiny import VOCAB_SIZE, build_byte_tokenizer, hf_greedy

    byte_tokenizer = build_byte_tokenizer()
    by_id = {index: token for token, index in byte_tokenizer.get_vocab().items()}
    tokens = [by_id.get(index, f"<unused{index}>") for index in range(VOCAB_SIZE - 1)] + ["~~"]
    hf_model = build_tiny_hf_model(kind)
    path = tmp_path / f"{arch}.gguf"
    write_model_gguf(hf_model, path, arch, tokens=tokens, merges=["~ ~"])     # (a merge the prompt never meets)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32)
    prompt_ids = llm.get_tokenizer()("hello, world")["input_ids"]
    assert prompt_ids == byte_tokenizer("hello, world")["input_ids"]
    output = llm.generate(["hello, world"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0]
    assert output.outputs[0].token_ids == hf_greedy(hf_model, [prompt_ids], 6)[0]


@pytest.mark.parametrize("kind", ["stablelm", "starcoder2"])
def test_a_quantized_layer_norm_gguf_multiplies_its_blocks(tmp_path: Path, kind: str, monkeypatch) -> None:
    """StableLM's and StarCoder2's layers (LayerNorms, biases; StarCoder2's ungated MLP, fc1 and fc2) keep their Q8_0
    blocks packed: the dequantised model within the 16-bit activations' noise."""
    path = tmp_path / f"{kind}-q8.gguf"
    write_model_gguf(build_tiny_hf_model(kind), path, kind, Q.Q8_0)
    packed = load_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf")).model
    dense = load_model(ModelConfig(model=str(path), dtype="float32")).model
    layer = packed.model.layers[0]
    mlp_weights = (layer.mlp.fc1.weight, layer.mlp.fc2.weight) if kind == "starcoder2" else \
        (layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight)
    assert all(w.dtype == torch.uint8 for w in (layer.self_attn.qkv_proj.weight, *mlp_weights))
    _assert_gguf_reference_near_the_dense_model(packed, dense, [1, 17, 250, 9, 33, 70, 5, 80, 81], monkeypatch)


def test_quantized_gguf_is_close(tmp_path: Path) -> None:
    hf_model = build_tiny_hf_model("llama-gqa")
    path = tmp_path / "q8.gguf"
    write_model_gguf(hf_model, path, "llama", Q.Q8_0)
    weights = dict(iterate_gguf(path, torch.float32))
    ref = hf_model.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        torch.testing.assert_close(weights[name], ref[name], atol=0.02, rtol=0.02)  # permutation undone
    assert weights["model.norm.weight"].dtype == torch.float32


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Rows [N, K] as Q4_K super-blocks (uint8 [N, K/256 * 144]), min-max per sub-block of 32 (gguf has no Q4_K
    quantizer): d dmin | scales and mins, 6 bits each (llama.cpp's get_scale_min_k4 layout) | nibbles."""
    sub = x.reshape(-1, 8, 32).astype(np.float32)  # [S, 8, 32]
    lo = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - lo) / 15, -lo  # [S, 8]
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (mins.max(-1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d, 1e-8)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mins / np.maximum(dmin, 1e-8)), 0, 63).astype(np.uint8)
    step = np.maximum(d.astype(np.float32) * sc, 1e-8)[..., None]
    q = np.clip(np.round((sub + (dmin.astype(np.float32) * m)[..., None]) / step), 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 0x0F) | (m[:, 4:] & 0x0F) << 4], axis=1)  # [S, 12]
    chunks = q.reshape(-1, 4, 2, 32)  # each 64 values: low nibbles the first 32, high the next 32
    nibbles = (chunks[:, :, 0] | chunks[:, :, 1] << 4).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, nibbles], axis=1)
    return blocks.reshape(x.shape[0], -1)


def test_q4_k_packs_as_q4_1_with_ggufs_dequantisation() -> None:
    """Random Q4_K bytes (f16 d and dmin kept finite) packed for the Q4_1 kernel stand for the bits gguf's
    dequantiser gives; and the test's quantizer writes the layout gguf reads."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (40, 2 * 144), dtype=np.uint8)
    raw.reshape(40, 2, 144)[..., :4] = (rng.random((40, 2, 2)) * 0.01).astype(np.float16).view(np.uint8)
    packed = pack_gguf_weight(torch.from_numpy(raw), Q.Q4_K)
    expected = torch.from_numpy(dequantize(raw, Q.Q4_K))
    assert packed_type(Q.Q4_K) == Q.Q4_1
    assert torch.equal(dequantize_gguf_packed(packed, Q.Q4_1, 40), expected)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    assert np.abs(dequantize(_quantize_q4_k(x), Q.Q4_K) - x).max() < 0.25


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_packed_gguf_rows_are_the_dequantised_weights(tmp_path: Path, qtype: Q) -> None:
    """Each linear weight's blocks, q/k rows unpermuted and regrouped for the kernel, dequantise to the bits
    `iterate_gguf` gives (the loader's torch dequantisers, checked against gguf's above)."""
    hf_model = build_tiny_hf_model("llama-gqa")
    path = tmp_path / f"{qtype.name}.gguf"
    write_model_gguf(hf_model, path, "llama", qtype)
    g = GGUFFile(path)
    rows = gguf_block_rows(g, PACKED_GGUF_TYPES, gguf_hf_config(g))
    weights = dict(iterate_gguf(path, torch.float32))
    assert "model.layers.0.self_attn.q_proj.weight" in rows and "model.norm.weight" not in rows  # 1-D stays out
    for name, (ggml_type, raw) in rows.items():
        assert ggml_type == qtype
        n = weights[name].shape[0]
        assert torch.equal(dequantize_gguf_packed(pack_gguf_weight(raw, ggml_type), ggml_type, n), weights[name])


def _assert_gguf_reference_near_the_dense_model(packed, dense, prompt: list[int], monkeypatch) -> None:
    """`packed`'s logits are those of its GGUF-packed layers computed by `gguf_reference`, bitwise, and within the noise
    of 16-bit activations of the dequantised (`dense`) model's, with the same next token."""
    got, expected = SimplePagedRunner(packed).step({0: prompt}), SimplePagedRunner(dense).step({0: prompt})
    assert (got - expected).abs().max() < 1e-3 * expected.abs().max() and got.argmax() == expected.argmax()
    use_gguf_reference(monkeypatch)
    assert torch.equal(got, SimplePagedRunner(packed).step({0: prompt}))


@pytest.mark.parametrize(("kind", "qtype"), [("llama-gqa", Q.Q4_1), ("llama-untied", Q.Q4_1), ("llama-gqa", Q.Q8_0)])
def test_gguf_quantization_multiplies_its_blocks(tmp_path: Path, kind: str, qtype: Q, monkeypatch) -> None:
    """quantization="gguf" keeps the blocks: weights times activations quantized to 16 bits (the dequantised
    model within that noise), the untied LM head's blocks and the tied one's (the embedding's) too."""
    path = tmp_path / f"{kind}.gguf"
    write_model_gguf(build_tiny_hf_model(kind), path, "llama", qtype)
    packed = load_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf")).model
    dense = load_model(ModelConfig(model=str(path), dtype="float32")).model
    qkv, head = packed.model.layers[0].self_attn.qkv_proj.weight, packed.lm_head.weight
    assert qkv.dtype == torch.uint8 and qkv.ggml_type == qtype and head.dtype == torch.uint8
    assert packed.model.embed_tokens.weight.dtype == torch.float32  # the lookup keeps a dequantised copy
    _assert_gguf_reference_near_the_dense_model(packed, dense, [1, 17, 250, 9, 33, 70, 5, 80, 81], monkeypatch)


def test_a_quantized_gemma3_gguf_multiplies_its_blocks(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "gemma3-q8_0.gguf"
    write_model_gguf(build_tiny_hf_model("gemma3", **_GEMMA3_LAYERS), path, "gemma3", Q.Q8_0)
    packed = load_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf")).model
    dense = load_model(ModelConfig(model=str(path), dtype="float32")).model
    assert packed.model.layers[5].mlp.gate_up_proj.weight.ggml_type == Q.Q8_0
    _assert_gguf_reference_near_the_dense_model(packed, dense, [(7 * i + 3) % 300 for i in range(30)], monkeypatch)


@pytest.mark.parametrize(("kind", "arch"), [("mixtral", "llama"), ("qwen2-moe", "qwen2moe"),
                                           ("ernie4_5-moe", "ernie4_5-moe"), ("lfm2-moe", "lfm2moe"),
                                           ("granitemoe", "granitemoe"), ("olmoe", "olmoe")])
def test_a_mixture_of_experts_keeps_its_experts_blocks(tmp_path: Path, kind: str, arch: str, monkeypatch) -> None:
    """Each expert's slice of a stacked experts tensor packs as its own weight's blocks (as do Qwen2-MoE's and ERNIE's
    shared experts and their dense layers, and LFM2-MoE's dense layer; Granite MoE's experts' down blocks with its
    residual multiplier in their scales); the router keeps its float32 weight, as llama.cpp's files keep it."""
    path = tmp_path / f"{kind}.gguf"
    overrides = {"qwen2-moe": dict(moe_intermediate_size=64),      # GGUF blocks: rows of 32 k's
                 "ernie4_5-moe": dict(moe_intermediate_size=64, use_bias=False),
                 "lfm2-moe": dict(moe_intermediate_size=64, routed_scaling_factor=1.0),
                 "granitemoe": dict(intermediate_size=64), "olmoe": dict(intermediate_size=64)}.get(kind, {})
    write_model_gguf(build_tiny_hf_model(kind, **overrides), path, arch, Q.Q4_1)
    packed = load_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf")).model
    dense = load_model(ModelConfig(model=str(path), dtype="float32")).model
    sparse, other = (1, 0) if kind in ("ernie4_5-moe", "lfm2-moe") else (0, 1)
    moe = packed.model.layers[sparse].mlp
    for expert in moe.experts:
        assert expert.gate_up_proj.weight.dtype == expert.down_proj.weight.dtype == torch.uint8
    assert moe.gate.weight.dtype == torch.float32 and moe.gate.weight.shape == (4, 64)
    if kind in ("qwen2-moe", "ernie4_5-moe"):
        assert moe.shared_expert.down_proj.weight.ggml_type == Q.Q4_1
    if kind not in ("mixtral", "granitemoe", "olmoe"):
        assert packed.model.layers[other].mlp.gate_up_proj.weight.ggml_type == Q.Q4_1     # the dense layer
    _assert_gguf_reference_near_the_dense_model(packed, dense, [1, 17, 250, 9, 33, 70, 5, 80, 81], monkeypatch)


def test_8_bit_activations_are_a_switch_read_at_load(tmp_path: Path, monkeypatch) -> None:
    """PAGEDLLM_GGUF_ACTIVATION_BITS=8 packs the weights to multiply 8-bit activations (llama.cpp's arithmetic): the
    logits are `gguf_reference`'s at 8 bits, bitwise, further from the dequantised model's than 16 bits leave them;
    any other value than 8 or 16 is refused at load, naming the variable."""
    path = tmp_path / "q4_1.gguf"
    write_model_gguf(build_tiny_hf_model("llama-gqa"), path, "llama", Q.Q4_1)
    config = ModelConfig(model=str(path), dtype="float32", quantization="gguf")
    fine, dense = load_model(config).model, load_model(ModelConfig(model=str(path), dtype="float32")).model
    monkeypatch.setenv("PAGEDLLM_GGUF_ACTIVATION_BITS", "8")
    coarse = load_model(config).model
    assert coarse.model.layers[0].mlp.down_proj.weight.activation_bits == 8
    assert fine.model.layers[0].mlp.down_proj.weight.activation_bits == 16
    prompt = [1, 17, 250, 9, 33, 70, 5, 80, 81]
    expected = SimplePagedRunner(dense).step({0: prompt})
    coarse_logits, fine_logits = SimplePagedRunner(coarse).step({0: prompt}), SimplePagedRunner(fine).step({0: prompt})
    assert (coarse_logits - expected).abs().max() > 10 * (fine_logits - expected).abs().max()
    assert (coarse_logits - expected).abs().max() < 0.05 * expected.abs().max()
    use_gguf_reference(monkeypatch)
    assert torch.equal(coarse_logits, SimplePagedRunner(coarse).step({0: prompt}))
    monkeypatch.setenv("PAGEDLLM_GGUF_ACTIVATION_BITS", "4")
    with pytest.raises(ValueError, match="PAGEDLLM_GGUF_ACTIVATION_BITS must be 8, 16 or bf16, got '4'"):
        load_model(config)


def test_the_gguf_arithmetic_follows_the_activations_dtype_and_the_cpu(monkeypatch) -> None:
    """bf16 activations take x in bf16 where the kernels multiply it and bf16 dot products pay (activation_bits 0:
    AMX-BF16 tiles, or AVX512-BF16 vectors on AMD); float32 ones, an Intel CPU with AVX512-BF16 but no tiles (its
    VDPBF16PS at half its FMA's rate) and every CPU without AVX512-BF16, the 16-bit integer arithmetic;
    PAGEDLLM_GGUF_ACTIVATION_BITS=bf16 asks for x in bf16 (wherever the kernels can) and is refused, naming what
    is missing, where there is none."""
    from pagedllm import cpu
    from pagedllm.layers import linear as linear_module
    from pagedllm.layers.linear import GGUF_BF16, gguf_activation_bits

    monkeypatch.delenv(cpu.MAX_ISA_ENV, raising=False)      # the CPUs below are faked whole: no cap on them
    avx2 = frozenset({"avx2", "fma", "f16c"})
    avx512_bf16 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
    for model_name, flags, tiles, available, expected in [
        ("AMD EPYC 9R14", avx512_bf16, False, True, GGUF_BF16),                 # Zen 4 and 5: vectors
        ("Intel(R) Xeon(R) Platinum 8480+", avx512_bf16 | {"amx_bf16"}, True, True, GGUF_BF16),     # AMX tiles
        ("Intel(R) Xeon(R) Processor", avx512_bf16, False, True, 16),           # Cooper Lake, a VM hiding AMX
        ("AMD EPYC 7R13", avx2, False, False, 16),                              # Zen 3: no AVX512-BF16
    ]:
        monkeypatch.setattr(cpu, "_read_cpu", lambda name=model_name, flags=flags: ("x86_64", name, flags))
        monkeypatch.setattr(linear_module, "gguf_bf16_tiles_available", lambda tiles=tiles: tiles)
        monkeypatch.setattr(linear_module, "gguf_bf16_available", lambda available=available: available)
        assert gguf_activation_bits(torch.bfloat16) == expected, model_name
        assert gguf_activation_bits(torch.float32) == 16
    monkeypatch.setenv("PAGEDLLM_GGUF_ACTIVATION_BITS", "bf16")
    monkeypatch.setattr(linear_module, "gguf_bf16_available", lambda: False)
    with pytest.raises(ValueError, match="AVX512-BF16, which this CPU"):
        gguf_activation_bits(torch.bfloat16)
    monkeypatch.setattr(linear_module, "gguf_bf16_available", lambda: True)
    assert gguf_activation_bits(torch.float32) == GGUF_BF16


def test_a_bf16_model_multiplies_gguf_blocks_by_bf16_activations(tmp_path: Path, monkeypatch) -> None:
    """On a CPU with AVX512-BF16, a bf16 model's GGUF layers multiply x in bf16 when asked (the default with AMX
    tiles or on AMD; in tiles where there are, else in vectors): its logits are `gguf_reference`'s (the bf16
    products summed in float64) within the float32 sums, near the dequantised bf16 model's (oneDNN's or pagedllm's
    bf16 matmuls), with the same next token, and a sequence's logits do not depend on its batch."""
    from pagedllm.layers.linear import gguf_bf16_available

    if not gguf_bf16_available():
        pytest.skip("GGUF blocks times bf16 activations need a CPU with AVX512-BF16; bf16 models take the 16-bit "
                    "integer arithmetic here (the tests above)")
    monkeypatch.setenv("PAGEDLLM_GGUF_ACTIVATION_BITS", "bf16")     # the default only where VDPBF16PS pays
    path = tmp_path / "q4_1.gguf"
    write_model_gguf(build_tiny_hf_model("llama-gqa"), path, "llama", Q.Q4_1)
    packed = load_model(ModelConfig(model=str(path), dtype="bfloat16", quantization="gguf")).model
    dense = load_model(ModelConfig(model=str(path), dtype="bfloat16")).model
    assert packed.model.layers[0].mlp.down_proj.weight.activation_bits == 0
    prompt, other = [1, 17, 250, 9, 33, 70, 5, 80, 81], [7, 7, 40, 2]

    def step(model, batch):
        return SimplePagedRunner(model, dtype=torch.bfloat16).step(batch)

    got, expected = step(packed, {0: prompt}), step(dense, {0: prompt})
    assert (got - expected).abs().max() < 2e-2 * expected.abs().max() and got.argmax() == expected.argmax()
    assert torch.equal(got[0], step(packed, {1: other, 0: prompt})[1])
    use_gguf_reference(monkeypatch)
    reference = step(packed, {0: prompt})
    assert (got - reference).abs().max() < 2e-2 * reference.abs().max() and got.argmax() == reference.argmax()


def test_gguf_quantization_keeps_q4_k_packed(tmp_path: Path, monkeypatch) -> None:
    """Q4_K weights (K a multiple of 256 here) run as Q4_1 groups."""
    path = tmp_path / "q4_k.gguf"
    write_model_gguf(build_tiny_hf_model("llama-gqa", hidden_size=256, intermediate_size=256), path, "llama", Q.Q4_K)
    packed = load_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf")).model
    dense = load_model(ModelConfig(model=str(path), dtype="float32")).model
    for proj in (packed.model.layers[0].self_attn.qkv_proj, packed.model.layers[1].mlp.down_proj, packed.lm_head):
        assert proj.weight.dtype == torch.uint8 and proj.weight.ggml_type == Q.Q4_1
    _assert_gguf_reference_near_the_dense_model(packed, dense, [1, 17, 250, 9, 33, 70, 5, 80, 81], monkeypatch)


def test_a_layer_with_a_part_not_in_a_packed_type_keeps_its_dequantised_weight(tmp_path: Path, monkeypatch) -> None:
    """A fused layer packs only when all its parts are blocks of one packed type (a Q4_K_M file, say, stores some
    v_proj as Q6_K): layer 0's qkv, whose v_proj is withheld here, falls back to the dense packing."""
    path = tmp_path / "mixed.gguf"
    write_model_gguf(build_tiny_hf_model("llama-gqa"), path, "llama", Q.Q4_0)

    def without_layer0_v(g: GGUFFile, types: tuple[Q, ...], config) -> dict:
        rows = gguf_block_rows(g, types, config)
        del rows["model.layers.0.self_attn.v_proj.weight"]
        return rows

    monkeypatch.setattr("pagedllm.loader.gguf.gguf_block_rows", without_layer0_v)
    packed = load_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf")).model
    assert packed.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert packed.model.layers[1].self_attn.qkv_proj.weight.dtype == torch.uint8
    dense = load_model(ModelConfig(model=str(path), dtype="float32")).model
    _assert_gguf_reference_near_the_dense_model(packed, dense, [1, 17, 250, 9, 33], monkeypatch)
