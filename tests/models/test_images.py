"""Images in prompts (pagedllm.multimodal, pagedllm.models.vision): tiny random Llava checkpoints (a CLIP tower that
reads its next-to-last layer and drops the class token, a SigLIP tower that reads its last layer whole) and a tiny
Idefics3 (SmolVLM's architecture: each image a 2 x 2 grid of tiles and the whole, pixel-shuffled), with their
transformers processors, against transformers' models on the same weights and pixels: the image encoder's rows,
greedy tokens offline and served, prefix caching that tells images apart, chunked prefills and preemption through an
image, chat templates of both kinds, and bad input."""

from __future__ import annotations

import asyncio
import base64
import functools
import http.server
import io
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers
from anthropic import Anthropic
from PIL import Image

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache.hashing import block_key
from pagedllm.cpu import MAX_ISA_ENV, onednn_bf16_ok
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.inputs import parse_prompt
from pagedllm.models.vision import image_encoder_class, image_part_name, tile_positions
from pagedllm.pooling_params import PoolingParams
from tests.entrypoints.server_utils import start_server
from tests.models.tiny import build_byte_tokenizer, randomize_norms, save_tiny_model, tiny_config

SIZE = 56       # pixels a side: 4 x 4 patches of 14, so 16 placeholders an image (CLIP drops its class token), 4 a
#               tile for Idefics3 (2 x 2 patches a row), whose processor tiles an image 2 x 2 and adds the whole
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# a template that renders typed content parts, as Llava's own do
TYPED_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% for c in m['content'] %}{% if c['type'] == 'image' %}"
                  "<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant: {% endif %}")


def load_encoder(model: Any, folder: Path, dtype: torch.dtype = torch.float32) -> Any:
    """pagedllm's image encoder for the checkpoint in `folder`, with transformers' `model`'s weights in `dtype`."""
    config = transformers.AutoConfig.from_pretrained(folder)
    encoder = image_encoder_class(config, config.architectures[0])(config, dtype)
    encoder.load_weights((ours, tensor.to(dtype)) for name, tensor in model.state_dict().items()
                         if (ours := image_part_name(name)) is not None)
    return encoder


# where the encoder prepacks its bf16 linears for oneDNN
NEEDS_ONEDNN_BF16 = pytest.mark.skipif(
    not onednn_bf16_ok(), reason="needs oneDNN's bf16 linears (AVX-512 BF16 or AMX), the only CPUs where the encoder "
                                 "prepacks: elsewhere the plain linears run, as the float32 tests run them")


def _save_model(folder: Path, vision: str, feature_layer: int | list[int] | None = None) -> Any:
    """A tiny random Llava (the tiny Llama, a two-layer `vision` tower of SIZE pixels: "clip" or "siglip"), Idefics3
    (`vision` "idefics3") or SmolVLM2 ("smolvlm") and its processor, saved in `folder`; returns transformers'
    model."""
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<image>",
                                                                "<fake_token_around_image>", "<global-img>"]})
    if vision in ("idefics3", "smolvlm"):
        return _save_idefics3(folder, tokenizer, vision == "smolvlm")
    clip = vision == "clip"
    tower = dict(model_type="clip_vision_model" if clip else "siglip_vision_model", hidden_size=32,
                 intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=SIZE, patch_size=14)
    config = transformers.LlavaConfig(
        text_config=tiny_config("llama-gqa", initializer_range=0.5).to_dict(), vision_config=tower,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default" if clip else "full",
        vision_feature_layer=feature_layer if feature_layer is not None else -2 if clip else -1)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    images = (transformers.CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})
              if clip else transformers.SiglipImageProcessor(size={"height": SIZE, "width": SIZE}))
    transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14, image_token="<image>",
                                vision_feature_select_strategy=config.vision_feature_select_strategy,
                                num_additional_image_tokens=1 if clip else 0).save_pretrained(folder)
    return model


