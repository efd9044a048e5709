"""One Llama-family decoder: Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM 2 and 3, Phi-3, Gemma 1, 2 and 3; MHA, GQA and
MQA; tied or untied embeddings. SmolLM3 leaves the rotary embedding out of the layers its `no_rope_layers` marks
0. Qwen3 adds an RMSNorm over each query and key head (`q_norm`, `k_norm`) before the rotary embedding (Hunyuan's
after it: `norms_after_rope`). Phi-3
stores its q/k/v and gate/up weights fused (`unfused` splits them) and may turn a part of each head
(`partial_rotary_factor`) with longrope's two sets of frequencies (`RotaryEmbedding`). Mixtral, Qwen2-MoE and Qwen3-MoE
replace the MLP with a mixture of experts (`LlamaSparseMoeBlock`), as do Granite MoE and Qwen3-VL-MoE's language model
(their experts stacked in their checkpoints: `_stacked_experts`) and OLMoE (OLMo's q/k norms over all the heads, before
Llama's layers). gpt-oss (20b, 120b) has biased experts under a biased router, their SwiGLU clamped (`SwigluOAI`),
their weights stacked and gate/up interleaved (`_gpt_oss_experts`), and an attention sink of each head, a learned
logit in every row's softmax whose value is zero (the attention backends' `sinks`), on local layers (a 128-token
window) alternating with global ones.
Gemma's have their embeddings scaled by sqrt(hidden_size), RMSNorm weights stored as w - 1 (`load_weights` adds the
1 back) and a GELU-gated MLP: the first Gemma's layers are otherwise Llama's. Gemma 2 and 3 add a norm on each
branch's output before it joins the residual stream (`pre_feedforward_layernorm`, `post_feedforward_layernorm`),
`query_pre_attn_scalar` for their attention scale, and local layers (over a sliding window). Gemma 2 soft-caps its
attention scores and its logits (`attn_logit_softcapping`, `final_logit_softcapping`: cap tanh(x / cap)); Gemma 3
(text) has Qwen3's head norms instead, and a rotary base of its own in its local layers. EmbeddingGemma is Gemma 3
as an encoder (`attends_both_ways`): each token attends to those after it too, through `bidirectional_attention`.
OLMo 2 and 3 and EXAONE 4 norm each branch's output rather than its input (`post_attention_layernorm`,
`post_feedforward_layernorm`, no `input_layernorm`: `_norms_outputs`); OLMo's norm their queries and keys over all
their heads at once (`q_norm`, `k_norm` of heads x head_dim: on one rank), EXAONE 4's each head's, as Qwen3's. OLMo 3
and EXAONE 4 have local layers (over a sliding window) among their global ones, as Gemma's; EXAONE 4's global layers
turn no values (NoPE). InternLM3 is Llama's layout; Seed-OSS has a bias of its own on o_proj (`attention_out_bias`).
ERNIE 4.5 and Helium turn interleaved pairs of a head's values (the GPT-J rotary layout): `load_weights` reorders
their q and k rows into the halves the rotary embedding turns (`interleaved_to_halves`, which leaves q . k as it was).
ERNIE 4.5 MoE (its 21B-A3B) adds experts chosen with a bias of the router's (`selection_bias`), an ungated shared
expert, and dense layers around its sparse ones (`_is_sparse_layer`).
GLM (GLM-4-9B-0414's `glm4`, and the older `glm`) turns interleaved pairs of half of each head's values, stores its
gate/up weights fused (as Phi-3's), biases q/k/v but not o_proj; GLM-4's layers norm each branch's output too, as
Gemma's (`_GLM4_NAMES` gives its norms Gemma's names), with plain RMSNorm weights.
Granite (IBM's Granite 3) scales four things by its config's multipliers: the embeddings (`embedding_multiplier`),
the attention scores (`attention_multiplier`, in place of head_dim ** -0.5), each branch's output before it joins
the residual stream (`residual_multiplier`: `load_weights` folds it into o_proj's and down_proj's weights, so that
the layers and the C++ stack run as Llama's) and the logits (divided by `logits_scaling`). Granite SWA adds gpt-oss's
attention sinks, local layers among global ones (`layer_types`) and a rotary base of each layer's own
(`layer_rope_theta`, 0: none); Granite MoE SWA the same over GraniteMoeShared's layers. Granite 4's layers
(GraniteMoeShared's, GraniteMoeHybrid's) add a shared MLP, gate and up fused (`_GRANITE_SHARED_NAMES`): an ungated
shared expert beside the experts, or the MLP of a model without them (granite-4.0-micro); GraniteMoeHybrid's
attention may turn no values (position_embedding_type other than "rope"); its Mamba-2 layers are
`pagedllm.models.mamba.Mamba2Mixer`s in the attention's place (the C++ stack has none: such a model runs its
modules). Qwen3-Next's and Qwen3.5's (dense and MoE) language models have Gated DeltaNet layers
(`pagedllm.models.deltanet.GatedDeltaNet`) in the attention's place in three of every four layers, modules too; the
fourth's attention gates each head's output by the sigmoid of a gate its q_proj gives beside the query
(`output_gate`, split from q_proj's rows by `unfused`), norms q and k by head and turns a quarter of each head, and
every norm of theirs scales by 1 + w (`_norm_weight_is_offset`); their experts have Qwen2-MoE's gated shared one.
LayerNorm models norm with `PreLayerNorm` (weights and biases; Cohere's weights only, OLMo's neither; Nemotron's
scaling by 1 + w): StableLM (Llama's layers otherwise), Phi, GPT-NeoX, StarCoder2 (biased, over a sliding window),
Cohere and Cohere2, GPT-2, GPT-BigCode, OPT, GPT-J, Falcon, OLMo (the first; q/k/v clamped to `clip_qkv`), Nemotron.
Phi's, GPT-J's, Cohere's, Falcon's and GPT-NeoX's attention and MLP read the same stream, their outputs joining it
together (`_parallel_branches`): under one norm, or (GPT-NeoX's, Falcon 40B's) the MLP under a norm of its own. Most
of their MLPs are ungated (`PlainMLP`: GELU, its tanh approximation, ReLU, Nemotron's squared ReLU), Phi's and
GPT-J's LM heads biased; Arcee's layers are Llama's with Nemotron's MLP. GPT-NeoX, GPT-BigCode and Falcon store
q/k/v fused by KV-head group, and GPT-2 its weights [in, out] (Conv1D): `unfused` splits the one, `load_weights`
transposes the other; each family's checkpoint names map onto the modules' (`_CHECKPOINT_NAMES`). GPT-2, GPT-BigCode
and OPT add a learned embedding of each position to its token's (`embed_positions`; OPT's table starts 2 rows in)
and turn no values; Cohere's and GPT-J's ropes turn interleaved pairs (reordered at load), Cohere's logits are
multiplied by `logit_scale`, Cohere2's global layers turn no values (as EXAONE 4's). BLOOM, MPT and Falcon-RW (Falcon's
`alibi`) turn no values either: ALiBi biases their attention scores by each key's distance from its query, a slope for
each head (`alibi_slopes_of`; BLOOM's layers are GPT-NeoX's sequential ones, its embeddings normed first: `embed_norm`;
MPT's unbiased, under LayerNorms without biases, q/k/v fused q's rows first). The C++ stack runs their layers as it
runs the others' (a LayerNorm where a norm has a bias, parallel branches, the ungated MLP's activation as torch
computes it, ALiBi's slopes).

The model is format-agnostic: `load_weights` takes Hugging Face parameter names from any loader and maps the
separate q/k/v and gate/up checkpoint tensors onto the fused parameters (`STACKED_PARAMS_MAPPING`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.cpu import bidirectional_attention, paged_attention, write_kv
from pagedllm.attention.metadata import AttentionBackend, AttentionMetadata, KVCache
from pagedllm.attention.torch_ref import paged_attention_ref
from pagedllm.distributed.communicator import communicator
from pagedllm.kernels import kernels_for
from pagedllm.layers.activation import GeluAndMul, SiluAndMul, SwigluOAI
from pagedllm.layers.alibi import geometric_slopes, mpt_slopes
from pagedllm.layers.embedding import ParallelLMHead, VocabEmbedding
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    fuses_silu_and_mul,
    is_block_packed,
    linear_silu_and_mul,
)
from pagedllm.layers.moe import Routing, route, run_experts
from pagedllm.layers.norm import PreLayerNorm, RMSNorm
from pagedllm.layers.rotary import (
    RotaryEmbedding,
    get_rope,
    interleaved_to_halves,
    mrope_axes,
    rope_config,
    rotary_dim,
)
from pagedllm.models.deltanet import QWEN3_NEXT_FUSED, GatedDeltaNet, split_qwen3_next_projections
from pagedllm.models.mamba import Mamba2Mixer
from pagedllm.models.mla import MLAttention, is_mla, mla_rope_rows
from pagedllm.models.recurrent import (
    GATED_DELTANET_MODEL_TYPES,
    RecurrentMixer,
    has_recurrent_layers,
    recurrent_layer_kind,
)
from pagedllm.models.vision import ImageEncoder, ImageRows
from pagedllm.multimodal import ImageInput

if TYPE_CHECKING:
    from pagedllm.lora.adapter import LoRABatch

# (fused parameter name part, checkpoint name part, shard id)
STACKED_PARAMS_MAPPING: list[tuple[str, str, str | int]] = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
    (".in_proj_qkvzba", ".in_proj_qkv", 0),     # a Gated DeltaNet layer's (Qwen3.5's names)
    (".in_proj_qkvzba", ".in_proj_z", 1),
    (".in_proj_qkvzba", ".in_proj_b", 2),
    (".in_proj_qkvzba", ".in_proj_a", 3),
]
# fused module -> the checkpoint modules whose rows it stacks, in order (vLLM's name for it), for loaders that
# place whole rows, such as pagedllm.layers.linear.pack_gguf_linear_weights
PACKED_MODULES_MAPPING: dict[str, list[str]] = {
    fused[1:]: [part[1:] for other, part, _ in STACKED_PARAMS_MAPPING if other == fused]
    for fused, _, _ in STACKED_PARAMS_MAPPING}
# (and older GPT-NeoX and GPT-2 checkpoints' causal masks)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached", ".attention.bias",
                     ".attention.masked_bias", ".attn.bias", ".attn.masked_bias")
# Mixtral's checkpoint names of its sparse MLP -> the names of Qwen-MoE's, which the model's modules take
_MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                  (".w2.", ".down_proj."))
# A model type's checkpoint names -> the modules', replaced in this order:
# GLM-4's norms under Gemma's names (in this order: its post_attention_layernorm is Gemma's pre_feedforward_layernorm);
# LFM2's (its convolution is the layer's `self_attn`, a ShortConv, whose out_proj is its o_proj as an attention's is);
# Granite MoE's router (its block_sparse_moe already the mlp: _MIXTRAL_NAMES); Phi's; GPT-NeoX's (its MLP under
# Phi's names; embed_out: older checkpoints' LM head); StarCoder2's MLP's; GPT-2's
# (c_attn: q/k/v fused, q's rows then k's then v's) and GPT-BigCode's (c_attn: fused by KV-head group, its one group
# of all the queries a multi-query model's); OPT's (its MLP's norm is the layer's
# final_layer_norm, the decoder's own the model's norm; older checkpoints' names start at "decoder."); GPT-J's;
# Falcon's (its new decoder architecture's ln_attn and ln_mlp: the two norms of GPT-NeoX's parallel branches)
_GLM4_NAMES = ((".post_attention_layernorm.", ".pre_feedforward_layernorm."),
               (".post_self_attn_layernorm.", ".post_attention_layernorm."),
               (".post_mlp_layernorm.", ".post_feedforward_layernorm."))
_LFM2_NAMES = ((".operator_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
               (".feed_forward.w1.", ".mlp.gate_proj."), (".feed_forward.w3.", ".mlp.up_proj."),
               (".feed_forward.w2.", ".mlp.down_proj."), (".self_attn.out_proj.", ".self_attn.o_proj."),
               (".q_layernorm.", ".q_norm."), (".k_layernorm.", ".k_norm."), (".conv.in_proj.", ".self_attn.in_proj."),
               (".conv.out_proj.", ".self_attn.o_proj."), (".conv.conv.", ".self_attn.conv."),
               ("model.embedding_norm.", "model.norm."))
_PHI_NAMES = ((".self_attn.dense.", ".self_attn.o_proj."), ("model.final_layernorm.", "model.norm."))
_GPT_NEOX_NAMES = (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.final_layer_norm.", "model.norm."),
                   ("gpt_neox.layers.", "model.layers."), (".attention.dense.", ".self_attn.o_proj."),
                   (".attention.", ".self_attn."), (".mlp.dense_h_to_4h.", ".mlp.fc1."),
                   (".mlp.dense_4h_to_h.", ".mlp.fc2."), ("embed_out.", "lm_head."))
_STARCODER2_NAMES = ((".mlp.c_fc.", ".mlp.fc1."), (".mlp.c_proj.", ".mlp.fc2."))
_GPT2_BODY_NAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.wpe.", "model.embed_positions."),
                    ("transformer.h.", "model.layers."), ("transformer.ln_f.", "model.norm."),
                    (".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
                    (".attn.c_proj.", ".self_attn.o_proj.")) + _STARCODER2_NAMES
_GPT2_NAMES = _GPT2_BODY_NAMES + ((".attn.c_attn.", ".self_attn.qkv_proj."),)
_GPT_BIGCODE_NAMES = _GPT2_BODY_NAMES + ((".attn.c_attn.", ".self_attn.query_key_value."),)
_OPT_NAMES = (("model.decoder.final_layer_norm.", "model.norm."), ("model.decoder.", "model."),
              (".self_attn_layer_norm.", ".input_layernorm."), (".final_layer_norm.", ".post_attention_layernorm."),
              (".self_attn.out_proj.", ".self_attn.o_proj."), (".fc1.", ".mlp.fc1."), (".fc2.", ".mlp.fc2."))
_GPTJ_NAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.h.", "model.layers."),
               ("transformer.ln_f.", "model.norm."), (".ln_1.", ".input_layernorm."), (".attn.", ".self_attn."),
               (".self_attn.out_proj.", ".self_attn.o_proj."), (".mlp.fc_in.", ".mlp.fc1."),
               (".mlp.fc_out.", ".mlp.fc2."))
_FALCON_NAMES = (("transformer.word_embeddings.", "model.embed_tokens."), ("transformer.h.", "model.layers."),
                 ("transformer.ln_f.", "model.norm."), (".ln_attn.", ".input_layernorm."),
                 (".ln_mlp.", ".post_attention_layernorm."), (".self_attention.dense.", ".self_attn.o_proj."),
                 (".self_attention.", ".self_attn."), (".mlp.dense_h_to_4h.", ".mlp.fc1."),
                 (".mlp.dense_4h_to_h.", ".mlp.fc2."))
_UP_DOWN_NAMES = ((".mlp.up_proj.", ".mlp.fc1."), (".mlp.down_proj.", ".mlp.fc2."))    # Nemotron's, Arcee's
# Apertus's: Llama's norms under names of their own, the ungated MLP's, its xIELU's parameters
_APERTUS_NAMES = _UP_DOWN_NAMES + ((".attention_layernorm.", ".input_layernorm."),
                                   (".feedforward_layernorm.", ".post_attention_layernorm."),
                                   (".mlp.act_fn.", ".mlp.xielu."))
_BLOOM_NAMES = (("transformer.word_embeddings_layernorm.", "model.embed_norm."),) + _FALCON_NAMES
_MPT_NAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.blocks.", "model.layers."),
              ("transformer.norm_f.", "model.norm."), (".norm_1.", ".input_layernorm."),
              (".norm_2.", ".post_attention_layernorm."), (".attn.Wqkv.", ".self_attn.qkv_proj."),
              (".attn.out_proj.", ".self_attn.o_proj."), (".ffn.up_proj.", ".mlp.fc1."),
              (".ffn.down_proj.", ".mlp.fc2."))
# the bias of a router's choice as a GGUF file's exp_probs_b loads (pagedllm.loader.gguf)
_GGUF_SELECTION_BIAS = (".mlp.moe_statics.e_score_correction.bias", ".mlp.selection_bias")
# LFM2-MoE's: LFM2's, its sparse layers' feed_forward the mlp, each expert's w1/w3/w2 a gated MLP's
_LFM2_MOE_NAMES = _LFM2_NAMES + ((".feed_forward.experts.", ".mlp.experts."), (".feed_forward.gate.", ".mlp.gate."),
                                 (".feed_forward.expert_bias", ".mlp.selection_bias"), (".w1.", ".gate_proj."),
                                 (".w3.", ".up_proj."), (".w2.", ".down_proj."), _GGUF_SELECTION_BIAS)
# ERNIE 4.5 MoE's shared experts (one ungated MLP) and its router's selection bias
_ERNIE_MOE_NAMES = ((".mlp.shared_experts.", ".mlp.shared_expert."),
                    (".mlp.moe_statics.e_score_correction_bias", ".mlp.selection_bias"), _GGUF_SELECTION_BIAS)
# DeepSeek's shared experts (one ungated MLP) and V3's bias of its router's choice
_DEEPSEEK_NAMES = ((".mlp.shared_experts.", ".mlp.shared_expert."),
                   (".mlp.gate.e_score_correction_bias", ".mlp.selection_bias"), _GGUF_SELECTION_BIAS)
# A model type's checkpoint tensors the model does not use, by a part of their names: ERNIE 4.5 MoE's, Qwen3-Next's
# and Qwen3.5's multi-token prediction layers (transformers ignores them too)
_UNUSED_NAME_PARTS = {"ernie4_5_moe": "mtp", **{t: "mtp." for t in GATED_DELTANET_MODEL_TYPES}}
# Granite 4's (GraniteMoeShared's, GraniteMoeHybrid's, Granite MoE SWA's): its router (router.layer as released,
# router in transformers 5's own layout, Granite MoE SWA's), its shared MLP (gate and up fused) the mixture of experts'
# ungated shared expert, or the MLP of a layer without experts (granite-4.0-micro's); GraniteMoeHybrid's Mamba-2
# layers (`Mamba2Mixer`, the layer's self_attn, its out_proj o_proj)
_MAMBA_NAMES = ((".mamba.out_proj.", ".self_attn.o_proj."), (".mamba.", ".self_attn."))
_GRANITE_SHARED_NAMES = {True: ((".mlp.router.layer.", ".mlp.gate."), (".mlp.router.", ".mlp.gate."),
                                (".shared_mlp.input_linear.", ".mlp.shared_expert.gate_up_proj."),
                                (".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj."), *_MAMBA_NAMES),
                         False: ((".shared_mlp.input_linear.", ".mlp.gate_up_proj."),
                                 (".shared_mlp.output_linear.", ".mlp.down_proj."), *_MAMBA_NAMES)}
_CHECKPOINT_NAMES = {"granitemoe": ((".mlp.router.layer.", ".mlp.gate."),),
                     "hunyuan_v1_dense": ((".self_attn.query_layernorm.", ".self_attn.q_norm."),
                                          (".self_attn.key_layernorm.", ".self_attn.k_norm.")),
                     "glm4": _GLM4_NAMES, "lfm2": _LFM2_NAMES, "lfm2_moe": _LFM2_MOE_NAMES, "phi": _PHI_NAMES,
                     "gpt_neox": _GPT_NEOX_NAMES,
                     "starcoder2": _STARCODER2_NAMES, "gpt2": _GPT2_NAMES, "gpt_bigcode": _GPT_BIGCODE_NAMES,
                     "opt": _OPT_NAMES, "gptj": _GPTJ_NAMES, "falcon": _FALCON_NAMES, "nemotron": _UP_DOWN_NAMES,
                     "arcee": _UP_DOWN_NAMES, "bloom": _BLOOM_NAMES, "mpt": _MPT_NAMES,
                     "apertus": _APERTUS_NAMES,
                     # gpt-oss's router; a GGUF file's sinks, named as a weight
                     "gpt_oss": ((".mlp.router.", ".mlp.gate."), (".self_attn.sinks.weight", ".self_attn.sinks")),
                     # VaultGemma's MLP norm, Llama's place under Gemma's name
                     "vaultgemma": ((".pre_feedforward_layernorm.", ".post_attention_layernorm."),),
                     "ernie4_5_moe": _ERNIE_MOE_NAMES, "deepseek_v2": _DEEPSEEK_NAMES, "deepseek_v3": _DEEPSEEK_NAMES,
                     # Qwen3-Next's and Qwen3.5's Gated DeltaNet layers (`GatedDeltaNet`, the layer's self_attn)
                     **{t: ((".linear_attn.out_proj.", ".self_attn.o_proj."), (".linear_attn.", ".self_attn."))
                        for t in GATED_DELTANET_MODEL_TYPES}}
# A model type's prefix of the names its causal LM's checkpoints give its body, which checkpoints saved from the body
# alone leave out (opt-125m's "decoder.layers.0...", bloom-560m's "h.0..."): `load_weights` puts it back
_BODY_PREFIXES = {"opt": "model.", "bloom": "transformer."}


TPRank = tuple[int, int]   # (tp_rank, tp_size)


def _num_kv_heads(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _has_bias(config: Any, part: str) -> bool:
    """Whether a layer's "qkv", "o" or "mlp" projections have biases: attention_bias (q/k/v and o; Qwen2's q/k/v
    always; GLM's q/k/v only), Seed-OSS's attention_out_bias for o, mlp_bias, ERNIE 4.5's and StarCoder2's use_bias and
    Phi's, GPT-2's, GPT-BigCode's and BLOOM's for all, OPT's enable_bias and Falcon's bias, StableLM's use_qkv_bias
    for q/k/v; GPT-NeoX's and GPT-J's MLP's always; MPT's never."""
    if config.model_type == "opt":
        return bool(config.enable_bias)
    if config.model_type == "gptj":
        return part == "mlp"
    if config.model_type == "falcon":
        return bool(config.bias)
    if config.model_type == "mpt":
        return False    # (`_check_mpt`: its no_bias)
    if getattr(config, "use_bias", False) or config.model_type in ("phi", "bloom") or _learns_positions(config) or \
            (part == "mlp" and config.model_type == "gpt_neox"):
        return True
    if config.model_type == "stablelm":
        return part == "qkv" and bool(config.use_qkv_bias)
    if part == "mlp":
        return bool(getattr(config, "mlp_bias", False))
    if part == "o":
        return config.model_type not in ("glm", "glm4") and \
            bool(getattr(config, "attention_out_bias", getattr(config, "attention_bias", False)))
    return bool(getattr(config, "attention_bias", False)) or config.model_type in ("qwen2", "qwen2_moe")


def _interleaved_rope(config: Any) -> bool:
    """Whether the checkpoint's rotary embedding turns interleaved pairs of a head's values (the GPT-J layout: ERNIE
    4.5's, Helium's, GLM's, Cohere's, GPT-J's), which `load_weights` reorders into the halves pagedllm's turns; not
    where the loader gives them in halves already (`rotary_rows_in_halves`: a GGUF file's, reordered as llama.cpp's
    Llama files are)."""
    return config.model_type in ("ernie4_5", "ernie4_5_moe", "helium", "glm", "glm4", "cohere", "cohere2",
                                 "gptj") and not getattr(config, "rotary_rows_in_halves", False)


def _has_qk_norm(config: Any) -> bool:
    return _is_lfm2(config) or config.model_type in ("qwen3", "qwen3_moe", "gemma3_text", "exaone4",
                                                     "hunyuan_v1_dense", "apertus", *GATED_DELTANET_MODEL_TYPES)


def gates_attention_output(config: Any) -> bool:
    """Whether each head's attention output is multiplied by the sigmoid of a gate of its own before o_proj
    (Qwen3-Next's and Qwen3.5's: their q_proj gives each head's gate beside its query, `unfused` splits them into
    `output_gate`)."""
    return config.model_type in GATED_DELTANET_MODEL_TYPES


def _norm_weight_is_offset(config: Any, name: str) -> bool:
    """Whether a checkpoint's norm weight is stored as w - 1, its norm scaling by 1 + w (`load_weights` adds the 1
    back): Gemma's RMSNorms, Nemotron's LayerNorms, Qwen3-Next's and Qwen3.5's RMSNorms (but their Gated DeltaNet
    layers' gated norm)."""
    if not name.endswith("norm.weight"):
        return False
    if config.model_type in GATED_DELTANET_MODEL_TYPES:
        return not name.endswith(".self_attn.norm.weight")
    return _is_gemma(config) or config.model_type == "nemotron"


def _norms_qk_after_rope(config: Any) -> bool:
    """Whether each query and key head is normed after the rotary embedding turns it (Hunyuan's), not before."""
    return config.model_type == "hunyuan_v1_dense"


def _eps(config: Any) -> float:
    """The norms' epsilon (LFM2's config calls it norm_eps; a LayerNorm model's, layer_norm_eps, or as
    `_LAYER_NORM_EPS` names it)."""
    if _norms_with_layer_norm(config):
        return getattr(config, _LAYER_NORM_EPS.get(config.model_type, "layer_norm_eps"), 1e-5)
    return config.norm_eps if _is_lfm2(config) else config.rms_norm_eps


# the LayerNorms' epsilon's name in a config, where it is not layer_norm_eps (OPT's config has none: torch's 1e-5)
_LAYER_NORM_EPS = {"starcoder2": "norm_epsilon", "gpt2": "layer_norm_epsilon", "gpt_bigcode": "layer_norm_epsilon",
                   "gptj": "layer_norm_epsilon", "falcon": "layer_norm_epsilon", "nemotron": "norm_eps",
                   "bloom": "layer_norm_epsilon", "mpt": "layer_norm_epsilon"}


def _norms_with_layer_norm(config: Any) -> bool:
    """Whether the model norms with LayerNorm (mean and variance, weight and bias: StableLM's, Phi's, GPT-NeoX's,
    StarCoder2's, GPT-2's, GPT-BigCode's, Nemotron's, BLOOM's; weight only: Cohere's, MPT's; neither: OLMo's) rather
    than RMSNorm."""
    return config.model_type in ("stablelm", "phi", "gpt_neox", "starcoder2", "cohere", "cohere2", "gptj",
                                 "falcon", "olmo", "nemotron", "bloom", "mpt") or _learns_positions(config)


def _falcon_parallel(config: Any) -> bool:
    """Whether Falcon's layers' branches are parallel (`parallel_attn`, or its new decoder architecture's)."""
    return config.model_type == "falcon" and bool(config.parallel_attn or config.new_decoder_architecture)


def _falcon_two_norms(config: Any) -> bool:
    """Whether Falcon's layers norm each branch's input with a norm of its own (its new decoder architecture's
    ln_attn and ln_mlp: `num_ln_in_parallel_attn`, 2 where unset)."""
    return config.model_type == "falcon" and bool(config.new_decoder_architecture) and \
        (config.num_ln_in_parallel_attn or 2) == 2


def _plain_mlp(config: Any) -> bool:
    """Whether the MLP is ungated (fc2(act(fc1(x))): `PlainMLP`)."""
    return config.model_type in ("phi", "gpt_neox", "starcoder2", "gptj", "falcon", "nemotron", "arcee", "bloom",
                                 "mpt", "apertus") or _learns_positions(config)


def dense_mlp_shape(config: Any) -> tuple[int, int]:
    """A dense layer's MLP: (its intermediate size, its weight matrices: 3 gated, 2 ungated)."""
    return _intermediate_size(config), 2 if _plain_mlp(config) else 3


def _learns_positions(config: Any) -> bool:
    """Whether the model adds a learned embedding of each token's position to its token's (GPT-2's `wpe`, GPT-BigCode's,
    OPT's) rather than turn its queries and keys (it has no rotary embedding)."""
    return config.model_type in ("gpt2", "gpt_bigcode", "opt")


def context_length(config: Any) -> int:
    """The context the model was made for: its config's max_position_embeddings (MPT's max_seq_len), else 2048 (BLOOM's
    config names none: ALiBi sets no bound), as vLLM takes it."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "max_seq_len", None) or 2048


def _has_alibi(config: Any) -> bool:
    """Whether the model biases its attention scores by ALiBi (`alibi_slopes_of`) rather than turn its values."""
    return config.model_type in ("bloom", "mpt") or (config.model_type == "falcon" and bool(config.alibi))


def alibi_slopes_of(config: Any) -> torch.Tensor | None:
    """ALiBi's slope of each query head ([num_heads] float32), for a model that biases its attention scores by each
    key's distance from its query rather than turn its queries and keys: BLOOM's and Falcon-RW's (`alibi`: transformers
    divides its biases by sqrt(head_dim), as the slopes are here) the paper's, MPT's its own (`alibi_bias_max`); None
    for any other model."""
    if not _has_alibi(config):
        return None
    heads = config.num_attention_heads
    if config.model_type == "mpt":
        _check_mpt(config)
        return mpt_slopes(heads, config.attn_config.alibi_bias_max)
    if config.model_type == "falcon":
        return geometric_slopes(heads) / _head_dim(config) ** 0.5
    return geometric_slopes(heads)     # BLOOM's


def _mpt_attention(config: Any, option: str) -> Any:
    """One of MPT's attention options (`attn_config`: softmax_scale, clip_qkv); None for another model."""
    return getattr(config.attn_config, option) if config.model_type == "mpt" else None


