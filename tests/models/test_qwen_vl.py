"""Grid images (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE: pagedllm.multimodal.GridImageProcessor,
pagedllm.models.vision.QwenVLEncoder):
tiny random checkpoints with their image processor, against transformers' models on the same weights and pixels:
the encoder's rows (Qwen2.5-VL's windows padded at the image's edge), M-RoPE positions and table rows, greedy tokens
for images of several shapes in one batch, chunked prefills and preemption through an image, prefix hits, chat and
the server, and the processor's arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import transformers
from PIL import Image

from pagedllm import LLM, SamplingParams
from pagedllm.inputs import parse_prompt
from pagedllm.layers.rotary import RotaryEmbedding, mrope_axes
from pagedllm.models.llama import unfused
from pagedllm.multimodal import ImageInput, MRopeLayout, pixels_hash
from tests.entrypoints.server_utils import start_server
from tests.models.test_images import NEEDS_ONEDNN_BF16, _data_url, _image, load_encoder, served_chat
from tests.models.tiny import build_byte_tokenizer, tiny_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# Qwen2-VL's own template, shortened: typed image parts become the image's markers
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}" + IMAGE +
            "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
KINDS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]


def _save_model(folder: Path, kind: str) -> Any:
    """A tiny random Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE, its image processor (images of 4 to 64
    placeholders) and tokenizer, saved in `folder`; returns transformers' model. Qwen2-VL and Qwen2.5-VL: the tiny Qwen2
    with M-RoPE sections [2, 3, 3] of its 16-value heads, a two- or three-layer encoder of 14-pixel patches
    (Qwen2.5-VL's windows 4 x 4 patches, its second layer over the whole image). Qwen3-VL: the tiny Qwen3 (32-value
    heads) with M-RoPE's sections [6, 5, 5] interleaved, an encoder of 16-pixel patches whose learned positions are a 4
    x 4 grid, DeepStack from its first two layers. Qwen3-VL-MoE: Qwen3-VL's with the tiny Qwen3-MoE (4 experts, 2 a
    token) for its language model, saved as its released checkpoints are (`_save_as_released`)."""
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]})
    tokenizer.chat_template = TEMPLATE
    qwen3 = kind.startswith("qwen3_vl")
    text = tiny_config({"qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3-moe"}.get(kind, "qwen2"),
                       initializer_range=0.5).to_dict()
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                               "mrope_section": [6, 5, 5] if qwen3 else [2, 3, 3], "mrope_interleaved": qwen3}
    ids = dict(image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
               video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
               vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
               vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"))
    patch = 16 if qwen3 else 14
    common = dict(num_heads=2, patch_size=patch, spatial_merge_size=2, temporal_patch_size=2)
    if kind == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=text["hidden_size"], mlp_ratio=2, **common)
        config: Any = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
        architecture: Any = transformers.Qwen2VLForConditionalGeneration
    elif kind == "qwen2_5_vl":
        vision = dict(depth=3, hidden_size=32, out_hidden_size=text["hidden_size"], intermediate_size=48,
                      window_size=56, fullatt_block_indexes=[1], **common)
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
        architecture = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        vision = dict(depth=3, hidden_size=32, out_hidden_size=text["hidden_size"], intermediate_size=48,
                      num_position_embeddings=16, deepstack_visual_indexes=[0, 1], initializer_range=0.5, **common)
        moe = kind == "qwen3_vl_moe"
        config = (transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig)(
            text_config=text, vision_config=vision, **ids)
        architecture = transformers.Qwen3VLMoeForConditionalGeneration if moe else \
            transformers.Qwen3VLForConditionalGeneration
    torch.manual_seed(0)
    model = architecture(config).eval()
    if kind == "qwen3_vl_moe":
        _save_as_released(model, folder)
    else:
        model.save_pretrained(folder)
    square = 2 * patch      # pixels a placeholder's side
    transformers.Qwen2VLImageProcessor(patch_size=patch, min_pixels=4 * square ** 2,
                                       max_pixels=64 * square ** 2).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def _save_as_released(model: Any, folder: Path) -> None:
    """A Qwen3-VL-MoE saved as its released checkpoints are: each layer's experts stacked, gate_up_proj [E, H, 2I]
    and down_proj [E, I, H] (transformers holds them transposed, and its save_pretrained fails to turn them back)."""
    model.save_pretrained(folder, save_original_format=False)
    path = folder / "model.safetensors"
    tensors = safetensors.torch.load_file(path)
    for name in [n for n in tensors if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=KINDS)
def qwen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, LLM]:
    folder = tmp_path_factory.mktemp(request.param)
    model = _save_model(folder, request.param)
    return folder, model, LLM(model=str(folder), dtype="float32", num_kv_blocks=256)


def _hf_greedy(folder: Path, model: Any, text: str, images: list[Image.Image], add_special_tokens: bool = True,
               **size: Any) -> tuple[list[int], list[int]]:
    """transformers' prompt token ids and greedy tokens for `text` with `images`, each `<|image_pad|>` expanded as
    Qwen2-VL's processor does (which needs torchvision: not installed here)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    pixels: dict[str, Any] = {}
    if images:
        pixels = dict(transformers.AutoImageProcessor.from_pretrained(folder)(images=images, return_tensors="pt",
                                                                              **size))
        pieces = text.split("<|image_pad|>")
        counts = [int(grid.prod()) // 4 for grid in pixels["image_grid_thw"]]
        text = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:]))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens)["input_ids"]
    if images:
        pixels["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, **pixels, max_new_tokens=8, do_sample=False)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_the_encoder_gives_transformers_rows(tmp_path: Path, kind: str) -> None:
    model = _save_model(tmp_path, kind)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    encoder = load_encoder(model, tmp_path)
    # square, wide and tall grids of patches; Qwen2.5-VL's 4 x 4 windows cut each, padded at its edges
    for grid in [(1, 8, 8), (1, 6, 10), (1, 14, 4)]:
        pixels = torch.randn(grid[0] * grid[1] * grid[2], 3 * 2 * config.vision_config.patch_size ** 2)
        with torch.inference_mode():
            expected = model.model.get_image_features(pixel_values=pixels, image_grid_thw=torch.tensor([grid]))
        # Qwen3-VL's DeepStack rows (each layer's split by image), after the last layer's
        deepstack = [torch.cat(list(rows)) for rows in getattr(expected, "deepstack_features", None) or []]
        assert len(deepstack) == (2 if kind.startswith("qwen3_vl") else 0)
        rows = torch.cat([*expected.pooler_output, *deepstack], dim=-1)
        torch.testing.assert_close(encoder(pixels, grid), rows, atol=1e-5 * rows.abs().max().item(), rtol=1e-5)


def test_the_layouts_positions_are_transformers_rope_index(qwen: tuple[Path, Any, LLM]) -> None:
    """A prompt with a wide and a tall image: text, the images' (frame, row, column) places, and the text after
    them shifted, as transformers' get_rope_index has them."""
    _, model, llm = qwen
    images = [_image(0, 60, 200), _image(1, 210, 70)]
    parsed = llm.engine.process_images(parse_prompt({"prompt": f"one {IMAGE} two {IMAGE} end",
                                                     "multi_modal_data": {"image": images}}))
    layout = MRopeLayout.of(parsed.image_inputs)
    assert layout is not None
    ours = [[i + layout.shift(i)] * 3 for i in range(len(parsed.token_ids))]
    for image in parsed.image_inputs:
        places = layout.image_positions(image, image.offset, image.offset + image.length)
        for j in range(image.length):
            ours[image.offset + j] = [axis[j] for axis in places]
    ids = torch.tensor([parsed.token_ids])
    grids = torch.tensor([[image.grid[0], image.grid[1] * 2, image.grid[2] * 2] for image in parsed.image_inputs])
    expected, delta = model.model.get_rope_index(ids, (ids == model.config.image_token_id).int(), grids)
    assert torch.tensor(ours).T.tolist() == expected[:, 0].tolist()
    assert layout.shift(len(parsed.token_ids)) == int(delta)      # every generated token's


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl"])
def test_spatial_rows_are_transformers_mrope_angles(kind: str) -> None:
    """The table rows M-RoPE writes for (frame, row, column) positions, sectioned (Qwen2-VL) or interleaved
    (Qwen3-VL), against transformers' rotary embeddings; more positions than there is room for make bigger tables,
    the text rows kept."""
    qwen3 = kind == "qwen3_vl"
    config = (transformers.Qwen3VLTextConfig if qwen3 else transformers.Qwen2VLTextConfig)(
        hidden_size=64, num_attention_heads=2 if qwen3 else 4, head_dim=32 if qwen3 else None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5] if qwen3 else
                         [2, 3, 3], "mrope_interleaved": qwen3})
    models = transformers.models
    reference = (models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding if qwen3 else
                 models.qwen2_vl.modeling_qwen2_vl.Qwen2VLRotaryEmbedding)(config)
    rope = RotaryEmbedding(32 if qwen3 else 16, 512, 10000.0, None, mrope_axes(config))
    text_rows = rope.cos_cache[:512].clone()
    for count in (5, 300):
        positions = torch.randint(0, 512, (3, count))
        rows, grown = rope.spatial_rows(positions)
        assert grown     # the first call makes room for 256 rows, the second for 300
        cos, sin = reference(torch.zeros(1, dtype=torch.float32), positions[:, None])
        torch.testing.assert_close(rope.cos_cache[rows], cos[0])
        torch.testing.assert_close(rope.sin_cache[rows], sin[0])
    assert torch.equal(rope.cos_cache[:512], text_rows)
    equal = torch.full((3, 4), 7)       # a text token's three positions: its own row
    assert torch.equal(rope.cos_cache[rope.spatial_rows(equal)[0]], rope.cos_cache[[7] * 4])


