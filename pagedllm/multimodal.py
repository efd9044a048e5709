"""Images in prompts, for a vision-language model (`pagedllm.models.vision`).

A prompt takes images as vLLM's do: `{"prompt": "USER: <image>\\nWhat is this? ASSISTANT:", "multi_modal_data":
{"image": image}}` (a PIL image, or a list of them, one per marker of the text in order). The model's own
transformers processor (`ImageProcessor`) turns text and images into token ids, where each image's marker has become
as many placeholder tokens as its encoder gives rows, and into pixels: one picture an image for Llava and Gemma 3,
for Idefics3 a grid of tiles and the whole image shrunk, each tile its own run of placeholders between the
processor's markers, for LLaVA-NeXT its tiles in one run (`AnyresImageProcessor`; LLaVA-OneVision's the same, counted
here: `OneVisionImageProcessor`). `image_inputs` then finds each picture's run. Where that processor needs
torchvision (SmolVLM2's, InternVL's, the Qwen-VLs', Pixtral's), the markers are expanded here, with the model's image
processor (`_ExpandingProcessor`). The Qwen-VLs' images keep their aspect: each becomes a grid of patches of its own
size (`GridImageProcessor`), and as many placeholders as the grid has 2 x 2 squares; their language model places
those tokens by M-RoPE (`MRopeLayout`). Mistral 3's and Pixtral-12B's keep their aspect as well, a row of
placeholders a row of the image's squares, each row ended by a token of the prompt's own (`RowBreakImageProcessor`).
An `ImageInput` (one picture) is what the core carries: where its placeholders sit in the prompt, a hash of its
pixels (its prefix-cache key: `pagedllm.core.kv_cache.hashing`), the pixels themselves, which only the runner reads,
and its shape where the encoder needs it. Pure Python at import: the core imports this module.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One picture of a prompt (an image, or a tile of one): placeholder positions `offset : offset + length`, a
    hash of its pixels, and the pixels (a [3, S, S] tensor, the processor's; a grid's [patches, values]), which the
    runner's image encoder turns into `length` rows. `grid`: a grid image's placeholders as (frames, rows, columns),
    one placeholder a 2 x 2 square of patches (`GridImageProcessor`); None for any other picture. `size`: an anyres
    image's own (height, width), which its encoder unpads its tiles' rows to (`AnyresImageProcessor`), or a Pixtral
    image's; else None. `row_width`: a Pixtral image's placeholders a row: its run is rows of that many, each
    followed by a token of the prompt's own ([IMG_BREAK], the last [IMG_END]: `RowBreakImageProcessor`), which
    keeps its embedding; the encoder gives rows for the placeholders alone."""

    offset: int
    length: int
    content_hash: str
    pixels: Any = field(repr=False)
    grid: tuple[int, int, int] | None = None
    size: tuple[int, int] | None = None
    row_width: int | None = None
    embeds: bool = False    # prompt embeddings (vLLM's prompt_embeds): `pixels` are the rows themselves [length, H]


def is_image(value: object) -> bool:
    """Whether `value` is an image a prompt takes (a PIL image)."""
    from PIL import Image

    return isinstance(value, Image.Image)


def pixels_hash(pixels: Any, shape: tuple[int, ...] | None = None) -> str:
    """A hash of an image's pixels (and its shape, a grid's or an anyres image's size: the same patches in another
    shape are another image), the same on every run: two prompts with the same text and different images share no
    prefix-cache block from the first image on."""
    import xxhash

    digest = xxhash.xxh3_128(pixels.float().contiguous().numpy().tobytes())
    if shape is not None:
        digest.update(repr(shape).encode())
    return digest.hexdigest()


