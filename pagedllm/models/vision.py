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
```

The model's processor (transformers') resizes (and tiles) each image and expands its `<image>` into as many
placeholder tokens as rows come out here; `pagedllm.multimodal` finds them in the prompt. The encoder runs once an
image (a tile), in plain torch (a few hundred rows through a few hundred million weights: one prompt's prefill
worth), in the step that first reaches its placeholders (`ModelRunner._image_rows`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.cpu import onednn_bf16_ok
from pagedllm.layers.linear import linear

# transformers' activations by config name, as these towers and projectors use them
_ACTIVATIONS = {"gelu": F.gelu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_new": lambda x: F.gelu(x, approximate="tanh")}
# the GELUs oneDNN applies inside a linear (its `_linear_pointwise` "gelu" and the approximation)
_ONEDNN_GELUS = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh"}
# the tower's and the projector's checkpoint prefixes, in transformers' layouts (Llava's before 4.52 at the top;
# since, under model.; CLIPVisionModel's and SiglipVisionModel's own vision_model. inside, where saved; Idefics3's
# vision_model and connector) -> the encoder's names
_PREFIXES = (("model.vision_tower.vision_model.", "tower."), ("vision_tower.vision_model.", "tower."),
             ("model.vision_tower.", "tower."), ("vision_tower.", "tower."), ("model.vision_model.", "tower."),
             ("model.multi_modal_projector.", "projector."), ("multi_modal_projector.", "projector."),
             ("model.connector.modality_projection.", "projector."))
_TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip", "idefics3_vision": "idefics3"}


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
    `feature_layer` (a negative index counts from the last; a list concatenates layers' features); Idefics3's
    post-normed."""

    def __init__(self, config: Any, feature_layer: int | list[int], dtype: torch.dtype) -> None:
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
            if kind == "idefics3" else None
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
    their placeholder tokens. `load_weights` takes `image_part_name`'s names."""

    tower: VisionTower

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
            name = name.replace("embeddings.", "").replace("encoder.layers.", "layers.") \
                .replace("self_attn.", "").replace("mlp.", "")
            if name.startswith("tower.layers.") and int(name.split(".")[2]) >= len(self.tower.layers):
                continue
            if name.startswith("tower.head.") or name.endswith("position_ids") or \
                    name.startswith("tower.post_layernorm.") and self.tower.post_layernorm is None:
                continue    # after the last layer, which Llava reads the features before; older CLIPs' arange
            if name not in params:
                raise KeyError(f"unexpected image encoder tensor {name!r}")
            with torch.no_grad():
                params[name].copy_(tensor.reshape(params[name].shape))
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint leaves these image encoder weights unset: {missing[:8]}")


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
        x = self.tower(pixels)      # [N, side x side, D], row-major patches
        n, rows, width = x.shape
        side, r = int(rows ** 0.5), self.scale
        # each r x r square of patches -> one row, its patches row-major: [N, side/r, r, side/r, r, D] ->
        # [N, side/r, side/r, r (row), r (column), D]
        x = x.view(n, side // r, r, side // r, r, width).permute(0, 1, 3, 2, 4, 5)
        return self.projector["proj"](x.reshape(n, rows // r ** 2, width * r ** 2))


# multimodal architectures -> their image encoder. SmolVLM-256M, 500M and 2.2B-Instruct are Idefics3 checkpoints;
# SmolVLM2's (SmolVLMForConditionalGeneration) processor needs torchvision, which pagedllm does not install: their text
# only.
IMAGE_ENCODERS: dict[str, type[ImageEncoder]] = {
    "LlavaForConditionalGeneration": LlavaEncoder, "Idefics3ForConditionalGeneration": Idefics3Encoder}
