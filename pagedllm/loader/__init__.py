"""Load a model: resolve the argument, read its config, build the model and feed it the checkpoint's weights.

The loaders (`safetensors.py`, `gguf.py`) yield Hugging Face (name, tensor) pairs and know nothing of models;
the registry picks the class; the model maps the names onto its parameters.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.attention.cpu import paged_attention as cpu_paged_attention
from pagedllm.attention.metadata import AttentionBackend
from pagedllm.attention.selector import attention_backend
from pagedllm.config import ModelConfig
from pagedllm.cpu import cpu_info, onednn_bf16_ok
from pagedllm.device import model_device
from pagedllm.loader.resolve import ResolvedModel, resolve_model
from pagedllm.models.vision import IMAGE_ENCODERS, image_encoder_class, image_part_name
from pagedllm.multimodal import has_processor

if TYPE_CHECKING:   # gguf (numpy and the gguf package) loads only for a .gguf model
    from pagedllm.loader.gguf import GGUFFile

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: Any  # transformers.PretrainedConfig
    resolved: ResolvedModel
    dtype: torch.dtype
    max_model_len: int      # the context it runs (`max_model_len_of` its config and ModelConfig)
    quantization: str | None = None  # as resolved (`resolve_quantization`): None, the dtype's own weights
    tp_rank: int = 0        # this process's slice of the model under tensor parallelism
    tp_size: int = 1
    attn_backend: AttentionBackend = cpu_paged_attention   # the one its layers attend through
    cascade: bool = True    # steps may run attention as cascade attention (not ModelConfig.disable_cascade_attn)
    gguf_file: GGUFFile | None = None   # a GGUF's header, parsed once (the runner reads its Dense weights later)


def resolve_dtype(dtype: str, device: str = "cpu") -> torch.dtype:
    """"auto" -> bfloat16 on a GPU, and on a CPU wherever linear layers run bf16 weights at full speed (oneDNN with
    bf16 instructions, or pagedllm's packed kernel: bf16 in memory, float32 arithmetic); float32 only where
    neither can (no bf16 in oneDNN, and pagedllm's kernels disabled or not built). Other names map directly."""
    from pagedllm.layers.linear import linear_packing

    if dtype != "auto":
        return _DTYPES[dtype]
    if device != "cpu" or onednn_bf16_ok() or linear_packing(torch.bfloat16) is not None:
        return torch.bfloat16
    return torch.float32


def _log_precision(requested: str, dtype: torch.dtype, device: str, quantization: str | None) -> None:
    """One line at start-up: the CPU, the dtype chosen and why, and how its matmuls run (with quantized linear
    weights, how the rest runs: the loaded line says how the weights were packed)."""
    from pagedllm.layers.linear import linear_packing

    chosen = f"{str(dtype).removeprefix('torch.')}{' (auto)' if requested == 'auto' else ''}"
    if device != "cpu":
        logger.info("device %s; dtype %s", device, chosen)
        return
    if quantization is not None:
        logger.info("CPU: %s; dtype %s for activations, the KV cache and unquantized tensors; linear weights as %s",
                    cpu_info().describe(), chosen, quantization)
        return
    how = {"onednn": "bf16 weights and KV cache, bf16 matmuls in oneDNN",
           "brgemm": "bf16 weights and KV cache, bf16 matmuls in torch's brgemm blocks (AMX tiles)",
           "pagedllm": ("bf16 weights and KV cache (half float32's bytes), float32 arithmetic in pagedllm's kernels"
                        if dtype == torch.bfloat16 else "float32 weights packed for pagedllm's kernels")}
    packing = linear_packing(dtype)
    if packing is not None:
        logger.info("CPU: %s; dtype %s: %s", cpu_info().describe(), chosen, how[packing])
    elif dtype == torch.bfloat16:
        logger.warning("CPU: %s; dtype %s runs through torch's bf16 emulation without pagedllm's kernels: several "
                       "times slower than float32 here", cpu_info().describe(), chosen)
    else:
        logger.info("CPU: %s; dtype %s", cpu_info().describe(), chosen)


# Multimodal checkpoints served for their text: architecture -> (its language model's, and the model_type pagedllm
# knows that model by where the text config names its own). The config is the language model's (`text_config`), its
# weights come under the text model's names (`text_part_name`); the vision tower's and the projector's are read only
# for an architecture IMAGE_ENCODERS names, whose checkpoint has its processor config (its images, then). Qwen2-VL's,
# Qwen2.5-VL's, Qwen3-VL's and Qwen3-VL-MoE's language models are Qwen2's, Qwen3's and Qwen3-MoE's with M-RoPE,
# which rotates by three position ids (time, height, width) that are one and the same on text: their plain rotary
# embedding (an image's placeholders are turned by their own three: `pagedllm.multimodal.MRopeLayout`).
TEXT_PARTS: dict[str, tuple[str, str | None]] = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", None),
    "Mistral3ForConditionalGeneration": ("MistralForCausalLM", None),
    "Qwen2VLForConditionalGeneration": ("Qwen2ForCausalLM", "qwen2"),
    "Qwen2_5_VLForConditionalGeneration": ("Qwen2ForCausalLM", "qwen2"),
    "Qwen3VLForConditionalGeneration": ("Qwen3ForCausalLM", "qwen3"),
    "Qwen3VLMoeForConditionalGeneration": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5ForCausalLM", None),
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeForCausalLM", None),
}
# And any other vision-language checkpoint of the Llava kind (a vision tower and a projector beside a language model
# of a family pagedllm runs, unchanged: Llava, LlavaNext, InternVL, Idefics3, ...): its text config's model_type ->
# the language model's architecture
_TEXT_MODEL_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# the language model's checkpoint names -> the text model's, in the layouts transformers has saved them in
# (language_model.model.* before 4.52, model.language_model.* since, Idefics3's and SmolVLM's model.text_model.*; the
# LM head beside either), and Qwen2-VL's and Qwen2.5-VL's, whose language model's names are a text model's own
# (model.layers.*, beside visual.*)
_TEXT_PART_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("model.text_model.", "model."),
                       ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."),
                       ("model.layers.", "model.layers."), ("model.embed_tokens.", "model.embed_tokens."),
                       ("model.norm.", "model.norm."))