def test_greedy_tokens_match_transformers_with_grid_images(qwen: tuple[Path, Any, LLM]) -> None:
    """Images of several shapes, two in one prompt, and a prompt without one, in one batch: over 256 image tokens
    in one step, after a step with fewer (M-RoPE's table rows grow, the decoder stack rebuilt)."""
    folder, model, llm = qwen
    cases = [(f"Look: {IMAGE} what is it?", [_image(0, 230, 230)]), (f"{IMAGE} and {IMAGE}!", [_image(1, 60, 200),
                                                                                                   _image(2, 210, 70)]),
             (f"Look: {IMAGE} what is it?", [_image(3, 224, 200)]), (f"{IMAGE} wide", [_image(4, 100, 230)]),
             (f"tall {IMAGE}", [_image(5, 230, 110)]), (f"{IMAGE}{IMAGE}", [_image(6, 230, 200), _image(7, 160, 160)]),
             (f"{IMAGE} last", [_image(8, 256, 256)]), ("no image at all", [])]
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text for text, images in cases]
    small = {"prompt": IMAGE, "multi_modal_data": {"image": _image(9, 60, 60)}}
    llm.generate(small, GREEDY, use_tqdm=False)     # room made for 256 rows; the stack built with those tables
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    image_token = model.config.image_token_id
    assert sum(o.prompt_token_ids.count(image_token) for o in outputs) > 256
    for output, (text, images) in zip(outputs, cases):
        prompt, tokens = _hf_greedy(folder, model, text, images)
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == tokens
    assert outputs[0].outputs[0].token_ids != outputs[2].outputs[0].token_ids


