"""Architecture name -> model class.

Accepts Hugging Face `architectures` entries (e.g. "LlamaForCausalLM") and GGUF `general.architecture` /
HF `model_type` names (e.g. "llama").
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.models.bert import BertModel
from pagedllm.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MinistralForCausalLM": LlamaForCausalLM,
    "Ministral3ForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    # Mixtures of experts (LlamaSparseMoeBlock in place of the MLP)
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
    "GemmaForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,
    # (not by their model_types: llama.cpp's files of these are not read)
    "Olmo2ForCausalLM": LlamaForCausalLM,
    "Olmo3ForCausalLM": LlamaForCausalLM,
    "Exaone4ForCausalLM": LlamaForCausalLM,
    "InternLM3ForCausalLM": LlamaForCausalLM,
    "SeedOssForCausalLM": LlamaForCausalLM,
    "Ernie4_5ForCausalLM": LlamaForCausalLM,
    "Ernie4_5_MoeForCausalLM": LlamaForCausalLM,
    "HeliumForCausalLM": LlamaForCausalLM,
    "GlmForCausalLM": LlamaForCausalLM,
    "Glm4ForCausalLM": LlamaForCausalLM,
    "StableLmForCausalLM": LlamaForCausalLM,
    "PhiForCausalLM": LlamaForCausalLM,
    "GPTNeoXForCausalLM": LlamaForCausalLM,
    "Starcoder2ForCausalLM": LlamaForCausalLM,
    "CohereForCausalLM": LlamaForCausalLM,
    "Cohere2ForCausalLM": LlamaForCausalLM,
    "GPT2LMHeadModel": LlamaForCausalLM,
    "GPTBigCodeForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": LlamaForCausalLM,
    "GPTJForCausalLM": LlamaForCausalLM,
    "GraniteMoeForCausalLM": LlamaForCausalLM,
    # Granite 4's: a shared MLP beside the experts, or alone (granite-4.0-micro); Mamba-2 layers among attention ones
    "GraniteMoeSharedForCausalLM": LlamaForCausalLM,
    "GraniteMoeHybridForCausalLM": LlamaForCausalLM,
    "GraniteMoeSWAForCausalLM": LlamaForCausalLM,     # and Granite SWA's sinks and local layers
    "OlmoForCausalLM": LlamaForCausalLM,
    "NemotronForCausalLM": LlamaForCausalLM,
    "ArceeForCausalLM": LlamaForCausalLM,
    "ApertusForCausalLM": LlamaForCausalLM,
    "VaultGemmaForCausalLM": LlamaForCausalLM,
    "HunYuanDenseV1ForCausalLM": LlamaForCausalLM,
    "OlmoeForCausalLM": LlamaForCausalLM,
    "FalconForCausalLM": LlamaForCausalLM,     # Falcon-RW's too (ALiBi)
    "BloomForCausalLM": LlamaForCausalLM,      # ALiBi
    "MptForCausalLM": LlamaForCausalLM,        # ALiBi
    "MPTForCausalLM": LlamaForCausalLM,        # (MosaicML's checkpoints name it so)
    "Lfm2ForCausalLM": LlamaForCausalLM,      # short convolutions among its attention layers (ShortConv)
    "Lfm2MoeForCausalLM": LlamaForCausalLM,   # and experts in its later layers
    "GptOssForCausalLM": LlamaForCausalLM,    # attention sinks, biased experts (MXFP4 ones kept in 4 bits)
    "GraniteSWAForCausalLM": LlamaForCausalLM,    # Granite's multipliers, attention sinks, local layers
    "DeepseekV2ForCausalLM": LlamaForCausalLM,    # latent attention (pagedllm.models.mla), shared experts
    "DeepseekV3ForCausalLM": LlamaForCausalLM,    # and sigmoid scores chosen with a bias
    # Gated DeltaNet layers (pagedllm.models.deltanet) among attention layers with gated outputs; experts with a
    # gated shared one (Qwen3-Next's, Qwen3.5-MoE's); Qwen3.5's released checkpoints are its ForConditionalGeneration
    # (pagedllm.loader's TEXT_PARTS)
    "Qwen3NextForCausalLM": LlamaForCausalLM,
    "Qwen3_5ForCausalLM": LlamaForCausalLM,
    "Qwen3_5MoeForCausalLM": LlamaForCausalLM,
    # The bare decoders (no LM head), as embedding models are saved (gte-Qwen2, e5-mistral): see BARE_ARCHITECTURES.
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": LlamaForCausalLM,
    "Qwen2Model": LlamaForCausalLM,
    "Qwen3Model": LlamaForCausalLM,
    "Gemma3TextModel": LlamaForCausalLM,    # EmbeddingGemma's, whose attention is bidirectional
    # BERT-family encoders, embedding models (pagedllm.models.bert)
    "BertModel": BertModel,
    "RobertaModel": BertModel,
    "XLMRobertaModel": BertModel,
    # With a classification head (rerankers, classifiers): see CLASSIFIER_ARCHITECTURES.
    "LlamaForSequenceClassification": LlamaForCausalLM,
    "MistralForSequenceClassification": LlamaForCausalLM,
    "Qwen2ForSequenceClassification": LlamaForCausalLM,
    "Qwen3ForSequenceClassification": LlamaForCausalLM,
    "BertForSequenceClassification": BertModel,     # and ENCODER_CLASSIFIER_ARCHITECTURES
    "RobertaForSequenceClassification": BertModel,
    "XLMRobertaForSequenceClassification": BertModel,
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "ministral": LlamaForCausalLM,
    "ministral3": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "mixtral": LlamaForCausalLM,
    "qwen2_moe": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
    "smollm3": LlamaForCausalLM,
    "gemma": LlamaForCausalLM,
    "gemma2": LlamaForCausalLM,
    "gemma3_text": LlamaForCausalLM,
    "granite": LlamaForCausalLM,
    "granitemoe": LlamaForCausalLM,
    "granitemoeshared": LlamaForCausalLM,
    "granitemoehybrid": LlamaForCausalLM,
    "granitemoe_swa": LlamaForCausalLM,
    "lfm2": LlamaForCausalLM,
    "lfm2_moe": LlamaForCausalLM,
    "olmo2": LlamaForCausalLM,
    "olmo3": LlamaForCausalLM,
    "olmoe": LlamaForCausalLM,
    "exaone4": LlamaForCausalLM,
    "ernie4_5": LlamaForCausalLM,
    "ernie4_5_moe": LlamaForCausalLM,
    "glm4": LlamaForCausalLM,
    "stablelm": LlamaForCausalLM,
    "starcoder2": LlamaForCausalLM,
    "phi": LlamaForCausalLM,
    "gpt_neox": LlamaForCausalLM,
    "cohere": LlamaForCausalLM,
    "cohere2": LlamaForCausalLM,
    "arcee": LlamaForCausalLM,
    "apertus": LlamaForCausalLM,
    "vaultgemma": LlamaForCausalLM,
    "hunyuan_v1_dense": LlamaForCausalLM,
    "seed_oss": LlamaForCausalLM,
    "nemotron": LlamaForCausalLM,
    "gpt_bigcode": LlamaForCausalLM,
    "gpt2": LlamaForCausalLM,
    "bloom": LlamaForCausalLM,
    "falcon": LlamaForCausalLM,
    "mpt": LlamaForCausalLM,
    "olmo": LlamaForCausalLM,
    "gpt_oss": LlamaForCausalLM,
    "granite_swa": LlamaForCausalLM,
    "deepseek_v2": LlamaForCausalLM,
    "deepseek_v3": LlamaForCausalLM,
    "qwen3_next": LlamaForCausalLM,
    "qwen3_5_text": LlamaForCausalLM,
    "qwen3_5_moe_text": LlamaForCausalLM,
    "bert": BertModel,
    "roberta": BertModel,
    "xlm-roberta": BertModel,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class for one architecture name; ValueError listing the supported names otherwise."""
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}") from None


def model_class_for_config(config: Any) -> type[nn.Module]:
    """The model class for a Hugging Face config: its `architectures`, else its `model_type`."""
    names = list(getattr(config, "architectures", None) or []) + [getattr(config, "model_type", "")]
    for name in names:
        if name in _MODELS:
            return _MODELS[name]
    raise ValueError(f"unsupported model architecture {names!r}; supported: {', '.join(supported_architectures())}")