def _check_mpt(config: Any) -> None:
    """ValueError for what of MPT's options transformers' MPT (the oracle) leaves out: biases, its norms of queries and
    keys, a prefix LM, multi-query attention, positions learned instead of ALiBi, a logit scale."""
    attn = config.attn_config
    unsupported = [name for name, value in (("no_bias=False", not config.no_bias), ("qk_ln", attn.qk_ln),
                                            ("prefix_lm", attn.prefix_lm), ("alibi=False", not attn.alibi),
                                            ("logit_scale", config.logit_scale is not None),
                                            ("attn_type=" + attn.attn_type, attn.attn_type != "multihead_attention"))
                   if value]
    if unsupported:
        raise ValueError(f"MPT with {', '.join(unsupported)} is not supported")


def _check_opt(config: Any) -> None:
    """ValueError for what of OPT's options the layers do not take: opt-350m's (its norms after each branch, its
    embeddings narrower than the layers), norms without weights."""
    if not config.do_layer_norm_before or config.word_embed_proj_dim != config.hidden_size:
        raise ValueError("OPT with its norms after each branch or embeddings projected in and out (opt-350m's: "
                         "do_layer_norm_before=False, word_embed_proj_dim) is not supported")
    if not config.layer_norm_elementwise_affine:
        raise ValueError("OPT's norms without weights (layer_norm_elementwise_affine=False) are not supported")


