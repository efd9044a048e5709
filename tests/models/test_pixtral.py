"""Pixtral's towers (pagedllm.models.vision.PixtralEncoder, pagedllm.multimodal.RowBreakImageProcessor): a tiny random
Mistral3ForConditionalGeneration (Mistral-Small-3.1's layout) and a LlavaForConditionalGeneration of a Pixtral tower
(Pixtral-12B's), each with its image processor, against transformers' models on the same weights and pixels: the
encoder's rows for images of several shapes, the prompts' rows of placeholders with their [IMG_BREAK] and [IMG_END],
greedy tokens for a batch of images, chunked prefills and preemption cutting an image's rows, prefix hits, chat and
the server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from PIL import Image

from pagedllm import LLM, SamplingParams
from tests.entrypoints.server_utils import start_server
from tests.models.test_images import NEEDS_ONEDNN_BF16, _data_url, _image, load_encoder, served_chat
from tests.models.tiny import build_byte_tokenizer, tiny_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PATCH = 8
SQUARES = {"mistral3": 2 * PATCH, "pixtral": PATCH}    # pixels a placeholder's side: 2 x 2 patches, or one
TEMPLATE = ("{% for m in messages %}[INST]{% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for c in m['content'] %}{% if c['type'] == 'image' %}[IMG]{% else %}{{ c['text'] }}{% endif %}"
            "{% endfor %}{% endif %}[/INST]{% endfor %}")


def _save_model(folder: Path, kind: str) -> Any:
    """A tiny random Mistral 3 (`kind` "mistral3": 2 x 2 patches a placeholder; "ministral3": the same with the tiny
    Ministral 3 for its language model) or Pixtral-12B (a Llava of a Pixtral tower, "pixtral": a patch a
    placeholder, the projector's biases), the tiny Mistral for its language model, a two-layer Pixtral tower of
    8-pixel patches, images up to 64 pixels a side; its image processor and a tokenizer with Pixtral's image
    tokens, saved in `folder`; returns transformers' model."""
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<|im_end|>", "[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]", "[/INST]"]})
    tokenizer.chat_template = TEMPLATE
    text = tiny_config("ministral3" if kind == "ministral3" else "mistral", initializer_range=0.5)
    parts = dict(text_config=text.to_dict(),
                 vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, image_size=64, patch_size=PATCH, head_dim=16,
                                    hidden_act="silu", initializer_range=0.5),
                 image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"))
    if kind in ("mistral3", "ministral3"):
        config: Any = transformers.Mistral3Config(**parts, spatial_merge_size=2)
    else:
        config = transformers.LlavaConfig(**parts, vision_feature_select_strategy="full", vision_feature_layer=-1,
                                          multimodal_projector_bias=True)
    torch.manual_seed(0)
    architecture = transformers.Mistral3ForConditionalGeneration if kind in ("mistral3", "ministral3") else \
        transformers.LlavaForConditionalGeneration
    model = architecture(config).eval()
    model.save_pretrained(folder)
    transformers.PixtralImageProcessorPil(patch_size=PATCH, size={"longest_edge": 64}).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=list(SQUARES))
def pixtral(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, LLM]:
    folder = tmp_path_factory.mktemp(request.param)
    model = _save_model(folder, request.param)
    return folder, model, LLM(model=str(folder), dtype="float32", num_kv_blocks=256)


def _square(model: Any) -> int:
    return SQUARES[model.config.model_type if model.config.model_type == "mistral3" else "pixtral"]


def _pixels(folder: Path, model: Any, images: list[Image.Image]) -> dict[str, Any]:
    """transformers' image processor's pixels and sizes, in whole squares of a placeholder's pixels, as the model's
    PixtralProcessor asks for them."""
    processor = transformers.AutoImageProcessor.from_pretrained(folder)
    square = _square(model)
    return dict(processor(images=images, patch_size={"height": square, "width": square}, return_tensors="pt"))


