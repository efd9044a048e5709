"""A multimodal checkpoint served for its text (pagedllm.loader.TEXT_PARTS): Gemma 3 4B and up are
Gemma3ForConditionalGeneration checkpoints, whose language model pagedllm runs as a Gemma3ForCausalLM, never reading
the vision tower, and gives transformers' logits on text; so are Mistral 3's (Mistral-Small-3.1) and Qwen2-VL's,
Qwen2.5-VL's and Qwen3-VL's (M-RoPE, which is the plain rotary embedding on text), in transformers' layouts, with
the LM head tied as the whole config says; and any checkpoint of the Llava kind whose language model is one of the
Llama family's (Llava, InternVL, Idefics3: SmolVLM's model.text_model.*)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.loader import load_hf_config, load_model, text_part_name
from pagedllm.loader.resolve import resolve_model
from tests.models.tiny import SimplePagedRunner, build_byte_tokenizer, hf_greedy, tiny_config

# transformers before 4.52 saved the language model as language_model.model.*, the rest at the top
_OLD_LAYOUT = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
               ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."))


def _tiny_gemma3_multimodal(folder: Path, old_layout: bool):
    """A tiny random Gemma3ForConditionalGeneration (its text model the tiny gemma3, a one-layer vision tower) saved
    in `folder`, in the layout of transformers before 4.52 or since; returns the transformers model."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(text_config=tiny_config("gemma3").to_dict(), mm_tokens_per_image=4, image_token_index=300,
                          boi_token_index=301, eoi_token_index=302,
                          vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14))
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():       # Gemma's norms start at w = 0 (a scale of 1 + w): made random, to be seen
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0, 0.2)
    model.save_pretrained(folder)
    if old_layout:
        tensors = {}
        for name, tensor in model.state_dict().items():
            for new, old in _OLD_LAYOUT:
                if name.startswith(new):
                    name = old + name.removeprefix(new)
            tensors[name] = tensor.contiguous()
        (folder / "model.safetensors").unlink()
        save_file({n: t for n, t in tensors.items() if n != "language_model.lm_head.weight"},
                  str(folder / "model.safetensors"), metadata={"format": "pt"})
    return model


def test_text_part_names() -> None:
    assert text_part_name("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert text_part_name("language_model.model.norm.weight") == "model.norm.weight"
    assert text_part_name("language_model.lm_head.weight") == "lm_head.weight"
    assert text_part_name("model.vision_tower.vision_model.embeddings.patch_embedding.weight") is None
    assert text_part_name("multi_modal_projector.mm_input_projection_weight") is None
    assert text_part_name("model.layers.1.self_attn.q_proj.bias") == "model.layers.1.self_attn.q_proj.bias"  # Qwen2-VL
    assert text_part_name("visual.blocks.0.attn.qkv.weight") is None
    assert text_part_name("model.visual.merger.mlp.0.weight") is None


def _tiny_text_part(folder: Path, architecture: str):
    """A tiny random multimodal checkpoint of `architecture` (its text model a tiny one, a one-layer vision tower),
    saved by transformers in `folder`; returns the transformers model."""
    import transformers

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    mrope = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    configs = {
        "Mistral3ForConditionalGeneration": lambda: transformers.Mistral3Config(
            text_config=tiny_config("mistral").to_dict(), vision_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                patch_size=14, head_dim=16)),
        "Qwen2VLForConditionalGeneration": lambda: transformers.Qwen2VLConfig(
            text_config={**tiny_config("qwen2").to_dict(), "rope_scaling": mrope},
            vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)),
        "Qwen2_5_VLForConditionalGeneration": lambda: transformers.Qwen2_5_VLConfig(
            text_config={**tiny_config("qwen2").to_dict(), "rope_scaling": mrope}, vision_config=vision,
            tie_word_embeddings=True),
        "LlavaForConditionalGeneration": lambda: transformers.LlavaConfig(
            text_config=tiny_config("llama-gqa").to_dict(), image_token_index=300, vision_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                patch_size=14, projection_dim=32)),
        "InternVLForConditionalGeneration": lambda: transformers.InternVLConfig(
            text_config=tiny_config("qwen2").to_dict(), image_token_id=300, vision_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=[28, 28],
                patch_size=[14, 14])),
        "Idefics3ForConditionalGeneration": lambda: transformers.Idefics3Config(
            text_config=tiny_config("llama-gqa").to_dict(), image_token_id=300, vision_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                patch_size=14)),
        "Qwen3VLForConditionalGeneration": lambda: transformers.Qwen3VLConfig(
            text_config={**tiny_config("qwen3").to_dict(), "rope_scaling": {**mrope, "mrope_section": [4, 6, 6],
                                                                            "mrope_interleaved": True}},
            vision_config={**vision, "deepstack_visual_indexes": [0]}),
    }
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(configs[architecture]()).eval()
    model.save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return model


@pytest.mark.parametrize("architecture", ["Mistral3ForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                                          "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                                          "LlavaForConditionalGeneration", "InternVLForConditionalGeneration",
                                          "Idefics3ForConditionalGeneration"])
def test_a_vision_language_checkpoint_serves_its_text(tmp_path: Path, architecture: str) -> None:
    hf_model = _tiny_text_part(tmp_path, architecture)
    config = load_hf_config(resolve_model(str(tmp_path)))
    assert config.text_part_of == architecture
    tied = hf_model.lm_head.weight.data_ptr() == hf_model.get_input_embeddings().weight.data_ptr()
    assert config.tie_word_embeddings == tied
    prompts = [[(7 * i + 3) % 250 for i in range(20)], [5, 17, 99]]
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(hf_model, prompts, 8)


@pytest.mark.parametrize("old_layout", [False, True], ids=["model.language_model", "language_model.model"])
def test_gemma3_for_conditional_generation_serves_its_text(tmp_path: Path, old_layout: bool) -> None:
    hf_model = _tiny_gemma3_multimodal(tmp_path, old_layout)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]
    config = load_hf_config(resolve_model(str(tmp_path)))
    assert config.model_type == "gemma3_text" and config.architectures == ["Gemma3ForCausalLM"]
    runner = SimplePagedRunner(load_model(ModelConfig(model=str(tmp_path), dtype="float32")).model)
    tokens = [(7 * i + 3) % 300 for i in range(20)]      # past the local layer's window of 12
    with torch.inference_mode():
        expected = hf_model(input_ids=torch.tensor([tokens])).logits[0, -1]
    torch.testing.assert_close(runner.step({0: tokens})[0], expected, atol=1e-4, rtol=0)


def test_a_quantized_multimodal_checkpoint_is_refused(tmp_path: Path) -> None:
    _tiny_gemma3_multimodal(tmp_path, old_layout=False)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized Gemma3ForConditionalGeneration"):
        load_hf_config(resolve_model(str(tmp_path)))


def test_an_encoder_decoder_is_no_text_part(tmp_path: Path) -> None:
    """T5ForConditionalGeneration has no text config: it stays what it is, and is refused as unsupported."""
    from transformers import T5Config

    T5Config(vocab_size=300, d_model=32, d_ff=64, num_layers=1, num_heads=2,
             architectures=["T5ForConditionalGeneration"]).save_pretrained(tmp_path)
    config = load_hf_config(resolve_model(str(tmp_path)))
    assert config.architectures == ["T5ForConditionalGeneration"] and not hasattr(config, "text_part_of")