def test_chunks_preemption_and_prefix_hits_through_a_grid_image(qwen: tuple[Path, Any, LLM]) -> None:
    folder, _, llm = qwen
    image_token = llm.engine.hf_config.image_token_id
    prompts = [{"prompt": f"request {i}: {IMAGE} tell", "multi_modal_data": {"image": _image(10 + i, 90, 150)}}
               for i in range(4)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    # chunks of 8 tokens cut each image's placeholders; a pool with room for one request at a time
    longest = max(len(o.prompt_token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False))
    blocks = -(-(longest + 8) // 8) + 2
    # (each admitted on its first chunk, not once its whole prompt fits: so that they preempt each other)
    squeezed = LLM(model=str(folder), dtype="float32", num_kv_blocks=blocks, max_num_batched_tokens=8,
                   scheduler_reserve_full_isl=False)
    twice = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)    # its child carries the layout
    outputs = squeezed.generate(prompts, [twice] + [GREEDY] * 3, use_tqdm=False)
    assert squeezed.engine.scheduler.num_preemptions > 0
    assert [o.outputs[-1].token_ids for o in outputs] == expected
    again = llm.generate(prompts[1], GREEDY, use_tqdm=False)[0]     # its image's blocks cached: hit, same tokens
    assert again.num_cached_tokens > again.prompt_token_ids.index(image_token) + 8
    assert again.outputs[0].token_ids == expected[1]
    other = llm.generate({**prompts[1], "multi_modal_data": {"image": _image(10 + 1, 150, 90)}}, GREEDY,
                         use_tqdm=False)[0]     # another image after the same text: no hit from it on
    assert other.num_cached_tokens <= other.prompt_token_ids.index(image_token)


def test_stacked_experts_load_from_either_layout() -> None:
    """Qwen3-VL-MoE's experts as its checkpoints store them ([E, H, 2I] and [E, I, H]) and as transformers 5 holds
    them ([E, 2I, H] and [E, H, I]) become the same experts' gate, up and down weights."""
    config = tiny_config("qwen3-moe")
    experts, hidden, inner = 4, config.hidden_size, 48
    gate_up, down = torch.randn(experts, 2 * inner, hidden), torch.randn(experts, hidden, inner)
    layer = "model.layers.1.mlp.experts."
    expected = {f"{layer}{e}.{part}.weight": rows for e in range(experts)
                for part, rows in (("gate_proj", gate_up[e, :inner]), ("up_proj", gate_up[e, inner:]),
                                   ("down_proj", down[e]))}
    for held in (gate_up, down), (gate_up.transpose(1, 2), down.transpose(1, 2)):
        parts = dict(unfused(config, layer + "gate_up_proj", held[0]) + unfused(config, layer + "down_proj", held[1]))
        assert parts.keys() == expected.keys()
        assert all(torch.equal(parts[name], rows) for name, rows in expected.items())


def test_an_images_grid_goes_into_its_hash() -> None:
    pixels = torch.arange(24.0).reshape(6, 4)
    assert pixels_hash(pixels, (1, 2, 3)) != pixels_hash(pixels, (1, 3, 2))
    assert pixels_hash(pixels, (1, 2, 3)) == pixels_hash(pixels.clone(), (1, 2, 3))
    layout = MRopeLayout.of([ImageInput(2, 6, "a", pixels, (1, 2, 3)), ImageInput(10, 4, "b", pixels, (1, 1, 4))])
    assert layout is not None and [layout.shift(i) for i in (0, 7, 8, 13, 14, 20)] == [0, 0, -3, -3, -3, -3]
    assert MRopeLayout.of([ImageInput(2, 6, "a", pixels)]) is None     # square pictures: plain positions


def test_chat_and_the_server_with_grid_images(qwen: tuple[Path, Any, LLM]) -> None:
    folder, model, llm = qwen
    image = _image(20, 120, 90)
    content = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": _data_url(image)}}]
    output = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)[0]
    text = f"<|im_start|>user\nWhat is it?{IMAGE}<|im_end|>\n<|im_start|>assistant\n"
    assert (output.prompt_token_ids, output.outputs[0].token_ids) == \
        _hf_greedy(folder, model, text, [image], add_special_tokens=False)
    running = start_server(llm.engine, api_key=None)
    try:
        assert served_chat(running, content) == output.outputs[0].text
    finally:
        running.stop()


