"""Tiny random Hugging Face models (and a byte-level tokenizer) in a folder, for tests. Nothing is downloaded.

    folder, hf_model = save_tiny_model(tmp_path / "m", "llama-gqa")
    runner = SimplePagedRunner(pagedllm_model, block_size=4, num_blocks=64)
    logits = runner.step({0: [1, 2, 3], 1: [4, 5]})        # seq id -> new tokens; returns last-token logits
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 384  # 256 bytes + specials, padded
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=True,
)
_DELTANET: dict[str, Any] = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                 linear_value_head_dim=16, linear_conv_kernel_dim=4)
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "llama-gqa": ("llama", dict(num_key_value_heads=2)),
    "llama-mqa": ("llama", dict(num_key_value_heads=1, head_dim=32)),
    "llama-untied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama3-rope": ("llama", dict(num_key_value_heads=2, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "qwen2": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    # Qwen's long context: YaRN over an original context of 64 of 256 (factor 4), its tables scaled by 0.1 ln 4 + 1
    "qwen2-yarn": ("qwen2", dict(num_key_value_heads=2, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64))),
    # as Qwen3's real ones: heads x head_dim (4 x 32) is not the hidden size (64)
    "qwen3": ("qwen3", dict(num_key_value_heads=2, head_dim=32)),
    "mistral": ("mistral", dict(num_key_value_heads=2, sliding_window=None)),
    # as VaultGemma's: Gemma 2's layers (soft caps, a local layer and a global one) without the branches' output norms
    "vaultgemma": ("vaultgemma", dict(num_key_value_heads=2, head_dim=32, sliding_window=12, query_pre_attn_scalar=24,
                                      attn_logit_softcapping=1.0, final_logit_softcapping=3.0,
                                      layer_types=["sliding_attention", "full_attention"])),
    # as Apertus's: per-head q/k norms, an ungated MLP whose xIELU has two parameters a layer (made random), its norms
    # under names of its own, Llama 3's rope
    "apertus": ("apertus", dict(num_key_value_heads=2, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    # as Ministral-8B's: its layer_types' sliding windows (here the first layer's, of 6 keys)
    "ministral": ("ministral", dict(num_key_value_heads=2, head_dim=16, sliding_window=6,
                                    layer_types=["sliding_attention", "full_attention"])),
    # as Ministral 3's: YaRN, and its queries scaled by 1 + 0.1 ln(1 + floor(position / 8)) past its original
    # context of 8 (the released ones' 16,384)
    "ministral3": ("ministral3", dict(num_key_value_heads=2, head_dim=32, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8, beta_fast=32.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1))),
    # as Gemma 3's: heads x head_dim past the hidden size, a local layer (a window of 12, rotary base 10,000) and a
    # global one (1,000,000), an attention scale of its own
    "gemma3": ("gemma3_text", dict(num_key_value_heads=2, head_dim=32, sliding_window=12, query_pre_attn_scalar=24,
                                   layer_types=["sliding_attention", "full_attention"])),
    # as Gemma's (the first: gemma-2b, gemma-7b, CodeGemma): Llama's layers with norms scaling by 1 + w, embeddings
    # times sqrt(hidden), a GELU-gated MLP, heads x head_dim past the hidden size (gemma-7b's 16 x 256 of 3,072)
    "gemma": ("gemma", dict(num_key_value_heads=2, head_dim=32)),
    # as Gemma 2's: soft-capped attention scores and logits (caps this small, 1 and 3 against 50 and 30, so that
    # they bend a tiny model's scores and logits), a local layer and a global one, no head norms
    "gemma2": ("gemma2", dict(num_key_value_heads=2, head_dim=32, sliding_window=12, query_pre_attn_scalar=24,
                              attn_logit_softcapping=1.0, final_logit_softcapping=3.0,
                              layer_types=["sliding_attention", "full_attention"])),
    # as Phi-3's: q/k/v and gate/up stored fused; Phi-3.5's and Phi-4-mini's longrope (short and long factors, an
    # original context of 64 of 256) over 3/4 of each head (12 of 16 values)
    "phi3": ("phi3", dict(num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0)),
    "phi3-longrope": ("phi3", dict(num_key_value_heads=2, pad_token_id=0, original_max_position_embeddings=64,
                                   rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                        partial_rotary_factor=0.75,
                                                        short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                                        long_factor=[1.5, 2.0, 3.0, 4.0, 6.0, 8.0]))),
    # as SmolLM3's: no rotary embedding in every fourth layer (here the second of two: no_rope_layers [1, 0])
    "smollm3": ("smollm3", dict(num_key_value_heads=2, no_rope_layer_interval=2, pad_token_id=0)),
    # as Granite 3's: embeddings, attention scores, branch outputs and logits scaled by its multipliers
    # (granite-3.3-2b's 12.0, 0.015625, 0.22 and 8.0; here the scores' this far from Llama's to tell them apart)
    "granite": ("granite", dict(num_key_value_heads=2, embedding_multiplier=12.0, attention_multiplier=0.05,
                                residual_multiplier=0.22, logits_scaling=8.0)),
    # as OLMo 2's: the branches' outputs normed, not their inputs; queries and keys normed over all their heads
    "olmo2": ("olmo2", dict(num_key_value_heads=2)),
    # OLMo 2's layers with a local one (a window of 12) before a global one, as OLMo 3's 3 in 4
    "olmo3": ("olmo3", dict(num_key_value_heads=2, sliding_window=12,
                            layer_types=["sliding_attention", "full_attention"])),
    # EXAONE 4's: OLMo's branch norms, Qwen3's head norms, a local layer and a global one without rotary embedding
    "exaone4": ("exaone4", dict(num_key_value_heads=2, sliding_window=12, sliding_window_pattern=2)),
    # InternLM3's (Llama's layout, its biases named qkv_bias and bias) and Seed-OSS's (q/k/v biased, o_proj not)
    "internlm3": ("internlm3", dict(num_key_value_heads=2, qkv_bias=True, bias=True)),
    "seed-oss": ("seed_oss", dict(num_key_value_heads=2, attention_bias=True, attention_out_bias=False)),
    # the GPT-J rotary layout (interleaved pairs): ERNIE 4.5's (with its use_bias) and Helium's
    "ernie4_5": ("ernie4_5", dict(num_key_value_heads=2, head_dim=16, use_bias=True)),
    "helium": ("helium", dict(num_key_value_heads=2, head_dim=16)),
    # GLM's: interleaved pairs of half of each head's values turned, gate/up stored fused, q/k/v biased and o_proj
    # not; GLM-4's with norms on each branch's output too (made random: GLM-4's start at 1)
    "glm": ("glm", dict(num_key_value_heads=2, head_dim=32, pad_token_id=0)),
    "glm4": ("glm4", dict(num_key_value_heads=2, head_dim=32, pad_token_id=0)),
    # LayerNorm models: StableLM's (Llama's layers, q/k/v biased, a quarter of each head turned), with its
    # use_parallel_residual (StableLM 2 12B's) too; Phi's (both branches reading one norm's output, an ungated GELU
    # MLP, biases everywhere, the LM head's too); GPT-NeoX's (Pythia's: q/k/v fused head by head, parallel branches
    # with a norm each, exact GELU), and with sequential ones
    "stablelm": ("stablelm", dict(num_key_value_heads=2, use_qkv_bias=True, tie_word_embeddings=False)),
    "stablelm-parallel": ("stablelm", dict(num_key_value_heads=2, use_parallel_residual=True)),
    "phi": ("phi", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "gpt-neox": ("gpt_neox", dict(tie_word_embeddings=False)),
    "gpt-neox-sequential": ("gpt_neox", dict(use_parallel_residual=False)),
    # StarCoder2's: Llama's layers with LayerNorms, biases everywhere, an ungated MLP, every layer over a window of 12
    "starcoder2": ("starcoder2", dict(num_key_value_heads=2, sliding_window=12, norm_epsilon=1e-5)),
    # Cohere's: one LayerNorm without biases before parallel branches, interleaved rope, logits times logit_scale;
    # Cohere2's local layer (a window of 12) and global one without a rotary embedding
    "cohere": ("cohere", dict(num_key_value_heads=2, logit_scale=0.5)),
    "cohere2": ("cohere2", dict(num_key_value_heads=2, logit_scale=0.5, sliding_window=12,
                                layer_types=["sliding_attention", "full_attention"])),
    # learned position embeddings, no rotary one: GPT-2's (Conv1D weights, [in, out]); GPT-BigCode's with one KV head
    # (StarCoder 1's, SantaCoder's) and with a KV head for each query head (q/k/v fused head by head)
    "gpt2": ("gpt2", dict()),
    # (n_head as a config.json names it: GPTBigCodeConfig works out num_key_value_heads from it)
    "gpt-bigcode": ("gpt_bigcode", dict(n_head=4, multi_query=True, tie_word_embeddings=False)),
    "gpt-bigcode-mha": ("gpt_bigcode", dict(n_head=4, multi_query=False)),
    # OPT's (opt-125m's layout): positions from row 2 of their table, a ReLU MLP of ffn_dim
    "opt": ("opt", dict(ffn_dim=128, word_embed_proj_dim=64)),
    # GPT-J's: parallel branches under one norm, interleaved rope over rotary_dim (8 of 16) values, a biased LM head
    "gptj": ("gptj", dict(rotary_dim=8, tie_word_embeddings=False)),
    # OLMo's (the first): LayerNorms without weights or biases, q/k/v clamped (clip_qkv, at a bound this small, 0.3,
    # so that it bites); Nemotron's: LayerNorms scaling by 1 + w, half of each head turned, a squared-ReLU MLP
    "olmo": ("olmo", dict(num_key_value_heads=2, clip_qkv=0.3)),
    "nemotron": ("nemotron", dict(num_key_value_heads=2, head_dim=16, norm_eps=1e-5)),
    # Hunyuan's (Hunyuan-0.5B..7B-Instruct): Qwen3's head norms after the rotary embedding (made random: a norm of
    # weights all 1 gives the same before the rotation as after it), its fixed-alpha NTK rope
    "hunyuan": ("hunyuan_v1_dense", dict(num_key_value_heads=2, head_dim=16, rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, alpha=1000.0, factor=1.0))),
    # Arcee's (AFM-4.5B): Llama's layers with an ungated squared-ReLU MLP, YaRN
    "arcee": ("arcee", dict(num_key_value_heads=2, head_dim=16, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64))),
    # Falcon's: 7B's (one KV head, parallel branches under one norm, no biases) and 40B's new decoder architecture (a
    # group of queries a KV head, a norm for each branch), with biases (num_kv_heads as a config.json names it)
    "falcon": ("falcon", dict(multi_query=True, num_kv_heads=1, parallel_attn=True, bias=False)),
    "falcon-new": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2, bias=True)),
    # ALiBi in place of a rotary embedding: Falcon-RW's (falcon-rw-1b's layout: biased, sequential branches, a KV head
    # for each query head); BLOOM's (its embeddings normed, q/k/v fused head by head, biases everywhere, tanh GELU);
    # MPT's (no biases, LayerNorms without them, q/k/v fused q's rows first, exact GELU), with a scale of its scores
    # and a clamp of q/k/v
    "falcon-rw": ("falcon", dict(alibi=True, multi_query=False, parallel_attn=False, bias=True)),
    "bloom": ("bloom", dict()),
    "mpt": ("mpt", dict(attn_config=dict(softmax_scale=0.2, clip_qkv=0.3))),
    # as LFM2's: a short convolution (its input of 64 values a token in two of the pool's layers of 2 x 1 x 16) and
    # an attention with Qwen3's head norms; the MLP's width adjusted as LFM2's (2/3 of 192, to a multiple of 32)
    "lfm2": ("lfm2", dict(num_key_value_heads=1, layer_types=["conv", "full_attention"], intermediate_size=192,
                          block_multiple_of=32, norm_eps=1e-5)),
    # mixtures of experts: 4 experts, 2 a token (8 and 2 for Mixtral, 128 and 8 for Qwen3-30B-A3B); Granite MoE's
    # (granite-3.1-1b-a400m's layout: stacked experts, Granite's multipliers); OLMoE's (OLMo's q/k norms over all the
    # heads, the top-2 weights not renormalised)
    "granitemoe": ("granitemoe", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                      intermediate_size=48, embedding_multiplier=12.0, attention_multiplier=0.05,
                                      residual_multiplier=0.22, logits_scaling=8.0)),
    # Granite 4's: GraniteMoeShared's experts beside an ungated shared MLP (gate and up fused); GraniteMoeHybrid's
    # attention layers with its shared MLP alone (granite-4.0-micro's), and without a rotary embedding (NoPE: as
    # granite-4.0-h-*'s attention layers); granite-4.0-h's Mamba-2 layers around an attention layer, with experts
    # (h-tiny's) and without (h-micro's): 4 heads of 32, 2 groups of B and C of 16, chunks of 8 (256 in theirs) so
    # that a prompt spans several; A_log, dt_bias, D, the conv's bias and the gated norm made random
    "granitemoeshared": ("granitemoeshared", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                                  intermediate_size=48, shared_intermediate_size=96,
                                                  embedding_multiplier=12.0, attention_multiplier=0.05,
                                                  residual_multiplier=0.22, logits_scaling=8.0)),
    "granite4-dense": ("granitemoehybrid", dict(num_key_value_heads=2, num_local_experts=0, shared_intermediate_size=96,
                                                layer_types=["attention", "attention"], position_embedding_type="rope",
                                                embedding_multiplier=12.0, attention_multiplier=0.05,
                                                residual_multiplier=0.22, logits_scaling=8.0)),
    "granite4-nope": ("granitemoehybrid", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                               intermediate_size=48, shared_intermediate_size=96,
                                               layer_types=["attention", "attention"], position_embedding_type=None,
                                               residual_multiplier=0.22)),
    "granite4-hybrid": ("granitemoehybrid", dict(
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
        shared_intermediate_size=96, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
        position_embedding_type=None, residual_multiplier=0.22, embedding_multiplier=2.0, mamba_n_heads=4,
        mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8)),
    "granite4-hybrid-dense": ("granitemoehybrid", dict(
        num_key_value_heads=2, num_local_experts=0, shared_intermediate_size=96, num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"], position_embedding_type=None, mamba_n_heads=4,
        mamba_d_state=16, mamba_chunk_size=8)),
    # Qwen3.5's and Qwen3-Next's: Gated DeltaNet layers (2 key heads of 16, 4 value heads of 16, each key head
    # read by two) around a gated attention layer (4 heads of 32, a quarter turned), q/k norms and the layers' norms
    # scaling by 1 + w (made random); Qwen3-Next's and Qwen3.5-MoE's with experts and a gated shared one
    "qwen3.5": ("qwen3_5_text", dict(num_key_value_heads=2, head_dim=32, num_hidden_layers=3,
                                     layer_types=["linear_attention", "full_attention", "linear_attention"],
                                     **_DELTANET)),
    "qwen3-next": ("qwen3_next", dict(num_key_value_heads=2, head_dim=32, num_hidden_layers=3,
                                      layer_types=["linear_attention", "full_attention", "linear_attention"],
                                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                      shared_expert_intermediate_size=96, **_DELTANET)),
    "qwen3.5-moe": ("qwen3_5_moe_text", dict(num_key_value_heads=2, head_dim=32, num_hidden_layers=3,
                                             layer_types=["linear_attention", "full_attention", "linear_attention"],
                                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                             shared_expert_intermediate_size=96, **_DELTANET)),
    "olmoe": ("olmoe", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    "mixtral": ("mixtral", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                tie_word_embeddings=False)),
    # a shared expert, a dense MLP in layer 1 (mlp_only_layers), the top-2 weights not renormalised
    "qwen2-moe": ("qwen2_moe", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=48, shared_expert_intermediate_size=96,
                                    mlp_only_layers=[1], norm_topk_prob=False)),
    # ERNIE 4.5 MoE's layout: a dense layer 0, then experts chosen with a bias of the router's (made random in
    # build_tiny_hf_model) and two shared experts as one ungated MLP; the GPT-J rotary layout; biases (use_bias)
    "ernie4_5-moe": ("ernie4_5_moe", dict(num_key_value_heads=2, head_dim=16, use_bias=True, moe_num_experts=4,
                                          moe_k=2, moe_intermediate_size=48, moe_num_shared_experts=2,
                                          moe_layer_start_index=1)),
    # LFM2-MoE's (LFM2-8B-A1B's layout): LFM2's layers, a dense MLP in layer 0, experts after it, scored by sigmoids,
    # chosen with a bias (made random in build_tiny_hf_model), renormalised and scaled
    "lfm2-moe": ("lfm2_moe", dict(num_key_value_heads=1, layer_types=["conv", "full_attention", "conv"],
                                  num_hidden_layers=3, norm_eps=1e-5, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=48, num_dense_layers=1, routed_scaling_factor=1.5)),
    "qwen3-moe": ("qwen3_moe", dict(num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=48, norm_topk_prob=True)),
    # DeepSeek's latent attention: V2-Lite's (queries straight from x, a dense layer 0, then 4 experts, 2 a token, and
    # a shared one; YaRN with its mscale, which scales the scores too) and V3's (queries through their own latent,
    # sigmoid scores chosen with a bias, made random in build_tiny_hf_model, renormalised and scaled)
    "deepseek-v2": ("deepseek_v2", dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=16, head_dim=8, n_routed_experts=4,
                                        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=48,
                                        first_k_dense_replace=1, tie_word_embeddings=False, rope_parameters=dict(
                                            rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.707,
                                            mscale_all_dim=0.707, original_max_position_embeddings=64))),
    "deepseek-v3": ("deepseek_v3", dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=16, head_dim=8, n_routed_experts=4,
                                        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=48,
                                        first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
                                        routed_scaling_factor=2.5, tie_word_embeddings=False)),
    # Granite SWA's: Granite's multipliers, attention sinks (made random), a global layer, then a local one (a window
    # of 6) with a rotary base of its own and a local one without a rotary embedding (its base 0)
    "granite-swa": ("granite_swa", dict(num_key_value_heads=2, num_hidden_layers=3, embedding_multiplier=12.0,
                                        attention_multiplier=0.05, residual_multiplier=0.22, logits_scaling=8.0,
                                        sliding_window=6, layer_types=["full_attention", "sliding_attention",
                                                                       "sliding_attention"],
                                        layer_rope_theta=[10000.0, 500.0, 0.0])),
    # Granite MoE SWA's: Granite SWA's attention over GraniteMoeShared's layers (experts beside a shared MLP)
    "granitemoe-swa": ("granitemoe_swa", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                              intermediate_size=48, shared_intermediate_size=96,
                                              residual_multiplier=0.22, sliding_window=6,
                                              layer_types=["sliding_attention", "full_attention"],
                                              layer_rope_theta=[500.0, 10000.0])),
    # gpt-oss's layout: a biased router and biased experts (made random in build_tiny_hf_model), their SwiGLU clamped
    # at a limit this small (0.5 against 7) so that it bites, attention sinks (made random), a local layer (a window
    # of 6) and a global one, YaRN untruncated, q/k/v/o biased, an untied LM head
    "gpt-oss": ("gpt_oss", dict(num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                intermediate_size=48, sliding_window=6, swiglu_limit=0.5, tie_word_embeddings=False,
                                layer_types=["sliding_attention", "full_attention"], rope_parameters=dict(
                                    rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                    truncate=False, original_max_position_embeddings=64))),
}


def tiny_config(kind: str = "llama-gqa", **overrides: Any) -> Any:
    """The transformers config of one of TINY_MODELS, with overrides."""
    from transformers import AutoConfig

    model_type, extra = TINY_MODELS[kind]
    return AutoConfig.for_model(model_type, **{**_COMMON, **extra, **overrides})


def build_tiny_hf_model(kind: str = "llama-gqa", seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised float32 transformers causal LM, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(kind, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    if config.model_type in ("gemma", "gemma2", "gemma3_text", "glm4", "stablelm", "phi", "gpt_neox", "starcoder2",
                             "cohere", "cohere2", "gpt2", "gpt_bigcode", "opt", "gptj", "falcon", "nemotron",
                             "hunyuan_v1_dense", "bloom", "mpt", "ernie4_5_moe", "apertus", "vaultgemma", "gpt_oss"):
        randomize_norms(model, mean=0.0 if "gemma" in config.model_type else 1.0)
    # their sinks start at 0 (+-0.1), gpt-oss's experts' biases (stacked) at 0
    if config.model_type in ("gpt_oss", "granite_swa", "granitemoe_swa"):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith((".sinks", "_proj_bias")):
                    param.normal_(0.0, 1.0 if name.endswith(".sinks") else 0.2)
    if config.model_type in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):   # norms of 1 + w, from w = 0
        randomize_norms(model, mean=0.0)
        with torch.no_grad():   # (and the Gated DeltaNet layers' gated norm, of w, and dt bias)
            for name, param in model.named_parameters():
                if name.endswith(("linear_attn.norm.weight", "dt_bias")):
                    param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.5)
    if config.model_type == "granitemoehybrid":     # its Mamba-2 layers' A, dt bias, D, conv bias and norm
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("A_log", "dt_bias", ".D", "conv1d.bias", "mamba.norm.weight")):
                    param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.5)
    if config.model_type == "apertus":     # its xIELUs' parameters start alike in every layer: made random
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith((".act_fn.alpha_p", ".act_fn.alpha_n")):
                    param.normal_(0.0, 0.5)
    if config.model_type in ("ernie4_5_moe", "lfm2_moe", "deepseek_v3"):    # their experts' selection bias starts
        with torch.no_grad():                   # at 0: made random, so that it changes which experts tokens get
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(("e_score_correction_bias", "expert_bias")):
                    tensor.uniform_(-0.3, 0.3)
    return model.eval()


def randomize_norms(model: Any, mean: float = 0.0) -> None:
    """Gemma's norms start at w = 0 (a scale of 1 + w), the others' at 1 (`mean`), LayerNorms' and linear layers'
    biases at 0: made random, so that a wrong or misplaced norm or bias shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or (".ln_" in name or ".norm_" in name) and name.endswith(".weight"):
                param.normal_(mean, 0.2)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.2)


