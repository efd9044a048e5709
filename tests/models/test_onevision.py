"""LLaVA-OneVision's images (pagedllm.models.vision.OneVisionEncoder, pagedllm.multimodal.OneVisionImageProcessor):
a tiny random LlavaOnevisionForConditionalGeneration (a SigLIP tower, Qwen2 for its language model) with its image
processor, against transformers' model on the same weights and pixels: placeholders counted as transformers'
processor counts them, an image alone in its prompt (its tiles' rows shrunk to anyres_max's bound where they pass
it), several in one prompt (their wholes alone), the encoder's rows and greedy tokens."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from PIL import Image

from pagedllm import LLM, SamplingParams
from pagedllm.inputs import parse_prompt
from tests.models.test_images import _image
from tests.models.tiny import build_byte_tokenizer, tiny_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SIZE = 28       # a tile's pixels a side: 2 x 2 patches of 14
PINPOINTS = [[SIZE * rows, SIZE * columns] for rows in range(1, 4) for columns in range(1, 4)]


def _save_model(folder: Path) -> Any:
    """The tiny model (anyres_max_2: an image's tiles shrunk to two tiles' worth of rows past 2.2) and its image
    processor (grids of up to 3 x 3 tiles), saved in `folder`; returns transformers' model."""
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<image>", "<video>"]})
    config = transformers.LlavaOnevisionConfig(
        text_config=tiny_config("qwen2", initializer_range=0.5).to_dict(), image_grid_pinpoints=PINPOINTS,
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, image_size=SIZE, patch_size=14),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"), vision_aspect_ratio="anyres_max_2")
    torch.manual_seed(0)
    model = transformers.LlavaOnevisionForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.image_newline.normal_()     # transformers leaves it at 0 until trained
    model.save_pretrained(folder)
    transformers.LlavaOnevisionImageProcessorPil(size={"height": SIZE, "width": SIZE}, image_grid_pinpoints=PINPOINTS,
                                                 crop_size={"height": SIZE, "width": SIZE}).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def onevision(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, LLM]:
    folder = tmp_path_factory.mktemp("onevision")
    model = _save_model(folder)
    return folder, model, LLM(model=str(folder), dtype="float32", num_kv_blocks=256)


def _transformers_count(folder: Path, size: list[int]) -> int:
    """An image's placeholders alone in its prompt, by LlavaOnevisionProcessor's own count (the processor itself
    needs torchvision: its methods run on what they read of it)."""
    processor = transformers.LlavaOnevisionProcessor
    state = types.SimpleNamespace(image_processor=transformers.AutoImageProcessor.from_pretrained(folder),
                                  num_image_tokens=(SIZE // 14) ** 2, vision_aspect_ratio="anyres_max_2")
    state._get_unpadded_features = types.MethodType(processor._get_unpadded_features, state)
    return processor._get_number_of_features(state, *size, SIZE, SIZE)


def _hf_greedy(folder: Path, model: Any, text: str, images: list[Image.Image]) -> tuple[list[int], list[int]]:
    """transformers' prompt token ids and greedy tokens for `text` with `images`, each `<image>` expanded as
    LlavaOnevisionProcessor expands it: by its count alone, by a whole's rows and a break among several."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    pixels = dict(transformers.AutoImageProcessor.from_pretrained(folder)(images=[images], return_tensors="pt"))
    pieces = text.split("<image>")
    for size, piece in zip(pixels["image_sizes"].tolist(), pieces[1:], strict=True):
        pieces[0] += "<image>" * (_transformers_count(folder, size) if len(images) == 1 else (SIZE // 14) ** 2 + 1)
        pieces[0] += piece
    ids = tokenizer(pieces[0], return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(input_ids=ids, **pixels, max_new_tokens=8, do_sample=False)  # batch_num_images: [n]
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


def test_greedy_tokens_match_transformers_with_images(onevision: tuple[Path, Any, LLM]) -> None:
    """A small image (one tile and its whole), wide and tall ones whose 2 x 3 tiles are shrunk to anyres_max's
    bound, two images in one prompt, and a prompt without one, in one batch."""
    folder, model, llm = onevision
    cases = [("Look: <image> what?", [_image(0, 20, 24)]), ("<image> wide", [_image(1, 50, 80)]),
             ("tall <image>", [_image(2, 84, 40)]), ("<image> and <image>!", [_image(3, 60, 30), _image(4, 30, 30)]),
             ("no image at all", [])]
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text for text, images in cases]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for output, (text, images) in zip(outputs[:-1], cases, strict=False):
        prompt, tokens = _hf_greedy(folder, model, text, images)
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == tokens
    processor = llm.engine.image_processor
    assert processor.placeholders(50, 80) < 4 + 2 * 3 * 4 + 2 * 2    # shrunk: fewer than its tiles' rows
    assert outputs[1].outputs[0].token_ids != outputs[2].outputs[0].token_ids


def test_the_encoder_gives_transformers_rows(onevision: tuple[Path, Any, LLM]) -> None:
    folder, model, llm = onevision
    images = [_image(5, 80, 50)]
    processed = llm.engine.process_images(parse_prompt({"prompt": "<image>", "multi_modal_data": {"image": images}}))
    pixels = dict(transformers.AutoImageProcessor.from_pretrained(folder)(images=images, return_tensors="pt"))
    with torch.inference_mode():
        expected = model.model.get_image_features(pixel_values=pixels["pixel_values"],
                                                  image_sizes=pixels["image_sizes"],
                                                  batch_num_images=torch.tensor([1])).pooler_output
    encoder = llm.engine.runner.model.image_encoder
    for image, rows in zip(processed.image_inputs, expected, strict=True):
        torch.testing.assert_close(encoder.encode(image), rows, atol=1e-5, rtol=1e-5)