def _is_cohere(config: Any) -> bool:
    return config.model_type in ("cohere", "cohere2")


def _is_lfm2(config: Any) -> bool:
    return config.model_type in ("lfm2", "lfm2_moe")


def _norm(config: Any, dtype: torch.dtype) -> RMSNorm | PreLayerNorm:
    """A norm over the hidden size, of the model's kind (`_norms_with_layer_norm`)."""
    if _norms_with_layer_norm(config):
        learned = config.model_type != "olmo"   # (OLMo's learn no weight nor bias; Cohere's and MPT's no bias)
        return PreLayerNorm(config.hidden_size, _eps(config), dtype,
                            bias=learned and not _is_cohere(config) and config.model_type != "mpt", weight=learned)
    return RMSNorm(config.hidden_size, _eps(config), dtype)


def _parallel_branches(config: Any) -> bool:
    """Whether a layer's attention and MLP both read the stream the layer takes, their outputs added to it together
    (Phi's, GPT-J's, Cohere's, Falcon's, GPT-NeoX's `use_parallel_residual`, StableLM 2 12B's), rather than the MLP
    reading the stream after the attention's output joined it."""
    return config.model_type in ("phi", "gptj") or _is_cohere(config) or _falcon_parallel(config) or \
        (config.model_type in ("stablelm", "gpt_neox")
                                          and bool(config.use_parallel_residual))