def _save_idefics3(folder: Path, tokenizer: Any, smolvlm: bool = False) -> Any:
    """A tiny random Idefics3 and its processor, or (`smolvlm`) SmolVLM2, Idefics3's architecture under SmolVLM's
    names, with its image processor and tokenizer but no processor (SmolVLM's needs torchvision): the tiny Llama, a
    two-layer tower of SIZE-pixel tiles, 4 placeholders a tile, each image a 2 x 2 grid of tiles and the whole."""
    config = (transformers.SmolVLMConfig if smolvlm else transformers.Idefics3Config)(
        text_config=tiny_config("llama-gqa", initializer_range=0.5).to_dict(), scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=SIZE, patch_size=14))
    torch.manual_seed(0)
    architecture = transformers.SmolVLMForConditionalGeneration if smolvlm else \
        transformers.Idefics3ForConditionalGeneration
    model = architecture(config).eval()
    model.save_pretrained(folder)
    size = dict(size={"longest_edge": 2 * SIZE}, max_image_size={"longest_edge": SIZE})
    if smolvlm:
        transformers.SmolVLMImageProcessor(**size).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    else:
        transformers.Idefics3Processor(image_processor=transformers.Idefics3ImageProcessor(**size),
                                       tokenizer=tokenizer, image_seq_len=4).save_pretrained(folder)
    return model


def _save_llava_next(folder: Path) -> Any:
    """A tiny random LLaVA-NeXT (the tiny Llama, a two-layer CLIP tower of SIZE-pixel tiles read at its next-to-last
    layer without the class token, 16 placeholders a tile; grids of 1 x 2, 2 x 1 and 2 x 2 tiles) and its processor,
    saved in `folder`; returns transformers' model."""
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<image>"]})
    pinpoints = [[SIZE, 2 * SIZE], [2 * SIZE, SIZE], [2 * SIZE, 2 * SIZE]]
    config = transformers.LlavaNextConfig(
        text_config=tiny_config("llama-gqa", initializer_range=0.5).to_dict(), image_grid_pinpoints=pinpoints,
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=SIZE, patch_size=14),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = transformers.LlavaNextForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.image_newline.normal_()     # transformers leaves it at 0 until trained
    model.save_pretrained(folder)
    images = transformers.LlavaNextImageProcessor(size={"shortest_edge": SIZE}, image_grid_pinpoints=pinpoints,
                                                  crop_size={"height": SIZE, "width": SIZE})
    transformers.LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14, image_token="<image>",
                                    vision_feature_select_strategy="default",
                                    num_additional_image_tokens=1).save_pretrained(folder)
    return model


def test_llava_next_unpads_each_images_tiles_as_transformers_does(tmp_path: Path) -> None:
    """LLaVA-NeXT: wide, tall, square and small images, two in one prompt, each its tiles' rows unpadded to its
    aspect with a row break after each row: the prompt, the encoder's rows and greedy tokens as transformers'."""
    model = _save_llava_next(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=256)
    cases = [("Look: <image> what?", [_image(100, 40, 110)]), ("<image> and <image>", [_image(101, 110, 40),
                                                                                         _image(102, 100, 90)]),
             ("small: <image>", [_image(103, 20, 20)])]
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in cases],
                           GREEDY, use_tqdm=False)
    for output, (text, images) in zip(outputs, cases):
        prompt, tokens = _hf_greedy(tmp_path, model, text, images)
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == tokens
    processed = llm.engine.process_images(parse_prompt(
        {"prompt": cases[1][0], "multi_modal_data": {"image": cases[1][1]}}))
    encoder = llm.engine.runner.model.image_encoder
    processor = transformers.AutoProcessor.from_pretrained(tmp_path)
    inputs = processor(text=cases[1][0], images=[cases[1][1]], return_tensors="pt")
    with torch.inference_mode():
        expected = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                  image_sizes=inputs["image_sizes"]).pooler_output
        for image, rows in zip(processed.image_inputs, expected):
            torch.testing.assert_close(encoder.encode(image), rows, atol=1e-5, rtol=1e-5)


def _save_gemma3(folder: Path) -> Any:
    """A tiny random Gemma 3 (the tiny Gemma 3 text model: a local layer with a window of 12 and a global one; a
    two-layer SigLIP of SIZE pixels, its 4 x 4 patches pooled into 4 placeholders an image; the norms random) and its
    processor (`<start_of_image>` marks an image), saved in `folder`; returns transformers' model."""
    from transformers import PreTrainedTokenizerFast

    build_byte_tokenizer().save_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<|im_end|>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]})
    ids = tokenizer.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    config = transformers.Gemma3Config(
        text_config=tiny_config("gemma3", initializer_range=0.5).to_dict(), mm_tokens_per_image=4,
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, image_size=SIZE, patch_size=14),
        boi_token_index=ids[0], eoi_token_index=ids[1], image_token_index=ids[2])
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomize_norms(model)
    model.save_pretrained(folder)
    images = transformers.Gemma3ImageProcessor(size={"height": SIZE, "width": SIZE})
    processor = transformers.Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=4)
    processor.save_pretrained(folder)
    return model