def _hf_greedy(folder: Path, model: Any, text: str, images: list[Image.Image]) -> tuple[list[int], list[int]]:
    """transformers' prompt token ids and greedy tokens for `text` with `images`: each [IMG] expanded as
    PixtralProcessor expands it (which needs torchvision: not installed here), a row of [IMG] a row of squares,
    [IMG_BREAK] after each row, [IMG_END] after the last."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    pixels, square = _pixels(folder, model, images) if images else {}, _square(model)
    pieces = text.split("[IMG]")
    for (height, width), piece in zip(pixels.get("image_sizes", torch.empty(0, 2)).tolist(), pieces[1:]):
        rows = [["[IMG]"] * (width // square) + ["[IMG_BREAK]"] for _ in range(height // square)]
        rows[-1][-1] = "[IMG_END]"
        pieces[0] += "".join(token for row in rows for token in row) + piece
    ids = tokenizer(pieces[0], return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(input_ids=ids, **pixels, max_new_tokens=8, do_sample=False)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("kind", list(SQUARES))
def test_the_encoder_gives_transformers_rows(tmp_path: Path, kind: str) -> None:
    model = _save_model(tmp_path, kind)
    encoder = load_encoder(model, tmp_path)
    images = [_image(0, 64, 64), _image(1, 30, 64), _image(2, 64, 20), _image(3, 50, 37)]
    encoded, square = _pixels(tmp_path, model, images), SQUARES[kind]
    with torch.inference_mode():
        expected = model.model.get_image_features(**encoded).pooler_output
    for pixels, (height, width), rows in zip(encoded["pixel_values"], encoded["image_sizes"].tolist(), expected,
                                             strict=True):
        assert rows.shape[0] == (height // square) * (width // square)
        torch.testing.assert_close(encoder(pixels[:, :height, :width]), rows, atol=1e-5 * rows.abs().max().item(),
                                   rtol=1e-5)


@NEEDS_ONEDNN_BF16
def test_the_prepacked_encoder_gives_the_plain_encoders_rows(tmp_path: Path) -> None:
    model = _save_model(tmp_path, "mistral3")
    plain, packed = load_encoder(model, tmp_path, torch.bfloat16), load_encoder(model, tmp_path, torch.bfloat16)
    packed.prepack()
    pixels = _pixels(tmp_path, model, [_image(4, 48, 64)])["pixel_values"][0].to(torch.bfloat16)
    expected = plain(pixels)
    torch.testing.assert_close(packed(pixels), expected, atol=0.02 * expected.abs().max().item(), rtol=0.02)


def test_greedy_tokens_match_transformers_with_images(pixtral: tuple[Path, Any, LLM]) -> None:
    """Images of several shapes (one row of squares, one column, neither), two in one prompt, and a prompt without
    one, in one batch."""
    folder, model, llm = pixtral
    cases = [("Look: [IMG] what is it?", [_image(0, 64, 64)]), ("[IMG] and [IMG]!", [_image(1, 20, 64),
                                                                                     _image(2, 64, 30)]),
             ("wide [IMG]", [_image(3, 16, 64)]), ("[IMG] tall", [_image(4, 64, 16)]),
             ("[IMG] odd", [_image(5, 45, 53)]), ("no image at all", [])]
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text for text, images in cases]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for output, (text, images) in zip(outputs, cases, strict=True):
        prompt, tokens = _hf_greedy(folder, model, text, images)
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == tokens
    breaks = llm.get_tokenizer().convert_tokens_to_ids("[IMG_BREAK]")
    assert outputs[0].prompt_token_ids.count(breaks) == 64 // _square(model) - 1    # after each row but the last
    assert outputs[0].outputs[0].token_ids != outputs[4].outputs[0].token_ids


def test_chunks_preemption_and_prefix_hits_through_an_image(pixtral: tuple[Path, Any, LLM]) -> None:
    folder, _, llm = pixtral
    prompts = [{"prompt": f"request {i}: [IMG] tell", "multi_modal_data": {"image": _image(10 + i, 48, 64)}}
               for i in range(4)]
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in first]
    # chunks of 7 tokens end within rows and on their breaks; a pool with room for one request at a time
    longest = max(len(o.prompt_token_ids) for o in first)
    squeezed = LLM(model=str(folder), dtype="float32", num_kv_blocks=-(-(longest + 8) // 8) + 2,
                   max_num_batched_tokens=7, scheduler_reserve_full_isl=False)
    outputs = squeezed.generate(prompts, GREEDY, use_tqdm=False)
    assert squeezed.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    image_token = llm.engine.hf_config.image_token_id
    again = llm.generate(prompts[1], GREEDY, use_tqdm=False)[0]     # its image's blocks cached: hit, same tokens
    assert again.num_cached_tokens > again.prompt_token_ids.index(image_token) + 8
    assert again.outputs[0].token_ids == expected[1]
    other = llm.generate({**prompts[1], "multi_modal_data": {"image": _image(11, 64, 48)}}, GREEDY,
                         use_tqdm=False)[0]     # another image after the same text: no hit from it on
    assert other.num_cached_tokens <= other.prompt_token_ids.index(image_token)


def test_chat_and_the_server_with_images(pixtral: tuple[Path, Any, LLM]) -> None:
    folder, model, llm = pixtral
    image = _image(20, 40, 64)
    content = [{"type": "image_url", "image_url": {"url": _data_url(image)}}, {"type": "text", "text": "Describe."}]
    offline = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)[0]
    prompt, tokens = _hf_greedy(folder, model, "[INST][IMG]Describe.[/INST]", [image])
    assert offline.prompt_token_ids == prompt
    assert offline.outputs[0].token_ids == tokens
    running = start_server(llm.engine, api_key=None)
    try:
        assert served_chat(running, content) == offline.outputs[0].text
    finally:
        running.stop()


def test_a_prompt_whose_markers_and_images_differ_is_a_clear_error(pixtral: tuple[Path, Any, LLM]) -> None:
    _, _, llm = pixtral
    with pytest.raises(ValueError, match="1 \\[IMG\\] markers for 2 images"):
        llm.generate({"prompt": "[IMG] two?", "multi_modal_data": {"image": [_image(0), _image(1)]}}, GREEDY,
                     use_tqdm=False)


def test_ministral_3_takes_images(tmp_path: Path) -> None:
    """Ministral 3's layout: Mistral 3's, its language model's queries scaled past its original context (of 8 here:
    the image's placeholders and the text after them run past it)."""
    model = _save_model(tmp_path, "ministral3")
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64)
    text, images = "Look: [IMG] what is it?", [_image(30, 48, 64)]
    output = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
    prompt, tokens = _hf_greedy(tmp_path, model, text, images)
    assert output.prompt_token_ids == prompt and len(prompt) > 8
    assert output.outputs[0].token_ids == tokens