def _image_encoder(resolved: ResolvedModel, dtype: torch.dtype, device: str, architecture: str) -> nn.Module:
    """A multimodal checkpoint's image encoder (`image_encoder_class`: the tower and the projector), loaded on
    `device`, in `dtype`; in float32 where that is bf16 on a CPU that does not multiply bf16 itself: its plain torch
    linears would be emulated there, several times slower than float32's (the language model's run pagedllm's
    kernels)."""
    from transformers import AutoConfig

    if device == "cpu" and dtype == torch.bfloat16 and not onednn_bf16_ok():
        dtype = torch.float32

    with torch.device(device):
        config = AutoConfig.from_pretrained(str(resolved.path))
        encoder = image_encoder_class(config, architecture)(config, dtype)
    encoder.load_weights(_checkpoint_tensors(resolved.path, dtype, config, image_part_name))
    encoder.prepack()
    return encoder.eval()


def text_part_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as its text model names it; None for the other parts' tensors."""
    for prefix, text_prefix in _TEXT_PART_PREFIXES:
        if name.startswith(prefix):
            return text_prefix + name.removeprefix(prefix)
    return None


def load_hf_config(resolved: ResolvedModel, gguf_file: GGUFFile | None = None,
                   overrides: dict[str, Any] | None = None, tokenizer: str | None = None) -> Any:
    """The transformers config of a folder (a multimodal checkpoint's language model's: TEXT_PARTS), or one built
    from a GGUF's metadata (`gguf_file`: the file already opened), with `overrides` (ModelConfig.hf_overrides) set
    on it (tokens they name are looked up in `tokenizer`'s vocabulary: ModelConfig.tokenizer)."""
    if resolved.gguf_path is not None:
        from pagedllm.loader.gguf import GGUFFile, gguf_hf_config

        config = gguf_hf_config(gguf_file or GGUFFile(resolved.gguf_path))
    else:
        from transformers import AutoConfig

        from pagedllm.loader.fp8 import is_eight_bit

        config = AutoConfig.from_pretrained(str(resolved.path))
        multimodal = next((a for a in getattr(config, "architectures", None) or [] if _text_part(config, a)), None)
        quantized = getattr(config, "quantization_config", None)
        if multimodal is not None and quantized and not is_eight_bit(config):
            raise ValueError(f"{resolved.name} is a quantized {multimodal}, whose language model pagedllm does not "
                             "read yet (it serves one's text from unquantized weights, or 8-bit ones dequantised)")
        if multimodal is not None:
            config = _text_config(config, multimodal)
            if quantized:   # the text model's weights are read as the whole checkpoint's config says
                config.quantization_config = quantized
    if overrides:
        config.update(overrides)
        if "classifier_from_token" in overrides:
            _classifier_from_token(config, resolved, tokenizer)
    return config


