"""MXFP4 checkpoints (`quant_method` "mxfp4": gpt-oss-20b and 120b as released), whose mixture-of-experts weights
are stored in the OCP microscaling format: each stacked projection as `{experts}.gate_up_proj_blocks` [E, N, K/32, 16]
(uint8, two 4-bit e2m1 values a byte: value 2 i in byte i's low nibble, 2 i + 1 in its high one) beside
`{experts}.gate_up_proj_scales` [E, N, K/32] (uint8 e8m0 exponents, one a block of 32), rows being outputs:

    W[e, n, k] = e2m1(value) x 2^(scales[e, n, k // 32] - 127)     e2m1: 0, +-0.5, +-1, +-1.5, +-2, +-3, +-4, +-6

(`down_proj` likewise); everything else (attention, router, embeddings, biases) is bf16. Under quantization
"mxfp4" the experts' weights stay in their 4 bits: `Mxfp4Rows` regroups each expert's rows as llama.cpp's MXFP4
blocks (its GGUF files' layout: the exponent byte, then 16 bytes whose low nibbles are values 0..15 and high nibbles
16..31), which `pagedllm.layers.linear.pack_gguf_linear_weights` packs for the `linear_gguf` kernel (exactly, as
`pagedllm.layers.gguf` describes). Elsewhere (no kernels, tensor parallelism, a GPU) `iterate_mxfp4` reads them
dequantised into the model's dtype, exactly (e2m1 values times powers of two are bf16 values).
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open

from pagedllm.loader.safetensors import iterate_safetensors, safetensors_files

_PARTS = ("_blocks", "_scales")
# e2m1's 16 values, by nibble (its sign in bit 3)
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def is_mxfp4(hf_config: Any) -> bool:
    """Whether a config's checkpoint stores MXFP4 weights (its quantization_config's quant_method)."""
    from pagedllm.loader.int4 import checkpoint_quantization

    return checkpoint_quantization(hf_config) == "mxfp4"


class _Stacked(NamedTuple):
    """One stacked MXFP4 projection: its name without the suffix ("model.layers.0.mlp.experts.gate_up_proj"), the
    files of its blocks and scales, and its experts' count."""

    name: str
    files: dict[str, Path]
    num_experts: int

    def read(self, expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks [E, N, K/32, 16], scales [E, N, K/32]), or one expert's ([N, K/32, 16], [N, K/32]) read alone."""
        parts = []
        for part in _PARTS:
            with safe_open(str(self.files[part]), framework="pt") as f:
                parts.append(f.get_tensor(self.name + part) if expert is None else
                             f.get_slice(self.name + part)[expert])
        blocks, scales = parts
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or \
                blocks.shape[-1] != 16:
            raise ValueError(f"MXFP4 tensor {self.name!r}: blocks {blocks.dtype} {tuple(blocks.shape)} and scales "
                             f"{scales.dtype} {tuple(scales.shape)}, expected uint8 [..., K/32, 16] and [..., K/32]")
        return blocks, scales


def _stacked(folder: Path) -> list[_Stacked]:
    """The MXFP4 projections of a folder's checkpoint (their tensors not read)."""
    files: dict[str, dict[str, Path]] = {}
    experts: dict[str, int] = {}
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_PARTS):
                    stacked = name[:-len("_blocks")]
                    files.setdefault(stacked, {})[name[-len("_blocks"):]] = file
                    experts[stacked] = f.get_slice(name).get_shape()[0]
    for stacked, where in files.items():
        if set(where) != set(_PARTS):
            raise ValueError(f"MXFP4 tensor {stacked!r} has {sorted(where)} without its other part")
    return [_Stacked(stacked, where, experts[stacked]) for stacked, where in files.items()]


def _values(blocks: torch.Tensor) -> torch.Tensor:
    """The 4-bit values of blocks [..., 16] in order, [..., 32] (value 2 i in byte i's low nibble)."""
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)


def gguf_mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Blocks [..., N, K/32, 16] and scales [..., N, K/32] as llama.cpp's MXFP4 rows, uint8 [..., N, K/32 x 17]: each
    block its exponent, then byte j = value j | value j + 16 << 4."""
    values = _values(blocks)
    return torch.cat([scales[..., None], values[..., :16] | (values[..., 16:] << 4)], dim=-1).flatten(-2)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks [..., N, K/32, 16] and scales [..., N, K/32] as the float weight [..., N, K] in `dtype`: e2m1 times
    2^(e - 127), in float32, exact in bf16 too (two significant bits, an exponent in float32's range)."""
    weight = torch.ldexp(_E2M1[_values(blocks).long()], scales.int()[..., None] - 127)
    return weight.flatten(-2).to(dtype)


def _expert_names(stacked: str, num_experts: int) -> list[tuple[str, int, int | None]]:
    """The per-expert weight names a stacked projection holds, with their expert and the rows each takes (gate_up's
    interleaved gate rows from 0, up rows from 1, every other one; None: all of down's)."""
    layer, part = stacked.split(".mlp.experts.")
    if part == "gate_up_proj":
        return [(f"{layer}.mlp.experts.{e}.{half}.weight", e, offset) for e in range(num_experts)
                for half, offset in (("gate_proj", 0), ("up_proj", 1))]
    if part == "down_proj":
        return [(f"{layer}.mlp.experts.{e}.down_proj.weight", e, None) for e in range(num_experts)]
    raise ValueError(f"MXFP4 tensor {stacked!r} is not a gpt-oss expert projection (gate_up_proj, down_proj)")


class Mxfp4Rows(Mapping[str, tuple[GGMLQuantizationType, torch.Tensor]]):
    """{each expert's weight name ("model.layers.0.mlp.experts.3.gate_proj.weight"): (MXFP4, its rows as llama.cpp's
    blocks, uint8 [N, K/32 x 17])}, gate_up's interleaved rows split into gate's and up's, for
    `pack_gguf_linear_weights`: each expert's read from the checkpoint when it is looked up (gpt-oss-20b's 11 GB of
    experts are never all in memory as rows)."""

    def __init__(self, folder: Path) -> None:
        self._where = {name: (stacked, expert, offset) for stacked in _stacked(folder)
                       for name, expert, offset in _expert_names(stacked.name, stacked.num_experts)}

    def __getitem__(self, name: str) -> tuple[GGMLQuantizationType, torch.Tensor]:
        stacked, expert, offset = self._where[name]
        blocks, scales = stacked.read(expert)
        if offset is not None:
            blocks, scales = blocks[offset::2], scales[offset::2]
        return GGMLQuantizationType.MXFP4, gguf_mxfp4_rows(blocks, scales).contiguous()

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def iterate_mxfp4(folder: Path, dtype: torch.dtype, skip: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs for the model's `load_weights`: the checkpoint's other tensors in `dtype`, then each
    stacked MXFP4 projection dequantised, [E, K, N] as transformers holds gpt-oss's experts, under its stacked name;
    but those whose every expert weight is in `skip` (packed as they are: never dequantised)."""
    yield from iterate_safetensors(folder, dtype, lambda name: None if name.endswith(_PARTS) else name)
    for stacked in _stacked(folder):
        if all(name in skip for name, _, _ in _expert_names(stacked.name, stacked.num_experts)):
            continue
        yield stacked.name, dequantize_mxfp4(*stacked.read(), dtype).transpose(1, 2)