def test_gemma3s_image_placeholders_see_each_other_as_in_transformers(tmp_path: Path) -> None:
    """Gemma 3: an image's placeholders attend to each other both ways (the rest causally), so a step computes each
    image whole: greedy tokens as transformers' model gives them, whole prompts and in chunks of 5 tokens (which the
    scheduler stops before each image of 4 they would cut); the encoder's rows too; a step too small for an image is
    refused at start."""
    model = _save_gemma3(tmp_path)
    cases = [("Look: <start_of_image> what?", [_image(110)]), ("<start_of_image> and <start_of_image>!",
                                                               [_image(111, 70, 30), _image(112)])]
    expected = [_hf_greedy(tmp_path, model, text, images) for text, images in cases]
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in cases]
    for chunk in (2048, 5):
        llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=chunk)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outputs] == expected
    # the prompt's logprobs, which the image's rows' attention moves (its greedy tokens are too few to tell)
    processor = transformers.AutoProcessor.from_pretrained(tmp_path)
    inputs = processor(text=cases[1][0], images=[cases[1][1]], return_tensors="pt")
    with torch.inference_mode():
        logits = model(**inputs).logits[0].float()
    ids = inputs["input_ids"][0]
    theirs = torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None])[:, 0]
    scored = llm.generate(prompts[1], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ours = torch.tensor([d[t].logprob for d, t in zip(scored.prompt_logprobs[1:], scored.prompt_token_ids[1:])])
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    pixels = torch.randn(2, 3, SIZE, SIZE)
    with torch.inference_mode():
        rows = model.model.get_image_features(pixel_values=pixels).pooler_output
    torch.testing.assert_close(load_encoder(model, tmp_path)(pixels), rows, atol=1e-5, rtol=1e-5)
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": cases[0][1][0]},
                                         {"type": "text", "text": "What?"}]}]
    chatted = llm.chat(chat, GREEDY, use_tqdm=False)[0]      # the processor's marker, expanded into 4 placeholders
    assert chatted.prompt_token_ids.count(model.config.image_token_id) == 4
    with pytest.raises(ValueError, match="must hold them"):
        LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=3)


def _save_internvl(folder: Path, rms: bool = False) -> Any:
    """A tiny random InternVL (-hf layout: the tiny Qwen2, a two-layer InternViT of SIZE-pixel tiles with layer scales,
    q/k norms and LayerNorms or (`rms`) RMSNorms, 4 placeholders a tile), its image processor (up to 4 tiles and a
    thumbnail) and tokenizer, saved in `folder` without a processor (InternVL's needs torchvision); returns
    transformers' model."""
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<img>", "</img>",
                                                                "<IMG_CONTEXT>"]})
    config = transformers.InternVLConfig(
        text_config=tiny_config("qwen2", initializer_range=0.5).to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=4,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=SIZE, patch_size=14, use_qk_norm=True, layer_scale_init_value=0.5,
                           norm_type="rms_norm" if rms else "layer_norm", initializer_range=0.5))
    torch.manual_seed(0)
    model = transformers.InternVLForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    transformers.GotOcr2ImageProcessor(size={"height": SIZE, "width": SIZE}, crop_to_patches=True,
                                       max_patches=4).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.mark.parametrize("rms", [False, True])
def test_internvl_encoder_gives_transformers_rows(tmp_path: Path, rms: bool) -> None:
    model = _save_internvl(tmp_path, rms)
    encoder = load_encoder(model, tmp_path)
    pixels = torch.randn(3, 3, SIZE, SIZE)
    with torch.inference_mode():
        expected = model.model.get_image_features(pixel_values=pixels).pooler_output
    torch.testing.assert_close(encoder(pixels), expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5)


