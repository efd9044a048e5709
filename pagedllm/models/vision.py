"""The image encoders of vision-language models: a ViT (CLIP's, SigLIP's, or Idefics3's SigLIP) and what maps its
patch features into the language model's embedding space, one row per placeholder token of the image.

```
pixels [N, 3, S, S] -> patches (a conv of stride P) [N, (S/P)^2, D]   (+ CLIP's class token in front)
    + position embeddings, CLIP's pre-LayerNorm
    -> encoder layers (pre-LayerNorm attention over every patch, then a pre-LayerNorm MLP), each added back
Llava (`LlavaEncoder`):
    -> the features of layer `vision_feature_layer` (-1: the last; CLIP checkpoints read -2), not post-normed;
       "default" selection drops CLIP's class token, "full" keeps every row
    -> projector: linear, GELU, linear  [N, tokens, hidden of the language model]
Idefics3 and SmolVLM (`Idefics3Encoder`), whose images come as tiles of S x S (a grid of the image, then the whole):
    -> the last layer's features, post-LayerNorm
    -> pixel shuffle: each r x r square of patches becomes one row of r^2 x D values (r: `scale_factor`)
    -> projector: linear  [N, (S/P)^2 / r^2, hidden of the language model]
Qwen2-VL and Qwen2.5-VL (`QwenVLEncoder`), whose images keep their aspect: one image of h x w patches (14 pixels,
two frames deep, the processor's, in 2 x 2 squares of patches) is the encoder's sequence
    -> patches: a linear [h w, D]; each patch's (row, column) turns its queries and keys (a 2-D rotary embedding)
    -> encoder layers over the whole image (Qwen2-VL: LayerNorm, a GELU MLP), or (Qwen2.5-VL: RMSNorm, a SiLU-gated
       MLP) over windows of 112 pixels a side but in `fullatt_block_indexes`' layers
    -> merger: each 2 x 2 square's patches normed and joined into one row, then linear, GELU, linear
       [h w / 4, hidden of the language model]; their language model places these rows by M-RoPE
Mistral 3 and Pixtral-12B (`PixtralEncoder`), whose images keep their aspect too: one image of h x w patches (14 or
16 pixels) is the encoder's sequence
    -> patches: a linear, RMSNorm; each patch's (row, column) turns its queries and keys (a 2-D rotary embedding)
    -> encoder layers over the whole image (RMSNorm, a SiLU-gated MLP), up to `vision_feature_layer`
    -> Mistral 3's: RMSNorm, each 2 x 2 square's patches joined into one row and merged by a linear
    -> projector: linear, GELU, linear  [h w / 4 (Pixtral-12B's: h w), hidden of the language model]; in the prompt
       each row of placeholders is ended by [IMG_BREAK] ([IMG_END] the last), which keep their own embeddings
```

The model's processor (transformers') resizes (and tiles) each image and expands its `<image>` into as many
placeholder tokens as rows come out here; `pagedllm.multimodal` finds them in the prompt. The encoder runs once an
image (a tile), in plain torch (a few hundred rows through a few hundred million weights: one prompt's prefill
worth), in the step that first reaches its placeholders (`ModelRunner._image_rows`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.cpu import onednn_bf16_ok
from pagedllm.layers.linear import linear
from pagedllm.multimodal import (
    AnyresImageProcessor,
    CroppedImageProcessor,
    GridImageProcessor,
    ImageInput,
    ImageProcessor,
    OneVisionImageProcessor,
    RowBreakImageProcessor,
    TiledImageProcessor,
    anyres_max_shape,
)

# transformers' activations by config name, as these towers and projectors use them
_ACTIVATIONS = {"gelu": F.gelu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}
# the GELUs oneDNN applies inside a linear (its `_linear_pointwise` "gelu" and the approximation)
_ONEDNN_GELUS = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh"}
# the tower's and the projector's checkpoint prefixes, in transformers' layouts (Llava's before 4.52 at the top;
# since, under model.; CLIPVisionModel's and SiglipVisionModel's own vision_model. inside, where saved; Idefics3's
# vision_model and connector) -> the encoder's names
_PREFIXES = (("model.vision_tower.vision_model.", "tower."), ("vision_tower.vision_model.", "tower."),
             ("model.vision_tower.", "tower."), ("vision_tower.", "tower."), ("model.vision_model.", "tower."),
             ("model.multi_modal_projector.", "projector."), ("multi_modal_projector.", "projector."),
             ("model.connector.modality_projection.", "projector."), ("model.visual.", "visual."),
             ("visual.", "visual."), ("model.image_newline", "image_newline"), ("image_newline", "image_newline"))
_TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip", "idefics3_vision": "idefics3",
           "smolvlm_vision": "idefics3"}


class ImageRows(NamedTuple):
    """What stands in for a step's image placeholders: their rows of the step [R], the image encoder's rows for them
    [R, H], and their M-RoPE positions [3, R] (grid images': `pagedllm.multimodal.MRopeLayout`; else None)."""

    index: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor | None


def image_part_name(name: str) -> str | None:
    """A vision-language checkpoint's tensor name as `ImageEncoder` names it; None for the language model's."""
    for prefix, ours in _PREFIXES:
        if name.startswith(prefix):
            return ours + name.removeprefix(prefix)
    return None


def activation(name: str) -> Any:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} of an image encoder is not one pagedllm runs: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class _Linear(nn.Linear):
    """A linear layer over any leading dimensions whose weight `prepack` may hand to oneDNN (`linear`), with a GELU
    that oneDNN then applies in the same call (`gelu`)."""

    def reset_parameters(self) -> None:
        """None: the checkpoint's weights replace them (a random start would cost seconds for CLIP-L's 0.3B)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x.flatten(0, -2), self.weight, self.bias).unflatten(0, x.shape[:-1])

    def gelu(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """activation(name)(self(x)), in one oneDNN call where the weight is oneDNN's and the GELU one it has."""
        if not self.weight.is_mkldnn or name not in _ONEDNN_GELUS:
            return activation(name)(self(x))
        out = torch.ops.mkldnn._linear_pointwise(x.flatten(0, -2), self.weight, self.bias, "gelu", [],
                                                 _ONEDNN_GELUS[name])
        return out.unflatten(0, x.shape[:-1])

    def prepack(self) -> None:
        """Hand a bf16 weight to oneDNN, reordered once, where oneDNN multiplies bf16 itself: an encoder's calls are
        hundreds of rows, where its blocked weights beat re-blocking them each call 1.1-1.9x (docs/benchmarks.md)."""
        if self.weight.dtype == torch.bfloat16 and self.weight.device.type == "cpu" and onednn_bf16_ok():
            self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1),
                                       requires_grad=False)


