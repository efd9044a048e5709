"""(hf_name, tensor) pairs from a GGUF file, dequantised with the `gguf` package, llama Q/K permutation undone.

The header is parsed here rather than with `gguf.GGUFReader`, which builds a numpy view per array item and
takes seconds on a tokenizer's 100k strings; tensor data is memory-mapped and dequantised one tensor at a time.

Layout of a GGUF file (little endian):

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x       (key: str, value_type: u32, value)          str = u64 length + utf-8 bytes
    n_tensors x  (name: str, n_dims: u32, dims: u64[n_dims], ggml_type: u32, offset: u64)
    padding to `general.alignment` (32) | tensor data, each at data_start + offset

dims run fastest first, so a GGUF [ne0, ne1] tensor is a torch [ne1, ne0] one.
"""

from __future__ import annotations

import mmap
import re
import struct
import warnings
from collections.abc import Container, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from pagedllm.layers.rotary import interleaved_to_halves

_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_PLAIN_TYPES: dict[int, torch.dtype] = {
    GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
# Architectures whose Q/K rows llama.cpp's converter permutes (for its interleaved rope).
# ERNIE 4.5's, GLM-4's and Cohere's (Command R's) rows as their checkpoints hold them: interleaved (GLM-4's in the
# rotary half of each head)
_HALVES_ARCHS = {"ernie4_5", "ernie4_5-moe", "glm4", "command-r", "cohere2"}    # (whose rows the loader reorders)
_PERMUTED_ARCHS = {"llama", "smollm3", "granite", "granitemoe", "granitehybrid", "arcee", "olmo", *_HALVES_ARCHS}
# SmolLM3's layers without a rotary embedding: every how many one is (llama.cpp fixes it rather than store it)
_SMOLLM3_NO_ROPE_EVERY = 4

# GGUF tensor name -> Hugging Face name (llama family). {i} is the layer index.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",      # Qwen3
    # a mixture of experts: the router, and Qwen2-MoE's shared expert and its gate (the experts: _EXPERT_RE)
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    # ERNIE 4.5 MoE's bias of its experts' choice (its checkpoints' e_score_correction_bias, as llama.cpp's converter
    # renames it)
    "exp_probs_b": "mlp.moe_statics.e_score_correction",
}
# Gemma's names where they differ: llama.cpp's ffn_norm is the norm before the MLP, which Gemma calls
# pre_feedforward_layernorm (its post_attention_layernorm is the attention branch's output norm)
_GEMMA_BLOCK_NAMES = {**_BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_OUTPUT_NORMED_BLOCK_NAMES = {**_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm",
                              "post_ffw_norm": "post_feedforward_layernorm"}
# LFM2's short convolutions, as the model's modules name them (its `self_attn`, a ShortConv); LFM2-MoE's the same
_LFM2_BLOCK_NAMES = {**_BLOCK_NAMES, "shortconv.in_proj": "self_attn.in_proj", "shortconv.out_proj": "self_attn.o_proj",
                     "shortconv.conv": "self_attn.conv"}
# Granite 4's hybrids' Mamba-2 layers, as the model's modules name them (its `self_attn`, a Mamba2Mixer); their
# dt bias, A and D (stored as A = -exp(A_log) and D, [H, 1] each, without .weight) are `_SSM_PARAMS`
_GRANITE_HYBRID_BLOCK_NAMES = {**_BLOCK_NAMES, "ssm_in": "self_attn.in_proj", "ssm_conv1d": "self_attn.conv1d",
                               "ssm_norm": "self_attn.norm", "ssm_out": "self_attn.o_proj"}
_SSM_PARAMS = {"ssm_dt.bias": "dt_bias", "ssm_a": "A_log", "ssm_d": "D"}
_SSM_PARAM_RE = re.compile(r"blk\.(\d+)\.(ssm_dt\.bias|ssm_a|ssm_d)$")
_PLAIN_MLP_BLOCK_NAMES = {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
# Phi-3's fused weights: its q/k/v in one tensor, and its gate and up in ffn_up (`unfused` splits them)
_ARCH_BLOCK_NAMES = {"gemma2": _GEMMA_BLOCK_NAMES, "gemma3": _GEMMA_BLOCK_NAMES, "gemma-embedding": _GEMMA_BLOCK_NAMES,
                     "phi3": {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                     # OLMo 2's and EXAONE 4's norms of their branches' outputs
                     "olmo2": _OUTPUT_NORMED_BLOCK_NAMES, "exaone4": _OUTPUT_NORMED_BLOCK_NAMES,
                     # GLM-4's gate and up in ffn_up, its norms of the branches' outputs as its checkpoint names them
                     "glm4": {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj",
                              "post_attention_norm": "post_self_attn_layernorm", "post_ffw_norm": "post_mlp_layernorm"},
                     "lfm2": _LFM2_BLOCK_NAMES, "lfm2moe": _LFM2_BLOCK_NAMES,
                     "granitehybrid": _GRANITE_HYBRID_BLOCK_NAMES,
                     # Seed-OSS's norm before the MLP, under llama.cpp's name for a norm after the attention
                     "seed_oss": {**_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm"},
                     # the ungated MLPs of StarCoder2, Phi-2 and GPT-NeoX, under the names the model gives them
                     # (`PlainMLP`); Phi-2's and GPT-NeoX's q/k/v fused (q's rows, then k's, then v's: llama.cpp's
                     # converter reorders GPT-NeoX's from head by head)
                     "starcoder2": _PLAIN_MLP_BLOCK_NAMES, "phi2": _PLAIN_MLP_BLOCK_NAMES,
                     "gptneox": _PLAIN_MLP_BLOCK_NAMES,
                     # StarCoder's (GPT-BigCode's) q/k/v fused as its checkpoints hold them: its queries' rows, then
                     # its one KV head's key and value (`unfused`)
                     "starcoder": {**_PLAIN_MLP_BLOCK_NAMES, "attn_qkv": "self_attn.query_key_value"},
                     # GPT-2's q/k/v fused: q's rows, then k's, then v's; BLOOM's the same, as llama.cpp's converter
                     # reorders them from head by head
                     "gpt2": _PLAIN_MLP_BLOCK_NAMES, "bloom": _PLAIN_MLP_BLOCK_NAMES,
                     # Falcon's q/k/v the same (the converter reorders them from its KV heads' groups); Falcon 7B's
                     # one norm for both branches, 40B's attn_norm_2 the attention's and attn_norm the MLP's
                     "falcon": _PLAIN_MLP_BLOCK_NAMES, "mpt": _PLAIN_MLP_BLOCK_NAMES,
                     "falcon-40b": {**_PLAIN_MLP_BLOCK_NAMES, "attn_norm_2": "input_layernorm",
                                    "attn_norm": "post_attention_layernorm"},
                     # gpt-oss's norm before the MLP under llama.cpp's name for a norm after the attention; its sinks
                     "gpt-oss": {**_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm",
                                 "attn_sinks": "self_attn.sinks"},
                     # DeepSeek's latent attention: its queries (straight, or through their latent), the shared
                     # latent and rotary key, and kv_b_proj (older files' attn_kv_b; newer ones split it by head
                     # into attn_k_b, transposed, and attn_v_b: `_fused_kv_b` joins them back)
                     "deepseek2": {**_BLOCK_NAMES, "attn_q_a": "self_attn.q_a_proj",
                                   "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
                                   "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                                   "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                                   "attn_k_b": "self_attn.kv_b_proj", "attn_v_b": "self_attn.kv_b_proj"}}
# Architectures whose norm scales by 1 + w (Gemma's RMSNorm, Nemotron's LayerNorm1P), which llama.cpp's converter
# stores as the 1 + w it multiplies by
_NORM_SHIFTED_ARCHS = {"gemma", "gemma2", "gemma3", "gemma-embedding", "nemotron"}
# Granite's config fields -> llama.cpp's keys
_GRANITE_MULTIPLIERS = (("embedding_multiplier", "embedding_scale"), ("attention_multiplier", "attention.scale"),
                        ("residual_multiplier", "residual_scale"), ("logits_scaling", "logit_scale"))
# GGUF architecture -> transformers' model_type, where they differ (a mixture of experts: _MOE_MODEL_TYPES)
_MODEL_TYPES = {"gemma3": "gemma3_text", "gemma-embedding": "gemma3_text", "phi2": "phi", "gptneox": "gpt_neox",
                "command-r": "cohere", "hunyuan-dense": "hunyuan_v1_dense", "starcoder": "gpt_bigcode",
                # the Qwen-VLs' language models (Qwen2-VL's, Qwen3-VL's): Qwen2's and Qwen3's, whose M-RoPE
                # (`rope.dimension_sections`) is the plain rope on text; their image encoders live in mmproj files
                "qwen2vl": "qwen2", "qwen3vl": "qwen3", "granitehybrid": "granitemoehybrid"}
# Every how many layers one is global, the others local over the window, where a file does not mark them (Cohere2's:
# llama.cpp fixes it rather than store it)
_GLOBAL_LAYER_EVERY = 4
# What llama.cpp fixes for Gemma rather than read from the file: every how many layers one is global (the others
# local, over the window), and the layer count of the 27B, whose queries are scaled by (hidden / heads) ** -0.5
_GEMMA_LAYOUTS = {"gemma2": (2, 46), "gemma3": (6, 62), "gemma-embedding": (6, 62)}
# EmbeddingGemma's sentence-transformers Dense layers, which its files hold beside the model (`dense_projection`)
DENSE_TENSORS = ("dense_2.weight", "dense_3.weight")
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
              "token_embd_norm": "model.embedding_norm",   # (LFM2's final norm, under transformers' name for it)
              "position_embd": "model.embed_positions"}    # (StarCoder's learned positions)
_ARCH_TOP_NAMES = {"bloom": {**_TOP_NAMES, "token_embd_norm": "model.embed_norm"}}    # (BLOOM's norm of its embedding)
# llama3's and longrope's rope factors: the rope is rebuilt from the config (longrope's factors go into it)
_SKIPPED = {"rope_freqs", "rope_factors_long", "rope_factors_short"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([\w.]+)\.(weight|bias)$")
# one expert's tensor: blk.{layer}.ffn_{gate,up,down}.{expert}.weight, as older Mixtral files store them and as
# GGUFFile names its slices of the stacked ones (_STACKED_EXPERTS_RE; gpt-oss's experts' biases too)
_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.(weight|bias)$")
_STACKED_EXPERTS_RE = re.compile(r"(blk\.\d+\.ffn_(?:gate|up|down))_exps\.(weight|bias)$")
# GGUF architectures of mixtures of experts -> transformers' model_type (a Mixtral file says "llama")
_MOE_MODEL_TYPES = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "qwen3vlmoe": "qwen3_moe",
                    "ernie4_5-moe": "ernie4_5_moe", "lfm2moe": "lfm2_moe", "granitemoe": "granitemoe", "olmoe": "olmoe",
                    "gpt-oss": "gpt_oss", "deepseek2": "deepseek_v2", "granitehybrid": "granitemoehybrid"}
# whether llama.cpp renormalises each token's top-k expert weights, by architecture (Qwen2-MoE does not)
_MOE_RENORMALIZES = {"llama": True, "qwen2moe": False, "qwen3moe": True, "qwen3vlmoe": True, "ernie4_5-moe": True,
                     "lfm2moe": True, "granitemoe": True, "olmoe": False, "gpt-oss": True, "deepseek2": False,
                     "granitehybrid": True}
# What llama.cpp fixes for gpt-oss rather than read from the file: its experts' SwiGLU's alpha and limit, and every how
# many layers one is global (the others, the first among them, local over the window)
_GPT_OSS_SWIGLU = (1.702, 7.0)
_GPT_OSS_GLOBAL_EVERY = 2


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (slowest first)
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file

    @property
    def num_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return int(np.prod(self.shape)) * type_size // block_size


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]

    def value(self, vtype: int, keep_string_arrays: bool) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype != GGUFValueType.ARRAY:
            return self.unpack(_SCALARS[vtype])
        item_type, count = self.unpack("<I"), self.unpack("<Q")
        if item_type in _SCALARS:
            fmt = _SCALARS[item_type]
            size = struct.calcsize(fmt)
            arr = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos).copy()
            self.pos += size * count
            return arr
        if item_type == GGUFValueType.STRING and not keep_string_arrays:
            for _ in range(count):
                self.skip_string()
            return None  # skipped: tokenizer vocabularies and merges
        return [self.value(item_type, keep_string_arrays) for _ in range(count)]


class GGUFFile:
    """Metadata and tensor index of a GGUF file; tensors are read lazily from a memory map.

    String arrays (the tokenizer's tokens and merges) are skipped unless `keep_string_arrays`; their keys map
    to None.
    """

    def __init__(self, path: str | Path, keep_string_arrays: bool = False) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(self._buf)
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        cur.pos = 4
        self.version = cur.unpack("<I")
        if self.version < 2:
            raise ValueError(f"{self.path}: GGUF version {self.version} is not supported (need >= 2)")
        num_tensors, num_kv = cur.unpack("<Q"), cur.unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("<I"), keep_string_arrays)
        raw = [self._tensor_header(cur) for _ in range(num_tensors)]
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors = {info.name: info for name, shape, t, off in raw
                        for info in _split_experts(GGUFTensorInfo(name, shape, t, data_start + off))}

    @staticmethod
    def _tensor_header(cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        ggml_type = GGMLQuantizationType(cur.unpack("<I"))
        return name, tuple(reversed(dims)), ggml_type, cur.unpack("<Q")

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}` from the metadata, e.g. arch_value("block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def _view(self, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
        """A tensor over the read-only memory map, without a copy; never write to it."""
        with warnings.catch_warnings():  # torch warns that the buffer is not writable
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self._buf, dtype=dtype, count=count, offset=offset)

    def read_tensor(self, info: GGUFTensorInfo) -> torch.Tensor:
        """The tensor dequantised: float32 for quantised types, its own dtype for F32/F16/BF16."""
        if info.ggml_type in _PLAIN_TYPES:
            count = int(np.prod(info.shape))
            return self._view(_PLAIN_TYPES[info.ggml_type], count, info.offset).view(info.shape)
        if info.ggml_type in _TORCH_DEQUANT:
            raw = self._view(torch.uint8, info.num_bytes, info.offset)
            return _TORCH_DEQUANT[info.ggml_type](raw).view(info.shape)
        data = np.frombuffer(self._buf, dtype=np.uint8, count=info.num_bytes, offset=info.offset)
        block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
        rows = data.reshape(*info.shape[:-1], info.shape[-1] // block_size * type_size)
        return torch.from_numpy(dequantize(rows, info.ggml_type))


def _split_experts(info: GGUFTensorInfo) -> list[GGUFTensorInfo]:
    """A stacked experts tensor (blk.N.ffn_gate_exps.weight: [experts, rows, K]; gpt-oss's biases,
    blk.N.ffn_gate_exps.bias: [experts, rows]) as one tensor per expert, each a contiguous run of the file's bytes,
    named as older files name an expert's (blk.N.ffn_gate.E.weight); any other tensor as it is."""
    match = _STACKED_EXPERTS_RE.match(info.name)
    if match is None or len(info.shape) != (3 if match.group(2) == "weight" else 2):
        return [info]
    size = info.num_bytes // info.shape[0]
    return [GGUFTensorInfo(f"{match.group(1)}.{e}.{match.group(2)}", info.shape[1:], info.ggml_type,
                           info.offset + e * size) for e in range(info.shape[0])]


# Torch versions of the common 32-element block formats: the same float32 arithmetic as gguf.quants (so
# results are bit-identical, which the tests check) but several times faster than its numpy code.
def _f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()  # [num_blocks, 1]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes -> [n, 32] values: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _dequant_q8_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 34)  # d: f16, qs: int8[32]
    return _f16_field(blocks, 0) * blocks[:, 2:].view(torch.int8).float()


def _dequant_q4_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 18)  # d: f16, qs: u8[16] (two 4-bit values, offset by 8)
    return _f16_field(blocks, 0) * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()


def _dequant_q4_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 20)  # d: f16, m: f16, qs: u8[16]
    return _f16_field(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _f16_field(blocks, 2)


_TORCH_DEQUANT = {GGMLQuantizationType.Q8_0: _dequant_q8_0, GGMLQuantizationType.Q4_0: _dequant_q4_0,
                  GGMLQuantizationType.Q4_1: _dequant_q4_1}


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (in a file of GGUF architecture `arch`);
    None for tensors to skip."""
    expert = _EXPERT_RE.match(name)
    if expert:
        layer, part, index, kind = expert.groups()
        return f"model.layers.{layer}.mlp.experts.{index}.{part}_proj.{kind}"
    ssm = _SSM_PARAM_RE.match(name)
    if ssm and arch == "granitehybrid":
        return f"model.layers.{ssm.group(1)}.self_attn.{_SSM_PARAMS[ssm.group(2)]}"
    m = _BLOCK_RE.match(name)
    if m:
        layer, part, kind = m.groups()
        names = _ARCH_BLOCK_NAMES.get(arch, _BLOCK_NAMES)
        if part not in names:
            raise KeyError(f"unknown GGUF tensor {name!r}")
        return f"model.layers.{layer}.{names[part]}.{kind}"
    base, _, kind = name.rpartition(".")
    if base in _SKIPPED or name in DENSE_TENSORS:
        return None
    top_names = _ARCH_TOP_NAMES.get(arch, _TOP_NAMES)
    if base not in top_names:
        raise KeyError(f"unknown GGUF tensor {name!r}")
    return f"{top_names[base]}.{kind}"


def _names_of(g: GGUFFile) -> str:
    """The key of `_ARCH_BLOCK_NAMES` that names a file's tensors: its architecture's, but Falcon 40B's (a norm for
    each branch: attn_norm_2) for a `falcon` file that has them."""
    return "falcon-40b" if g.architecture == "falcon" and "blk.0.attn_norm_2.weight" in g.tensors else g.architecture


def iterate_gguf(path: str | Path, dtype: torch.dtype = torch.float32, gguf_file: GGUFFile | None = None,
                 skip: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, tensor in `dtype`) for every weight of a llama-family GGUF but those named in
    `skip`, which are never read; as the Hugging Face checkpoint holds it (Gemma's norms as w, not 1 + w)."""
    from pagedllm.models.llama import fused_parts

    g = gguf_file or GGUFFile(path)
    permute = g.architecture in _PERMUTED_ARCHS
    num_heads = g.arch_value("attention.head_count")
    num_kv_heads = max(_per_layer(g.arch_value("attention.head_count_kv", num_heads)))     # (per layer: a hybrid's)
    rope_dims = g.arch_value("rope.dimension_count")    # a head's values its rope turns (GLM-4's half)
    names = _names_of(g)
    for info in g.tensors.values():
        hf_name = gguf_to_hf_name(info.name, names)
        if hf_name is None or all(part in skip for part in fused_parts(hf_name)) or \
                info.name.endswith(".attn_v_b.weight"):    # (DeepSeek's: read with its attn_k_b)
            continue
        tensor = _fused_kv_b(g, info) if info.name.endswith(".attn_k_b.weight") else g.read_tensor(info)
        if g.architecture in _NORM_SHIFTED_ARCHS and hf_name.endswith("norm.weight"):
            tensor = tensor.float() - 1
        # llama.cpp may store [H] (or [E]) where the checkpoints hold [1, H]: Qwen2-MoE's shared expert's gate, ERNIE's
        # selection bias ([1, E]; LFM2-MoE's checkpoints hold theirs as [E])
        if tensor.dim() == 1 and (hf_name.endswith("shared_expert_gate.weight") or (
                g.architecture == "ernie4_5-moe" and hf_name.endswith("e_score_correction.bias"))):
            tensor = tensor[None]
        if permute and ".q_proj." in hf_name:
            tensor = interleaved_to_halves(tensor, num_heads, rope_dims)
        elif permute and ".k_proj." in hf_name:
            tensor = interleaved_to_halves(tensor, num_kv_heads, rope_dims)
        if g.architecture == "gpt2" and ".layers." in hf_name and tensor.dim() == 2:
            tensor = tensor.t()     # GPT-2's Conv1D weights [in, out], as its checkpoints hold them
        if g.architecture == "granitehybrid":
            tensor = _mamba_layout(hf_name, tensor)
        yield hf_name, tensor.to(dtype)


def _mamba_layout(hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A Mamba-2 layer's tensor as its checkpoint holds it, from llama.cpp's layout: A_log from A = -exp(A_log) and
    D from [H, 1]; the convolution [conv_dim, 1, d_conv] from [conv_dim, d_conv]; the norm [d_inner] from
    [groups, d_inner / groups]; any other tensor as it is."""
    if hf_name.endswith(".self_attn.A_log"):
        return torch.log(-tensor.float().flatten())
    if hf_name.endswith((".self_attn.D", ".self_attn.norm.weight")):
        return tensor.flatten()
    if hf_name.endswith(".self_attn.conv1d.weight") and tensor.dim() == 2:
        return tensor.unsqueeze(1)
    return tensor


def _fused_kv_b(g: GGUFFile, k_b: GGUFTensorInfo) -> torch.Tensor:
    """DeepSeek's kv_b_proj [heads x (nope + v), kv_lora_rank] from a newer file's two parts: attn_k_b [heads,
    kv_lora_rank, nope] (each head's key rows transposed) and attn_v_b [heads, v, kv_lora_rank]."""
    keys = g.read_tensor(k_b).transpose(1, 2)
    values = g.read_tensor(g.tensors[k_b.name.replace(".attn_k_b.", ".attn_v_b.")])
    return torch.cat([keys, values.to(keys.dtype)], dim=1).flatten(0, 1)


def gguf_block_rows(g: GGUFFile, ggml_types: tuple[GGMLQuantizationType, ...], config: Any
                    ) -> dict[str, tuple[GGMLQuantizationType, torch.Tensor]]:
    """{Hugging Face name: (type, raw rows)} of the 2-D tensors stored as one of `ggml_types`: each row's blocks
    as stored (uint8 [N, K/32 * block bytes], over the memory map, never to be written), q/k rows unpermuted as
    `iterate_gguf` unpermutes them, a fused tensor's rows split among its parts as `config` (the file's
    `gguf_hf_config`) sizes them (rows are independent, so moving whole rows of blocks is exact)."""
    from pagedllm.models.llama import unfused
    from pagedllm.models.mla import is_mla, mla_rope_rows

    permute = g.architecture in _PERMUTED_ARCHS
    residual = float(getattr(config, "residual_multiplier", None) or 1.0)    # Granite's, into its blocks' scales
    heads = {".q_proj.": g.arch_value("attention.head_count")}
    heads[".k_proj."] = max(_per_layer(g.arch_value("attention.head_count_kv", heads[".q_proj."])))
    rope_dims = g.arch_value("rope.dimension_count")
    names = _names_of(g)
    rows: dict[str, tuple[GGMLQuantizationType, torch.Tensor]] = {}
    for info in g.tensors.values():
        hf_name = gguf_to_hf_name(info.name, names)
        if hf_name is None or info.ggml_type not in ggml_types or len(info.shape) != 2:
            continue
        raw = g._view(torch.uint8, info.num_bytes, info.offset).view(info.shape[0], -1)
        for part, num_heads in heads.items():
            if permute and part in hf_name:
                raw = interleaved_to_halves(raw, num_heads, rope_dims)
        if residual != 1.0 and hf_name.endswith((".o_proj.weight", ".down_proj.weight")):
            raw = scaled_blocks(raw, info.ggml_type, residual)
        if is_mla(config):      # DeepSeek's interleaved rotary rows, reordered as whole rows of blocks
            raw = mla_rope_rows(config, hf_name, raw)
        for part_name, part_rows in unfused(config, hf_name, raw):     # Phi-3's fused tensors, row by row
            rows[part_name] = (info.ggml_type, part_rows)
    return rows


# the float16 scales at the head of each block, which multiply all its values: (how many, of which block types)
_BLOCK_SCALES = {GGMLQuantizationType.Q4_0: 1, GGMLQuantizationType.Q8_0: 1, GGMLQuantizationType.Q4_1: 2,
                 GGMLQuantizationType.Q4_K: 2}


def scaled_blocks(raw: torch.Tensor, ggml_type: GGMLQuantizationType, factor: float) -> torch.Tensor:
    """Rows of blocks (uint8 [N, blocks x block bytes]) whose values are `factor` times these': a copy with each
    block's float16 scales multiplied (Q4_0's and Q8_0's d; Q4_1's d and m; Q4_K's d and dmin, which scale its
    sub-blocks' scales and mins), rounded to float16 as the file's were (Granite's residual multiplier)."""
    block_bytes = GGML_QUANT_SIZES[ggml_type][1]
    blocks = raw.clone().view(raw.shape[0], -1, block_bytes)
    count = _BLOCK_SCALES[ggml_type]
    scales = blocks[:, :, :2 * count].contiguous().view(torch.float16)
    blocks[:, :, :2 * count] = (scales.float() * factor).to(torch.float16).view(torch.uint8)
    return blocks.view(raw.shape)


def gguf_hf_config(g: GGUFFile) -> Any:
    """A transformers config built from GGUF metadata (the fields `AutoConfig.from_pretrained(gguf_file=)` gives,
    without parsing the tokenizer, which takes seconds).

    It is the generic `PretrainedConfig` with `model_type` set, not the architecture's own class: importing any
    of those (LlamaConfig, Qwen2Config) pulls in torch.distributed.tensor and sympy through transformers'
    activations, ~1.3 s of a ~6 s cold start on a Zen 3 core, and the engine reads only the fields. Code that
    builds a transformers model from it converts it (`pagedllm.bench.hf_baseline.load_hf_model`).
    """
    from transformers import PretrainedConfig

    arch = g.architecture
    num_heads = int(g.arch_value("attention.head_count"))
    hidden = int(g.arch_value("embedding_length"))
    kwargs: dict[str, Any] = dict(
        vocab_size=int(g.arch_value("vocab_size") or g.tensors["token_embd.weight"].shape[0]),
        hidden_size=hidden,
        intermediate_size=int(g.arch_value("feed_forward_length") or g.arch_value("expert_feed_forward_length")),
        num_hidden_layers=int(g.arch_value("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=max(_per_layer(g.arch_value("attention.head_count_kv", num_heads))),
        # a head's width: Qwen3's converter writes key_length (its heads times head_dim is not the hidden size)
        head_dim=int(g.arch_value("attention.key_length") or g.arch_value("rope.dimension_count", hidden // num_heads)),
        max_position_embeddings=int(g.arch_value("context_length", 2048)),
        rms_norm_eps=float(g.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in g.tensors,
        rope_parameters=_gguf_rope_parameters(g),
    )
    kwargs.update(_gguf_token_ids(g))
    _add_architecture_fields(g, kwargs)
    kwargs.update(_gguf_experts(g, kwargs["num_hidden_layers"]))
    if arch == "deepseek2":     # (its experts' fields its own)
        kwargs.update(_gguf_deepseek(g, kwargs))
    name = g.metadata.get("general.name")
    named = kwargs.pop("model_type", None)      # (OLMo 3's: olmo3; DeepSeek-V3's: deepseek_v3)
    config = PretrainedConfig(**kwargs)
    config.model_type = named or (_MOE_MODEL_TYPES[arch] if kwargs.get("num_local_experts") else
                                  _MODEL_TYPES.get(arch, arch))
    if name:
        config._name_or_path = str(name)
    return config


def _gguf_token_ids(g: GGUFFile) -> dict[str, Any]:
    """The special tokens' ids a file names, under transformers' config fields."""
    ids: dict[str, Any] = {}
    for field, gguf_field in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        token_id = g.metadata.get(f"tokenizer.ggml.{gguf_field}_token_id")
        if token_id is not None:
            ids[f"{field}_token_id"] = int(token_id)
    # llama.cpp ends a reply on any end-of-generation token: the EOS, and the end of a turn or of a message where
    # the file names them (Gemma's <end_of_turn>)
    ends = [g.metadata.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    ends = list(dict.fromkeys(int(t) for t in ends if t is not None))
    if len(ends) > 1:
        ids["eos_token_id"] = ends
    return ids


def _add_architecture_fields(g: GGUFFile, kwargs: dict[str, Any]) -> None:
    """Add to `kwargs` (gguf_hf_config's fields so far) what the file's architecture adds or changes."""
    arch = g.architecture
    num_heads, hidden = kwargs["num_attention_heads"], kwargs["hidden_size"]
    if arch in _PERMUTED_ARCHS:
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
    if arch == "smollm3":
        kwargs["no_rope_layers"] = [int((i + 1) % _SMOLLM3_NO_ROPE_EVERY != 0)
                                    for i in range(kwargs["num_hidden_layers"])]
    if arch in _GEMMA_LAYOUTS:
        kwargs.update(_gguf_gemma(g, kwargs))
    if arch == "gemma":     # the first Gemma's MLP: GELU's tanh approximation (llama.cpp's, its checkpoints' intent)
        kwargs["hidden_act"] = "gelu_pytorch_tanh"
    if arch == "phi3":
        kwargs.update(_gguf_phi3(g, kwargs))
    if arch in _HALVES_ARCHS:    # its q/k rows come out of the file in halves already (_PERMUTED_ARCHS)
        kwargs["rotary_rows_in_halves"] = True
    if arch in ("glm4", "stablelm", "phi2", "gptneox", "nemotron"):     # a rope over `rope.dimension_count` of a head
        kwargs["head_dim"] = int(g.arch_value("attention.key_length") or hidden // num_heads)
        kwargs["rope_parameters"] = _partial_rope(g, kwargs["rope_parameters"], kwargs["head_dim"])
    if arch in ("stablelm", "starcoder2", "phi2", "gptneox"):
        kwargs.update(_gguf_layer_norm_model(g, arch))
    if arch == "granitehybrid":
        kwargs.update(_gguf_granite_hybrid(g))
    if arch in ("lfm2", "lfm2moe"):     # its convolution layers: those with no KV heads; the MLP's width as it is
        kv_heads = _per_layer(g.arch_value("attention.head_count_kv"))
        kwargs.update(layer_types=["conv" if heads == 0 else "full_attention" for heads in kv_heads],
                      conv_L_cache=int(g.arch_value("shortconv.l_cache")), conv_bias=False,
                      norm_eps=kwargs["rms_norm_eps"], block_auto_adjust_ff_dim=False)
    kwargs.update(_gguf_windows(g, kwargs))
    kwargs.update(_gguf_norms_and_mlps(g, kwargs))
    if arch == "gpt-oss":
        kwargs.update(_gguf_gpt_oss(g, kwargs))
    if arch in ("granite", "granitemoe", "granitehybrid"):  # its four multipliers (pagedllm.models.llama), by llama.cpp
        kwargs.update({field: float(g.arch_value(key)) for field, key in _GRANITE_MULTIPLIERS
                       if g.arch_value(key) is not None})


def _gguf_gpt_oss(g: GGUFFile, fields: dict[str, Any]) -> dict[str, Any]:
    """A gpt-oss file's config fields: biased attention, the experts' SwiGLU as llama.cpp fixes it, every other layer
    local over `attention.sliding_window` from the first on, its YaRN untruncated (as gpt-oss's config.json has it)."""
    alpha, limit = _GPT_OSS_SWIGLU
    rope = dict(fields["rope_parameters"])
    if rope["rope_type"] == "yarn":
        rope["truncate"] = False
    return dict(attention_bias=True, swiglu_alpha=alpha, swiglu_limit=limit, rope_parameters=rope,
                sliding_window=int(g.arch_value("attention.sliding_window")),
                layer_types=["sliding_attention" if i % _GPT_OSS_GLOBAL_EVERY < _GPT_OSS_GLOBAL_EVERY - 1
                             else "full_attention" for i in range(fields["num_hidden_layers"])])


def _gguf_deepseek(g: GGUFFile, fields: dict[str, Any]) -> dict[str, Any]:
    """A `deepseek2` file's config fields, as transformers' DeepSeek-V2 (softmax scores) or V3 (sigmoid ones, chosen
    with exp_probs_b) config names them: the latent attention's widths (newer files' *_mla lengths, which their
    absorbed layout leaves the per-head ones to; their one KV head stands for every head's), the experts' counts,
    scale and norm, the dense layers first."""
    rope = int(g.arch_value("rope.dimension_count"))
    key = int(g.arch_value("attention.key_length_mla") or g.arch_value("attention.key_length"))
    sigmoid = int(g.arch_value("expert_gating_func") or 1) == 2     # llama.cpp's LLAMA_EXPERT_GATING_FUNC_SIGMOID
    q_rank = int(g.arch_value("attention.q_lora_rank") or 0)
    return dict(model_type="deepseek_v3" if sigmoid else "deepseek_v2", q_lora_rank=q_rank or None,
                kv_lora_rank=int(g.arch_value("attention.kv_lora_rank")), qk_rope_head_dim=rope,
                qk_nope_head_dim=key - rope, head_dim=rope, num_key_value_heads=fields["num_attention_heads"],
                v_head_dim=int(g.arch_value("attention.value_length_mla") or g.arch_value("attention.value_length")),
                n_routed_experts=fields["num_local_experts"], n_shared_experts=int(g.arch_value("expert_shared_count")),
                first_k_dense_replace=int(g.arch_value("leading_dense_block_count") or 0),
                routed_scaling_factor=float(g.arch_value("expert_weights_scale") or 1.0),
                norm_topk_prob=bool(g.arch_value("expert_weights_norm")), topk_method="greedy",
                n_group=int(g.arch_value("expert_group_count") or 1),
                topk_group=int(g.arch_value("expert_group_used_count") or 1), rope_interleave=True)


def _gguf_windows(g: GGUFFile, fields: dict[str, Any]) -> dict[str, Any]:
    """The local layers of EXAONE 4, OLMo 3 and Cohere2 files, over `attention.sliding_window`: as the file marks them
    (OLMo 3's files say `olmo2`, with a window), or where it marks none three in four, the fourth global (as llama.cpp
    fixes Cohere2's, and as the three's configs default to); EXAONE 4's and Cohere2's global layers are NoPE (their
    model types'). OLMo 3's rope, the file's, is its global layers' (a YaRN's in the 32B), its local ones' plain."""
    arch, window = g.architecture, g.arch_value("attention.sliding_window")
    if arch not in ("exaone4", "olmo2", "cohere2") or not window:
        return {}
    pattern = g.arch_value("attention.sliding_window_pattern")
    local = _per_layer(pattern) if pattern is not None else \
        [(i + 1) % _GLOBAL_LAYER_EVERY != 0 for i in range(fields["num_hidden_layers"])]
    config: dict[str, Any] = dict(sliding_window=int(window), layer_types=[
        "sliding_attention" if is_local else "full_attention" for is_local in local])
    if arch == "olmo2":
        rope = fields["rope_parameters"]
        config.update(model_type="olmo3", rope_parameters={
            "full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": rope["rope_theta"]}})
    return config


def _gguf_norms_and_mlps(g: GGUFFile, fields: dict[str, Any]) -> dict[str, Any]:
    """The config fields of the architectures whose norms are LayerNorms (their epsilon under the name their configs
    give it) or whose MLPs or biases differ from Llama's: Cohere's (its logits' scale; Command R+'s q/k norms, which
    are refused), BLOOM's, GPT-BigCode's and GPT-2's (their MLPs' width and GELU; learned positions: a table of
    them), Falcon's, MPT's, OLMo 1's, Nemotron's LayerNorm1P, Arcee's and Nemotron's squared-ReLU MLPs, Seed-OSS's
    biases."""
    arch = g.architecture
    eps = float(g.arch_value("attention.layer_norm_epsilon", 1e-5))
    if arch in ("command-r", "cohere2"):
        return dict(layer_norm_eps=eps, logit_scale=float(g.arch_value("logit_scale", 1.0)),
                    use_qk_norm="blk.0.attn_q_norm.weight" in g.tensors)
    if arch == "bloom":     # (its ALiBi and its MLP's width: its model_type's)
        return dict(layer_norm_epsilon=eps, apply_residual_connection_post_layernorm=False)
    if arch in ("starcoder", "gpt2"):
        return dict(layer_norm_epsilon=eps, n_inner=fields["intermediate_size"],
                    activation_function="gelu_pytorch_tanh" if arch == "starcoder" else "gelu_new")
    if arch == "nemotron":
        return dict(norm_eps=eps, hidden_act="relu2")
    if arch == "arcee":
        return dict(hidden_act="relu2")
    if arch == "falcon":    # 7B's one KV head and one norm, 40B's KV heads and a norm each branch; parallel branches
        new = "blk.0.attn_norm_2.weight" in g.tensors
        return dict(layer_norm_epsilon=eps, new_decoder_architecture=new, parallel_attn=True,
                    num_ln_in_parallel_attn=2 if new else None, multi_query=fields["num_key_value_heads"] == 1,
                    num_kv_heads=fields["num_key_value_heads"], bias="blk.0.attn_qkv.bias" in g.tensors, alibi=False,
                    ffn_hidden_size=fields["intermediate_size"], activation="gelu")
    if arch == "mpt":
        return _gguf_mpt(g, fields, eps)
    if arch == "olmo":  # OLMo 1's LayerNorms without weights (none in the file), its q/k/v's clamp
        clip = g.arch_value("attention.clamp_kqv")
        return dict(clip_qkv=None if clip is None else float(clip))
    if arch == "seed_oss":
        return dict(attention_bias="blk.0.attn_q.bias" in g.tensors,
                    attention_out_bias="blk.0.attn_output.bias" in g.tensors)
    return {}


def _gguf_mpt(g: GGUFFile, fields: dict[str, Any], eps: float) -> dict[str, Any]:
    """MPT's config fields as llama.cpp reads its files: no biases, ALiBi up to `max_alibi_bias` (none at 0: refused
    by the model, as from a folder), q/k/v clamped to `clamp_kqv`, the MLP `feed_forward_length` wide; its scores
    scaled by head_dim ** -0.5 (a file holds no softmax_scale)."""
    from transformers.models.mpt.configuration_mpt import MptAttentionConfig  # (~2 s: MPT's alone)

    bias_max = int(g.arch_value("attention.max_alibi_bias") or 0)     # (8 in every MPT)
    clip = g.arch_value("attention.clamp_kqv")
    return dict(layer_norm_epsilon=eps, no_bias=True, logit_scale=None,
                expansion_ratio=fields["intermediate_size"] / fields["hidden_size"],
                attn_config=MptAttentionConfig(alibi=bias_max > 0, alibi_bias_max=bias_max or 8,
                                               clip_qkv=None if clip is None else float(clip)))


def _gguf_granite_hybrid(g: GGUFFile) -> dict[str, Any]:
    """Granite 4's hybrids' config fields as transformers' GraniteMoeHybrid names them: a layer with no KV heads is a
    Mamba-2 layer, whose widths llama.cpp stores under `ssm.*` (time_step_rank: its heads); the attention turns its
    rotary embedding where the file says `rope.scaling.finetuned` (the hybrids' do not: NoPE); a model without
    experts has its shared MLP as ffn_gate/up/down."""
    kv_heads = _per_layer(g.arch_value("attention.head_count_kv"))
    mamba = next((i for i, n in enumerate(kv_heads) if n == 0), 0)
    heads, inner = int(g.arch_value("ssm.time_step_rank")), int(g.arch_value("ssm.inner_size"))
    config: dict[str, Any] = dict(
        layer_types=["mamba" if n == 0 else "attention" for n in kv_heads], hidden_act="silu",
        position_embedding_type="rope" if g.arch_value("rope.scaling.finetuned") else None,
        mamba_n_heads=heads, mamba_d_head=inner // heads, mamba_n_groups=int(g.arch_value("ssm.group_count")),
        mamba_d_state=int(g.arch_value("ssm.state_size")), mamba_d_conv=int(g.arch_value("ssm.conv_kernel")),
        mamba_conv_bias=f"blk.{mamba}.ssm_conv1d.bias" in g.tensors,
        mamba_proj_bias=f"blk.{mamba}.ssm_in.bias" in g.tensors, time_step_limit=(0.0, float("inf")))
    dense = next((info for name, info in g.tensors.items() if name.endswith(".ffn_up.weight")), None)
    if dense is not None:
        config["shared_intermediate_size"] = int(dense.shape[0])
    return config


def _per_layer(value: Any) -> list[int]:
    """A metadata value that llama.cpp stores once or once a layer (LFM2's KV heads), as a list of ints."""
    return np.atleast_1d(np.asarray(value)).astype(int).tolist()


def _gguf_gemma(g: GGUFFile, fields: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's and 3's config fields as llama.cpp reads their files: what a file does not hold is fixed there, as
    it is in every checkpoint of the family (`_GEMMA_LAYOUTS`): one layer in 2 (Gemma 2) or 6 (Gemma 3) global, the
    others local over `attention.sliding_window`; queries scaled by head_dim ** -0.5 (hidden / heads for the 27B);
    the MLP's GELU the tanh approximation. Gemma 3's local layers have a rotary base of 10,000 and no scaling, the
    file's rope being its global layers'. Gemma 2's soft caps of its scores and logits are the file's."""
    every, layers_27b = _GEMMA_LAYOUTS[g.architecture]
    window = int(g.arch_value("attention.sliding_window") or 0)
    num_layers, num_heads = fields["num_hidden_layers"], fields["num_attention_heads"]
    config = dict(
        sliding_window=window or None,
        layer_types=["sliding_attention" if window and (i + 1) % every else "full_attention"
                     for i in range(num_layers)],
        query_pre_attn_scalar=fields["hidden_size"] // num_heads if num_layers == layers_27b else fields["head_dim"],
        hidden_activation="gelu_pytorch_tanh",
        attn_logit_softcapping=g.arch_value("attn_logit_softcapping"),
        final_logit_softcapping=g.arch_value("final_logit_softcapping"))
    if g.architecture in ("gemma3", "gemma-embedding"):
        config["rope_parameters"] = {"full_attention": fields["rope_parameters"],
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    if g.architecture == "gemma-embedding":
        # EmbeddingGemma, an encoder saved as the bare model: its file holds the checkpoint's window W, which
        # llama.cpp reads as keys within W / 2 either side, and transformers as W // 2 + 1 exclusive: the same keys
        config.update(use_bidirectional_attention=True, architectures=["Gemma3TextModel"],
                      sliding_window=window // 2 + 1 if window else None)
    return config


def _partial_rope(g: GGUFFile, rope: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """`rope` turning the part of each head `rope.dimension_count` says (Phi-4-mini's 3/4, GLM-4's half; all of it
    where the file says nothing)."""
    rope_dims = int(g.arch_value("rope.dimension_count") or head_dim)
    return dict(rope, partial_rotary_factor=rope_dims / head_dim)


def _gguf_layer_norm_model(g: GGUFFile, arch: str) -> dict[str, Any]:
    """StableLM's, StarCoder2's, Phi-2's and GPT-NeoX's config fields, read as transformers reads them from their
    files: their LayerNorms' epsilon; StableLM's q/k/v biases and per-head q/k LayerNorms where the file holds them, its
    branches parallel where its layers have no norm before the MLP; StarCoder2's biases where the file holds them, and
    its window; Phi-2's tanh GELU; GPT-NeoX's exact one, its biases and parallel branches as the file says."""
    q_bias = "blk.0.attn_q.bias" in g.tensors
    eps = float(g.arch_value("attention.layer_norm_epsilon", 1e-5))
    if arch == "phi2":
        return dict(layer_norm_eps=eps, hidden_act="gelu_new", qk_layernorm=False)
    if arch == "gptneox":
        return dict(layer_norm_eps=eps, hidden_act="gelu", attention_bias="blk.0.attn_qkv.bias" in g.tensors,
                    use_parallel_residual=bool(g.arch_value("use_parallel_residual", True)))
    if arch == "stablelm":
        return dict(layer_norm_eps=eps, use_qkv_bias=q_bias, hidden_act="silu",
                    use_parallel_residual="blk.0.ffn_norm.weight" not in g.tensors,
                    qk_layernorm="blk.0.attn_q_norm.weight" in g.tensors)
    window = g.arch_value("attention.sliding_window")
    return dict(norm_epsilon=eps, use_bias=q_bias, hidden_act="gelu_pytorch_tanh",
                sliding_window=int(window) if window else None)


def _gguf_phi3(g: GGUFFile, fields: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's config fields from a `phi3` file: its heads' width (hidden / heads: `rope.dimension_count` is the
    part of each head its rope turns, Phi-4-mini's 3/4), its window (0 there for none), and longrope's factors,
    stored as the rope_factors_short and rope_factors_long tensors, with the original context and the tables'
    scale from the metadata."""
    head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    window = int(g.arch_value("attention.sliding_window") or 0)
    config: dict[str, Any] = dict(head_dim=head_dim, sliding_window=window or None, hidden_act="silu")
    rope = _partial_rope(g, fields["rope_parameters"], head_dim)
    if "rope_factors_long.weight" in g.tensors:
        rope.update(rope_type="longrope",
                    original_max_position_embeddings=int(g.arch_value("rope.scaling.original_context_length")),
                    short_factor=g.read_tensor(g.tensors["rope_factors_short.weight"]).float().tolist(),
                    long_factor=g.read_tensor(g.tensors["rope_factors_long.weight"]).float().tolist())
        attn_factor = g.arch_value("rope.scaling.attn_factor")
        if attn_factor is not None:
            rope["attention_factor"] = float(attn_factor)
    config["rope_parameters"] = rope
    return config


def _gguf_experts(g: GGUFFile, num_layers: int) -> dict[str, Any]:
    """A mixture of experts' config fields from GGUF metadata, as transformers names them; {} for a dense model.
    A layer without a router (ffn_gate_inp) has a dense MLP (`mlp_only_layers`)."""
    num_experts = int(g.arch_value("expert_count") or 0)
    if not num_experts:
        return {}
    if g.architecture not in _MOE_MODEL_TYPES:
        raise ValueError(f"a {g.architecture!r} mixture of experts is not supported (GGUF mixtures of experts: "
                         f"{', '.join(sorted(_MOE_MODEL_TYPES))})")
    fields: dict[str, Any] = dict(   # Mixtral's config names the count num_local_experts, Qwen2-MoE's num_experts
        num_local_experts=num_experts, num_experts=num_experts,
        num_experts_per_tok=int(g.arch_value("expert_used_count")),
        moe_intermediate_size=int(g.arch_value("expert_feed_forward_length") or g.arch_value("feed_forward_length")),
        norm_topk_prob=_MOE_RENORMALIZES[g.architecture],
        mlp_only_layers=[i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in g.tensors])
    # the shared expert's width, as its tensor has it (ERNIE's converter writes a width of its own reckoning)
    shared = next((info.shape[0] for name, info in g.tensors.items() if name.endswith(".ffn_up_shexp.weight")), 0)
    if shared and g.architecture == "granitemoe":     # GraniteMoeShared's (Granite 4's), its ungated shared MLP
        fields.update(model_type="granitemoeshared", shared_intermediate_size=int(shared))
    elif g.architecture == "granitehybrid":
        fields.update(shared_intermediate_size=int(shared))
    elif shared:
        fields["shared_expert_intermediate_size"] = int(shared)
    if g.architecture == "ernie4_5-moe":    # its dense layers first, then one in `interleave_moe_layer_step` sparse
        fields.update(moe_layer_start_index=int(g.arch_value("leading_dense_block_count") or 0),
                      moe_layer_interval=int(g.arch_value("interleave_moe_layer_step") or 1),
                      moe_layer_end_index=num_layers - 1, moe_norm_min=1e-12,
                      moe_num_shared_experts=int(g.arch_value("expert_shared_count") or 0))
    if g.architecture == "lfm2moe":     # its dense layers first; experts chosen with exp_probs_b, never scaled
        fields.update(num_dense_layers=int(g.arch_value("leading_dense_block_count") or 0), routed_scaling_factor=1.0,
                      use_expert_bias=any(name.endswith(".exp_probs_b.bias") for name in g.tensors))
    return fields


def _gguf_rope_parameters(g: GGUFFile) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": float(g.arch_value("rope.freq_base", 10000.0)), "rope_type": "default"}
    scaling = g.arch_value("rope.scaling.type")
    if scaling in ("linear",):
        params.update(rope_type="linear", factor=float(g.arch_value("rope.scaling.factor")))
    elif scaling == "yarn":
        params.update(rope_type="yarn", factor=float(g.arch_value("rope.scaling.factor")),
                      original_max_position_embeddings=int(g.arch_value("rope.scaling.original_context_length")))
        log_mul = g.arch_value("rope.scaling.yarn_log_multiplier")     # DeepSeek's 0.1 mscale_all_dim (= its mscale)
        if log_mul:
            params.update(mscale=float(log_mul) / 0.1, mscale_all_dim=float(log_mul) / 0.1)
        for key in ("beta_fast", "beta_slow"):
            if g.arch_value(f"rope.scaling.yarn_{key}") is not None:
                params[key] = float(g.arch_value(f"rope.scaling.yarn_{key}"))
    elif scaling not in (None, "none"):
        raise NotImplementedError(f"GGUF rope scaling {scaling!r} is not supported")
    return params
