"""The image encoder of a Llava-kind vision-language model: a ViT (CLIP's or SigLIP's) and the projector that maps
its patch features into the language model's embedding space, one row per placeholder token of the image.

```
pixels [N, 3, S, S] -> patches (a conv of stride P) [N, (S/P)^2, D]   (+ CLIP's class token in front)
    + position embeddings, CLIP's pre-LayerNorm
    -> encoder layers (pre-LayerNorm attention over every patch, then a pre-LayerNorm MLP), each added back
    -> the features of layer `vision_feature_layer` (-1: the last; CLIP checkpoints read -2), not post-normed;
       "default" selection drops CLIP's class token, "full" keeps every row
    -> projector: linear, GELU, linear  [N, tokens, hidden of the language model]
```

Llava's processor (transformers') resizes each image to the tower's size and expands its `<image>` into as many
placeholder tokens as rows come out here; `pagedllm.multimodal` finds them in the prompt. The encoder runs once an
image, in plain torch (an image is a few hundred rows through a few hundred million weights: one prompt's prefill
worth), in the step that first reaches its placeholders (`ModelRunner._image_rows`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# transformers' activations by config name, as these towers and projectors use them
_ACTIVATIONS = {"gelu": F.gelu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_new": lambda x: F.gelu(x, approximate="tanh")}
# the tower's and the projector's checkpoint prefixes, in transformers' layouts (before 4.52 at the top; since, under
# model.; CLIPVisionModel's and SiglipVisionModel's own vision_model. inside, where saved) -> the encoder's names
_PREFIXES = (("model.vision_tower.vision_model.", "tower."), ("vision_tower.vision_model.", "tower."),
             ("model.vision_tower.", "tower."), ("vision_tower.", "tower."),
             ("model.multi_modal_projector.", "projector."), ("multi_modal_projector.", "projector."))


def image_part_name(name: str) -> str | None:
    """A Llava-kind checkpoint's tensor name as `ImageEncoder` names it; None for the language model's tensors."""
    for prefix, ours in _PREFIXES:
        if name.startswith(prefix):
            return ours + name.removeprefix(prefix)
    return None


def activation(name: str) -> Any:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} of an image encoder is not one pagedllm runs: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class _EncoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        width, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.layer_norm1 = nn.LayerNorm(width, eps, dtype=dtype)
        self.layer_norm2 = nn.LayerNorm(width, eps, dtype=dtype)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(width, width, dtype=dtype)
                                                                for _ in range(4))
        self.fc1 = nn.Linear(width, config.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(config.intermediate_size, width, dtype=dtype)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: [N, rows, D]
        h = self.layer_norm1(x)
        q, k, v = (proj(h).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))     # [N, heads, rows, head_dim]
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        x = x + self.out_proj(attn)
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class VisionTower(nn.Module):
    """CLIP's or SigLIP's ViT (config.model_type "clip_vision_model" or "siglip_vision_model") up to the features
    of layer `feature_layer` (a negative index counts from the last; a list concatenates layers' features)."""

    def __init__(self, config: Any, feature_layer: int | list[int], dtype: torch.dtype) -> None:
        super().__init__()
        if config.model_type not in ("clip_vision_model", "siglip_vision_model"):
            raise ValueError(f"an image encoder of type {config.model_type!r} is not one pagedllm runs: it runs "
                             "CLIP's and SigLIP's (clip_vision_model, siglip_vision_model)")
        self.clip = config.model_type == "clip_vision_model"
        width, num_patches = config.hidden_size, (config.image_size // config.patch_size) ** 2
        self.patch_size = config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, width, config.patch_size, config.patch_size,
                                         bias=not self.clip, dtype=dtype)
        self.class_embedding = nn.Parameter(torch.empty(width, dtype=dtype)) if self.clip else None
        self.position_embedding = nn.Embedding(num_patches + self.clip, width, dtype=dtype)
        self.pre_layrnorm = nn.LayerNorm(width, config.layer_norm_eps, dtype=dtype) if self.clip else None
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
        x = x + self.position_embedding.weight[:x.shape[1]]
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = [x]
        for layer in self.layers:
            states.append(layer(states[-1]))
        return torch.cat([states[i] for i in self.feature_states], dim=-1)


class ImageEncoder(nn.Module):
    """A Llava-kind model's tower and projector (`LlavaForConditionalGeneration`'s config): images -> the rows that
    stand in for their placeholder tokens."""

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
        self.projector = nn.ModuleDict(dict(linear_1=nn.Linear(features, hidden, bias, dtype=dtype),
                                            linear_2=nn.Linear(hidden, hidden, bias, dtype=dtype)))
        self.projector_act = activation(config.projector_hidden_act)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] (the processor's) -> [N, tokens, hidden]: image i's rows for its placeholders."""
        features = self.tower(pixels)
        if self.skip_class_token:
            features = features[:, 1:]
        return self.projector["linear_2"](self.projector_act(self.projector["linear_1"](features)))

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
            if name.startswith(("tower.post_layernorm.", "tower.head.")) or name.endswith("position_ids"):
                continue    # after the last layer, which the features are read before; older CLIPs' arange
            if name not in params:
                raise KeyError(f"unexpected image encoder tensor {name!r}")
            with torch.no_grad():
                params[name].copy_(tensor.reshape(params[name].shape))
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint leaves these image encoder weights unset: {missing[:8]}")