def test_internvl_reads_images_without_its_transformers_processor(tmp_path: Path) -> None:
    """InternVL: each `<IMG_CONTEXT>` expanded into `<img>`, its tiles' placeholders, `</img>`, as transformers'
    processor would; greedy tokens as transformers' model gives them."""
    model = _save_internvl(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=128)
    images, text = [_image(90), _image(91, 70, 30)], "Look: <IMG_CONTEXT> and <IMG_CONTEXT>, what are they?"
    output = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
    pixels = transformers.AutoImageProcessor.from_pretrained(tmp_path)(images=images, return_tensors="pt")
    pieces = text.split("<IMG_CONTEXT>")
    expanded = pieces[0] + "".join(f"<img>{'<IMG_CONTEXT>' * 4 * tiles}</img>{piece}"
                                   for tiles, piece in zip(pixels["num_patches"].tolist(), pieces[1:]))
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path)(expanded, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(input_ids=ids, pixel_values=pixels["pixel_values"], max_new_tokens=8, do_sample=False)
    assert output.prompt_token_ids == ids[0].tolist()
    assert pixels["num_patches"].tolist() == [1, 3]      # one tile; 2 tiles and the thumbnail
    assert output.outputs[0].token_ids == out[0, ids.shape[1]:].tolist()


def _image(seed: int, height: int = 40, width: int = 50) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module", params=["clip", "siglip", "idefics3"])
def llava(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, LLM]:
    folder = tmp_path_factory.mktemp(f"llava-{request.param}")
    model = _save_model(folder, request.param)
    return folder, model, LLM(model=str(folder), dtype="float32", num_kv_blocks=128)


def _hf_greedy(folder: Path, model: Any, text: str, images: list[Image.Image], max_tokens: int = 8,
               add_special_tokens: bool = True, **processor_kwargs: Any) -> tuple[list[int], list[int]]:
    """transformers' prompt token ids and greedy tokens for `text` with `images`."""
    processor = transformers.AutoProcessor.from_pretrained(folder)
    inputs = processor(text=text, images=[images], return_tensors="pt", add_special_tokens=add_special_tokens,
                       **processor_kwargs)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


@pytest.mark.parametrize("vision,feature_layer,rows", [("clip", None, 16), ("siglip", None, 16),
                                                       ("clip", [-3, -1], 16), ("idefics3", None, 4)])
def test_the_image_encoder_gives_transformers_rows(tmp_path: Path, vision: str, feature_layer: Any,
                                                   rows: int) -> None:
    model = _save_model(tmp_path, vision, feature_layer)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    encoder = load_encoder(model, tmp_path)
    pixels = torch.randn(2, 3, SIZE, SIZE)
    with torch.inference_mode():
        if vision == "idefics3":
            expected = model.model.get_image_features(pixel_values=pixels[None])
        else:
            expected = model.model.get_image_features(
                pixel_values=pixels, vision_feature_layer=feature_layer or config.vision_feature_layer,
                vision_feature_select_strategy=config.vision_feature_select_strategy)
    expected = torch.cat(list(expected.pooler_output)).reshape(2, rows, 64)
    torch.testing.assert_close(encoder(pixels), expected, atol=1e-5, rtol=1e-5)


def test_greedy_tokens_match_transformers_with_images(llava: tuple[Path, Any, LLM]) -> None:
    folder, model, llm = llava
    cases = [("Look: <image> what is it?", [_image(0)]), ("<image> and <image>, side by side", [_image(1), _image(2)]),
             ("Look: <image> what is it?", [_image(3, 70, 30)])]
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in cases],
                           GREEDY, use_tqdm=False)
    expected = [_hf_greedy(folder, model, text, images) for text, images in cases]
    for output, (prompt, tokens) in zip(outputs, expected):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == tokens
    assert expected[0][1] != expected[2][1], "the same text with another image must read otherwise"


def test_the_prefix_cache_tells_images_apart(llava: tuple[Path, Any, LLM]) -> None:
    """Three requests one after another, the same text and image A, B, then A: B reuses only the blocks before the
    image; A's second run reuses its image's blocks too. Each gives transformers' tokens."""
    folder, model, llm = llava
    text = "a long shared preamble before the picture: <image> now describe it"
    outputs = [llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
               for image in (_image(4), _image(5), _image(4))]
    placeholders = [i for i, t in enumerate(outputs[0].prompt_token_ids) if t == llm.engine.hf_config.image_token_id]
    block_size = llm.engine.config.cache.block_size
    assert outputs[1].num_cached_tokens == placeholders[0] // block_size * block_size
    assert outputs[2].num_cached_tokens > placeholders[-1]
    for output, image in zip(outputs, (_image(4), _image(5), _image(4))):
        assert output.outputs[0].token_ids == _hf_greedy(folder, model, text, [image])[1]