def _intermediate_size(config: Any) -> int:
    """The MLP's width: the config's, but for LFM2's, cut to 2/3, times its multiplier, rounded up to its multiple
    (`block_auto_adjust_ff_dim`), as transformers does; GPT-2's, GPT-BigCode's and GPT-J's n_inner (4 x hidden_size
    without),
    OPT's ffn_dim, Falcon's ffn_hidden_size, BLOOM's 4 x hidden_size, MPT's expansion_ratio x hidden_size, Granite 4's
    shared_intermediate_size."""
    if config.model_type == "opt":
        return config.ffn_dim
    if config.model_type in ("bloom", "mpt"):
        return int(getattr(config, "expansion_ratio", 4) * config.hidden_size)
    if config.model_type == "falcon":
        return config.ffn_hidden_size or 4 * config.hidden_size
    if _learns_positions(config) or config.model_type == "gptj":
        return config.n_inner or 4 * config.hidden_size
    if _has_granite_shared_mlp(config) and not num_experts(config):    # (its shared MLP alone: granite-4.0-micro's)
        return config.shared_intermediate_size
    size = config.intermediate_size
    if config.model_type != "lfm2" or not config.block_auto_adjust_ff_dim:
        return size
    size = int(2 * size / 3)
    if config.block_ffn_dim_multiplier is not None:
        multiple = config.block_multiple_of
        size = multiple * ((int(config.block_ffn_dim_multiplier * size) + multiple - 1) // multiple)
    return size


def load_time_change(config: Any, quantization: str) -> str | None:
    """What `load_weights` does to the checkpoint's weights, which blocks kept packed (`quantization` "gguf",
    "awq" or "gptq": never loaded as weights) cannot take; None where it changes none that they cannot. (A GGUF
    file's blocks take Granite's residual multiplier in their scales: `pagedllm.loader.gguf.scaled_blocks`.)"""
    if float(getattr(config, "residual_multiplier", None) or 1.0) != 1.0 and quantization != "gguf":
        return "Granite's residual_multiplier is folded into its o_proj and down_proj weights"
    if _interleaved_rope(config):
        return f"{config.model_type}'s q and k rows are reordered for the rotary embedding"
    return None


def is_conv_layer(config: Any, index: int) -> bool:
    """Whether decoder layer `index` is a short convolution (LFM2's "conv" layers), not an attention."""
    return _layer_type(config, index) == "conv"


def has_conv_layers(config: Any) -> bool:
    """Whether any decoder layer is a short convolution (LFM2's)."""
    return any(is_conv_layer(config, index) for index in range(config.num_hidden_layers))


def cache_layers(config: Any) -> list[slice]:
    """Each decoder layer's layers of the KV pool: one for an attention layer; for a short convolution (LFM2's), as
    many as hold a token's convolution input (hidden_size values) in their K and V rows (`ShortConv`)."""
    row = 2 * _num_kv_heads(config) * _head_dim(config)     # a pool layer's values a token
    slices, start = [], 0
    for index in range(config.num_hidden_layers):
        width = -(-config.hidden_size // row) if is_conv_layer(config, index) else \
            0 if recurrent_layer_kind(config, index) else 1
        slices.append(slice(start, start + width))
        start += width
    return slices


def _is_gemma(config: Any) -> bool:
    return config.model_type in ("gemma", "gemma2", "gemma3_text", "vaultgemma")


def _norms_both_sides(config: Any) -> bool:
    """Whether the layers norm their branches' inputs and outputs (Gemma 2's and 3's and GLM-4's sandwich; not the first
    Gemma's, whose layers are Llama's, nor VaultGemma's, which are Gemma 2's without their outputs' norms)."""
    return config.model_type in ("gemma2", "gemma3_text", "glm4")


def _is_olmo(config: Any) -> bool:
    return config.model_type in ("olmo2", "olmo3")


def _norms_outputs(config: Any) -> bool:
    """Whether the layers norm their branches' outputs, not their inputs (OLMo 2 and 3, EXAONE 4)."""
    return _is_olmo(config) or config.model_type == "exaone4"


def _has_nope_globals(config: Any) -> bool:
    """EXAONE 4's and Cohere2's: their global layers turn none of their values where they have local ones."""
    return config.model_type in ("exaone4", "cohere2") and bool(getattr(config, "sliding_window", None))


# the BERT family's (pagedllm.models.bert), encoders all
ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")


def attends_both_ways(config: Any) -> bool:
    """Whether the model is an encoder: each token attends to those after it too (EmbeddingGemma's
    `use_bidirectional_attention`, the BERT family), so it embeds, each prompt whole, and never generates."""
    return bool(getattr(config, "use_bidirectional_attention", False)) or \
        getattr(config, "model_type", None) in ENCODER_MODEL_TYPES


def _softcap(config: Any, option: str) -> float:
    """Gemma 2's soft cap of its attention scores or its logits (`attn_logit_softcapping`,
    `final_logit_softcapping`); 0.0 for none."""
    return float(getattr(config, option, None) or 0.0)


def _layer_type(config: Any, index: int) -> str | None:
    """Layer `index`'s entry in transformers' `layer_types` ("full_attention", "sliding_attention"), if any."""
    layer_types = getattr(config, "layer_types", None)
    return None if layer_types is None else layer_types[index]


def sliding_window_of_layer(config: Any, index: int) -> int:
    """The sliding window decoder layer `index` attends over (its queries see their last that many keys), 0 where it
    sees its whole context: the config's `sliding_window` in the layers transformers' `layer_types` marks
    "sliding_attention" (Qwen2's and Qwen3's from `max_window_layers` on, with `use_sliding_window`), or in every
    layer of a config without them (Mistral 7B v0.1); 0 for a window as long as the model's context."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return 0
    if window >= (getattr(config, "max_position_embeddings", None) or float("inf")):
        return 0
    return int(window) if _layer_type(config, index) in (None, "sliding_attention") else 0


def kv_window(config: Any) -> int:
    """The sliding window the whole model reads its cache within, where every layer has one (Mistral 7B v0.1's, Phi-3
    mini 4k's): no query reads a key more than its window - 1 positions back, so a sequence's blocks wholly behind
    the window of its next token can be freed (`KVCacheManager`'s `window`, vLLM's sliding-window manager); 0 where a
    layer reads its whole context (a global layer, an encoder's, a short convolution's cache)."""
    if has_conv_layers(config) or attends_both_ways(config):
        return 0
    windows = [sliding_window_of_layer(config, index) for index in range(config.num_hidden_layers)]
    return max(windows) if windows and all(windows) else 0


def _has_granite_shared_mlp(config: Any) -> bool:
    """Whether every layer has Granite 4's shared MLP (GraniteMoeShared's, GraniteMoeHybrid's, Granite MoE SWA's):
    beside its experts, an ungated shared expert; in a model without experts (granite-4.0-micro), the layer's MLP."""
    return config.model_type in ("granitemoeshared", "granitemoehybrid", "granitemoe_swa")


def num_experts(config: Any) -> int:
    """How many experts each sparse MLP of the model has; 0 for a dense model."""
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0


# a fused checkpoint tensor's name part -> its parts', in row order (Phi-3 stores its q/k/v and gate/up fused)
_FUSED_CHECKPOINT_PARTS = {".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."),
                           ".query_key_value.": (".q_proj.", ".k_proj.", ".v_proj."),   # (split by `unfused`)
                           ".gate_up_proj.": (".gate_proj.", ".up_proj.")}


def fused_parts(name: str) -> list[str]:
    """The checkpoint names of a fused tensor's parts, in row order; [name] for any other tensor."""
    for fused, parts in _FUSED_CHECKPOINT_PARTS.items():
        if fused in name:
            return [name.replace(fused, part) for part in parts]
    return [name]


def unfused(config: Any, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint's fused q/k/v or gate/up tensor as its parts' rows, each under the name a separate checkpoint
    gives it, so that each loads (a tensor-parallel rank taking its slice of each) or packs as one; any other tensor
    as it is."""
    if config.model_type == "gpt_oss" and name.rpartition(".mlp.experts.")[2] in _GPT_OSS_STACKED:
        return _gpt_oss_experts(name, tensor)
    if gates_attention_output(config) and name.endswith((".self_attn.q_proj.weight", ".self_attn.q_proj.bias")):
        query, gate = tensor.unflatten(0, (config.num_attention_heads, 2, -1)).unbind(1)    # each head's, in turn
        return [(name, query.flatten(0, 1)), (name.replace(".q_proj.", ".output_gate."), gate.flatten(0, 1))]
    if config.model_type == "qwen3_next" and name.endswith(QWEN3_NEXT_FUSED):
        return split_qwen3_next_projections(config, name, tensor)
    if any(part in name for part in _STACKED_EXPERTS):    # Granite MoE's and Qwen3-VL-MoE's experts
        return _stacked_experts(config, name, tensor)
    if ".query_key_value." in name:     # each KV head's group: its queries' rows, then its key's, then its value's
        kv_heads = _num_kv_heads(config)    # (GPT-NeoX's one query a group; Falcon 7B's one group of all)
        groups = tensor.unflatten(0, (kv_heads, config.num_attention_heads // kv_heads + 2, -1))
        parts = (groups[:, :-2].flatten(0, 2), groups[:, -2].flatten(0, 1), groups[:, -1].flatten(0, 1))
        return [(name.replace(".query_key_value.", part_name), part)
                for part_name, part in zip((".q_proj.", ".k_proj.", ".v_proj."), parts, strict=True)]
    names = fused_parts(name)
    if len(names) == 1:
        return [(name, tensor)]
    q_rows, kv_rows = (n * _head_dim(config) for n in (config.num_attention_heads, _num_kv_heads(config)))
    sizes = [q_rows, kv_rows, kv_rows] if len(names) == 3 else [tensor.shape[0] // 2] * 2
    return list(zip(names, tensor.split(sizes), strict=True))


# a stacked experts tensor's name part -> whether it holds the gate and up rows (else down's), and whether each
# expert's matrix is stored transposed ([in, out]), as transformers' original checkpoints store Qwen3-VL-MoE's
_STACKED_EXPERTS = {".mlp.input_linear.": (True, False), ".mlp.output_linear.": (False, False),
                    ".mlp.experts.gate_up_proj": (True, True), ".mlp.experts.down_proj": (False, True)}


def _stacked_experts(config: Any, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Experts stacked in one tensor as each expert's tensors under Qwen-MoE's names (`model.layers.i.mlp.experts.e.
    gate_proj.weight` ...): Granite MoE's input_linear [E, 2I, H], each expert's gate rows then its up rows, and
    output_linear [E, H, I], its down; Qwen3-VL-MoE's gate_up_proj [E, H, 2I] and down_proj [E, I, H], as its
    checkpoints store them (transformers 5 holds them as Granite's, and a checkpoint saved in that layout, whose
    shapes tell it apart where H is not 2I (gate/up) or I (down), is read as it is)."""
    part = next(p for p in _STACKED_EXPERTS if p in name)
    gate_up, transposed = _STACKED_EXPERTS[part]
    if transposed and tensor.shape[1 if gate_up else 2] != config.hidden_size:
        transposed = False      # not [E, H, 2I] or [E, I, H]: the layout transformers 5 holds
    if transposed:
        tensor = tensor.transpose(1, 2)
    layer = name[:name.index(part)] + ".mlp.experts."
    if gate_up:
        return [(f"{layer}{index}.{half}.weight", rows) for index, expert in enumerate(tensor)
                for half, rows in zip(("gate_proj", "up_proj"), expert.chunk(2), strict=True)]
    return [(f"{layer}{index}.down_proj.weight", expert) for index, expert in enumerate(tensor)]


# gpt-oss's stacked experts' tensors, by their names' last part (a GGUF file's come split: each expert's own)
_GPT_OSS_STACKED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _gpt_oss_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """gpt-oss's stacked experts as each expert's tensors under Qwen-MoE's names: gate_up_proj [E, H, 2I] ([in,
    out], its gate and up columns interleaved, gate first) and its bias [E, 2I] as gate_proj's and up_proj's weights
    and biases; down_proj [E, I, H] and its bias [E, H] as down_proj's."""
    layer, part = name.split(".mlp.experts.")
    kind = "bias" if part.endswith("_bias") else "weight"
    if kind == "weight":
        tensor = tensor.transpose(1, 2)     # [E, out, in]
    if part.startswith("gate_up_proj"):
        return [(f"{layer}.mlp.experts.{index}.{half}.{kind}", expert[offset::2]) for index, expert in enumerate(tensor)
                for half, offset in (("gate_proj", 0), ("up_proj", 1))]
    return [(f"{layer}.mlp.experts.{index}.down_proj.{kind}", expert) for index, expert in enumerate(tensor)]


def expert_intermediate_size(config: Any) -> int:
    """One expert's intermediate size: Qwen-MoE's `moe_intermediate_size`, Mixtral's `intermediate_size`."""
    return getattr(config, "moe_intermediate_size", None) or config.intermediate_size


def shared_expert_size(config: Any) -> int:
    """The intermediate size of the shared expert every token of a sparse layer runs besides its chosen ones (0 for
    none): Qwen2-MoE's, ERNIE 4.5's moe_num_shared_experts and DeepSeek's n_shared_experts as one expert of their
    summed width, Granite 4's shared MLP."""
    if config.model_type == "ernie4_5_moe":
        return config.moe_num_shared_experts * config.moe_intermediate_size
    if is_mla(config):
        return config.n_shared_experts * config.moe_intermediate_size
    if _has_granite_shared_mlp(config):
        return config.shared_intermediate_size
    return getattr(config, "shared_expert_intermediate_size", None) or 0


def _is_sparse_layer(config: Any, index: int) -> bool:
    """Whether decoder layer `index` has a mixture of experts for its MLP: every layer of Mixtral; Qwen-MoE's every
    `decoder_sparse_step`-th, but those in `mlp_only_layers`; ERNIE 4.5's every `moe_layer_interval`-th from
    `moe_layer_start_index` to `moe_layer_end_index`; LFM2-MoE's after its `num_dense_layers`; DeepSeek's from
    `first_k_dense_replace` on (every `moe_layer_freq`-th, where the config has one)."""
    if is_mla(config):
        return index >= config.first_k_dense_replace and index % (getattr(config, "moe_layer_freq", None) or 1) == 0
    if config.model_type == "ernie4_5_moe":
        return (index + 1) % config.moe_layer_interval == 0 and \
            config.moe_layer_start_index <= index <= config.moe_layer_end_index
    if config.model_type == "lfm2_moe":
        return index >= config.num_dense_layers
    return num_experts(config) > 0 and index not in (getattr(config, "mlp_only_layers", None) or []) and \
        (index + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0


class LayerLoRA:
    """The step's LoRA adapters (`LoRABatch`) at one decoder layer: `add(module, x, out)` adds their updates of
    the fused module's output `out` for input `x`, in place, and returns `out`."""

    __slots__ = ("batch", "layer")

    def __init__(self, batch: LoRABatch, layer: int) -> None:
        self.batch, self.layer = batch, layer

    def add(self, module: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.batch.add(self.layer, module, x, out)


def _query_temperature(config: Any, max_position: int) -> tuple[float, int] | None:
    """Ministral 3's (Llama 4's) temperature of the queries: each scaled by 1 + beta ln(1 + floor(position /
    original)) after the rope, beta its rope's `llama_4_scaling_beta`, original its `original_max_position_embeddings`;
    (beta, original) where a position the tables cover (`max_position`) reaches past `original`, None where none does
    (every scale is 1 there)."""
    params = getattr(config, "rope_parameters", None) or {}
    beta, original = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
    if not beta or not original or max_position <= original:
        return None
    return float(beta), int(original)


def _attention_scale(config: Any, head_dim: int) -> float:
    """The scores' scale: 1 where GPT-2 and GPT-BigCode turn scaling off (scale_attn_weights), else Granite's
    attention_multiplier, MPT's softmax_scale, or 1 / sqrt(Gemma's query_pre_attn_scalar, else the head size)."""
    if not getattr(config, "scale_attn_weights", True):
        return 1.0
    return getattr(config, "attention_multiplier", None) or _mpt_attention(config, "softmax_scale") or \
        (getattr(config, "query_pre_attn_scalar", None) or head_dim) ** -0.5


def _refuse_unsupported_attention(config: Any, encoder: bool, softcap: float) -> None:
    """A clear error for the attention variants pagedllm does not run."""
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        raise ValueError("GPT-2's attention scores scaled by each layer's inverse index "
                         "(scale_attn_by_inverse_layer_idx) are not supported")
    if getattr(config, "qk_layernorm", False) or (_is_cohere(config) and getattr(config, "use_qk_norm", False)):
        raise ValueError(f"{config.model_type}'s LayerNorms of each query and key head (qk_layernorm, "
                         "use_qk_norm) are not supported")
    if encoder and softcap:
        raise ValueError("an encoder with soft-capped attention scores is not supported")


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads (all of them at tp_size 1; see `head_shard`)."""

    def __init__(self, config: Any, dtype: torch.dtype, attn_backend: AttentionBackend,
                 rotary_emb: RotaryEmbedding, tp: TPRank, index: int) -> None:
        super().__init__()
        self.head_dim = _head_dim(config)
        self.sliding_window = sliding_window_of_layer(config, index)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = _num_kv_heads(config)
        self.scale = _attention_scale(config, self.head_dim)
        # OLMo's and MPT's: q, k and v clamped to +-it
        self.clip_qkv = float(getattr(config, "clip_qkv", None) or _mpt_attention(config, "clip_qkv") or 0.0)
        self.softcap = _softcap(config, "attn_logit_softcapping")
        self.attn_backend = attn_backend
        # an encoder's modules attend through `bidirectional_attention`, to the step's own K/V (its decoder stack:
        # through the kernels' bidirectional mode)
        self.encoder = attends_both_ways(config)
        _refuse_unsupported_attention(config, self.encoder, self.softcap)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads,
                                          bias=_has_bias(config, "qkv"), dtype=dtype, tp_rank=tp[0], tp_size=tp[1])
        heads = self.qkv_proj.heads
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, config.hidden_size,
                                        bias=_has_bias(config, "o"), dtype=dtype,
                                        tp_rank=tp[0], tp_size=tp[1],
                                        input_shard=(heads.q_start * self.head_dim, heads.num_heads * self.head_dim))
        self.rotary_emb = rotary_emb  # shared by all layers
        self.query_temperature = _query_temperature(config, rotary_emb.max_position)
        # ALiBi's slopes of this rank's heads (`alibi_slopes_of`), a buffer so that they go to the model's device
        slopes = alibi_slopes_of(config)
        self.alibi_slopes: torch.Tensor | None
        self.register_buffer("alibi_slopes", None if slopes is None else
                             slopes[heads.q_start:heads.q_start + heads.num_heads].contiguous(), persistent=False)
        # gpt-oss's and Granite SWA's (and Granite MoE SWA's) attention sink of each head, all of them (float32: the
        # kernels' `sinks`); this rank's: `rank_sinks`
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) \
            if config.model_type in ("gpt_oss", "granite_swa", "granitemoe_swa") else None
        self.rank_heads = slice(heads.q_start, heads.q_start + heads.num_heads)
        self._add_qk_norms(config, dtype, tp)
        # Qwen3-Next's and Qwen3.5's gate of each head's output (`gates_attention_output`), this rank's heads'
        self.output_gate = ColumnParallelLinear(config.hidden_size, self.num_heads * self.head_dim,
                                                bias=_has_bias(config, "qkv"), dtype=dtype, tp_rank=tp[0],
                                                tp_size=tp[1]) if gates_attention_output(config) else None

    def _add_qk_norms(self, config: Any, dtype: torch.dtype, tp: TPRank) -> None:
        """Qwen3's per-head norms of q and k (one weight of head_dim each, shared by the heads; Hunyuan's after the
        rotary embedding); OLMo 2's and OLMoE's over all of a token's query (key) values at once
        (`norms_all_heads`); or none."""
        self.norms_all_heads = _is_olmo(config) or config.model_type == "olmoe"
        if self.norms_all_heads and tp[1] > 1:
            raise ValueError("OLMo norms its queries and keys over all heads at once: it runs on one rank "
                             "(tensor_parallel_size=1)")
        q_width, k_width = ((self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim)
                            if self.norms_all_heads else (self.head_dim, self.head_dim))
        has_norms = _has_qk_norm(config) or self.norms_all_heads
        self.q_norm = RMSNorm(q_width, _eps(config), dtype) if has_norms else None
        self.k_norm = RMSNorm(k_width, _eps(config), dtype) if has_norms else None
        self.norms_after_rope = _norms_qk_after_rope(config)

    def rank_sinks(self) -> torch.Tensor | None:
        """The sinks of this rank's heads (a contiguous slice), or None for a layer without sinks."""
        return None if self.sinks is None else self.sinks[self.rank_heads]

    def head_norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] with each head's values normed (Qwen3's q_norm and k_norm), where the layer
        has those norms; as they are where it has none."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        return (self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape),
                self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, lora: LayerLoRA | None = None) -> torch.Tensor:
        # x: [T, hidden]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        if lora is not None:
            lora.add("qkv_proj", x, qkv)
        if self.clip_qkv:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.norms_all_heads:    # OLMo 2's, over all of a token's query (key) values
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q = q.view(-1, q_size // self.head_dim, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, kv_size // self.head_dim, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, kv_size // self.head_dim, self.head_dim)
        if not self.norms_all_heads and not self.norms_after_rope:  # each head's values
            q, k = self.head_norms(q, k)
        q, k = self.rotary_emb(positions, q, k)
        if self.norms_after_rope:   # (Hunyuan's)
            q, k = self.head_norms(q, k)
        if self.query_temperature is not None:
            beta, original = self.query_temperature
            q = q * (1 + beta * torch.log(1 + torch.floor(positions / original)))[:, None, None].to(q.dtype)
        if self.encoder:
            out = bidirectional_attention(q, k, v, meta, self.scale, self.sliding_window)
        else:
            k_cache, v_cache = kv_cache
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            out = self.attn_backend(q, k_cache, v_cache, meta, self.scale, self.sliding_window, self.softcap,
                                    alibi_slopes=self.alibi_slopes, sinks=self.rank_sinks())
            for rows, span in meta.image_spans:     # an image's placeholders see all of it (Gemma 3's)
                out[rows] = paged_attention_ref(q[rows], k_cache, v_cache, span, self.scale, self.sliding_window,
                                                self.softcap, causal=False)
        out = out.flatten(1)    # [T, Hq*D]
        if self.output_gate is not None:
            out = out * torch.sigmoid(self.output_gate(x))
        return self.o_proj(out) if lora is None else lora.add("o_proj", out, self.o_proj(out))  # [T, hidden]


class ShortConv(nn.Module):
    """LFM2's short convolution in place of an attention: in_proj gives B, C and x; each channel of B * x is convolved
    over the token and the `conv_L_cache - 1` before it (causal, depthwise), times C, through out_proj.

    The tokens' B * x live in the paged KV pool, as the attention layers' K/V do: this layer's pool layers
    (`cache_layers`) hold a token's hidden_size values in their K and V rows, written at its slot, and the tokens
    before it are read at theirs (through the block table). So prefix caching, chunked prefill, preemption, swap,
    copy-on-write and rejected drafts need nothing of their own: a block holds its tokens' inputs."""

    def __init__(self, config: Any, dtype: torch.dtype, tp: TPRank) -> None:
        super().__init__()
        if tp[1] > 1:
            raise ValueError("LFM2's convolution layers run on one rank (tensor_parallel_size=1)")
        hidden, self.kernel_size = config.hidden_size, config.conv_L_cache
        self.in_proj = MergedColumnParallelLinear(hidden, [hidden] * 3, bias=config.conv_bias, dtype=dtype)
        self.o_proj = RowParallelLinear(hidden, hidden, bias=config.conv_bias, dtype=dtype)   # (its out_proj)
        self.conv = nn.Conv1d(hidden, hidden, self.kernel_size, groups=hidden, bias=config.conv_bias, dtype=dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: list[KVCache],
                meta: AttentionMetadata, lora: LayerLoRA | None = None) -> torch.Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        bx = b * h                                                          # [T, H]
        k_cache = kv_cache[0][0]
        num_kv_heads, head_dim = k_cache.shape[-2:]
        padded = torch.zeros(bx.shape[0], len(kv_cache) * 2 * num_kv_heads * head_dim, dtype=bx.dtype,
                             device=bx.device)
        padded[:, :bx.shape[1]] = bx
        parts = padded.view(bx.shape[0], len(kv_cache), 2, num_kv_heads, head_dim)
        for index, (k, v) in enumerate(kv_cache):
            write_kv(parts[:, index, 0], parts[:, index, 1], k, v, meta.slot_mapping)
        window = [self._earlier(kv_cache, positions, meta, back, bx.shape[1]) for back in
                  range(self.kernel_size - 1, 0, -1)] + [bx]               # oldest first, as the kernel's taps
        weight = self.conv.weight.squeeze(1)                                # [H, L]
        out = sum(tap * weight[:, j] for j, tap in enumerate(window))
        if self.conv.bias is not None:
            out = out + self.conv.bias
        return self.o_proj(c * out)

    @staticmethod
    def _earlier(kv_cache: list[KVCache], positions: torch.Tensor, meta: AttentionMetadata, back: int,
                 hidden: int) -> torch.Tensor:
        """[T, H]: each token's convolution input `back` positions before it, read from the pool (0 before its
        sequence's start)."""
        blocks, offsets, before_start = meta.earlier_slots(positions, back, kv_cache[0][0].shape[1])
        rows = torch.cat([torch.cat([k[blocks, offsets], v[blocks, offsets]], dim=1).flatten(1)
                          for k, v in kv_cache], dim=1)[:, :hidden]
        return rows.masked_fill(before_start.unsqueeze(1), 0)


class LlamaMLP(nn.Module):
    """The gated MLP, down_proj(silu(gate_proj(x)) * up_proj(x)), of `intermediate_size` (the config's by default;
    an expert's under a mixture of experts, whose block sums its experts' outputs before it all-reduces them:
    `reduce_results=False`), with biases where `_has_bias` says (or `bias` does: an expert's), its activation the
    config's (SiLU, Gemma's GELU) or `activation` (gpt-oss's experts' clamped SwiGLU)."""

    def __init__(self, config: Any, dtype: torch.dtype, tp: TPRank, intermediate_size: int | None = None,
                 reduce_results: bool = True, bias: bool | None = None, activation: SwigluOAI | None = None) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden activation {act!r} is not supported (only 'silu' and 'gelu_pytorch_tanh')")
        bias = _has_bias(config, "mlp") if bias is None else bias
        inter = intermediate_size or _intermediate_size(config)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias, dtype=dtype,
                                                       tp_rank=tp[0], tp_size=tp[1])
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, dtype=dtype,
                                           tp_rank=tp[0], tp_size=tp[1], reduce_results=reduce_results)
        self.act_fn: SiluAndMul | GeluAndMul | SwigluOAI = activation or \
            (SiluAndMul() if act == "silu" else GeluAndMul())

    def forward(self, x: torch.Tensor, lora: LayerLoRA | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if lora is not None:
            y = self.act_fn(lora.add("gate_up_proj", x, gate_up(x)))
            return lora.add("down_proj", y, self.down_proj(y))
        # GGUF blocks in AMX tiles with SiLU in their store: the same bits, the [T, 2I] product never stored
        if isinstance(self.act_fn, SiluAndMul) and fuses_silu_and_mul(gate_up.weight, x.shape[0]):
            return self.down_proj(linear_silu_and_mul(x, gate_up.weight, gate_up.bias))
        return self.down_proj(self.act_fn(gate_up(x)))  # [T, H] -> [T, 2I] -> [T, I] -> [T, H]


class PlainMLP(nn.Module):
    """The ungated MLP of Phi, GPT-NeoX, StarCoder2, GPT-2, GPT-BigCode, OPT, GPT-J, Falcon, Nemotron, Arcee, BLOOM,
    MPT and Apertus, fc2(act(fc1(x))), with biases (`_has_bias`): GELU, exact (GPT-NeoX's "gelu") or its tanh
    approximation (Phi's "gelu_new", StarCoder2's "gelu_pytorch_tanh"), ReLU (OPT's) or its square (Nemotron's and
    Arcee's "relu2"), or Apertus's xIELU (`XIELU`, its two parameters a layer). Its modules keep Phi's names
    (GPT-NeoX's dense_h_to_4h and dense_4h_to_h, StarCoder2's c_fc and c_proj, Nemotron's, Arcee's and Apertus's
    up_proj and down_proj load into them); a LoRA adapter reaches the attention only (fc1 and fc2 are not its
    modules)."""

    # a config's activation -> its kind (the C++ stack's name for it), and the kind's function
    _KINDS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
              "relu": "relu", "relu2": "relu2", "xielu": "xielu"}
    _FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "relu": F.relu,
        "relu2": lambda x: torch.square(F.relu(x))}
    # the activation of a model whose config names none: BLOOM's (its bloom_gelu: GELU's tanh approximation), MPT's
    _FIXED = {"bloom": "gelu_new", "mpt": "gelu"}

    def __init__(self, config: Any, dtype: torch.dtype, tp: TPRank) -> None:
        super().__init__()
        act = self._FIXED.get(config.model_type) or getattr(config, "hidden_act", None) or \
            getattr(config, "activation_function", None) or config.activation   # (GPT-2's name for it, Falcon's)
        if act not in self._KINDS:
            raise ValueError(f"hidden activation {act!r} is not supported here (only "
                             f"{', '.join(map(repr, self._KINDS))})")
        self.activation = self._KINDS[act]
        inter = _intermediate_size(config)
        bias = _has_bias(config, "mlp")
        self.fc1 = ColumnParallelLinear(config.hidden_size, inter, bias=bias, dtype=dtype, tp_rank=tp[0],
                                        tp_size=tp[1])
        self.fc2 = RowParallelLinear(inter, config.hidden_size, bias=bias, dtype=dtype, tp_rank=tp[0], tp_size=tp[1])
        self.xielu = XIELU(dtype) if self.activation == "xielu" else None

    def forward(self, x: torch.Tensor, lora: LayerLoRA | None = None) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(self.xielu(h) if self.xielu is not None else self._FUNCTIONS[self.activation](h))