def image_inputs(token_ids: list[int], pictures: Sequence[Any], image_token_id: int,
                 grids: Sequence[tuple[int, int, int]] | None = None, sizes: Sequence[tuple[int, int]] | None = None,
                 lengths: Sequence[int] | None = None, row_widths: Sequence[int] | None = None,
                 row_ends: frozenset[int] = frozenset()) -> tuple[ImageInput, ...]:
    """Each picture's run of placeholders in `token_ids`, with its pixels (`pictures`, in order): `lengths` long, or
    as long as its grid has placeholders (`grids`), or else the placeholders split evenly among the pictures; each
    run contiguous. ValueError when they are not. `sizes`: anyres images' own sizes. `row_widths`: Pixtral images'
    placeholders a row, each row ended by one of the `row_ends` tokens, which the runs hold too."""
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id or t in row_ends]
    count = len(pictures)
    if lengths is None and grids is not None:
        lengths = [math.prod(grid) for grid in grids]
    elif lengths is None:
        lengths = [len(positions) // count] * count if count and len(positions) % count == 0 else []
    if not count or sum(lengths) != len(positions):
        raise ValueError(f"the prompt has {len(positions)} image placeholder tokens for {count} pictures")
    result, start = [], 0
    for index, length in enumerate(lengths):
        run = positions[start:start + length]
        start += length
        if run[-1] - run[0] != length - 1:
            raise ValueError(f"image {index}'s placeholder tokens are not one run")
        grid, size = None if grids is None else grids[index], None if sizes is None else sizes[index]
        result.append(ImageInput(run[0], length, pixels_hash(pictures[index], grid or size), pictures[index], grid,
                                 size, None if row_widths is None else row_widths[index]))
    return tuple(result)


@dataclass(frozen=True, slots=True)
class MRopeLayout:
    """Where M-RoPE (the Qwen-VLs' language models) puts a prompt's tokens with grid images: a token's
    rotary position is three, (frame, row, column). A text token's three are its index plus a shift; an image's
    placeholders' are its start (its first placeholder's index plus the shift there) plus their place in its grid.
    An image of R x C placeholders advances the positions by max(R, C), not by R x C: every token after it, text
    and generated alike, is shifted by the difference (transformers' `get_rope_index`)."""

    ends: tuple[int, ...]       # each grid image's end in the prompt (offset + length), in order
    shifts: tuple[int, ...]     # the shift of every token from that end on (0 before the first)

    @classmethod
    def of(cls, images: Sequence[ImageInput]) -> MRopeLayout | None:
        """The layout of a prompt's images; None when none of them is a grid image (positions are the indices)."""
        grids = [image for image in images if image.grid is not None]
        if not grids:
            return None
        ends, shifts, shift = [], [], 0
        for image in grids:
            _, rows, columns = image.grid    # type: ignore[misc]
            shift += max(rows, columns) - image.length
            ends.append(image.offset + image.length)
            shifts.append(shift)
        return cls(tuple(ends), tuple(shifts))

    def shift(self, index: int) -> int:
        """What is added to token `index`'s position."""
        at = bisect.bisect_right(self.ends, index)
        return self.shifts[at - 1] if at else 0

    def image_positions(self, image: ImageInput, first: int, last: int) -> list[list[int]]:
        """The (frame, row, column) positions of `image`'s placeholders at prompt indices [first, last): three
        lists."""
        assert image.grid is not None
        _, rows, columns = image.grid
        start = image.offset + self.shift(image.offset)
        places = range(first - image.offset, last - image.offset)
        return [[start + j // (rows * columns) for j in places], [start + j // columns % rows for j in places],
                [start + j % columns for j in places]]


def check_image_count(count: int, limit: int | None) -> None:
    """ValueError for a prompt of `count` images past `limit` (`ModelConfig.image_limit`; None: no limit)."""
    if limit is not None and count > limit:
        raise ValueError(f"the prompt has {count} images, and a prompt may hold at most {limit} (limit_mm_per_prompt"
                         f"{': images are off' if limit == 0 else ''})")


def has_processor(path: Path) -> bool:
    """Whether a model folder holds a processor's config: without one a vision-language checkpoint serves text
    only."""
    return any((path / name).is_file() for name in ("processor_config.json", "preprocessor_config.json"))


class ImageProcessor:
    """The model's transformers processor (its `processor_config.json` or `preprocessor_config.json`): text with
    `<image>` markers and images -> token ids and `ImageInput`s, their pixels in the model's `dtype` (a request
    holds them until it ends: 53 MB of float32 for a 17-tile SmolVLM image, half in bf16). Thread-safe (the server
    calls it off its loop)."""

    def __init__(self, path: Path, image_token_id: int, dtype: Any, kwargs: dict[str, Any] | None = None) -> None:
        self.image_token_id, self.dtype = image_token_id, dtype
        self.kwargs = dict(kwargs or {})     # ModelConfig.mm_processor_kwargs
        self.tokenizer = self._load(path)
        self.image_token = self._marker()

    @property
    def prompt_marker(self) -> str:
        """What marks an image's place in a prompt as the model was trained to see it (its chat template's): the
        image token, which the processor expands."""
        return self.image_token

    def _load(self, path: Path) -> Any:
        """Load the processor; returns its tokenizer."""
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(path))
        return self.processor.tokenizer

    def _marker(self) -> str:
        """What marks an image in a prompt's text, which the processor expands: its `image_token` (Gemma 3's
        `<start_of_image>`, not the placeholder it expands into), else the placeholder's."""
        marker = getattr(getattr(self, "processor", None), "image_token", None)
        return marker if isinstance(marker, str) else self.tokenizer.convert_ids_to_tokens(self.image_token_id)

    def __call__(self, text: str, images: list[Any], add_special_tokens: bool = True,
                 kwargs: dict[str, Any] | None = None) -> tuple[list[int], tuple[ImageInput, ...]]:
        """Token ids and images of a prompt; `add_special_tokens` False for a chat template's text, which holds its
        own BOS; `kwargs` (a prompt's mm_processor_kwargs) over the engine's."""
        markers = text.count(self.image_token)
        if markers != len(images):
            raise ValueError(f"the prompt has {markers} {self.image_token} markers for {len(images)} images: put one "
                             "where each image goes")
        return self._process(text, [image.convert("RGB") for image in images], add_special_tokens,
                             self.kwargs | (kwargs or {}))     # one the processor does not know: warned of, ignored

    def _process(self, text: str, images: list[Any], add_special_tokens: bool, kwargs: dict[str, Any]
                 ) -> tuple[list[int], tuple[ImageInput, ...]]:
        encoded = self.processor(text=text, images=[images], return_tensors="pt",
                                 add_special_tokens=add_special_tokens, **kwargs)
        token_ids, pixels = encoded["input_ids"][0].tolist(), encoded["pixel_values"].to(self.dtype)
        if pixels.dim() == 5:   # Idefics3's [1, tiles, 3, S, S], each tile whole (one prompt pads none)
            pixels = pixels[0]
            assert bool(encoded["pixel_attention_mask"].all()), "a tile of one prompt is never padded"
        return token_ids, image_inputs(token_ids, pixels, self.image_token_id)


class AnyresImageProcessor(ImageProcessor):
    """LLaVA-NeXT's (`LlavaNextForConditionalGeneration`): its transformers processor, which cuts each image into the
    tiles of the grid that best fits its aspect (`image_grid_pinpoints`) after a shrunk whole, and expands its
    `<image>` into as many placeholders as its encoder keeps of them once unpadded to the image's own aspect (a row
    break after each row); each image one `ImageInput`, with its size."""

    def _process(self, text: str, images: list[Any], add_special_tokens: bool, kwargs: dict[str, Any]
                 ) -> tuple[list[int], tuple[ImageInput, ...]]:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        encoded = self.processor(text=text, images=[images], return_tensors="pt",
                                 add_special_tokens=add_special_tokens, **kwargs)
        token_ids, pixels = encoded["input_ids"][0].tolist(), encoded["pixel_values"].to(self.dtype)
        sizes = [tuple(size) for size in encoded["image_sizes"].tolist()]
        tile = pixels.shape[-1]
        pinpoints = self.processor.image_processor.image_grid_pinpoints
        tiles = [image_size_to_num_patches(size, pinpoints, tile) for size in sizes]   # the whole's among them
        drop = self.processor.vision_feature_select_strategy == "default"
        lengths = [self.processor._get_number_of_features(*size, tile, tile) - drop for size in sizes]
        return token_ids, image_inputs(token_ids, [p[:n] for p, n in zip(pixels, tiles, strict=True)],
                                       self.image_token_id, sizes=sizes, lengths=lengths)


class _ExpandingProcessor(ImageProcessor):
    """A model whose transformers processor needs torchvision (for videos), which pagedllm does not install: its
    image processor (transformers', PIL's backend) and its tokenizer, each image's marker expanded here as that
    processor expands it."""

    def _load(self, path: Path) -> Any:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.images = AutoImageProcessor.from_pretrained(str(path))
        return AutoTokenizer.from_pretrained(str(path))

    def _pixels(self, images: Any, kwargs: dict[str, Any], **fixed: Any) -> Any:
        """The image processor's output for `images`, with a ValueError for an argument it does not take."""
        try:
            return self.images(images=images, return_tensors="pt", **fixed, **kwargs)
        except TypeError as exc:
            raise ValueError(f"mm_processor_kwargs {sorted(kwargs)}: {exc}") from exc

    def _token_ids(self, text: str, expansions: Sequence[str], add_special_tokens: bool) -> list[int]:
        """The token ids of `text` with its i-th marker replaced by `expansions[i]`."""
        pieces = text.split(self.image_token)
        text = pieces[0] + "".join(expansion + piece for expansion, piece in zip(expansions, pieces[1:], strict=True))
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


class TiledImageProcessor(_ExpandingProcessor):
    """SmolVLM2's (`SmolVLMForConditionalGeneration`, Idefics3's architecture): its image processor (transformers':
    the image cut into tiles, then shrunk whole) and its tokenizer; each `<image>` becomes transformers' prompt
    string for its grid of tiles (`get_image_prompt_string`: a tile's run of placeholders between its row and column
    markers, the whole's after `<global-img>`), as its transformers processor does (which needs torchvision, for
    videos). A tile's placeholders: its encoder's rows, (tile side / patch side)^2 / scale_factor^2."""

    def _load(self, path: Path) -> Any:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path))
        vision = config.vision_config
        self.tile_tokens = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor ** 2
        tokenizer = super()._load(path)
        self.markers = (getattr(tokenizer, "fake_image_token", None) or "<fake_token_around_image>",
                        getattr(tokenizer, "global_image_token", None) or "<global-img>")
        return tokenizer

    def _process(self, text: str, images: list[Any], add_special_tokens: bool, kwargs: dict[str, Any]
                 ) -> tuple[list[int], tuple[ImageInput, ...]]:
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        encoded = self._pixels([images], kwargs, return_row_col_info=True)
        token_ids = self._token_ids(text, [
            get_image_prompt_string(rows, columns, self.tile_tokens, self.markers[0], self.image_token, self.markers[1])
            for rows, columns in zip(encoded["rows"][0], encoded["cols"][0], strict=True)], add_special_tokens)
        assert bool(encoded["pixel_attention_mask"].all()), "a tile of one prompt is never padded"
        return token_ids, image_inputs(token_ids, encoded["pixel_values"][0].to(self.dtype), self.image_token_id)