def test_an_images_hash_goes_into_the_block_its_placeholders_start_in() -> None:
    tokens = list(range(12))
    plain = [block_key(tokens, i, 4, None, ()) for i in range(3)]
    with_image = [block_key(tokens, i, 4, None, (), ((5, "abc"),)) for i in range(3)]
    assert [k.extra_keys for k in with_image] == [(), ("abc",), ()]
    assert with_image[0] == plain[0] and with_image[1] != plain[1]


def test_chunked_prefills_and_preemption_through_an_image_change_no_token(llava: tuple[Path, Any, LLM]) -> None:
    folder, _, llm = llava
    prompts = [{"prompt": f"request {i}: <image> tell", "multi_modal_data": {"image": _image(10 + i)}}
               for i in range(6)]
    alone = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in alone]
    # chunks of 8 tokens cut each image's (and tile's) placeholders; a pool with room for one request at a time
    blocks = -(-(max(len(o.prompt_token_ids) for o in alone) + 8) // 8) + 2
    # (each admitted on its first chunk, not once its whole prompt fits: so that they preempt each other)
    squeezed = LLM(model=str(folder), dtype="float32", num_kv_blocks=blocks, max_num_batched_tokens=8,
                   enable_prefix_caching=False, max_num_encoder_input_tokens=4,     # an image (a tile) a step
                   scheduler_reserve_full_isl=False)
    twice = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)    # its child carries the images
    outputs = squeezed.generate(prompts, [twice] + [GREEDY] * 5, use_tqdm=False)
    assert squeezed.engine.scheduler.num_preemptions > 0
    assert [o.outputs[-1].token_ids for o in outputs] == expected
    assert outputs[0].outputs[0].token_ids == expected[0]


def test_the_async_engine_takes_a_prompt_with_images(llava: tuple[Path, Any, LLM]) -> None:
    folder, model, llm = llava
    text, image = "Look: <image> what is it?", _image(50)

    async def serve() -> Any:
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            return [o async for o in engine.generate("raw", {"prompt": text, "multi_modal_data": {"image": image}},
                                                     GREEDY)][-1]
        finally:
            engine.shutdown()

    output = asyncio.run(asyncio.wait_for(serve(), 30))
    assert output.outputs[0].token_ids == _hf_greedy(folder, model, text, [image])[1]


def test_chat_renders_images_in_string_and_typed_templates(llava: tuple[Path, Any, LLM]) -> None:
    folder, model, llm = llava
    image = _image(20)
    conversation = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                 {"type": "image_url", "image_url": {"url": _data_url(image)}}]}]
    chatml = "<|im_start|>user\nWhat is it?\n<image><|im_end|>\n<|im_start|>assistant\n"
    typed = "user: What is it?<image>\nassistant: "     # the newline after {% endfor %} trimmed, as transformers does
    for template, text in ((None, chatml), (TYPED_TEMPLATE, typed)):
        output = llm.chat(conversation, GREEDY, chat_template=template, use_tqdm=False)[0]
        prompt, tokens = _hf_greedy(folder, model, text, [image], add_special_tokens=False)
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == tokens
    text_only = [{"role": "user", "content": "What is it?"}]   # a typed template gets a text part, not a string
    assert llm.chat(text_only, GREEDY, chat_template=TYPED_TEMPLATE, use_tqdm=False)[0].prompt_token_ids == \
        llm.get_tokenizer().encode("user: What is it?assistant: ", add_special_tokens=False)
    pil = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                        {"type": "image_pil", "image_pil": image}]}]
    assert llm.chat(pil, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        _hf_greedy(folder, model, chatml, [image], add_special_tokens=False)[1]


def served_chat(running: Any, content: list[dict[str, Any]]) -> str:
    """The server's greedy reply, 8 tokens, to a user message of `content`."""
    reply = running.client().chat.completions.create(model=running.model_name, temperature=0.0, max_tokens=8,
                                                     messages=[{"role": "user", "content": content}],
                                                     extra_body={"ignore_eos": True})
    return reply.choices[0].message.content


def test_the_server_reads_a_chats_images(llava: tuple[Path, Any, LLM]) -> None:
    folder, _, llm = llava
    image = _image(30)
    content = [{"type": "image_url", "image_url": {"url": _data_url(image)}}, {"type": "text", "text": "Describe."}]
    offline = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)[0].outputs[0]
    running = start_server(llm.engine, api_key=None)
    try:
        client = running.client()
        assert served_chat(running, content) == offline.text
        # the Responses API's input_image, as chat's image_url
        response = client.responses.create(model=running.model_name, temperature=0.0, max_output_tokens=8, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": _data_url(image)},
                                         {"type": "input_text", "text": "Describe."}]}])
        chat = client.chat.completions.create(model=running.model_name, temperature=0.0, max_tokens=8,
                                              messages=[{"role": "user", "content": content}])
        assert response.output_text == chat.choices[0].message.content
        # the Messages API's image blocks as chat's image_url
        data = _data_url(image).removeprefix("data:image/png;base64,")
        anthropic = Anthropic(base_url=running.base_url, api_key="none", max_retries=0, timeout=60)
        blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                  {"type": "text", "text": "Describe."}]
        message = anthropic.messages.create(model=running.model_name, max_tokens=8, extra_body={"temperature": 0.0},
                                            messages=[{"role": "user", "content": blocks}])
        assert message.content[0].text == chat.choices[0].message.content
        # /tokenize counts the image's placeholders, as the chat's prompt holds them
        tokenized = httpx.post(f"{running.base_url}/tokenize", json={
            "model": running.model_name, "messages": [{"role": "user", "content": content}]}, timeout=30).json()
        assert tokenized["count"] == chat.usage.prompt_tokens and \
            tokenized["tokens"].count(llm.engine.hf_config.image_token_id) > 0
        broken = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]
        with pytest.raises(Exception, match="not a readable image"):
            client.chat.completions.create(model=running.model_name, max_tokens=4,
                                           messages=[{"role": "user", "content": broken}])
    finally:
        running.stop()


