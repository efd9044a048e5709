"""`pagedllm bench random-model`: a folder every engine reads, in a preset's shape."""

from __future__ import annotations

import json

from pagedllm import LLM, SamplingParams
from pagedllm.bench import random_model
from pagedllm.bench.cli import main


def test_a_random_model_folder_loads_and_generates_in_its_presets_shape(tmp_path, monkeypatch):
    model_type, fields = random_model.PRESETS["qwen3-moe-1b"]
    small = {**fields, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    monkeypatch.setitem(random_model.PRESETS, "qwen3-moe-1b", (model_type, small))
    result = main(["random-model", str(tmp_path / "m"), "--preset", "qwen3-moe-1b", "--dtype", "float32"])
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_local_experts"] == 4
    assert result["num_params"] > 0 and (tmp_path / "m" / "tokenizer.json").is_file()
    with LLM(str(tmp_path / "m"), num_kv_blocks=64) as llm:
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_the_lfm2_preset_has_its_convolutions_where_its_config_says(tmp_path, monkeypatch):
    model_type, fields = random_model.PRESETS["lfm2-350m"]
    small = {**fields, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "full_attn_idxs": [2], "block_multiple_of": 32}
    monkeypatch.setitem(random_model.PRESETS, "lfm2-350m", (model_type, small))
    main(["random-model", str(tmp_path / "m"), "--preset", "lfm2-350m", "--dtype", "float32"])
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Lfm2ForCausalLM"] and config["layer_types"] == \
        ["conv", "conv", "full_attention", "conv"]
    with LLM(str(tmp_path / "m"), num_kv_blocks=64) as llm:
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_the_embeddinggemma_preset_is_an_encoder_with_its_dense_layers(tmp_path, monkeypatch):
    """The encoder preset saves the bare Gemma 3 model with a sentence-transformers config (mean pooling, two Dense
    layers, a norm), which pagedllm embeds with: vectors of the last Dense layer's width, of norm 1."""
    model_type, fields = random_model.PRESETS["embeddinggemma-300m"]
    small = {**fields, "hidden_size": 96, "intermediate_size": 96, "num_hidden_layers": 2, "head_dim": 32,
             "query_pre_attn_scalar": 32, "sliding_window": 8}
    monkeypatch.setitem(random_model.PRESETS, "embeddinggemma-300m", (model_type, small))
    monkeypatch.setattr(random_model, "ENCODER_DENSE", [("2_Dense", 96, False, "torch.nn.modules.linear.Identity"),
                                                        ("3_Dense", 48, False, "torch.nn.modules.linear.Identity")])
    main(["random-model", str(tmp_path / "m"), "--preset", "embeddinggemma-300m", "--dtype", "float32"])
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Gemma3TextModel"] and config["use_bidirectional_attention"]
    with LLM(str(tmp_path / "m"), num_kv_blocks=64) as llm:
        assert llm.engine.pooling_type == "MEAN"
        (out,) = llm.embed(["The capital of France is"], use_tqdm=False)
    assert len(out.outputs.embedding) == 48 and abs(sum(x * x for x in out.outputs.embedding) - 1) < 1e-4


def test_the_minilm_preset_is_a_bert_encoder_pooled_by_its_mean(tmp_path, monkeypatch):
    model_type, fields = random_model.PRESETS["all-minilm-l6"]
    monkeypatch.setitem(random_model.PRESETS, "all-minilm-l6",
                        (model_type, {**fields, "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}))
    main(["random-model", str(tmp_path / "m"), "--preset", "all-minilm-l6", "--dtype", "float32"])
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["BertModel"]
    assert [m["type"].rsplit(".", 1)[1] for m in json.loads((tmp_path / "m" / "modules.json").read_text())] == \
        ["Transformer", "Pooling", "Normalize"]
    with LLM(str(tmp_path / "m"), num_kv_blocks=64) as llm:
        assert llm.engine.pooling_type == "MEAN"
        (out,) = llm.embed(["The capital of France is"], use_tqdm=False)
    assert len(out.outputs.embedding) == 64


def test_the_cross_encoder_preset_is_a_bert_classifier_with_one_label(tmp_path, monkeypatch):
    model_type, fields = random_model.PRESETS["ms-marco-minilm-l6"]
    monkeypatch.setitem(random_model.PRESETS, "ms-marco-minilm-l6",
                        (model_type, {**fields, "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}))
    main(["random-model", str(tmp_path / "m"), "--preset", "ms-marco-minilm-l6", "--dtype", "float32"])
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == \
        ["BertForSequenceClassification"]
    assert not (tmp_path / "m" / "modules.json").exists()
    with LLM(str(tmp_path / "m"), num_kv_blocks=64) as llm:
        assert llm.engine.class_labels == ["LABEL_0"]
        (score,) = llm.score("a query", ["a document"], use_tqdm=False)
    assert 0.0 < score.outputs.score < 1.0


def test_the_smolvlm_preset_is_an_idefics3_with_its_processor(tmp_path, monkeypatch):
    """The vision-language preset saves an Idefics3 and its processor (the tokenizer with Idefics3's tokens): an
    image's tiles each become their placeholders, and pagedllm generates from them."""
    import numpy as np
    from PIL import Image

    model_type, fields = random_model.PRESETS["smolvlm-256m"]
    small = {**fields, "scale_factor": 2,
             "text_config": {**fields["text_config"], "hidden_size": 64, "intermediate_size": 64,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
             "vision_config": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=56, patch_size=14)}
    monkeypatch.setitem(random_model.PRESETS, "smolvlm-256m", (model_type, small))
    main(["random-model", str(tmp_path / "m"), "--preset", "smolvlm-256m", "--dtype", "float32"])
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Idefics3ForConditionalGeneration"] and config["scale_factor"] == 2
    image = Image.fromarray(np.zeros((60, 100, 3), dtype=np.uint8))
    with LLM(str(tmp_path / "m"), num_kv_blocks=64) as llm:
        out = llm.generate({"prompt": "<image>Describe it.", "multi_modal_data": {"image": image}},
                           SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    # 100 x 60 pixels scaled to 224 x 168 (4 tiles of 56 a side at most): 3 rows of 4 tiles, then the whole, each
    # tile 4 placeholders
    assert out.prompt_token_ids.count(config["image_token_id"]) == 13 * 4
    assert len(out.outputs[0].token_ids) == 4


def test_the_qwen_vl_preset_is_a_qwen2_5_vl_with_its_image_processor(tmp_path, monkeypatch):
    """The Qwen2.5-VL preset saves the model, its image processor and the tokenizer with Qwen's image tokens: an
    image becomes one placeholder a 2 x 2 square of its patches, and pagedllm generates from them."""
    import numpy as np
    from PIL import Image

    model_type, fields = random_model.PRESETS["qwen2.5-vl-3b"]
    small = {"text_config": {**fields["text_config"], "hidden_size": 64, "intermediate_size": 64,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
             "vision_config": {**fields["vision_config"], "depth": 2, "hidden_size": 32, "intermediate_size": 48,
                               "num_heads": 2, "out_hidden_size": 64, "fullatt_block_indexes": [1]}}
    small["text_config"]["rope_parameters"] = {**fields["text_config"]["rope_parameters"], "mrope_section": [2, 3, 3]}
    monkeypatch.setitem(random_model.PRESETS, "qwen2.5-vl-3b", (model_type, small))
    main(["random-model", str(tmp_path / "m"), "--preset", "qwen2.5-vl-3b", "--dtype", "float32"])
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    image = Image.fromarray(np.zeros((60, 100, 3), dtype=np.uint8))
    with LLM(str(tmp_path / "m"), num_kv_blocks=64) as llm:
        out = llm.generate({"prompt": "<|vision_start|><|image_pad|><|vision_end|>Describe it.",
                            "multi_modal_data": {"image": image}},
                           SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    # 100 x 60 pixels to whole 28-pixel squares: 112 x 56, 4 x 2 squares
    assert out.prompt_token_ids.count(config["image_token_id"]) == 8
    assert len(out.outputs[0].token_ids) == 4


def test_the_gemma3_preset_is_a_gemma3_with_its_processor(tmp_path, monkeypatch):
    """The Gemma 3 preset saves the model and its processor (the tokenizer with Gemma's image tokens, named as its
    processor reads them): `<start_of_image>` becomes the image's placeholders, and pagedllm generates from them."""
    import numpy as np
    from PIL import Image

    model_type, fields = random_model.PRESETS["gemma3-4b"]
    small = {"mm_tokens_per_image": 4,
             "text_config": {**fields["text_config"], "hidden_size": 64, "intermediate_size": 64,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8},
             "vision_config": {**fields["vision_config"], "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 56}}
    monkeypatch.setitem(random_model.PRESETS, "gemma3-4b", (model_type, small))
    main(["random-model", str(tmp_path / "m"), "--preset", "gemma3-4b", "--dtype", "float32"])
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"]
    image = Image.fromarray(np.zeros((60, 100, 3), dtype=np.uint8))
    with LLM(str(tmp_path / "m"), num_kv_blocks=64) as llm:
        out = llm.generate({"prompt": "<start_of_image>Describe it.", "multi_modal_data": {"image": image}},
                           SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids.count(config["image_token_index"]) == 4
    assert len(out.outputs[0].token_ids) == 4