def build_byte_tokenizer() -> Any:
    """A byte-level BPE tokenizer with no merges (ids 3..258 are bytes) and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(specials + sorted(alphabet) + ["<|im_start|>", "<|im_end|>"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return fast


def save_tiny_model(folder: Path, kind: str = "llama-gqa", seed: int = 0, max_shard_size: str | None = None,
                    with_tokenizer: bool = True, **overrides: Any) -> tuple[Path, Any]:
    """Save a tiny random model (safetensors, optionally sharded) and a byte tokenizer; returns (folder, hf model)."""
    folder = Path(folder)
    model = build_tiny_hf_model(kind, seed, **overrides)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    if with_tokenizer:
        build_byte_tokenizer().save_pretrained(folder)
    return folder, model


def hf_greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt (token ids), one prompt at a time, exactly max_tokens each."""
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                       min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            out.append(generated[0, len(prompt):].tolist())
    return out


class SimplePagedRunner:
    """A minimal stand-in for the model runner: per-sequence block tables over a hand-allocated KV cache (and the
    sequences' Mamba-2 states, for a model with Mamba-2 layers)."""

    def __init__(self, model: Any, block_size: int = 4, num_blocks: int = 64,
                 dtype: torch.dtype = torch.float32) -> None:
        from pagedllm.attention.metadata import AttentionMetadata
        from pagedllm.models.recurrent import RecurrentMixer, RecurrentStates
        from pagedllm.runner.model_runner import model_shape

        self._meta_cls = AttentionMetadata
        pool = model_shape(model.config)     # (LFM2's convolutions may take more layers, DeepSeek's rows are wider)
        shape = (num_blocks, block_size, pool.num_kv_heads, pool.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(pool.num_layers)]
        self.model, self.block_size = model, block_size
        # Hand out blocks in a scrambled order (block 0 reserved) so tables are not contiguous.
        self._free = list(range(num_blocks - 1, 0, -1))[::2] + list(range(num_blocks - 1, 0, -1))[1::2]
        self.block_tables: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}
        mixers = [m for m in model.modules() if isinstance(m, RecurrentMixer)]
        self.recurrent = RecurrentStates(mixers, 16, dtype, torch.device("cpu")) if mixers else None

    @torch.inference_mode()
    def step(self, new_tokens: dict[int, list[int]]) -> torch.Tensor:
        """Run one batched step; returns the last new token's logits of each sequence: [num_seqs, V] float32."""
        seq_ids = list(new_tokens)
        for sid in seq_ids:
            table = self.block_tables.setdefault(sid, [])
            needed = -(-(self.num_computed.get(sid, 0) + len(new_tokens[sid])) // self.block_size)
            while len(table) < needed:
                table.append(self._free.pop(0))
        computed = [self.num_computed.get(s, 0) for s in seq_ids]
        query_lens = [len(new_tokens[s]) for s in seq_ids]
        meta = self._meta_cls.build([self.block_tables[s] for s in seq_ids], computed, query_lens, self.block_size)
        input_ids = torch.tensor([t for s in seq_ids for t in new_tokens[s]], dtype=torch.int64)
        positions = torch.cat([torch.arange(c, c + q) for c, q in zip(computed, query_lens)])
        if self.recurrent is not None:
            from pagedllm.core.sched.output import ScheduledRequest

            meta.recurrent = self.recurrent.begin([ScheduledRequest(str(s), self.block_tables[s], c, new_tokens[s],
                                                                    True) for s, c in zip(seq_ids, computed)])
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if meta.recurrent is not None:
            self.recurrent.commit(meta.recurrent, {})
        last = torch.tensor(meta.query_start_loc_cpu[1:]) - 1
        for s, q in zip(seq_ids, query_lens):
            self.num_computed[s] = self.num_computed.get(s, 0) + q
        return self.model.compute_logits(hidden[last]).float()


def clear_first_tokens(hf_model: Any, prompts: list[list[int]]) -> tuple[list[int], list[int]]:
    """(each prompt's first greedy token in float32, the prompts whose token a lower precision should keep): those
    whose float32 top two logits are not a near tie (0.05 apart) and whose token transformers' own model keeps in
    bf16 (a tiny random model's choices can flip there: an expert's, a Mamba-2 layer's decays)."""
    import copy

    with torch.inference_mode():
        logits = [hf_model(torch.tensor([p])).logits[0, -1] for p in prompts]
        hf_bf16 = copy.deepcopy(hf_model).bfloat16()
        bf16_tokens = [int(hf_bf16(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
    clear = [i for i, row in enumerate(logits)
             if float(row.topk(2).values.diff().abs()) > 0.05 and bf16_tokens[i] == int(row.argmax())]
    assert clear, "no prompt's first token is clear enough to compare"
    return [int(row.argmax()) for row in logits], clear


def save_attention_adapter(hf_model: Any, folder: Path, seed: int = 1,
                           modules: tuple[str, ...] = ("q_proj", "v_proj", "o_proj")) -> Any:
    """A random rank-4 PEFT LoRA adapter of the attention's `modules` (its B made non-zero), saved in `folder`; the
    adapted transformers model, its oracle. (A model of experts or recurrent layers takes adapters there only.)"""
    import copy

    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=list(modules), init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(folder)
    return model.eval()


def run_modules(monkeypatch: Any) -> None:
    """Make every Llama model, loaded before or after, run its modules one by one (no DecoderStack), so that a layer
    function the test patches takes effect."""
    from pagedllm.models.llama import LlamaModel

    monkeypatch.setattr(LlamaModel, "stack_for", lambda self, x: None)


def use_gguf_reference(monkeypatch: Any) -> None:
    """Make every linear layer whose weight is packed as GGUF blocks (Q8_0, Q4_0, Q4_1: GGUF's, and AWQ's and
    GPTQ's repacked) compute `gguf_reference` (the kernel's bits, from torch) instead; the others keep their kernels.
    The models run their modules (`run_modules`)."""
    from gguf import GGMLQuantizationType

    from pagedllm.layers import embedding
    from pagedllm.layers import linear as linear_module

    kernel_linear = linear_module.linear

    def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.dtype != torch.uint8:
            return kernel_linear(x, weight, bias)
        x = x if weight.input_perm is None else x.index_select(1, weight.input_perm)
        return linear_module.gguf_reference(x, weight, GGMLQuantizationType(weight.ggml_type), weight.out_features,
                                            bias, weight.activation_bits)

    monkeypatch.setattr(linear_module, "linear", reference)
    monkeypatch.setattr(embedding, "linear", reference)
    run_modules(monkeypatch)