def test_bad_image_input_is_a_clear_error(llava: tuple[Path, Any, LLM], tmp_path: Path) -> None:
    _, _, llm = llava
    image = _image(40)
    with pytest.raises(ValueError, match="1 <image> markers for 2 images"):
        llm.generate({"prompt": "one <image>", "multi_modal_data": {"image": [image, image]}}, GREEDY)
    with pytest.raises(ValueError, match="PIL image"):
        llm.generate({"prompt": "one <image>", "multi_modal_data": {"image": "cat.png"}}, GREEDY)
    with pytest.raises(ValueError, match="images only"):
        llm.generate({"prompt": "one", "multi_modal_data": {"video": image}}, GREEDY)
    with pytest.raises(ValueError, match="not with 'prompt_token_ids'"):
        llm.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": image}}, GREEDY)
    with pytest.raises(ValueError, match="embeds and classifies text only"):
        llm.engine.add_request("embed", {"prompt": "<image>", "multi_modal_data": {"image": image}},
                               PoolingParams())
    with pytest.raises(ValueError, match="not in beam search"):
        llm.beam_search([{"prompt": "<image>", "multi_modal_data": {"image": image}}], BeamSearchParams(2, 4))
    local = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///tmp/cat.png"}}]}]
    with pytest.raises(ValueError, match="the server reads no local files .*--allowed-local-media-path"):
        llm.chat(local, GREEDY)
    with pytest.raises(ValueError, match="data: URL .* an http.* or a file:// URL"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://x/cat.png"}}]}],
                 GREEDY)
    assert not llm.engine.has_unfinished_requests()
    text_only = LLM(model=str(save_tiny_model(tmp_path)[0]), dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="takes no images"):
        text_only.generate({"prompt": "<image>", "multi_modal_data": {"image": image}}, GREEDY)
    with pytest.raises(ValueError, match="takes no images"):
        text_only.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image}]}], GREEDY)


def test_a_tiles_positions_are_transformers_buckets() -> None:
    """Idefics3 buckets each patch's fractional coordinates in float32, which is not always the row-major order: a
    side of 25 patches is one where it is not."""
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    side = 25
    embeddings = Idefics3VisionEmbeddings(transformers.Idefics3VisionConfig(hidden_size=1, image_size=side * 14,
                                                                            patch_size=14))
    with torch.no_grad():   # each patch's embedding: its position id
        embeddings.patch_embedding.weight.zero_()
        embeddings.patch_embedding.bias.zero_()
        embeddings.position_embedding.weight.copy_(torch.arange(side * side, dtype=torch.float32)[:, None])
        rows = embeddings(torch.zeros(1, 3, side * 14, side * 14), torch.ones(1, side, side, dtype=torch.bool))
    assert torch.equal(rows[0, :, 0].long(), tile_positions(side))
    assert not torch.equal(tile_positions(side), torch.arange(side * side))