class CroppedImageProcessor(_ExpandingProcessor):
    """InternVL's (`InternVLForConditionalGeneration`, the -hf checkpoints): its image processor (transformers':
    an image cropped into up to `max_patches` tiles of 448 pixels, and a thumbnail) and its tokenizer; each
    `<IMG_CONTEXT>` marker becomes `<img>`, `image_seq_length` placeholders a tile in one run, `</img>`, as its
    transformers processor does (which needs torchvision, for videos)."""

    def _load(self, path: Path) -> Any:
        from transformers import AutoConfig

        self.tile_tokens = AutoConfig.from_pretrained(str(path)).image_seq_length
        tokenizer = super()._load(path)
        self.markers = (getattr(tokenizer, "start_image_token", None) or "<img>",
                        getattr(tokenizer, "end_image_token", None) or "</img>")
        return tokenizer

    def _process(self, text: str, images: list[Any], add_special_tokens: bool, kwargs: dict[str, Any]
                 ) -> tuple[list[int], tuple[ImageInput, ...]]:
        encoded = self._pixels(images, kwargs)
        start, end = self.markers
        token_ids = self._token_ids(text, [f"{start}{self.image_token * (self.tile_tokens * tiles)}{end}"
                                           for tiles in encoded["num_patches"].tolist()], add_special_tokens)
        return token_ids, image_inputs(token_ids, encoded["pixel_values"].to(self.dtype), self.image_token_id)