def _text_part(config: Any, architecture: str) -> tuple[str, str | None] | None:
    """A multimodal architecture's language model's architecture and the model_type pagedllm knows it by (None: the
    text config's own), if pagedllm serves its text (TEXT_PARTS, or one of the Llava kind); None otherwise."""
    if architecture in TEXT_PARTS:
        return TEXT_PARTS[architecture]
    if not architecture.endswith("ForConditionalGeneration") or not hasattr(config, "text_config"):
        return None     # an encoder-decoder (T5, BART) is no vision-language model
    text_model = _TEXT_MODEL_ARCHITECTURES.get(config.get_text_config().model_type)
    return None if text_model is None else (text_model, None)


def _text_config(config: Any, multimodal: str) -> Any:
    """A multimodal config's language model's, as the text model it is (`_text_part`). Whether the LM head is tied to
    the embedding is the whole config's to say, as transformers ties them (Mistral 3's text config says untied, its
    whole config tied)."""
    text = config.get_text_config()
    part = _text_part(config, multimodal)
    assert part is not None, f"{multimodal} has no text part pagedllm serves"
    architecture, model_type = part
    text.architectures, text.text_part_of = [architecture], multimodal
    if multimodal in IMAGE_ENCODERS:    # the token whose runs stand for images (pagedllm.multimodal)
        text.image_token_id = config.image_token_id
    if model_type is not None:
        text.model_type = model_type
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    return text