def test_processor_arguments_for_the_engine_and_for_a_prompt(tmp_path: Path) -> None:
    """Idefics3 without image splitting (the engine's mm_processor_kwargs): one tile an image, 4 placeholders; a
    prompt's own arguments over the engine's: the 2 x 2 tiles and the whole again, 20."""
    model = _save_model(tmp_path, "idefics3")
    text, image = "Look: <image> what is it?", _image(60)
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64,
              mm_processor_kwargs={"do_image_splitting": False})
    whole, tiled = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}},
                                 {"prompt": text, "multi_modal_data": {"image": image},
                                  "mm_processor_kwargs": {"do_image_splitting": True}}], GREEDY, use_tqdm=False)
    image_token = llm.engine.hf_config.image_token_id
    assert [o.prompt_token_ids.count(image_token) for o in (whole, tiled)] == [4, 20]
    for output, splitting in ((whole, False), (tiled, True)):
        prompt, tokens = _hf_greedy(tmp_path, model, text, [image], do_image_splitting=splitting)
        assert output.prompt_token_ids == prompt and output.outputs[0].token_ids == tokens
    conversation = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}]}]
    chatted = llm.chat(conversation, GREEDY, mm_processor_kwargs={"do_image_splitting": True}, use_tqdm=False)[0]
    assert chatted.prompt_token_ids.count(image_token) == 20
    # generate's own (vLLM's), over the engine's and under a prompt's; a prompt without images runs as it is
    called = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}},
                           {"prompt": text, "multi_modal_data": {"image": image},
                            "mm_processor_kwargs": {"do_image_splitting": False}}, "no image"], GREEDY,
                          use_tqdm=False, mm_processor_kwargs={"do_image_splitting": True})
    assert [o.prompt_token_ids.count(image_token) for o in called] == [20, 4, 0]
    with pytest.raises(ValueError, match="beside 'multi_modal_data'"):
        llm.generate({"prompt": text, "mm_processor_kwargs": {"do_image_splitting": True}}, GREEDY)


def test_the_image_encoder_runs_float32_where_bf16_would_be_emulated(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _save_model(tmp_path, "siglip")
    monkeypatch.setenv(MAX_ISA_ENV, "avx2")     # as on an AVX2 CPU: no bf16 linears in oneDNN
    llm = LLM(model=str(tmp_path), dtype="bfloat16", num_kv_blocks=64)
    assert llm.engine.runner.model.image_encoder.tower.patch_embedding.weight.dtype == torch.float32
    processed = llm.engine.process_images(parse_prompt({"prompt": "<image>", "multi_modal_data": {"image": _image(1)}}))
    assert processed.image_inputs[0].pixels.dtype == torch.bfloat16      # held in the model's dtype
    output = llm.generate({"prompt": "Look: <image>", "multi_modal_data": {"image": _image(70)}}, GREEDY,
                          use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == GREEDY.max_tokens


@NEEDS_ONEDNN_BF16
@pytest.mark.parametrize("vision", ["clip", "siglip", "idefics3"])
def test_the_prepacked_encoder_gives_the_plain_encoders_rows(tmp_path: Path, vision: str) -> None:
    """bf16 weights reordered for oneDNN once, SigLIP's GELU inside fc1's call (CLIP's quick GELU apart)."""
    model = _save_model(tmp_path, vision)
    plain, packed = (load_encoder(model, tmp_path, torch.bfloat16) for _ in range(2))
    packed.prepack()
    assert packed.tower.layers[0].fc1.weight.is_mkldnn and not plain.tower.layers[0].fc1.weight.is_mkldnn
    pixels = torch.randn(2, 3, SIZE, SIZE)
    expected = plain(pixels).float()
    torch.testing.assert_close(packed(pixels).float(), expected, atol=0.03 * expected.abs().max().item(), rtol=0.03)


def test_an_image_url_over_http_is_fetched(llava: tuple[Path, Any, LLM], tmp_path: Path, monkeypatch) -> None:
    """An http(s) image URL gives the same reply as the same image in a data: URL, as does a file:// URL under the
    allowed folder; one that cannot be fetched, or is on a host not allowed, is a clear error."""
    _, _, llm = llava
    image = _image(80)
    image.save(tmp_path / "cat.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        def chat(url: str) -> list[int]:
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe."}]
            return llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids

        assert chat(f"{base}/cat.png") == chat(_data_url(image))
        with pytest.raises(ValueError, match="could not be fetched"):
            chat(f"{base}/missing.png")
        # vLLM's allowed_local_media_path: file:// URLs of the files under that folder give the same reply
        monkeypatch.setattr(llm.engine.config.model, "allowed_local_media_path", str(tmp_path))
        assert chat((tmp_path / "cat.png").as_uri()) == chat(_data_url(image))
        # and allowed_media_domains: another host's URL is refused before it is fetched
        monkeypatch.setattr(llm.engine.config.model, "allowed_media_domains", ["images.example.com"])
        with pytest.raises(ValueError, match="is on 127.0.0.1, and the server reads images from images.example.com"):
            chat(f"{base}/cat.png")
    finally:
        server.shutdown()


def test_data_parallel_replicas_refuse_images_offline(tmp_path: Path) -> None:
    _save_model(tmp_path, "siglip")
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=32, data_parallel_size=2)
    image = _image(90)
    with pytest.raises(ValueError, match="one engine"):
        llm.generate({"prompt": "Look: <image>", "multi_modal_data": {"image": image}}, GREEDY)
    with pytest.raises(ValueError, match="one engine"):
        llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image}]}], GREEDY)
    assert llm.generate("Look:", GREEDY, use_tqdm=False)[0].outputs[0].token_ids     # text still runs


