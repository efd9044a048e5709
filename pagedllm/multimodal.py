"""Images in prompts, for a Llava-kind model (`pagedllm.models.vision`).

A prompt takes images as vLLM's do: `{"prompt": "USER: <image>\\nWhat is this? ASSISTANT:", "multi_modal_data":
{"image": image}}` (a PIL image, or a list of them, one per `<image>` of the text in order). The model's own
transformers processor (`ImageProcessor`) turns text and images into token ids, where each image's `<image>` has
become as many placeholder tokens as its encoder gives rows, and into pixels: one picture an image for Llava, for
Idefics3 and SmolVLM a grid of tiles and the whole image shrunk, each tile its own run of placeholders between
the processor's markers. `image_inputs` then finds each picture's run. An `ImageInput` (one picture) is what the
core carries: where its placeholders sit in the prompt, a hash of its pixels (its prefix-cache key:
`pagedllm.core.kv_cache.hashing`) and the pixels themselves, which only the runner reads. Pure Python at import:
the core imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One picture of a prompt (an image, or a tile of one): placeholder positions `offset : offset + length`, a
    hash of its pixels, and the pixels (a [3, S, S] tensor, the processor's), which the runner's image encoder turns
    into `length` rows."""

    offset: int
    length: int
    content_hash: str
    pixels: Any = field(repr=False)


def is_image(value: object) -> bool:
    """Whether `value` is an image a prompt takes (a PIL image)."""
    from PIL import Image

    return isinstance(value, Image.Image)


def pixels_hash(pixels: Any) -> str:
    """A hash of an image's pixels, the same on every run: two prompts with the same text and different images
    share no prefix-cache block from the first image on."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(pixels.float().contiguous().numpy().tobytes())


def image_inputs(token_ids: list[int], pixels: Any, image_token_id: int) -> tuple[ImageInput, ...]:
    """Each picture's run of placeholders in `token_ids`, with its pixels ([N, 3, S, S]): the placeholders split
    evenly among the N pictures, each one's contiguous. ValueError when they are not."""
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id]
    count = len(pixels)
    if count == 0 or len(positions) % count:
        raise ValueError(f"the prompt has {len(positions)} image placeholder tokens for {count} pictures")
    length = len(positions) // count
    result = []
    for index in range(count):
        run = positions[index * length:(index + 1) * length]
        if run[-1] - run[0] != length - 1:
            raise ValueError(f"image {index}'s placeholder tokens are not one run")
        result.append(ImageInput(run[0], length, pixels_hash(pixels[index]), pixels[index]))
    return tuple(result)


def has_processor(path: Path) -> bool:
    """Whether a model folder holds a processor's config: without one a Llava checkpoint serves text only."""
    return any((path / name).is_file() for name in ("processor_config.json", "preprocessor_config.json"))


class ImageProcessor:
    """The model's transformers processor (its `processor_config.json` or `preprocessor_config.json`): text with
    `<image>` markers and images -> token ids and `ImageInput`s, their pixels in the model's `dtype` (a request
    holds them until it ends: 53 MB of float32 for a 17-tile SmolVLM image, half in bf16). Thread-safe (the server
    calls it off its loop)."""

    def __init__(self, path: Path, image_token_id: int, dtype: Any, kwargs: dict[str, Any] | None = None) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(path))
        self.image_token_id, self.dtype = image_token_id, dtype
        self.kwargs = dict(kwargs or {})     # ModelConfig.mm_processor_kwargs
        self.image_token = self.processor.tokenizer.convert_ids_to_tokens(image_token_id)

    def __call__(self, text: str, images: list[Any], add_special_tokens: bool = True,
                 kwargs: dict[str, Any] | None = None) -> tuple[list[int], tuple[ImageInput, ...]]:
        """Token ids and images of a prompt; `add_special_tokens` False for a chat template's text, which holds its
        own BOS; `kwargs` (a prompt's mm_processor_kwargs) over the engine's."""
        markers = text.count(self.image_token)
        if markers != len(images):
            raise ValueError(f"the prompt has {markers} {self.image_token} markers for {len(images)} images: put one "
                             "where each image goes")
        encoded = self.processor(text=text, images=[[image.convert("RGB") for image in images]],
                                 return_tensors="pt", add_special_tokens=add_special_tokens,
                                 **(self.kwargs | (kwargs or {})))     # one it does not know: warned of, ignored
        token_ids, pixels = encoded["input_ids"][0].tolist(), encoded["pixel_values"].to(self.dtype)
        if pixels.dim() == 5:   # Idefics3's [1, tiles, 3, S, S], each tile whole (one prompt pads none)
            pixels = pixels[0]
            assert bool(encoded["pixel_attention_mask"].all()), "a tile of one prompt is never padded"
        return token_ids, image_inputs(token_ids, pixels, self.image_token_id)