class _EncoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        width, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.layer_norm1 = nn.LayerNorm(width, eps, dtype=dtype)
        self.layer_norm2 = nn.LayerNorm(width, eps, dtype=dtype)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (_Linear(width, width, dtype=dtype)
                                                                for _ in range(4))
        self.fc1 = _Linear(width, config.intermediate_size, dtype=dtype)
        self.fc2 = _Linear(config.intermediate_size, width, dtype=dtype)
        self.act = config.hidden_act
        activation(self.act)    # one pagedllm runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: [N, rows, D]
        h = self.layer_norm1(x)
        q, k, v = (proj(h).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))     # [N, heads, rows, head_dim]
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        x = x + self.out_proj(attn)
        return x + self.fc2(self.fc1.gelu(self.layer_norm2(x), self.act))


def tile_positions(per_side: int) -> torch.Tensor:
    """Idefics3's position ids of a whole tile's patches: its fractional coordinates bucketed over the position
    grid as transformers computes them (in float32, which is not always the plain row-major order)."""
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side)
    coords = torch.arange(per_side, dtype=torch.float32) * (1.0 / torch.tensor(per_side))
    buckets = torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)
    return (buckets[:, None] * per_side + buckets[None, :]).flatten()


class VisionTower(nn.Module):
    """CLIP's, SigLIP's or Idefics3's ViT (config.model_type in _TOWERS) up to the features of layer
    `feature_layer` (a negative index counts from the last; a list concatenates layers' features); Idefics3's, and
    with `post_norm` any, post-normed."""

    def __init__(self, config: Any, feature_layer: int | list[int], dtype: torch.dtype,
                 post_norm: bool = False) -> None:
        super().__init__()
        kind = _TOWERS.get(config.model_type)
        if kind is None:
            raise ValueError(f"an image encoder of type {config.model_type!r} is not one pagedllm runs: it runs "
                             f"{', '.join(_TOWERS)}")
        clip = kind == "clip"
        width, per_side = config.hidden_size, config.image_size // config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, width, config.patch_size, config.patch_size,
                                         bias=not clip, dtype=dtype)
        self.class_embedding = nn.Parameter(torch.empty(width, dtype=dtype)) if clip else None
        self.position_embedding = nn.Embedding(per_side ** 2 + clip, width, dtype=dtype)
        self.register_buffer("position_ids", tile_positions(per_side) if kind == "idefics3" else
                             torch.arange(per_side ** 2 + clip), persistent=False)
        self.pre_layrnorm = nn.LayerNorm(width, config.layer_norm_eps, dtype=dtype) if clip else None
        self.post_layernorm = nn.LayerNorm(width, config.layer_norm_eps, dtype=dtype) \
            if kind == "idefics3" or post_norm else None
        layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
        # hidden state i is the input of layer i (0: the embeddings), -1 the last layer's output
        self.feature_states = [i % (config.num_hidden_layers + 1) for i in layers]
        self.layers = nn.ModuleList(_EncoderLayer(config, dtype) for _ in range(max(self.feature_states)))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] -> the features [N, rows, D x len(feature layers)] (rows: patches, CLIP's class
        token first)."""
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(len(x), 1, -1), x], dim=1)
        x = x + self.position_embedding(self.position_ids)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = [x]
        for layer in self.layers:
            states.append(layer(states[-1]))
        features = torch.cat([states[i] for i in self.feature_states], dim=-1)
        return features if self.post_layernorm is None else self.post_layernorm(features)


class ImageEncoder(nn.Module):
    """A tower and what maps its features to the language model's rows: images -> the rows that stand in for
    their placeholder tokens. `load_weights` takes `image_part_name`'s names; `processor` makes its prompts."""

    processor: type[ImageProcessor] = ImageProcessor
    # whether the language model lets an image's placeholders see each other both ways (Gemma 3's): each image's
    # placeholders are then computed in one step (`SchedulerConfig.whole_images`)
    attends_whole_image = False
    tower: VisionTower

    def encode(self, image: ImageInput) -> torch.Tensor:
        """One picture's rows for its placeholders [placeholders, H] (image.length of them, but for the tokens of
        the prompt's own within its run: `ImageInput.row_width`)."""
        return self(image.pixels.to(next(self.parameters()).device)[None])[0]

    def prepack(self) -> None:
        """Each linear's weight handed to oneDNN where that is faster (`_Linear.prepack`); after `load_weights`."""
        for module in self.modules():
            if isinstance(module, _Linear):
                module.prepack()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (encoder name, tensor) pairs (`image_part_name`'s); a ValueError names any parameter left unset.
        The tower's layers past the last feature layer are never run, and their tensors are skipped."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = self._parameter_name(name)
            if name is None:
                continue
            if name not in params:
                raise KeyError(f"unexpected image encoder tensor {name!r}")
            with torch.no_grad():
                params[name].copy_(tensor.reshape(params[name].shape))
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint leaves these image encoder weights unset: {missing[:8]}")

    def _parameter_name(self, name: str) -> str | None:
        """An `image_part_name` as this module names its parameter; None for a tensor it never reads: the tower's
        layers past the last feature layer, CLIP's and SigLIP's head and post-norm after it, which Llava reads the
        features before, older CLIPs' saved position ids."""
        name = name.replace("embeddings.", "").replace("encoder.layers.", "layers.") \
            .replace("self_attn.", "").replace("mlp.", "")
        if name.startswith("tower.layers.") and int(name.split(".")[2]) >= len(self.tower.layers):
            return None
        if name.startswith("tower.head.") or name.endswith("position_ids") or \
                name.startswith("tower.post_layernorm.") and self.tower.post_layernorm is None:
            return None
        return name


class LlavaEncoder(ImageEncoder):
    """A Llava-kind model's tower and projector (`LlavaForConditionalGeneration`'s config)."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        strategy = config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r}: pagedllm runs 'default' and 'full'")
        self.skip_class_token = strategy == "default"
        self.tower = VisionTower(config.vision_config, config.vision_feature_layer, dtype)
        layers = config.vision_feature_layer
        features = config.vision_config.hidden_size * (1 if isinstance(layers, int) else len(layers))
        hidden, bias = config.text_config.hidden_size, getattr(config, "multimodal_projector_bias", True)
        self.projector = nn.ModuleDict(dict(linear_1=_Linear(features, hidden, bias, dtype=dtype),
                                            linear_2=_Linear(hidden, hidden, bias, dtype=dtype)))
        self.projector_act = config.projector_hidden_act
        activation(self.projector_act)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] (the processor's) -> [N, tokens, hidden]: image i's rows for its placeholders."""
        features = self.tower(pixels)
        if self.skip_class_token:
            features = features[:, 1:]
        return self.projector["linear_2"](self.projector["linear_1"].gelu(features, self.projector_act))


class LlavaNextEncoder(LlavaEncoder):
    """LLaVA-NeXT's (`LlavaNextForConditionalGeneration`'s config): Llava's tower and projector over each of an
    image's tiles (a shrunk whole first, then its grid of tiles), the grid's rows laid out as the image, unpadded to
    its own aspect, a learned row break (`image_newline`) after each row, after the whole's rows (transformers'
    `pack_image_features`, "spatial_unpad")."""

    processor = AnyresImageProcessor

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size, dtype=dtype))
        self.pinpoints, self.tile = config.image_grid_pinpoints, config.vision_config.image_size
        self.side = self.tile // config.vision_config.patch_size

    def encode(self, image: ImageInput) -> torch.Tensor:
        from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

        rows = self(image.pixels.to(self.image_newline.device))      # [tiles, side x side, H]
        whole, tiles = rows[0], rows[1:]
        if not len(tiles):
            return torch.cat([whole, self.image_newline[None]])
        grid_rows, grid_columns = get_anyres_image_grid_shape(image.size, self.pinpoints, self.tile)
        side = self.side    # [grid rows, grid columns, side, side, H] -> [H, grid rows x side, grid columns x side]
        tiles = tiles.view(grid_rows, grid_columns, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
        tiles = self._shrunk(unpad_image(tiles, torch.tensor(image.size)))
        newline = self.image_newline[:, None, None].expand(*tiles.shape[:-1], 1)
        return torch.cat([whole, torch.cat([tiles, newline], dim=-1).flatten(1, 2).T])

    def _shrunk(self, tiles: torch.Tensor) -> torch.Tensor:
        """The unpadded tiles' rows [H, rows, columns] as the model reads them: LLaVA-NeXT's, all of them."""
        return tiles


class OneVisionEncoder(LlavaNextEncoder):
    """LLaVA-OneVision's (`LlavaOnevisionForConditionalGeneration`'s config): LLaVA-NeXT's, but that an image's
    unpadded tiles' rows are shrunk (bilinear) to at most `anyres_max_N` tiles' worth where they pass it by a tenth,
    and that one of several images in a prompt comes as its whole alone (`OneVisionImageProcessor`)."""

    processor = OneVisionImageProcessor

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.most_tiles = int(config.vision_aspect_ratio.removeprefix("anyres_max_"))

    def _shrunk(self, tiles: torch.Tensor) -> torch.Tensor:
        shape = anyres_max_shape(tiles.shape[1], tiles.shape[2], self.side, self.most_tiles)
        return tiles if shape == tiles.shape[1:] else F.interpolate(tiles[None], list(shape), mode="bilinear")[0]


class Idefics3Encoder(ImageEncoder):
    """Idefics3's and SmolVLM's tower and connector (`Idefics3ForConditionalGeneration`'s config)."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = config.scale_factor
        self.tower = VisionTower(config.vision_config, -1, dtype)
        features = config.vision_config.hidden_size * self.scale ** 2
        self.projector = nn.ModuleDict(dict(proj=_Linear(features, config.text_config.hidden_size, bias=False,
                                                         dtype=dtype)))

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] (tiles, the processor's) -> [N, tokens, hidden]: tile i's rows for its placeholders."""
        return self.projector["proj"](_pixel_shuffle(self.tower(pixels), self.scale))


def _pixel_shuffle(x: torch.Tensor, r: int) -> torch.Tensor:
    """[N, side x side, D] row-major patches -> [N, (side / r)^2, D r^2]: each r x r square of patches one row, its
    patches row-major ([N, side/r, r, side/r, r, D] -> [N, side/r, side/r, r (row), r (column), D])."""
    n, rows, width = x.shape
    side = int(rows ** 0.5)
    x = x.view(n, side // r, r, side // r, r, width).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, rows // r ** 2, width * r ** 2)


class _RMSNorm(nn.Module):
    """Qwen2.5-VL's and InternViT's RMSNorm, as transformers computes it (float32 inside)."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.empty(width, dtype=dtype)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim] turned by the patches' angles ([N, 1, head_dim]), neox style, in float32."""
    h = x.float()
    half = torch.cat([-h[..., h.shape[-1] // 2:], h[..., :h.shape[-1] // 2]], dim=-1)
    return (h * cos + half * sin).to(x.dtype)


def _windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Attention of [N, heads, head_dim] rows within each window [bounds[i], bounds[i + 1]) (one: all of them), the
    windows batched, each padded to the longest with its padding masked out -> [N, heads x head_dim]."""
    n, heads, _ = q.shape
    if len(bounds) == 2:    # [1, heads, N, head_dim]: SDPA's flash kernel (3-D inputs take its math path, 8x slower)
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))
        return out[0].transpose(0, 1).reshape(n, -1)
    starts, lengths = torch.tensor(bounds[:-1]), torch.tensor(bounds[1:]) - torch.tensor(bounds[:-1])
    offsets = torch.arange(int(lengths.max()))
    valid = offsets[None] < lengths[:, None]                              # [W, L]
    index = torch.where(valid, starts[:, None] + offsets[None], 0).to(q.device)
    mask = valid.to(q.device)[:, None, None, :]                           # keys a window's rows see
    out = F.scaled_dot_product_attention(*(t[index].transpose(1, 2) for t in (q, k, v)), attn_mask=mask)
    return out.transpose(1, 2)[valid.to(q.device)].reshape(n, -1)       # [W, L, heads, hd] -> the valid rows


class _QwenVisionBlock(nn.Module):
    """A Qwen VL encoder layer: Qwen2-VL's and Qwen3-VL's (LayerNorm, a GELU MLP) or Qwen2.5-VL's (RMSNorm, a
    SiLU-gated MLP with biases)."""

    def __init__(self, config: Any, width: int, inner: int, gated: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.act = config.num_heads, config.hidden_act
        if not gated:
            activation(self.act)    # one pagedllm runs
        self.norm1, self.norm2 = ((_RMSNorm(width, 1e-6, dtype) for _ in range(2)) if gated else
                                  (nn.LayerNorm(width, 1e-6, dtype=dtype) for _ in range(2)))
        self.attn = nn.ModuleDict(dict(qkv=_Linear(width, 3 * width, dtype=dtype), proj=_Linear(width, width,
                                                                                                 dtype=dtype)))
        if gated:
            self.mlp = nn.ModuleDict(dict(gate_proj=_Linear(width, inner, dtype=dtype),
                                          up_proj=_Linear(width, inner, dtype=dtype),
                                          down_proj=_Linear(inner, width, dtype=dtype)))
        else:
            self.mlp = nn.ModuleDict(dict(fc1=_Linear(width, inner, dtype=dtype), fc2=_Linear(inner, width,
                                                                                               dtype=dtype)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        q, k, v = self.attn["qkv"](self.norm1(x)).unflatten(-1, (3, self.num_heads, -1)).unbind(1)
        x = x + self.attn["proj"](_windowed_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, bounds))
        h, mlp = self.norm2(x), self.mlp
        if "fc1" in mlp:
            return x + mlp["fc2"](mlp["fc1"].gelu(h, self.act))
        return x + mlp["down_proj"](F.silu(mlp["gate_proj"](h)) * mlp["up_proj"](h))


class _Merger(nn.Module):
    """Each 2 x 2 square of patches joined into one row: normed (each patch; Qwen3-VL's DeepStack mergers: the
    joined row), then linear, GELU, linear."""

    def __init__(self, width: int, unit: int, out: int, rms: bool, joined_norm: bool, dtype: torch.dtype) -> None:
        super().__init__()
        joined, self.unit, self.joined_norm = width * unit, unit, joined_norm
        normed = joined if joined_norm else width
        self.ln_q = _RMSNorm(normed, 1e-6, dtype) if rms else nn.LayerNorm(normed, 1e-6, dtype=dtype)
        self.mlp = nn.ModuleList([_Linear(joined, joined, dtype=dtype), nn.GELU(), _Linear(joined, out, dtype=dtype)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # [patches, width] -> [patches / unit, out]
        joined = self.ln_q(x.reshape(-1, x.shape[-1] * self.unit)) if self.joined_norm else \
            self.ln_q(x).reshape(-1, x.shape[-1] * self.unit)
        return self.mlp[2](self.mlp[0].gelu(joined, "gelu"))


class QwenVLEncoder(ImageEncoder):
    """Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision transformer and merger (their
    `Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration` and `Qwen3VLForConditionalGeneration`
    configs; Qwen3-VL-MoE's is Qwen3-VL's), one image at a time. Qwen3-VL's adds learned position embeddings (a square
    grid, resampled to each image's) and DeepStack: the merged features of some layers (`deepstack_visual_indexes`)
    besides the last's, which its language model adds to its first layers' hidden states at the image's rows;
    `forward`'s rows carry them after the last layer's: [tokens, hidden x (1 + DeepStack layers)]."""

    processor = GridImageProcessor

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vision, kind = config.vision_config, config.model_type
        self.windowed, qwen2, qwen3 = kind == "qwen2_5_vl", kind == "qwen2_vl", kind in ("qwen3_vl", "qwen3_vl_moe")
        width = vision.embed_dim if qwen2 else vision.hidden_size
        out = vision.hidden_size if qwen2 else vision.out_hidden_size
        inner = int(width * vision.mlp_ratio) if qwen2 else vision.intermediate_size
        self.merge, self.patch_size = vision.spatial_merge_size, vision.patch_size
        self.window = getattr(vision, "window_size", 0) // self.merge // self.patch_size    # merged rows a side
        self.full_layers = set(getattr(vision, "fullatt_block_indexes", None) or [])
        self.deepstack_layers = list(getattr(vision, "deepstack_visual_indexes", None) or [])
        head_dim = width // vision.num_heads
        theta = (getattr(vision, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, head_dim // 2, 2).float() / (head_dim // 2)),
                             persistent=False)
        values = vision.in_channels * vision.temporal_patch_size * self.patch_size ** 2
        unit = self.merge ** 2
        parts: dict[str, nn.Module] = dict(
            patch_embed=nn.ModuleDict(dict(proj=_Linear(values, width, bias=qwen3, dtype=dtype))),
            blocks=nn.ModuleList(_QwenVisionBlock(vision, width, inner, self.windowed, dtype)
                                 for _ in range(vision.depth)),
            merger=_Merger(width, unit, out, self.windowed, False, dtype))
        if qwen3:
            parts["pos_embed"] = nn.Embedding(vision.num_position_embeddings, width, dtype=dtype)
            parts["deepstack_merger_list"] = nn.ModuleList(_Merger(width, unit, out, False, True, dtype)
                                                           for _ in self.deepstack_layers)
        self.visual = nn.ModuleDict(parts)

    def encode(self, image: ImageInput) -> torch.Tensor:
        assert image.grid is not None, "a Qwen2-VL image is a grid"
        frames, rows, columns = image.grid
        return self(image.pixels.to(self.inv_freq.device), (frames, rows * self.merge, columns * self.merge))

    def _parameter_name(self, name: str) -> str | None:
        """Qwen3-VL's names as Qwen2-VL's: a merger's norm, linear_fc1 and linear_fc2 as ln_q, mlp.0 and mlp.2, a
        layer's MLP's linear_fc1 and linear_fc2 as fc1 and fc2."""
        name = re.sub(r"(merger|merger_list\.\d+)\.norm\.", r"\1.ln_q.", name)
        name = re.sub(r"(merger|merger_list\.\d+)\.linear_fc([12])\.", lambda m: f"{m[1]}.mlp.{2 * int(m[2]) - 2}.",
                      name)
        return name.replace("mlp.linear_fc", "mlp.fc")

    def _position_rows(self, frames: int, rows: int, columns: int) -> torch.Tensor:
        """Qwen3-VL's learned position embeddings, their square grid resampled (bilinear, corners aligned) to the
        image's rows x columns patches, in the processor's order of patches [patches, width]: each patch's four
        nearest rows of the table weighed, as transformers weighs them (float32 sums, in its order)."""
        table = self.visual["pos_embed"].weight
        side, m = int(len(table) ** 0.5), self.merge

        def taps(size: int) -> tuple[torch.Tensor, torch.Tensor]:   # each place's two table rows and their weights
            place = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
            floor, offsets = place.floor(), torch.arange(2)
            weights = (1 - (place[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
            return (floor.long()[:, None] + offsets).clamp(0, side - 1), weights

        (row_taps, row_weights), (column_taps, column_weights) = taps(rows), taps(columns)
        indices = row_taps[:, None, :, None] * side + column_taps[None, :, None, :]      # [h, w, 2, 2]
        weights = row_weights[:, None, :, None] * column_weights[None, :, None, :]

        def ordered(t: torch.Tensor) -> torch.Tensor:  # [h, w, 2, 2] -> [patches, 4], 2 x 2 squares row-major
            return t.reshape(rows // m, m, columns // m, m, 4).transpose(1, 2).reshape(rows * columns, 4)

        weights = ordered(weights).to(table.device)
        return (table[ordered(indices).to(table.device)] * weights[..., None]).sum(1).repeat(frames, 1)

    def _angles(self, rows: int, columns: int, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [patches, 1, head_dim] of each patch's (row, column), patches in the processor's order: 2 x
        2 squares, row-major within and among them."""
        m = self.merge
        places = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij"))  # [2, h, w]
        places = places.reshape(2, rows // m, m, columns // m, m).transpose(2, 3).reshape(2, -1).repeat(1, frames)
        freqs = (places[..., None].to(self.inv_freq) * self.inv_freq).permute(1, 0, 2).flatten(1)  # [N, hd / 2]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None]
        return angles.cos(), angles.sin()

    def _windows(self, frames: int, rows: int, columns: int) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL's windows: the order that puts each window's 2 x 2 squares together [squares], and the
        windows' bounds in patches (transformers' `get_vision_window_index`, for one image)."""
        size, rows, columns = self.window, rows // self.merge, columns // self.merge
        grid = torch.arange(frames * rows * columns).reshape(frames, rows, columns)
        pad_rows, pad_columns = -rows % size, -columns % size
        grid = F.pad(grid, (0, pad_columns, 0, pad_rows), value=-1)
        windows = grid.reshape(frames, (rows + pad_rows) // size, size, (columns + pad_columns) // size, size)
        windows = windows.permute(0, 1, 3, 2, 4).reshape(-1, size * size)
        counts = (windows >= 0).sum(1)
        bounds = [0] + [int(b) * self.merge ** 2 for b in counts[counts > 0].cumsum(0)]
        return windows[windows >= 0], bounds

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [t h w, values] (grid (t, h, w) patches) -> its rows [t h w / 4, hidden], Qwen3-VL's
        DeepStack rows after them."""
        frames, rows, columns = grid
        visual, unit = self.visual, self.merge ** 2
        x = visual["patch_embed"]["proj"](pixels.to(self.inv_freq.device, visual["merger"].ln_q.weight.dtype))
        if "pos_embed" in visual:
            x = x + self._position_rows(frames, rows, columns).to(x.dtype)
        cos, sin = self._angles(rows, columns, frames)
        full = [i * rows * columns for i in range(frames + 1)]     # each frame attends to itself
        order, windows = None, full
        if self.windowed:
            order, windows = self._windows(frames, rows, columns)
            x, cos, sin = (t.unflatten(0, (-1, unit))[order].flatten(0, 1) for t in (x, cos, sin))
        deepstack = []
        for index, block in enumerate(visual["blocks"]):
            x = block(x, cos, sin, full if not self.windowed or index in self.full_layers else windows)
            if index in self.deepstack_layers:
                deepstack.append(visual["deepstack_merger_list"][self.deepstack_layers.index(index)](x))
        x = torch.cat([visual["merger"](x), *deepstack], dim=-1)
        return x if order is None else x[torch.argsort(order)]


class _InternVitLayer(nn.Module):
    """InternViT's encoder layer: pre-norm attention (q and k RMS-normed over all heads where `use_qk_norm`) and
    MLP, each scaled by its learned `lambda` before it is added back."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        width, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads, self.act = config.num_attention_heads, config.hidden_act
        activation(self.act)
        rms = config.norm_type == "rms_norm"
        self.layernorm_before, self.layernorm_after = (
            _RMSNorm(width, eps, dtype) if rms else nn.LayerNorm(width, eps, dtype=dtype) for _ in range(2))
        bias = config.attention_bias
        attention: dict[str, nn.Module] = dict(
            q_proj=_Linear(width, width, bias, dtype=dtype), k_proj=_Linear(width, width, bias, dtype=dtype),
            v_proj=_Linear(width, width, bias, dtype=dtype), projection_layer=_Linear(width, width, dtype=dtype))
        if config.use_qk_norm:
            attention |= dict(q_norm=_RMSNorm(width, 1e-6, dtype), k_norm=_RMSNorm(width, 1e-6, dtype))
        self.attention = nn.ModuleDict(attention)
        self.mlp = nn.ModuleDict(dict(fc1=_Linear(width, config.intermediate_size, dtype=dtype),
                                      fc2=_Linear(config.intermediate_size, width, dtype=dtype)))
        self.lambda_1, self.lambda_2 = (nn.Parameter(torch.empty(width, dtype=dtype)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # [N, rows, D]
        h, attention = self.layernorm_before(x), self.attention
        q, k, v = (attention[name](h) for name in ("q_proj", "k_proj", "v_proj"))
        if "q_norm" in attention:
            q, k = attention["q_norm"](q), attention["k_norm"](k)
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        x = x + self.lambda_1 * attention["projection_layer"](out)
        return x + self.lambda_2 * self.mlp["fc2"](self.mlp["fc1"].gelu(self.layernorm_after(x), self.act))


class InternVLEncoder(ImageEncoder):
    """InternVL's (`InternVLForConditionalGeneration`'s config, the -hf checkpoints): InternViT over each 448-pixel
    tile (a class token and learned positions, the tile at the size they were learned for), its last layer's
    features post-normed, the class token dropped, pixel-shuffled (2 x 2 patches a row), then the projector:
    LayerNorm, linear, GELU, linear."""

    processor = CroppedImageProcessor

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vision = config.vision_config
        if config.vision_feature_layer != -1 or config.vision_feature_select_strategy != "default":
            raise ValueError("pagedllm reads an InternVL tower's last layer without its class token "
                             f"(vision_feature_layer -1, 'default'), not {config.vision_feature_layer}, "
                             f"{config.vision_feature_select_strategy!r}")
        width, patch = vision.hidden_size, vision.patch_size
        patch = patch[0] if isinstance(patch, (list, tuple)) else patch
        size = vision.image_size[0] if isinstance(vision.image_size, (list, tuple)) else vision.image_size
        self.scale = round(1 / config.downsample_ratio)
        embeddings = nn.Module()
        embeddings.cls_token = nn.Parameter(torch.empty(1, 1, width, dtype=dtype))
        embeddings.position_embeddings = nn.Parameter(torch.empty(1, (size // patch) ** 2 + 1, width, dtype=dtype))
        embeddings.patch_embeddings = nn.ModuleDict(dict(projection=nn.Conv2d(vision.num_channels, width, patch, patch,
                                                                              dtype=dtype)))
        self.tower = nn.ModuleDict(dict(
            embeddings=embeddings,
            encoder=nn.ModuleDict(dict(layer=nn.ModuleList(_InternVitLayer(vision, dtype)
                                                           for _ in range(vision.num_hidden_layers)))),
            layernorm=nn.Identity() if vision.use_mean_pooling else nn.LayerNorm(width, vision.layer_norm_eps,
                                                                                  dtype=dtype)))
        joined, hidden = width * self.scale ** 2, config.text_config.hidden_size
        self.projector = nn.ModuleDict(dict(layer_norm=nn.LayerNorm(joined, dtype=dtype),
                                            linear_1=_Linear(joined, hidden, dtype=dtype),
                                            linear_2=_Linear(hidden, hidden, dtype=dtype)))
        self.projector_act = config.projector_hidden_act
        activation(self.projector_act)

    def _parameter_name(self, name: str) -> str | None:
        return name

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] (tiles, the processor's) -> [N, tokens, hidden]: tile i's rows for its placeholders."""
        embeddings = self.tower["embeddings"]
        projection = embeddings.patch_embeddings["projection"]
        x = projection(pixels.to(projection.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([embeddings.cls_token.expand(len(x), 1, -1), x], dim=1) + embeddings.position_embeddings
        for layer in self.tower["encoder"]["layer"]:
            x = layer(x)
        x = _pixel_shuffle(self.tower["layernorm"](x)[:, 1:], self.scale)
        projector = self.projector
        return projector["linear_2"](projector["linear_1"].gelu(projector["layer_norm"](x), self.projector_act))


class Gemma3Encoder(ImageEncoder):
    """Gemma 3's (`Gemma3ForConditionalGeneration`'s config): SigLIP's last layer, post-normed, each image's patches
    average-pooled into `mm_tokens_per_image` rows (16 x 16 of 64 x 64 at 896 pixels), RMS-normed (Gemma's 1 + w)
    and projected. Its language model lets an image's placeholders see each other both ways
    (`attends_whole_image`)."""

    attends_whole_image = True

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vision = config.vision_config
        self.tower = VisionTower(vision, -1, dtype, post_norm=True)
        self.patches = vision.image_size // vision.patch_size
        self.image_tokens = config.mm_tokens_per_image    # an image's placeholders, computed in one step
        self.pool = self.patches // round(self.image_tokens ** 0.5)
        self.eps = vision.layer_norm_eps
        self.projector = nn.Module()
        self.projector.mm_input_projection_weight = nn.Parameter(
            torch.empty(vision.hidden_size, config.text_config.hidden_size, dtype=dtype))
        self.projector.mm_soft_emb_norm = nn.Module()
        self.projector.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(vision.hidden_size, dtype=dtype))

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] (the processor's) -> [N, tokens, hidden]: image i's rows for its placeholders."""
        x = self.tower(pixels)      # [N, patches^2, D]
        n, _, width = x.shape
        x = F.avg_pool2d(x.transpose(1, 2).reshape(n, width, self.patches, self.patches), self.pool)
        h = x.flatten(2).transpose(1, 2).float()
        weight = self.projector.mm_soft_emb_norm.weight
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + weight.float())
        return h.to(x.dtype) @ self.projector.mm_input_projection_weight


class _PixtralLayer(nn.Module):
    """A Pixtral encoder layer: RMSNorm, attention over the image's patches (each query and key turned by its
    patch's row and column), RMSNorm, a gated MLP; no biases."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        width, inner = config.hidden_size, config.intermediate_size
        self.num_heads, self.act = config.num_attention_heads, activation(config.hidden_act)
        self.attention_norm, self.ffn_norm = (_RMSNorm(width, 1e-5, dtype) for _ in range(2))
        self.attention = nn.ModuleDict({name: _Linear(width, width, bias=False, dtype=dtype)
                                        for name in ("q_proj", "k_proj", "v_proj", "o_proj")})
        self.feed_forward = nn.ModuleDict(dict(gate_proj=_Linear(width, inner, bias=False, dtype=dtype),
                                               up_proj=_Linear(width, inner, bias=False, dtype=dtype),
                                               down_proj=_Linear(inner, width, bias=False, dtype=dtype)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x: [patches, D]
        h, attention = self.attention_norm(x), self.attention
        q, k, v = (attention[name](h).unflatten(-1, (self.num_heads, -1)) for name in ("q_proj", "k_proj", "v_proj"))
        x = x + attention["o_proj"](_windowed_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, [0, len(x)]))
        h, mlp = self.ffn_norm(x), self.feed_forward
        return x + mlp["down_proj"](self.act(mlp["gate_proj"](h)) * mlp["up_proj"](h))


class PixtralEncoder(ImageEncoder):
    """Pixtral's tower and Mistral 3's projector (`Mistral3ForConditionalGeneration`'s config: Mistral-Small-3.1 and
    3.2), or Llava's (a `LlavaForConditionalGeneration` of a Pixtral tower: Pixtral-12B): Pixtral's ViT over an
    image of its own size (14- or 16-pixel patches, each turned by its row and column: a 2-D rotary embedding over
    the head's values, rows' angles then columns'), up to `vision_feature_layer`, then Mistral 3's projector:
    RMSNorm, each s x s square of patches joined into one row (`spatial_merge_size`, channel-major as torch's
    unfold joins them) and merged by a linear, linear, GELU, linear; or Llava's: linear, GELU, linear, a row a
    patch. Its prompt holds a row of placeholders a row of squares (patches), each row followed by [IMG_BREAK], the
    last by [IMG_END] (`RowBreakImageProcessor`)."""

    processor = RowBreakImageProcessor

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vision, layer = config.vision_config, config.vision_feature_layer
        if not isinstance(layer, int) or getattr(config, "vision_feature_select_strategy", "full") != "full":
            raise ValueError(f"vision_feature_layer {layer}, vision_feature_select_strategy "
                             f"{config.vision_feature_select_strategy!r}: pagedllm reads one layer of a Pixtral "
                             "tower, every row of it ('full')")
        width, self.patch = vision.hidden_size, vision.patch_size
        self.merge = getattr(config, "spatial_merge_size", 1)     # Llava's: none, a row a patch
        head_dim = width // vision.num_attention_heads
        every = 1.0 / vision.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", torch.cat([every[0::2], every[1::2]]), persistent=False)  # rows', columns'
        self.tower = nn.ModuleDict(dict(
            patch_conv=_Linear(vision.num_channels * self.patch ** 2, width, bias=False, dtype=dtype),
            ln_pre=_RMSNorm(width, 1e-5, dtype),
            transformer=nn.ModuleDict(dict(layers=nn.ModuleList(
                _PixtralLayer(vision, dtype) for _ in range(layer % (vision.num_hidden_layers + 1)))))))
        hidden, bias = config.text_config.hidden_size, config.multimodal_projector_bias
        projector: dict[str, nn.Module] = dict(linear_1=_Linear(width, hidden, bias=bias, dtype=dtype),
                                               linear_2=_Linear(hidden, hidden, bias=bias, dtype=dtype))
        if config.model_type == "mistral3":
            projector |= dict(norm=_RMSNorm(width, config.text_config.rms_norm_eps, dtype),
                              patch_merger=nn.ModuleDict(dict(merging_layer=_Linear(width * self.merge ** 2, width,
                                                                                    bias=False, dtype=dtype))))
        self.projector = nn.ModuleDict(projector)
        self.projector_act = config.projector_hidden_act
        activation(self.projector_act)

    def encode(self, image: ImageInput) -> torch.Tensor:
        return self(image.pixels.to(self.inv_freq.device))

    def _parameter_name(self, name: str) -> str | None:
        """None for the tower's layers past the feature layer."""
        parts = name.split(".")
        if name.startswith("tower.transformer.layers.") and int(parts[3]) >= len(self.tower["transformer"]["layers"]):
            return None
        return name

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image [3, H, W] (the processor's, sides whole squares) -> its placeholders' rows [H W / (P s)^2,
        hidden], row-major."""
        tower, projector, p, s = self.tower, self.projector, self.patch, self.merge
        rows, columns = pixels.shape[1] // p, pixels.shape[2] // p
        patches = pixels.reshape(-1, rows, p, columns, p).permute(1, 3, 0, 2, 4).reshape(rows * columns, -1)
        x = tower["ln_pre"](tower["patch_conv"](patches.to(tower["ln_pre"].weight.dtype)))
        places = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij")).flatten(1)
        half = len(self.inv_freq) // 2
        freqs = torch.cat([places[0, :, None] * self.inv_freq[:half], places[1, :, None] * self.inv_freq[half:]], -1)
        angles = torch.cat([freqs, freqs], dim=-1)[:, None]     # [patches, 1, head_dim]
        cos, sin = angles.cos(), angles.sin()
        for layer in tower["transformer"]["layers"]:
            x = layer(x, cos, sin)
        if "patch_merger" in projector:
            x = projector["norm"](x).reshape(rows // s, s, columns // s, s, -1).permute(0, 2, 4, 1, 3).flatten(2)
            x = projector["patch_merger"]["merging_layer"](x.flatten(0, 1))
        return projector["linear_2"](projector["linear_1"].gelu(x, self.projector_act))


class SmolVLMEncoder(Idefics3Encoder):
    """SmolVLM2's (`SmolVLMForConditionalGeneration`'s config): Idefics3's tower and connector, its prompts made
    without its transformers processor, which needs torchvision."""

    processor = TiledImageProcessor


def image_encoder_class(config: Any, architecture: str) -> type[ImageEncoder]:
    """The image encoder of a multimodal checkpoint's `config` (its `architecture`): IMAGE_ENCODERS' for the
    architecture, Pixtral's for a Llava of a Pixtral tower (Pixtral-12B)."""
    if architecture == "LlavaForConditionalGeneration" and config.vision_config.model_type == "pixtral":
        return PixtralEncoder
    return IMAGE_ENCODERS[architecture]


# multimodal architectures -> their image encoder. SmolVLM-256M, 500M and 2.2B-Instruct are Idefics3 checkpoints,
# SmolVLM2's SmolVLM ones.
IMAGE_ENCODERS: dict[str, type[ImageEncoder]] = {
    "LlavaForConditionalGeneration": LlavaEncoder, "Idefics3ForConditionalGeneration": Idefics3Encoder,
    "Qwen2VLForConditionalGeneration": QwenVLEncoder, "Qwen2_5_VLForConditionalGeneration": QwenVLEncoder,
    "Qwen3VLForConditionalGeneration": QwenVLEncoder, "Qwen3VLMoeForConditionalGeneration": QwenVLEncoder,
    "SmolVLMForConditionalGeneration": SmolVLMEncoder,
    "InternVLForConditionalGeneration": InternVLEncoder, "LlavaNextForConditionalGeneration": LlavaNextEncoder,
    "Gemma3ForConditionalGeneration": Gemma3Encoder, "Mistral3ForConditionalGeneration": PixtralEncoder,
    "LlavaOnevisionForConditionalGeneration": OneVisionEncoder}