def test_the_servers_data_parallel_replicas_take_a_chats_images(tmp_path: Path) -> None:
    """Served, the chat's images are processed once, in front of the replicas; the replica the router picks runs
    them, with the tokens one engine gives."""
    from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
    from pagedllm.engine.data_parallel import build_async_engine

    _save_model(tmp_path, "siglip")
    image = _image(95)
    content = [{"type": "image_url", "image_url": {"url": _data_url(image)}}, {"type": "text", "text": "Describe."}]
    one = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64)
    offline = one.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)[0].outputs[0]
    engine = build_async_engine(EngineConfig(model=ModelConfig(model=str(tmp_path), dtype="float32"),
                                             cache=CacheConfig(num_blocks=64),
                                             parallel=ParallelConfig(data_parallel_size=2)))
    running = start_server(engine, api_key=None)
    try:
        reply = running.client().chat.completions.create(
            model=running.model_name, temperature=0.0, max_tokens=8, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": content}])
        assert reply.choices[0].message.content == offline.text
    finally:
        running.stop()


def test_limit_mm_per_prompt_refuses_more_images_and_zero_serves_text_only(tmp_path: Path) -> None:
    """vLLM's limit_mm_per_prompt: a prompt past the image limit is refused before any of its images is read
    (offline, in a chat, on the server); image 0 (language_model_only) loads no encoder, and the checkpoint generates
    text as before."""
    _save_model(tmp_path, "clip")
    image = _image(70)
    limited = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64, limit_mm_per_prompt={"image": 1})
    one = limited.generate({"prompt": "look: <image>", "multi_modal_data": {"image": image}}, GREEDY)[0]
    assert one.prompt_token_ids.count(limited.engine.hf_config.image_token_id) == 16
    with pytest.raises(ValueError, match="2 images, and a prompt may hold at most 1 "):
        limited.generate({"prompt": "<image> <image>", "multi_modal_data": {"image": [image, image]}}, GREEDY)
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}  # never read
    with pytest.raises(ValueError, match="at most 1 "):
        limited.chat([{"role": "user", "content": [broken, broken]}], GREEDY)
    running = start_server(limited.engine, api_key=None)
    try:
        with pytest.raises(openai.BadRequestError, match="at most 1 ") as refused:
            served_chat(running, [broken, broken])
        assert refused.value.body["param"] == "messages"
    finally:
        running.stop()
    text = limited.generate("Hello there", GREEDY)[0].outputs[0].token_ids
    limited.close()
    off = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64, language_model_only=True)  # {"image": 0}
    assert off.engine.image_processor is None
    assert getattr(off.engine.runner.model, "image_encoder", None) is None
    assert off.generate("Hello there", GREEDY)[0].outputs[0].token_ids == text
    with pytest.raises(ValueError, match="images are off"):
        off.generate({"prompt": "look: <image>", "multi_modal_data": {"image": image}}, GREEDY)
    with pytest.raises(ValueError, match="images are off"):
        off.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image}]}], GREEDY)