def _classifier_from_token(config: Any, resolved: ResolvedModel, tokenizer_path: str | None) -> None:
    """vLLM's classifier from an LM head's rows (`hf_overrides` `classifier_from_token`: token strings, one per
    class): the tokens' ids go to `config.classifier_token_ids` (the model builds its head from those rows,
    `LlamaForCausalLM.load_weights`) and the classes to id2label. With two tokens and `is_original_qwen3_reranker`
    (or `method` "from_2_way_softmax") the head has one label, the second token's row less the first's: the sigmoid
    of its logit is the second token's probability in a softmax over the two (Qwen3-Reranker's "yes" against
    "no")."""
    from pagedllm.tokenizer.tokenizer import model_tokenizer

    tokens = config.classifier_from_token
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must be a list of token strings, got {tokens!r}")
    tokenizer = model_tokenizer(resolved, tokenizer_path)
    ids = tokenizer.convert_tokens_to_ids(tokens)
    unknown = [t for t, i in zip(tokens, ids, strict=True) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ValueError(f"classifier_from_token names {unknown}, which are not tokens of this model's vocabulary")
    two_way = getattr(config, "is_original_qwen3_reranker", False) or \
        getattr(config, "method", None) == "from_2_way_softmax"
    if two_way and len(tokens) != 2:
        raise ValueError(f"a two-way classifier takes two tokens (false, true), got {tokens}")
    config.classifier_token_ids = ids
    config.id2label = {0: tokens[1]} if two_way else dict(enumerate(tokens))
    config.label2id = {label: i for i, label in config.id2label.items()}


def max_model_len_of(hf_config: Any, wanted: int | None, disable_sliding_window: bool = False) -> int:
    """The model's context length (`context_length`), capped by `wanted` when given. A model
    whose layers attend over sliding windows (`sliding_window_of_layer`) runs its whole context too: each such layer
    reads its window of the cache; with `disable_sliding_window` (vLLM's), its context is capped at its smallest
    window instead, within which every layer may attend over all of it (`without_sliding_window`)."""
    from pagedllm.models.bert import position_offset
    from pagedllm.models.llama import context_length

    # RoBERTa's positions start after its padding id: two of its rows are not positions of the context
    model_len = context_length(hf_config) - position_offset(hf_config)
    what = "the model's context length"
    window = min(_sliding_windows(hf_config), default=0) if disable_sliding_window else 0
    if 0 < window < model_len:
        model_len, what = window, "the model's sliding window (disable_sliding_window caps the context there)"
    if wanted is not None and wanted > model_len:
        raise ValueError(f"max_model_len={wanted} is larger than {what} {model_len}")
    return wanted or model_len


def _sliding_windows(hf_config: Any) -> set[int]:
    from pagedllm.models.llama import sliding_window_of_layer

    num_layers = getattr(hf_config, "num_hidden_layers", 0) or 0
    return {window for i in range(num_layers) if (window := sliding_window_of_layer(hf_config, i))}


def without_sliding_window(hf_config: Any) -> None:
    """Make every layer of `hf_config` attend over its whole context (vLLM's disable_sliding_window): after its
    context was capped at its window by `max_model_len_of`, the same attention."""
    if _sliding_windows(hf_config):
        hf_config.sliding_window = None


def _weights(resolved: ResolvedModel, dtype: torch.dtype, hf_config: Any, quantization: str | None,
             model: nn.Module, gguf_file: GGUFFile | None) -> Iterator[tuple[str, torch.Tensor]]:
    """A lazy (name, tensor) iterator over the checkpoint's weights in `dtype` (quantized ones dequantised), but
    for the quantized ones `model` packed before loading (`packed_checkpoint_names`), which are never read."""
    from pagedllm.layers.linear import packed_checkpoint_names
    from pagedllm.loader.int4 import INT4_METHODS, int4_config, iterate_int4
    from pagedllm.loader.mxfp4 import is_mxfp4, iterate_mxfp4

    skip = packed_checkpoint_names(model)
    if resolved.gguf_path is not None:
        from pagedllm.loader.gguf import iterate_gguf

        return iterate_gguf(resolved.gguf_path, dtype, gguf_file, skip)
    if is_mxfp4(hf_config):
        return iterate_mxfp4(resolved.path, dtype, skip)
    if quantization in INT4_METHODS:
        return iterate_int4(resolved.path, dtype, int4_config(hf_config), skip, getattr(model, "checkpoint_name", str))
    return _checkpoint_tensors(resolved.path, dtype, hf_config,
                               text_part_name if hasattr(hf_config, "text_part_of") else None)


def _checkpoint_tensors(folder: Path, dtype: torch.dtype, hf_config: Any, rename: Callable[[str], str | None] | None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """A folder's tensors in `dtype`, under `rename`'s names: an 8-bit checkpoint's (FP8, compressed-tensors')
    weights dequantised (`pagedllm.loader.fp8`)."""
    from pagedllm.loader.fp8 import eight_bit_layout, is_eight_bit, iterate_eight_bit
    from pagedllm.loader.safetensors import iterate_safetensors

    if is_eight_bit(hf_config):
        return iterate_eight_bit(folder, dtype, eight_bit_layout(hf_config), rename)
    return iterate_safetensors(folder, dtype, rename)


# The share of the RAM under which a .gguf file's weights, in bf16, are dequantised where the CPU lacks VNNI.
SMALL_GGUF_SHARE = 1 / 8


def implied_gguf(resolved: ResolvedModel, hf_config: Any, dtype: str, tp_size: int = 1,
                 device: str = "cpu") -> str | None:
    """"gguf" when a .gguf file runs under dtype "auto" where its blocks can stay packed (pagedllm's CPU kernels,
    one rank), unless this CPU lacks VNNI (`CpuInfo.int8_dot_products`) and the weights in bf16 would be small
    (`SMALL_GGUF_SHARE` of the RAM): there the blocks save bytes but no arithmetic, and a batch runs faster on bf16
    weights, while a bigger model is bound by reading its weights at the batches it runs and needs the blocks'
    memory. None otherwise: the file is dequantised into the dtype (a dtype named outright asks for that;
    quantization="gguf" keeps the blocks), as is one whose weights change at load (`load_time_change`)."""
    import psutil

    from pagedllm.cpu import cpu_info
    from pagedllm.layers.linear import quantized_kernels_available
    from pagedllm.models.llama import load_time_change

    if not resolved.is_gguf or dtype != "auto":
        return None
    change = load_time_change(hf_config, "gguf")
    if change is not None:
        logger.info("%s: GGUF weights dequantised (%s at load)", resolved.name, change)
        return None
    if tp_size > 1 or device != "cpu" or not quantized_kernels_available():
        logger.info("%s: GGUF weights dequantised (their blocks stay packed only on one CPU rank, in pagedllm's "
                    "kernels)", resolved.name)
        return None
    gguf_path = resolved.gguf_path
    assert gguf_path is not None
    bf16_bytes = 4 * gguf_path.stat().st_size        # 4-bit blocks, 4.5-5 bits a weight: about a quarter of bf16's
    if not cpu_info().int8_dot_products and bf16_bytes <= SMALL_GGUF_SHARE * psutil.virtual_memory().total:
        logger.info("%s: GGUF weights dequantised (without VNNI their blocks' integer products cost what bf16 "
                    "weights' float32 FMAs do, so a batch runs faster on these; quantization='gguf' keeps the "
                    "blocks: faster one stream at a time)", resolved.name)
        return None
    return "gguf"


def resolve_quantization(requested: str | None, resolved: ResolvedModel, hf_config: Any, tp_size: int = 1,
                         device: str = "cpu", dtype: str = "auto") -> str | None:
    """The quantization to run: `requested`, or when None the checkpoint's own, as vLLM does: an AWQ/GPTQ
    folder's `quantization_config.quant_method`, or "gguf" for a .gguf file under dtype "auto" (`implied_gguf`).
    ValueError when they disagree, for a quant method pagedllm does not run, and for the modes that keep packed
    weights (gguf, awq, gptq) asked for off one CPU rank."""
    from pagedllm.loader.fp8 import eight_bit_layout, is_eight_bit
    from pagedllm.loader.int4 import INT4_METHODS, checkpoint_quantization
    from pagedllm.models.llama import load_time_change

    method = None if resolved.is_gguf else checkpoint_quantization(hf_config)
    if method == "mxfp4":
        return _mxfp4_quantization(requested, resolved, tp_size, device)
    if method is not None and is_eight_bit(hf_config):  # read dequantised: runs as unquantized, or quantized here
        eight_bit_layout(hf_config)
        if requested not in (None, "int8", "w8a8", method):
            raise ValueError(f"{resolved.name} is a {method!r} checkpoint, read dequantised into the dtype: it runs "
                             f"as quantization {method!r} (or None), 'int8' or 'w8a8', not {requested!r}")
        return requested if requested in ("int8", "w8a8") else None
    if requested in ("fp8", "compressed-tensors", "mxfp4") and requested != method:
        raise ValueError(f"quantization={requested!r} reads a checkpoint saved so (its config.json's "
                         f"quantization_config), dequantised; {resolved.name} is none (pagedllm quantizes weights at "
                         "load to 'int8' or 'w8a8')")
    quantization = requested or method or implied_gguf(resolved, hf_config, dtype, tp_size, device)
    if method is not None and quantization != method:
        raise ValueError(f"{resolved.name} is a {method!r} checkpoint (its quantization_config), which runs as "
                         f"quantization={method!r} or None, not {requested!r}")
    if quantization not in (None, "int8", "w8a8", "gguf", *INT4_METHODS):
        raise ValueError(f"{resolved.name} is a {quantization!r} checkpoint: pagedllm runs unquantized, GGUF, AWQ, "
                         "GPTQ, FP8 and compressed-tensors checkpoints")
    if quantization in INT4_METHODS and method is None:
        raise ValueError(f"quantization={quantization!r} needs a checkpoint whose config.json has "
                         f"quantization_config.quant_method={quantization!r}; {resolved.name} has none")
    if quantization == "gguf" and resolved.gguf_path is None:
        raise ValueError(f"quantization='gguf' keeps a GGUF file's blocks packed, but {resolved.name} is not a .gguf "
                         "file: use 'int8', 'w8a8' or None")
    change = load_time_change(hf_config, quantization) if quantization in ("gguf", *INT4_METHODS) else None
    if change is not None:
        how = "load it with dtype 'auto' (or one named), which dequantises its weights" if quantization == "gguf" \
            else f"pagedllm does not run {quantization!r} checkpoints of it"
        raise ValueError(f"{resolved.name}: {change} at load, which its {quantization!r} blocks, kept packed, "
                         f"cannot take: {how}")
    if quantization in ("gguf", *INT4_METHODS) and (tp_size > 1 or device != "cpu"):
        raise ValueError(f"quantization={quantization!r} runs on one rank (tensor_parallel_size=1), in pagedllm's CPU "
                         "kernels: the packed blocks are not split across ranks yet")
    return quantization


def _mxfp4_quantization(requested: str | None, resolved: ResolvedModel, tp_size: int, device: str) -> str | None:
    """An MXFP4 checkpoint's quantization: "mxfp4" (its experts kept in 4 bits) on one CPU rank where pagedllm's
    kernels run, asked for or not; otherwise None, its experts read dequantised into the dtype (ValueError where
    "mxfp4" was asked for there, or another quantization anywhere)."""
    from pagedllm.layers.linear import quantized_kernels_available

    if requested not in (None, "mxfp4"):
        raise ValueError(f"{resolved.name} is an 'mxfp4' checkpoint: it runs as quantization 'mxfp4' (or None), not "
                         f"{requested!r}")
    packs = tp_size == 1 and device == "cpu" and quantized_kernels_available()
    if requested == "mxfp4" and not packs:
        raise ValueError("quantization='mxfp4' keeps the experts in 4 bits on one rank (tensor_parallel_size=1), in "
                         "pagedllm's CPU kernels; use None, which reads them dequantised")
    if not packs:
        logger.info("%s: MXFP4 experts dequantised (their blocks stay packed only on one CPU rank, in pagedllm's "
                    "kernels)", resolved.name)
    return "mxfp4" if packs else None


def _check_load_format(load_format: str, resolved: ResolvedModel) -> None:
    """ValueError where the model is not of the kind `load_format` reads (ModelConfig.load_format)."""
    if load_format == "gguf" and not resolved.is_gguf:
        raise ValueError(f"load_format 'gguf' reads a .gguf file; {resolved.name} is a model folder")
    if load_format in ("safetensors", "dummy") and resolved.is_gguf:
        raise ValueError(f"load_format {load_format!r} takes a model folder (its config.json"
                         f"{'' if load_format == 'dummy' else ' and safetensors'}); {resolved.name} is a .gguf file")


def dummy_weights(model: nn.Module, seed: int = 1234) -> None:
    """Every floating-point parameter uniform in [-0.001, 0.001] (vLLM's dummy weights), from a fixed seed."""
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            if param.is_floating_point():
                param.uniform_(-1e-3, 1e-3, generator=torch.Generator(param.device).manual_seed(seed + index))


def _pack_blocks(model: nn.Module, quantization: str | None, resolved: ResolvedModel, hf_config: Any,
                 dtype: torch.dtype, gguf_file: GGUFFile | None, activation_bits: int | None) -> list[str]:
    """Before loading: pack the GGUF kernel's blocks (quantization "gguf", "awq", "gptq", 4-bit
    "compressed-tensors" or "mxfp4") in place of the linear
    weights they hold, so that loading never reads, or dequantises, those weights (`packed_checkpoint_names`), to
    multiply activations as `activation_bits` says (None: `gguf_activation_bits`, the CPU's default). Returns what
    was packed, for the start-up line."""
    from pagedllm.layers.linear import (
        gguf_activation_bits,
        gguf_arithmetic,
        pack_gguf_linear_weights,
        pack_int4_linear_weights,
    )
    from pagedllm.loader.int4 import INT4_METHODS, int4_config, int4_weights

    if quantization not in ("gguf", "mxfp4", *INT4_METHODS):
        return []
    if activation_bits is None:
        activation_bits = gguf_activation_bits(dtype)
    if quantization == "mxfp4":
        from pagedllm.loader.mxfp4 import Mxfp4Rows

        counts = pack_gguf_linear_weights(model, Mxfp4Rows(resolved.path), activation_bits)
        parts = [f"{counts['MXFP4']} experts' projections as MXFP4"]
    elif quantization == "gguf":
        from pagedllm.layers.gguf import PACKED_GGUF_TYPES
        from pagedllm.loader.gguf import gguf_block_rows

        rows = gguf_block_rows(gguf_file, PACKED_GGUF_TYPES, hf_config)  # type: ignore[arg-type]
        counts = pack_gguf_linear_weights(model, rows, activation_bits)
        parts = [f"{count} as GGUF {name}" for name, count in sorted(counts.items())]
    else:
        weights = int4_weights(resolved.path, int4_config(hf_config), getattr(model, "checkpoint_name", str))
        parts = [f"{pack_int4_linear_weights(model, weights, activation_bits)} as {quantization.upper()} 4-bit "
                 "(Q4_1 kernel)"]
    parts[-1] += f", times {gguf_arithmetic(activation_bits)}"
    return parts


def _pack(model: nn.Module, quantization: str | None) -> list[str]:
    """After loading: pack the linear weights still plain (`pack_linear_weights`), quantized to int8 here under
    quantization "int8" or "w8a8". Returns what was packed, for the start-up line."""
    from pagedllm.layers.linear import pack_linear_weights

    at_load = quantization if quantization in ("int8", "w8a8") else None  # quantized here, from any checkpoint
    packed = pack_linear_weights(model, at_load)
    return [f"{packed}{f' as {at_load}' if at_load else ''}"] if packed else []


def load_model(model_config: ModelConfig, tp_rank: int = 0, tp_size: int = 1,
               gguf_activation_bits: int | None = None) -> LoadedModel:
    """Resolve, build and load the model of `model_config`, in eval mode on `model_config.device`; under tensor
    parallelism, rank `tp_rank`'s slice of it (each rank reads the checkpoint and keeps its own slice).
    `gguf_activation_bits` sets how GGUF/AWQ/GPTQ blocks multiply (16, 8 or `GGUF_BF16`); None: the CPU's default."""
    from pagedllm.loader.fp8 import is_eight_bit
    from pagedllm.loader.huge_pages import place_in_huge_pages
    from pagedllm.models.registry import model_class_for_config

    start = time.perf_counter()
    model_config = dataclasses.replace(model_config, device=model_device(model_config, tp_size))
    resolved = resolve_model(model_config.model)
    dummy = model_config.load_format == "dummy"
    _check_load_format(model_config.load_format, resolved)
    gguf_file = None
    if resolved.gguf_path is not None:   # its header parsed once, for the config, the packing and the tensors
        from pagedllm.loader.gguf import GGUFFile

        gguf_file = GGUFFile(resolved.gguf_path)
    hf_config = load_hf_config(resolved, gguf_file, model_config.hf_overrides, model_config.tokenizer)
    quantization = resolve_quantization(model_config.quantization, resolved, hf_config, tp_size, model_config.device,
                                        model_config.dtype)
    if dummy and quantization not in (None, "int8", "w8a8"):
        raise ValueError(f"load_format 'dummy' makes weights in the dtype, to run as such or quantized at load (int8, "
                         f"w8a8); {resolved.name} is a {quantization!r} checkpoint")
    dtype = resolve_dtype(model_config.dtype, model_config.device)
    if tp_rank == 0:
        _log_precision(model_config.dtype, dtype, model_config.device, quantization)
    model_cls = model_class_for_config(hf_config)
    max_model_len = max_model_len_of(hf_config, model_config.max_model_len, model_config.disable_sliding_window)
    if model_config.disable_sliding_window:
        without_sliding_window(hf_config)
    # Parameters are allocated with torch.empty (no random init), so building directly is cheap.
    attn_backend = attention_backend(model_config.device)
    with torch.device(model_config.device):
        model = model_cls(hf_config, dtype=dtype, attn_backend=attn_backend, tp_rank=tp_rank, tp_size=tp_size,
                          max_positions=max_model_len)
    parts = _pack_blocks(model, quantization, resolved, hf_config, dtype, gguf_file, gguf_activation_bits)
    if dummy:
        dummy_weights(model)
        parts.append("random (load_format dummy)")
    else:
        model.load_weights(_weights(resolved, dtype, hf_config, quantization, model, gguf_file))
        if is_eight_bit(hf_config):
            parts.append(f"the checkpoint's 8-bit weights dequantised into {str(dtype).removeprefix('torch.')}")
    model.eval()
    parts += _pack(model, quantization)
    if getattr(hf_config, "text_part_of", None) in IMAGE_ENCODERS:
        if model_config.image_limit == 0:
            parts.append("no image encoder (limit_mm_per_prompt: images off)")
        elif dummy:
            parts.append("no image encoder (load_format dummy: text only)")
        elif has_processor(resolved.path):
            model.image_encoder = _image_encoder(resolved, dtype, model_config.device, hf_config.text_part_of)
            parts.append("the image encoder in plain torch")
        elif tp_rank == 0:
            logger.warning("%s has no processor config (preprocessor_config.json): it takes text prompts only",
                           resolved.name)
    how = f", weights packed: {', '.join(parts)}" if parts else ""
    if model_config.device == "cpu" and place_in_huge_pages(model):
        how += ", in 2 MiB pages"
    if not model_config.enforce_eager:
        model.use_decoder_stack()
    rank = f", tensor-parallel rank {tp_rank} of {tp_size}" if tp_size > 1 else ""
    logger.info("loaded %s (%s%s%s) in %.2f s", resolved.name, dtype, how, rank, time.perf_counter() - start)
    return LoadedModel(model, hf_config, resolved, dtype, max_model_len, quantization, tp_rank, tp_size, attn_backend,
                       not model_config.disable_cascade_attn, gguf_file)


__all__ = ["LoadedModel", "ResolvedModel", "load_model", "load_hf_config", "max_model_len_of", "resolve_dtype",
           "resolve_model"]