class XIELU(nn.Module):
    """Apertus's xIELU, as transformers computes it: alpha_p x^2 + beta x where x > 0, else
    (expm1(min(x, eps)) - x) alpha_n + beta x, with alpha_p = softplus(a_p) and alpha_n = beta + softplus(a_n) from
    the layer's two parameters, and beta, eps the checkpoint's (0.5, -1e-6), all in the model's dtype, as
    transformers loads them in it."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.alpha_p, self.alpha_n = (nn.Parameter(torch.empty(1, dtype=dtype), requires_grad=False) for _ in range(2))
        self.beta, self.eps = (nn.Parameter(torch.empty((), dtype=dtype), requires_grad=False) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p, alpha_n = F.softplus(self.alpha_p), self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)


class LlamaSparseMoeBlock(nn.Module):
    """A mixture of experts in place of the MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, ERNIE 4.5 MoE): the router (`gate`,
    never quantized: a few thousand weights that decide everything after them; in the model's dtype, ERNIE's in
    float32 as its checkpoints keep it) picks each token's `num_experts_per_tok` experts, which run on their tokens
    alone (`pagedllm.layers.moe.run_experts`); ERNIE's choice is biased (`selection_bias`: its
    e_score_correction_bias) and its weights' sum bounded below (moe_norm_min); LFM2-MoE's scores are sigmoids,
    biased in the choice too (its expert_bias), their sum plus 1e-6, times its routed_scaling_factor. Qwen2-MoE adds
    a shared expert that every token runs, scaled by sigmoid(shared_expert_gate(x)); ERNIE adds its
    moe_num_shared_experts as one ungated expert of their summed width. gpt-oss's router and experts have biases, its
    experts a clamped SwiGLU (`SwigluOAI`).

    Under tensor parallelism each rank holds a slice of every expert's intermediate size, as of a dense MLP, and the
    block all-reduces its sum once."""

    def __init__(self, config: Any, dtype: torch.dtype, tp: TPRank) -> None:
        super().__init__()
        self.tp_size = tp[1]
        self.routing = Routing.of(config)
        ernie, lfm2 = config.model_type == "ernie4_5_moe", config.model_type == "lfm2_moe"
        deepseek = is_mla(config)
        inter = expert_intermediate_size(config)
        oss = config.model_type == "gpt_oss"     # a biased router; biased experts, their SwiGLU clamped
        self.gate = nn.Linear(config.hidden_size, num_experts(config), bias=oss,
                              dtype=torch.float32 if ernie or deepseek else dtype)
        self.swiglu = (float(getattr(config, "swiglu_alpha", 1.702)), float(config.swiglu_limit)) if oss else None
        # (ERNIE's [1, E] and LFM2's [E] as their checkpoints hold them; never trained here)
        bias_shape = (1, num_experts(config)) if ernie else \
            (num_experts(config),) if (lfm2 and config.use_expert_bias) or config.model_type == "deepseek_v3" else None
        self.selection_bias = None if bias_shape is None else \
            nn.Parameter(torch.zeros(bias_shape), requires_grad=False)
        self.experts = nn.ModuleList(LlamaMLP(config, dtype, tp, inter, reduce_results=False, bias=oss,
                                              activation=None if self.swiglu is None else SwigluOAI(*self.swiglu))
                                     for _ in range(num_experts(config)))
        for expert in self.experts:     # small calls, each on one thread (kernels/csrc/moe.cpp): see brgemm_packs and
            expert.gate_up_proj.small_calls = expert.down_proj.small_calls = True   # few_rows_activation_bits
        shared = shared_expert_size(config)
        self.shared_expert = LlamaMLP(config, dtype, tp, shared, reduce_results=False) if shared else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False, dtype=dtype) \
            if shared and not (ernie or deepseek or _has_granite_shared_mlp(config)) else None
        # kernel module -> this block for its MoEWeights (built on first use, once the weights are final, packed)
        self.kernel_blocks: dict[ModuleType, Any] = {}

    def forward(self, x: torch.Tensor, lora: LayerLoRA | None = None) -> torch.Tensor:
        # x: [T, H]; `lora` is taken for the dense MLP's signature: adapters reach the attention only here
        kernels = kernels_for(x)
        out = self.forward_native(x) if kernels is None else self.kernel_weights(kernels)(x)
        if self.tp_size > 1:
            communicator().all_reduce(out)
        return out

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The block in torch (this rank's partial sums under tensor parallelism): where the CPU kernels do not run,
        and the reference of their MoEWeights, which splits the experts between the threads."""
        weights, ids = route(self.gate(x.to(self.gate.weight.dtype)), self.routing,
                             self.selection_bias)   # [T, top_k] each
        out = run_experts(x, weights, ids, self.experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            gate = self.shared_expert_gate
            out = out + (shared if gate is None else torch.sigmoid(gate(x)) * shared)
        return out

    def kernel_weights(self, kernels: ModuleType) -> Any:
        """This block as the C++ kernels' MoEWeights (pagedllm/kernels/csrc/moe.cpp), built on first use."""
        if kernels not in self.kernel_blocks:
            shared, r = self.shared_expert, self.routing
            self.kernel_blocks[kernels] = kernels.MoEWeights(
                self.gate.weight, r.top_k, r.renormalize,
                [e.gate_up_proj.kernel_weights(kernels) for e in self.experts],
                [e.down_proj.kernel_weights(kernels) for e in self.experts],
                None if shared is None else shared.gate_up_proj.kernel_weights(kernels),
                None if shared is None else shared.down_proj.kernel_weights(kernels),
                None if self.shared_expert_gate is None else self.shared_expert_gate.weight,
                self.selection_bias, r.norm_min, r.sigmoid, r.norm_eps, r.scale, self.gate.bias,
                *(self.swiglu or (0.0, 0.0)), r.groups, r.kept_groups, r.group_top2)
        return self.kernel_blocks[kernels]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, attn_backend: AttentionBackend,
                 rotary_emb: RotaryEmbedding, tp: TPRank, index: int) -> None:
        super().__init__()
        # the token mixer: an attention (DeepSeek's latent one), LFM2's short convolution, or a recurrent layer
        recurrent = recurrent_layer_kind(config, index)
        self.self_attn: LlamaAttention | MLAttention | ShortConv | Mamba2Mixer | GatedDeltaNet = (
            ShortConv(config, dtype, tp) if is_conv_layer(config, index) else
            Mamba2Mixer(config, dtype, tp, index) if recurrent == "mamba2" else
            GatedDeltaNet(config, dtype, tp, index) if recurrent == "gated_deltanet" else
            MLAttention(config, dtype, attn_backend, rotary_emb, tp) if is_mla(config) else
            LlamaAttention(config, dtype, attn_backend, rotary_emb, tp, index))
        self.mlp: LlamaMLP | LlamaSparseMoeBlock | PlainMLP = (
            LlamaSparseMoeBlock(config, dtype, tp) if _is_sparse_layer(config, index) else
            PlainMLP(config, dtype, tp) if _plain_mlp(config) else LlamaMLP(config, dtype, tp))
        # OLMo's and EXAONE 4's layers norm their branches' outputs only (post_attention_layernorm and
        # post_feedforward_layernorm)
        self.input_layernorm = None if _norms_outputs(config) else _norm(config, dtype)
        # parallel branches (`_parallel_branches`): the MLP reads the stream normed by input_layernorm as the
        # attention does (Phi's, StableLM's), or by post_attention_layernorm (GPT-NeoX's, Falcon 40B's ln_mlp)
        self.parallel = _parallel_branches(config)
        self.post_attention_layernorm = None if self.parallel and config.model_type != "gpt_neox" and \
            not _falcon_two_norms(config) else _norm(config, dtype)
        # Gemma's and GLM-4's: the attention's output normed by post_attention_layernorm before it joins the
        # residual stream, the stream normed by pre_feedforward_layernorm for the MLP, the MLP's output by
        # post_feedforward_layernorm
        sandwich = _norms_both_sides(config)
        self.pre_feedforward_layernorm = _norm(config, dtype) if sandwich else None
        self.post_feedforward_layernorm = _norm(config, dtype) if sandwich or _norms_outputs(config) else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata, lora: LayerLoRA | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's output, the residual stream before it is added): the next layer, or the final norm, adds
        the two."""
        if self.input_layernorm is None:    # OLMo's, EXAONE 4's: the stream itself in, the branches' outputs normed
            residual = x if residual is None else x + residual
            residual = residual + self.post_attention_layernorm(self.self_attn(positions, residual, kv_cache, meta,
                                                                                lora))
            return self.post_feedforward_layernorm(self.mlp(residual, lora)), residual
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.parallel:   # both branches read the stream the layer took; their outputs join it together
            mlp_in = x if self.post_attention_layernorm is None else self.post_attention_layernorm(residual)
            return self.self_attn(positions, x, kv_cache, meta, lora) + self.mlp(mlp_in, lora), residual
        x = self.self_attn(positions, x, kv_cache, meta, lora)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x, lora), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x, lora)), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, attn_backend: AttentionBackend, tp: TPRank,
                 max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, tp[0], tp[1])
        # Gemma's embeddings times sqrt(hidden_size), rounded to the model's dtype first, as transformers has it;
        # Granite's times its embedding_multiplier (a float, as transformers multiplies)
        self.embed_scale: torch.Tensor | float | None = \
            torch.tensor(config.hidden_size ** 0.5, dtype=dtype) if _is_gemma(config) else \
            getattr(config, "embedding_multiplier", None)
        # GPT-2's, GPT-BigCode's and OPT's learned position embeddings (`_learns_positions`), split across ranks as the
        # vocabulary is; OPT's table starts 2 rows in (`position_offset`)
        if config.model_type == "opt":
            _check_opt(config)
        if config.model_type == "bloom" and config.apply_residual_connection_post_layernorm:
            raise ValueError("BLOOM with its residual stream taken after each norm "
                             "(apply_residual_connection_post_layernorm=True) is not supported")
        # BLOOM's norm of the embeddings before the first layer (word_embeddings_layernorm)
        self.embed_norm = _norm(config, dtype) if config.model_type == "bloom" else None
        self.position_offset = 2 if config.model_type == "opt" else 0
        self.embed_positions = VocabEmbedding(config.max_position_embeddings + self.position_offset,
                                              config.hidden_size, dtype, tp[0], tp[1]) \
            if _learns_positions(config) else None
        rotary: dict[str, RotaryEmbedding] = {}     # one for each rope of the layers (Gemma's local and global ones)

        def rotary_of(index: int) -> RotaryEmbedding:
            base, scaling = rope_config(config, _layer_type(config, index))
            thetas = getattr(config, "layer_rope_theta", None)     # Granite SWA's base of each layer (0: none)
            if thetas is not None:
                base = float(thetas[index])
            # SmolLM3's every fourth layer has no rotary embedding (NoPE): one that turns none of a head's values
            no_rope = getattr(config, "no_rope_layers", None)
            nope = (no_rope is not None and not no_rope[index]) or _learns_positions(config) or _has_alibi(config) or \
                (_has_nope_globals(config) and _layer_type(config, index) == "full_attention") or base == 0 or \
                (config.model_type == "granitemoehybrid" and config.position_embedding_type != "rope")
            dim = 0 if nope else rotary_dim(config, _head_dim(config))
            key = repr((base, scaling, dim))
            if key not in rotary:
                rotary[key] = get_rope(dim, max_positions, base, scaling, mrope_axes(config))
            return rotary[key]

        self.layers = nn.ModuleList(LlamaDecoderLayer(config, dtype, attn_backend, rotary_of(index), tp, index)
                                    for index in range(config.num_hidden_layers))
        # longrope's (Phi-3's), whose step picks its tables' rows once for every layer (`table_rows`)
        self.longrope = next((r for r in rotary.values() if r.long_from), None)
        assert self.longrope is None or len(rotary) == 1, "longrope beside other ropes"
        # M-RoPE's (the Qwen-VLs'), whose image tokens' table rows are written for their step (`spatial_rows`)
        self.mrope = next((r for r in rotary.values() if r.mrope_axes), None)
        self.norm = _norm(config, dtype)
        self.cache_layers = cache_layers(config)    # each layer's layers of the KV pool
        # kernel module -> its DecoderStack of these layers; None: the modules run (see use_decoder_stack)
        self.stacks: dict[ModuleType, Any] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, lora: LoRABatch | None = None,
                image_rows: ImageRows | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        deepstack = None    # Qwen3-VL's: [R, layers, H], added to the first layers' outputs at the image rows
        if image_rows is not None:      # image placeholders' rows: the image encoder's, not the token's embedding
            x[image_rows.index] = image_rows.rows[:, :x.shape[1]].to(x.dtype)
            if image_rows.rows.shape[1] > x.shape[1]:
                deepstack = image_rows.rows[:, x.shape[1]:].unflatten(1, (-1, x.shape[1])).to(x.dtype)
            if image_rows.positions is not None:    # and their M-RoPE table rows
                assert self.mrope is not None, "(frame, row, column) positions for a model without M-RoPE"
                positions = positions.clone()
                positions[image_rows.index], grown = self.mrope.spatial_rows(image_rows.positions)
                if grown and self.stacks:   # the stacks hold the tables they were built with
                    self.stacks = {}
        if self.embed_positions is not None:    # (after the image rows: prompt embeddings take them too)
            x = x + self.embed_positions(positions + self.position_offset)
        if self.longrope is not None:
            positions = self.longrope.table_rows(positions)
        # the C++ stack has no LoRA updates, nor DeepStack's, nor images seen whole
        stack = self.stack_for(x) if lora is None and deepstack is None and not meta.image_spans else None
        if stack is not None:
            return stack.forward(x, positions, kv_caches, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                 meta.query_start_loc, meta.num_decodes, meta.cascade)
        residual = None
        for index, (layer, pool_layers) in enumerate(zip(self.layers, self.cache_layers, strict=True)):
            kv_cache = kv_caches[pool_layers] if isinstance(layer.self_attn, (ShortConv, RecurrentMixer)) else \
                kv_caches[pool_layers.start]
            x, residual = layer(positions, x, residual, kv_cache, meta,
                                None if lora is None else LayerLoRA(lora, index))
            if deepstack is not None and index < deepstack.shape[1]:    # the layer's output is x + residual
                x[image_rows.index] += deepstack[:, index]  # type: ignore[union-attr]
        x, _ = self.norm(x, residual)
        return x

    def stack_for(self, x: torch.Tensor) -> Any:
        """The DecoderStack of the kernels that x's computation runs in, built on first use; None where the
        modules run (no stack wanted, or no kernels: disabled, not built, not on the CPU)."""
        if self.stacks is None or (kernels := kernels_for(x)) is None:
            return None
        if kernels not in self.stacks:
            self.stacks[kernels] = self._build_stack(kernels)
        return self.stacks[kernels]

    def _build_stack(self, kernels: ModuleType) -> Any:
        def weight(norm: RMSNorm | PreLayerNorm | None) -> torch.Tensor | None:
            return None if norm is None else norm.weight

        def bias(norm: RMSNorm | PreLayerNorm | None) -> torch.Tensor | None:     # a LayerNorm's (the stack's cue)
            return norm.bias if isinstance(norm, PreLayerNorm) else None

        def mlp_weights(mlp: LlamaMLP | LlamaSparseMoeBlock | PlainMLP) -> dict[str, Any]:
            if isinstance(mlp, LlamaSparseMoeBlock):
                return dict(gate_up=None, down=None, moe=mlp.kernel_weights(kernels))
            if isinstance(mlp, PlainMLP):   # fc1 and fc2 where gate_up and down go
                return dict(gate_up=mlp.fc1.kernel_weights(kernels), down=mlp.fc2.kernel_weights(kernels), moe=None,
                            activation=mlp.activation)
            return dict(gate_up=mlp.gate_up_proj.kernel_weights(kernels), down=mlp.down_proj.kernel_weights(kernels),
                        moe=None, activation="gelu_and_mul" if isinstance(mlp.act_fn, GeluAndMul) else "silu_and_mul")

        def layer_weights(layer: LlamaDecoderLayer, pool_layers: slice) -> Any:
            mixer = layer.self_attn
            shared = dict(input_norm=weight(layer.input_layernorm),
                          post_attention_norm=weight(layer.post_attention_layernorm),
                          o=mixer.o_proj.kernel_weights(kernels),
                          pre_feedforward_norm=weight(layer.pre_feedforward_layernorm),
                          post_feedforward_norm=weight(layer.post_feedforward_layernorm),
                          input_norm_bias=bias(layer.input_layernorm),
                          post_attention_norm_bias=bias(layer.post_attention_layernorm), parallel=layer.parallel,
                          **mlp_weights(layer.mlp))
            if isinstance(mixer, ShortConv):    # its in_proj where an attention's qkv goes, no rotary tables
                none = torch.empty(0)
                return kernels.DecoderLayerWeights(
                    qkv=mixer.in_proj.kernel_weights(kernels), q_norm=None, k_norm=None, sliding_window=0,
                    cos_cache=none, sin_cache=none, conv=mixer.conv.weight,
                    pool_layers=pool_layers.stop - pool_layers.start, **shared)
            return kernels.DecoderLayerWeights(
                qkv=mixer.qkv_proj.kernel_weights(kernels), q_norm=weight(mixer.q_norm), k_norm=weight(mixer.k_norm),
                sliding_window=mixer.sliding_window, cos_cache=mixer.rotary_emb.cos_cache,
                sin_cache=mixer.rotary_emb.sin_cache, sinks=mixer.rank_sinks(), **shared)

        attn = next(layer.self_attn for layer in self.layers if isinstance(layer.self_attn, LlamaAttention))
        return kernels.DecoderStack([layer_weights(layer, pool_layers) for layer, pool_layers
                                     in zip(self.layers, self.cache_layers, strict=True)], self.norm.weight,
                                    self.norm.eps, attn.qkv_proj.q_size // attn.head_dim,
                                    attn.qkv_proj.kv_size // attn.head_dim, attn.head_dim, attn.scale, attn.softcap,
                                    not attn.encoder, bias(self.norm), attn.clip_qkv, attn.norms_after_rope,
                                    attn.alibi_slopes, *(attn.query_temperature or (0.0, 0)))


# Checkpoints of the decoder alone, as decoder embedding models are saved (gte-Qwen2, e5-mistral): tensor names
# without the "model." prefix and no LM head. Such a model embeds (LAST pooling); its embedding matrix stands in as
# the LM head, so that the engine can still sample the one token an embedding request samples (and generate, where
# the config ties the two: `generates`).
BARE_ARCHITECTURES = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model", "Gemma3TextModel"})
# Checkpoints of the decoder with a classification head (`score`: hidden -> num_labels logits) instead of the LM head,
# as transformers saves sequence classifiers and rerankers: the head reads the final hidden state at the prompt's
# last token (vLLM's LAST pooling). The embedding matrix stands in as the LM head, as for a bare decoder.
CLASSIFIER_ARCHITECTURES = frozenset({"LlamaForSequenceClassification", "MistralForSequenceClassification",
                                      "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification"})
# The BERT family's sequence classifiers (pagedllm.models.bert), as cross-encoders are saved (ms-marco-MiniLM,
# bge-reranker): the head reads the prompt's first token ([CLS], <s>), vLLM's CLS pooling.
ENCODER_CLASSIFIER_ARCHITECTURES = frozenset({"BertForSequenceClassification", "RobertaForSequenceClassification",
                                              "XLMRobertaForSequenceClassification"})


def _architectures(config: Any) -> set[str]:
    return set(getattr(config, "architectures", None) or [])


def generates(config: Any) -> bool:
    """Whether the checkpoint's model has an LM head to generate with: a causal LM's own, or the embedding matrix
    of a bare decoder or a classifier whose config ties it to the head. A bare decoder or a classifier saved
    untied has none (the embedding matrix stands in for the one token a pooling request samples, unseen). An
    encoder (`attends_both_ways`) never generates."""
    if attends_both_ways(config):
        return False
    return not _architectures(config) & (BARE_ARCHITECTURES | CLASSIFIER_ARCHITECTURES) or \
        bool(getattr(config, "tie_word_embeddings", False))


def class_labels(config: Any) -> list[str] | None:
    """A classifier checkpoint's class names, in logit order (its config's id2label); None for any other model."""
    if not (CLASSIFIER_ARCHITECTURES | ENCODER_CLASSIFIER_ARCHITECTURES) & _architectures(config):
        return None
    return [config.id2label.get(i, f"LABEL_{i}") for i in range(config.num_labels)]


def classifier_pooling(config: Any) -> str:
    """The token a classification head reads: an encoder's first (CLS), a decoder's last (LAST)."""
    return "CLS" if attends_both_ways(config) else "LAST"


def token_type_vocab_size(config: Any) -> int:
    """How many token types the model's embedding adds (a BERT-family encoder's `type_vocab_size`: BERT's 2, for the
    two texts of a pair; RoBERTa's 1); 0 for a model that takes no token type ids."""
    return int(getattr(config, "type_vocab_size", 0)) if config.model_type in ENCODER_MODEL_TYPES else 0


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a paged KV cache.

    Args:
        config: a Hugging Face config (LlamaConfig, MistralConfig, Qwen2Config, ...).
        dtype: parameter and activation dtype.
        attn_backend: paged attention function; the batched CPU backend by default.
        tp_rank, tp_size: this rank's slice of every layer under tensor parallelism (docs/scale-out.md); the
            row-parallel layers and the embedding all-reduce, and the LM head gathers to rank 0.
        max_positions: the positions the rotary tables cover (the engine's max_model_len); None: the model's
            whole context (`max_position_embeddings`), whose tables take 2 x 4 bytes x head_dim a position for each
            rope (Gemma 3 4B's two at 128k positions: 0.5 GB).
    """

    packed_modules_mapping = PACKED_MODULES_MAPPING

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32,
                 attn_backend: AttentionBackend = paged_attention, tp_rank: int = 0, tp_size: int = 1,
                 max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        tp = (tp_rank, tp_size)
        self.model = LlamaModel(config, dtype, attn_backend, tp, max_positions or context_length(config))
        architectures = _architectures(config)
        self.bare = bool(BARE_ARCHITECTURES & architectures)
        # float32, as the pooled rows it reads: a few thousand values, next to nothing to store or to multiply
        self.score = (nn.Linear(config.hidden_size, config.num_labels, bias=False, dtype=torch.float32)
                      if CLASSIFIER_ARCHITECTURES & architectures else None)
        # a causal LM served as a classifier from its LM head's rows (pagedllm.loader._classifier_from_token): the
        # checkpoint has no head, which load_weights builds from those rows
        self.classifier_token_ids: list[int] | None = getattr(config, "classifier_token_ids", None)
        self.head_is_embedding = bool(getattr(config, "tie_word_embeddings", False))     # the checkpoint's LM head
        self.final_softcap = _softcap(config, "final_logit_softcapping")   # Gemma 2's: 30.0
        self.logits_scaling = float(getattr(config, "logits_scaling", None) or 1.0)     # Granite's divisor
        self.logit_scale = float(config.logit_scale) if _is_cohere(config) else 1.0     # Cohere's multiplier
        # a vision-language model's image encoder (pagedllm.models.vision), set by the loader after the weights
        self.image_encoder: ImageEncoder | None = None
        self.tie_word_embeddings = self.bare or self.score is not None or self.head_is_embedding
        # (Phi's, GPT-J's and ERNIE 4.5 MoE's with its use_bias LM heads have biases)
        head_bias = config.model_type in ("phi", "gptj") or \
            (config.model_type == "ernie4_5_moe" and bool(getattr(config, "use_bias", False)))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype, tp_rank, tp_size, bias=head_bias)
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def use_decoder_stack(self) -> None:
        """Run the decoder layers in one C++ call a step (the kernels' DecoderStack, pagedllm/kernels/csrc/decoder.cpp)
        wherever the CPU kernels run, instead of ~15 module calls a layer: the same kernels in the same order, so the
        same bits, without ~3-5 ms of Python a step (SmolLM2, one stream); an encoder's layers attend through the
        kernels' bidirectional mode there, to the K/V they write to the cache (the modules: SDPA's, to the step's
        own). Only on one rank, with the CPU attention backend and without Apertus's xIELU: otherwise the modules
        run. The loader calls it once
        the weights are final, packed: a stack holds the weight tensors it was built with. `enforce_eager=True` keeps
        the modules."""
        if is_mla(self.config) or has_recurrent_layers(self.config):    # (the stack has no latent attention, no
            return                                                      # recurrent layers)
        attn = next(layer.self_attn for layer in self.model.layers if isinstance(layer.self_attn, LlamaAttention))
        convolutions = [layer.self_attn for layer in self.model.layers if isinstance(layer.self_attn, ShortConv)]
        xielu = any(isinstance(layer.mlp, PlainMLP) and layer.mlp.xielu is not None for layer in self.model.layers)
        if attn.qkv_proj.tp_size == 1 and attn.attn_backend is paged_attention and not xielu and \
                not any(conv.conv.bias is not None for conv in convolutions):   # (the stack's take no bias)
            self.model.stacks = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, lora: LoRABatch | None = None,
                image_rows: ImageRows | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, H]; writes the new tokens' K/V to kv_caches. `lora`: the
        step's LoRA adapters and their rows; `image_rows`: what stands in for the token embeddings of the step's
        image placeholders (`encode_image`), and their M-RoPE positions."""
        return self.model(input_ids, positions, kv_caches, meta, lora, image_rows)

    def encode_image(self, image: ImageInput) -> torch.Tensor:
        """An image's pixels (its processor's) -> the rows of its placeholders [tokens, H]; a multimodal model's
        only (the loader sets `image_encoder`). Prompt embeddings (`image.embeds`) are their rows already, as the
        embedding layer gives them (Gemma's scaled by its normalizer, which belongs to the layer), times Granite's
        embedding_multiplier, which scales every input embedding (as in transformers and vLLM)."""
        if image.embeds:
            rows = image.pixels.to(self.lm_head.weight.device, self.dtype)
            multiplier = getattr(self.config, "embedding_multiplier", None)
            return rows * multiplier if multiplier else rows
        if self.image_encoder is None:
            raise ValueError("this model takes no images")
        return self.image_encoder.encode(image)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V]: the LM head's (its dtype), float32 once scaled or soft-capped."""
        logits = self.lm_head(hidden)
        if self.logits_scaling != 1.0 or self.logit_scale != 1.0 or self.final_softcap:
            logits = logits.float()
        if self.logits_scaling != 1.0:
            logits = logits.div_(self.logits_scaling)
        if self.logit_scale != 1.0:
            logits = logits.mul_(self.logit_scale)
        if self.final_softcap:
            logits = logits.div_(self.final_softcap).tanh_().mul_(self.final_softcap)
        return logits

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> the classification head's logits [N, num_labels] float32 (a classifier checkpoint's
        only: CLASSIFIER_ARCHITECTURES)."""
        if self.score is None:
            raise ValueError("this model has no classification head")
        return self.score(hidden.float())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load (Hugging Face name, tensor) pairs; returns the names of the parameters loaded.

        Raises KeyError for a checkpoint name the model does not know and ValueError for parameters no
        checkpoint tensor filled.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        residual_multiplier = float(getattr(self.config, "residual_multiplier", None) or 1.0)
        loaded: set[str] = set()
        head_rows = None        # the classifier's tokens' rows of the checkpoint's LM head, if it is made of them
        unused = _UNUSED_NAME_PARTS.get(self.config.model_type)
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (unused is not None and unused in name) or \
                    self._is_prediction_layer(name):
                continue
            name = self.checkpoint_name(name)
            if is_mla(self.config):
                tensor = mla_rope_rows(self.config, name, tensor)
            if _is_lfm2(self.config) and name.endswith(".conv.weight") and tensor.dim() == 2:
                tensor = tensor.unsqueeze(1)    # llama.cpp's files squeeze it
            if self.config.model_type == "gpt2" and ".layers." in name and tensor.dim() == 2:
                tensor = tensor.t()     # GPT-2's Conv1D layers store their weights [in, out]
            if self.classifier_token_ids is not None and name == (
                    "model.embed_tokens.weight" if self.head_is_embedding else "lm_head.weight"):
                head_rows = tensor[self.classifier_token_ids].float()
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # some checkpoints store the tied head anyway; the embedding is the one used
            if _norm_weight_is_offset(self.config, name):
                tensor = tensor.float() + 1     # Gemma's RMSNorm scales by 1 + w, Nemotron's LayerNorm, Qwen3.5's...
            if _interleaved_rope(self.config) and name.endswith((".q_proj.weight", ".q_proj.bias", ".k_proj.weight",
                                                                 ".k_proj.bias")):
                heads = self.config.num_attention_heads if ".q_proj." in name else _num_kv_heads(self.config)
                tensor = interleaved_to_halves(tensor, heads, rotary_dim(self.config, _head_dim(self.config)))
            if residual_multiplier != 1.0 and name.endswith((".o_proj.weight", ".down_proj.weight",
                                                             ".output_linear.weight", ".experts.down_proj")):
                tensor = (tensor.float() * residual_multiplier).to(tensor.dtype)     # Granite's (module docstring)
            for part_name, part in unfused(self.config, name, tensor):
                if part_name.endswith(".bias") and self._target(part_name)[0] not in params and not part.any():
                    continue  # a zero bias is no bias (AutoGPTQ stores one for every layer, biased or not)
                loaded.add(self._load_one(params, part_name, part))
        if head_rows is not None:
            loaded.add(self._load_one(params, "score.weight", self._classifier_head(head_rows)))
        self._check_all_loaded(params, loaded)
        return loaded

    def _is_prediction_layer(self, name: str) -> bool:
        """Whether a checkpoint tensor belongs to DeepSeek-V3's multi-token prediction layers, which come after its
        `num_hidden_layers` (model.layers.61 of DeepSeek-V3's 61; transformers ignores them too)."""
        if self.config.model_type != "deepseek_v3" or not name.startswith("model.layers."):
            return False
        return int(name.split(".")[2]) >= self.config.num_hidden_layers

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as `load_weights` reads it: Mixtral's block_sparse_moe as Qwen-MoE's mlp (its
        experts' w1/w3/w2 as gate/up/down), a body's prefix put back (OPT's, BLOOM's), the family's own names mapped
        (`_CHECKPOINT_NAMES`), a bare decoder's under model.; a name read so already stays as it is."""
        if ".block_sparse_moe." in name:
            for mixtral, qwen in _MIXTRAL_NAMES:
                name = name.replace(mixtral, qwen)
        body = _BODY_PREFIXES.get(self.config.model_type)
        if body is not None and not name.startswith((body, "lm_head.", "model.")):     # (a GGUF's: ours already)
            name = body + name
        names = _GRANITE_SHARED_NAMES[num_experts(self.config) > 0] if _has_granite_shared_mlp(self.config) else \
            _CHECKPOINT_NAMES.get(self.config.model_type, ())
        for theirs, ours in names:
            name = name.replace(theirs, ours)
        return "model." + name if self.bare and not name.startswith("model.") else name

    def _classifier_head(self, rows: torch.Tensor) -> torch.Tensor:
        """The classification head made of the LM head's rows of the classifier's tokens: those rows, one class
        each; or, for a one-label head of two tokens (false, true), the true row less the false one."""
        return rows[1:] - rows[:1] if self.config.num_labels == 1 else rows

    @staticmethod
    def _target(name: str) -> tuple[str, str | int | None]:
        """(parameter name, shard id) of a checkpoint name: q/k/v_proj go to qkv_proj, gate/up_proj to gate_up_proj
        (STACKED_PARAMS_MAPPING); other names to themselves, with no shard."""
        for fused, part, shard_id in STACKED_PARAMS_MAPPING:
            if part in name:
                return name.replace(part, fused), shard_id
        return name, None

    def _load_one(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str:
        target, shard_id = self._target(name)
        if shard_id is not None and (target in params or name not in params):  # (MLA's own q_proj is not fused)
            param = self._param(params, name, target)
            param.weight_loader(param, tensor, shard_id)
            return f"{target}#{shard_id}"
        param = self._param(params, name, name)
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            param.data.copy_(tensor)
        else:
            loader(param, tensor)
        return name

    @staticmethod
    def _param(params: dict[str, nn.Parameter], name: str, target: str) -> nn.Parameter:
        if target not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in LlamaForCausalLM")
        return params[target]

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        expected: set[str] = set()
        for name, param in params.items():
            if (self.tie_word_embeddings and name == "lm_head.weight") or is_block_packed(param):
                continue  # a block-packed weight was packed from the checkpoint before loading
            shard_ids = [s for fused, _, s in STACKED_PARAMS_MAPPING if fused + "." in name]
            expected.update([f"{name}#{s}" for s in shard_ids] if shard_ids else [name])
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"{len(missing)} parameters were not found in the checkpoint: {shown}")