def test_processor_size_bounds_and_bad_arguments(qwen: tuple[Path, Any, LLM]) -> None:
    """vLLM's min_pixels / max_pixels for a prompt (and the engine) bound the grid as the image processor's size
    does; an argument the processor does not take is a clear error."""
    folder, model, llm = qwen
    text, image = f"Look: {IMAGE} what is it?", _image(60, 230, 230)
    small = llm.generate({"prompt": text, "multi_modal_data": {"image": image},
                          "mm_processor_kwargs": {"max_pixels": 56 * 56 * 2}}, GREEDY, use_tqdm=False)[0]
    bounds = dict(transformers.AutoImageProcessor.from_pretrained(folder).size)
    size = {"size": bounds | {"longest_edge": 56 * 56 * 2}}
    assert (small.prompt_token_ids, small.outputs[0].token_ids) == _hf_greedy(folder, model, text, [image], **size)
    assert small.prompt_token_ids.count(model.config.image_token_id) < 16
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": image}, "mm_processor_kwargs": {"bogus": 1}},
                     GREEDY)
    with pytest.raises(ValueError, match="1 <\\|image_pad\\|> markers for 2 images"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": [image, image]}}, GREEDY)


@NEEDS_ONEDNN_BF16
@pytest.mark.parametrize("kind", KINDS)
def test_the_prepacked_encoder_gives_the_plain_encoders_rows(tmp_path: Path, kind: str) -> None:
    """bf16 weights reordered for oneDNN once, the merger's GELU inside its first linear's call."""
    model = _save_model(tmp_path, kind)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    plain, packed = (load_encoder(model, tmp_path, torch.bfloat16) for _ in range(2))
    packed.prepack()
    assert packed.visual["merger"].mlp[0].weight.is_mkldnn and \
        not plain.visual["merger"].mlp[0].weight.is_mkldnn
    pixels, grid = torch.randn(80, 3 * 2 * config.vision_config.patch_size ** 2), (1, 8, 10)
    expected = plain(pixels, grid).float()
    torch.testing.assert_close(packed(pixels, grid).float(), expected, atol=0.03 * expected.abs().max().item(),
                               rtol=0.03)