class GridImageProcessor(_ExpandingProcessor):
    """Qwen2-VL's and Qwen2.5-VL's: their image processor (transformers': an image resized to whole 28-pixel
    squares within its pixel bounds, cut into 14 x 14 patches, two frames deep) and their tokenizer; each image's
    `<|image_pad|>` becomes one placeholder a 2 x 2 square of patches (`merge_size`) here, as their transformers
    processor does (which needs torchvision, which pagedllm does not install)."""

    @property
    def prompt_marker(self) -> str:
        return f"<|vision_start|>{self.image_token}<|vision_end|>"

    def _process(self, text: str, images: list[Any], add_special_tokens: bool, kwargs: dict[str, Any]
                 ) -> tuple[list[int], tuple[ImageInput, ...]]:
        if "min_pixels" in kwargs or "max_pixels" in kwargs:    # vLLM's names of the size bounds, as a size
            bounds = {"shortest_edge": kwargs.pop("min_pixels", None), "longest_edge": kwargs.pop("max_pixels", None)}
            kwargs["size"] = dict(kwargs.get("size") or self.images.size) | {k: v for k, v in bounds.items() if v}
        encoded = self._pixels(images, kwargs)
        merge = self.images.merge_size
        grids = [(t, h // merge, w // merge) for t, h, w in encoded["image_grid_thw"].tolist()]
        token_ids = self._token_ids(text, [self.image_token * math.prod(grid) for grid in grids], add_special_tokens)
        pixels = encoded["pixel_values"].to(self.dtype).split([math.prod(grid) * merge ** 2 for grid in grids])
        return token_ids, image_inputs(token_ids, pixels, self.image_token_id, grids)


class RowBreakImageProcessor(_ExpandingProcessor):
    """Mistral 3's and Pixtral-12B's (Pixtral's tower): its image processor (transformers': an image shrunk to fit
    `longest_edge`, its sides whole squares of `patch_size` x `spatial_merge_size` pixels) and its tokenizer; each
    `[IMG]` becomes a row of placeholders a row of squares, each row followed by `[IMG_BREAK]` and the last by
    `[IMG_END]`, as its transformers processor does (which needs torchvision). Those two lie within the image's run
    and keep their own embeddings (`ImageInput.row_width`)."""

    def _load(self, path: Path) -> Any:
        import json

        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path))
        self.square = config.vision_config.patch_size * getattr(config, "spatial_merge_size", 1)   # Llava's: 1
        saved = path / "processor_config.json"
        settings = json.loads(saved.read_text()) if saved.is_file() else {}
        tokenizer = super()._load(path)
        self.row_markers = (settings.get("image_break_token", "[IMG_BREAK]"),
                            settings.get("image_end_token", "[IMG_END]"))
        self.row_ends = frozenset(tokenizer.convert_tokens_to_ids(list(self.row_markers)))
        return tokenizer

    def _process(self, text: str, images: list[Any], add_special_tokens: bool, kwargs: dict[str, Any]
                 ) -> tuple[list[int], tuple[ImageInput, ...]]:
        encoded = self._pixels(images, kwargs, patch_size={"height": self.square, "width": self.square})
        sizes = [(height, width) for height, width in encoded["image_sizes"].tolist()]
        shapes = [(height // self.square, width // self.square) for height, width in sizes]
        row_break, end = self.row_markers
        token_ids = self._token_ids(text, [(self.image_token * columns + row_break) * (rows - 1) +
                                           self.image_token * columns + end for rows, columns in shapes],
                                    add_special_tokens)
        pixels = [p[:, :height, :width] for p, (height, width) in zip(encoded["pixel_values"].to(self.dtype), sizes,
                                                                      strict=True)]
        return token_ids, image_inputs(token_ids, pixels, self.image_token_id, sizes=sizes,
                                       lengths=[rows * (columns + 1) for rows, columns in shapes],
                                       row_widths=[columns for _, columns in shapes], row_ends=self.row_ends)


def anyres_max_shape(rows: int, columns: int, side: int, most_tiles: int) -> tuple[int, int]:
    """LLaVA-OneVision's bound on an image's unpadded tiles' rows x columns of features (`side` a tile's side):
    shrunk to `most_tiles` tiles' worth where they pass it by a tenth (its "anyres_max_N"), else as they are."""
    ratio = math.sqrt(rows * columns / (most_tiles * side ** 2))
    return (int(rows // ratio), int(columns // ratio)) if ratio > 1.1 else (rows, columns)


class OneVisionImageProcessor(_ExpandingProcessor):
    """LLaVA-OneVision's (`LlavaOnevisionForConditionalGeneration`): its image processor (transformers': a shrunk
    whole, then the grid of tiles that best fits the image's aspect) and its tokenizer; each `<image>` expanded here
    as its transformers processor would (which needs torchvision, for videos): alone in its prompt, an image's
    placeholders are the whole's rows, then its tiles' rows laid out as the image, unpadded to its aspect, shrunk to
    at most `anyres_max_N` tiles' worth where they pass that by a tenth, with a row break after each row; one of
    several images in a prompt is padded square and shrunk whole into one tile: its rows and one break."""

    def _load(self, path: Path) -> Any:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path))
        vision = config.vision_config
        self.tile, self.pinpoints = vision.image_size, config.image_grid_pinpoints
        self.side = vision.image_size // vision.patch_size     # patches a tile's side
        self.most_tiles = int(config.vision_aspect_ratio.removeprefix("anyres_max_"))
        self.drop = int(config.vision_feature_select_strategy == "default")
        return super()._load(path)

    def placeholders(self, height: int, width: int) -> int:
        """An image alone in its prompt: its placeholders (transformers' `_get_number_of_features`)."""
        from transformers.image_processing_utils import select_best_resolution

        best_height, best_width = select_best_resolution([height, width], self.pinpoints)
        rows, columns = self.side * (best_height // self.tile), self.side * (best_width // self.tile)
        if width / height > columns / rows:     # unpadded to the image's aspect
            rows -= (rows - int(round(height * (columns / width), 7))) // 2 * 2
        else:
            columns -= (columns - int(round(width * (rows / height), 7))) // 2 * 2
        rows, columns = anyres_max_shape(rows, columns, self.side, self.most_tiles)
        return self.side ** 2 + rows * (columns + 1) - self.drop

    def _process(self, text: str, images: list[Any], add_special_tokens: bool, kwargs: dict[str, Any]
                 ) -> tuple[list[int], tuple[ImageInput, ...]]:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        encoded = self._pixels([images], kwargs)    # one prompt's: several are padded square, each one tile
        sizes = [(height, width) for height, width in encoded["image_sizes"].tolist()]
        alone = len(images) == 1
        tiles = [image_size_to_num_patches(size, self.pinpoints, self.tile) if alone else 1 for size in sizes]
        lengths = [self.placeholders(*size) if alone else self.side ** 2 + 1 - self.drop for size in sizes]
        token_ids = self._token_ids(text, [self.image_token * n for n in lengths], add_special_tokens)
        pixels = encoded["pixel_values"].to(self.dtype)
        return token_ids, image_inputs(token_ids, [p[:n] for p, n in zip(pixels, tiles, strict=True)],
                                       self.image_token_id, sizes=sizes, lengths=lengths)
