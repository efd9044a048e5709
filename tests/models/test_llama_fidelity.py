"""pagedllm's Llama-family model against transformers on tiny random checkpoints, through a paged KV cache."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.loader import load_model
from tests.models.tiny import TINY_MODELS, SimplePagedRunner, save_tiny_model

PROMPTS = [[1, 17, 250, 9, 33, 70, 5], [1, 200, 3], [1, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 12]]
NUM_DECODE_STEPS = 10
ATOL = 1e-4


@torch.inference_mode()
def _hf_last_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([tokens])).logits[0, -1].float()


def _load(folder) -> torch.nn.Module:
    return load_model(ModelConfig(model=str(folder), dtype="float32")).model


@pytest.mark.parametrize("kind", list(TINY_MODELS))
def test_prefill_and_decode_match_transformers(tmp_path, kind: str) -> None:
    folder, hf_model = save_tiny_model(tmp_path / kind, kind, with_tokenizer=False)
    runner = SimplePagedRunner(_load(folder), block_size=4, num_blocks=64)
    seqs = [list(p) for p in PROMPTS]
    # Step 1: prompt 0 and 1 whole, prompt 2 as a first chunk; step 2: prompt 2's second chunk.
    logits = runner.step({0: seqs[0], 1: seqs[1], 2: seqs[2][:5]})
    logits = torch.cat([logits[:2], runner.step({2: seqs[2][5:]})])
    for _ in range(NUM_DECODE_STEPS):
        for i, seq in enumerate(seqs):
            expected = _hf_last_logits(hf_model, seq)
            torch.testing.assert_close(logits[i], expected, atol=ATOL, rtol=0)
            assert int(logits[i].argmax()) == int(expected.argmax())
            seq.append(int(expected.argmax()))
        logits = runner.step({i: [seq[-1]] for i, seq in enumerate(seqs)})


def test_the_rotary_tables_cover_max_model_len(tmp_path) -> None:
    """A model loaded for a shorter max_model_len than its context keeps rotary tables of that many positions (Gemma
    3's two ropes: one table each), and the same logits."""
    folder, hf_model = save_tiny_model(tmp_path / "m", "gemma3", with_tokenizer=False)
    model = load_model(ModelConfig(model=str(folder), dtype="float32", max_model_len=24)).model
    tables = {id(layer.self_attn.rotary_emb): layer.self_attn.rotary_emb.cos_cache for layer in model.model.layers}
    assert len(tables) == 2 and {t.shape for t in tables.values()} == {(24, 32)}
    prompt = PROMPTS[2] * 2     # 24 tokens: the last at position 23
    logits = SimplePagedRunner(model).step({0: prompt})
    torch.testing.assert_close(logits[0], _hf_last_logits(hf_model, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernels", [True, False])
def test_longrope_takes_its_long_factors_for_a_step_past_the_original_context(tmp_path, kernels, monkeypatch) -> None:
    """Phi-3's longrope with an original context of 16: a 30-token prompt prefilled in one step, and the decodes after
    it, take the long factors for every token, as transformers does for a sequence past 16 tokens; through the
    kernels (the C++ stack) and the torch modules."""
    if not kernels:
        monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
    folder, hf_model = save_tiny_model(tmp_path / "m", "phi3-longrope", with_tokenizer=False,
                                       original_max_position_embeddings=16)
    assert hf_model.config.rope_parameters["original_max_position_embeddings"] == 16
    runner = SimplePagedRunner(_load(folder))
    tokens = [(7 * i + 3) % 300 for i in range(30)]
    logits = runner.step({0: tokens})
    for _ in range(3):
        expected = _hf_last_logits(hf_model, tokens)
        torch.testing.assert_close(logits[0], expected, atol=ATOL, rtol=0)
        tokens.append(int(expected.argmax()))
        logits = runner.step({0: tokens[-1:]})


def test_sharded_checkpoint(tmp_path) -> None:
    folder, hf_model = save_tiny_model(tmp_path / "sharded", "llama-untied", max_shard_size="100KB",
                                       with_tokenizer=False)
    assert (folder / "model.safetensors.index.json").is_file()
    runner = SimplePagedRunner(_load(folder))
    logits = runner.step({0: PROMPTS[0]})
    torch.testing.assert_close(logits[0], _hf_last_logits(hf_model, PROMPTS[0]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama-gqa", "gemma3", "phi", "gpt-neox", "cohere"])
def test_bfloat16_close_to_float32(tmp_path, kind: str) -> None:
    folder, hf_model = save_tiny_model(tmp_path / "bf16", kind, with_tokenizer=False)
    model = load_model(ModelConfig(model=str(folder), dtype="bfloat16")).model
    assert model.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
    logits = SimplePagedRunner(model, dtype=torch.bfloat16).step({0: PROMPTS[0]})
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], _hf_last_logits(hf_model, PROMPTS[0]), atol=0.1, rtol=0.05)


def test_granites_multipliers_refuse_4_bit_blocks(tmp_path) -> None:
    """Granite's residual multiplier is folded into two weights at load: not into an AWQ checkpoint's blocks."""
    from tests.models.int4_checkpoints import save_int4_checkpoint
    from tests.models.tiny import build_tiny_hf_model

    model = build_tiny_hf_model("granite", tie_word_embeddings=False)
    folder, _ = save_int4_checkpoint(tmp_path / "awq", model, "awq", group_size=64)
    with pytest.raises(ValueError, match="residual_multiplier is folded .* 'awq' blocks, kept packed, cannot take"):
        load_model(ModelConfig(model=str(folder)))


@pytest.mark.parametrize("kind", ["olmo2", "olmo3", "exaone4"])
def test_branch_output_norms_through_the_engine_as_transformers(tmp_path, kind: str) -> None:
    """OLMo's and EXAONE 4's layers, which norm their branches' outputs, in the engine (its C++ stack) generate
    transformers' tokens, past the local layers' window (12) with prompts prefilled in chunks."""
    from pagedllm import LLM, SamplingParams
    from tests.models.tiny import hf_greedy

    folder, hf_model = save_tiny_model(tmp_path / kind, kind, initializer_range=0.5)
    llm = LLM(str(folder), dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(llm.engine.runner.model.model.stacks) == 1
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf_model, PROMPTS, 8)


@pytest.mark.parametrize("kind", ["stablelm", "phi", "gpt-neox", "starcoder2", "cohere2", "gpt2", "gpt-bigcode",
                                  "opt", "gptj", "falcon-new", "olmo", "nemotron", "falcon-rw", "bloom", "mpt"])
def test_layer_norm_models_through_the_engine_as_transformers(tmp_path, kind: str) -> None:
    """StableLM's, Phi's, GPT-NeoX's, StarCoder2's, Cohere2's, GPT-2's, GPT-BigCode's, OPT's, GPT-J's, Falcon's, OLMo's,
    Nemotron's, BLOOM's and MPT's LayerNorm layers in the engine (its C++ stack) generate transformers' tokens, with
    prompts prefilled in chunks and a prefix cached (StarCoder2's and Cohere2's past their window of 12; StarCoder2's
    blocks behind it freed; GPT-2's, GPT-BigCode's and OPT's positions embedded; Falcon-RW's, BLOOM's and MPT's
    scores biased by ALiBi)."""
    from pagedllm import LLM, SamplingParams
    from tests.models.tiny import hf_greedy

    folder, hf_model = save_tiny_model(tmp_path / kind, kind, initializer_range=0.5)
    llm = LLM(str(folder), dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    prompts = PROMPTS + [PROMPTS[2] + [7, 8]]       # the last one hits the third one's blocks
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(llm.engine.runner.model.model.stacks) == 1
    assert outputs[-1].num_cached_tokens > 0
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf_model, prompts, 8)


def test_a_prompt_hits_the_cache_through_its_window_after_its_first_blocks_were_evicted(tmp_path) -> None:
    """StarCoder2's every layer attends over a window of 12: a 40-token prompt's first blocks, freed behind the window
    as it ran, are evicted by the next request's; the same prompt and two more tokens still hits its last blocks
    (the null block for those behind its next token's window) and generates transformers' tokens."""
    from pagedllm import LLM, SamplingParams
    from tests.models.tiny import hf_greedy

    folder, hf_model = save_tiny_model(tmp_path / "starcoder2", "starcoder2", initializer_range=0.5)
    llm = LLM(str(folder), dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    long = [(11 * i + 5) % 300 + 3 for i in range(40)]
    prompts = [long, [(7 * i + 2) % 300 + 3 for i in range(60)], long + [7, 8]]
    outputs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    assert outputs[2].num_cached_tokens >= 32
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf_model, prompts, 8)


@pytest.mark.parametrize(("kind", "option"), [("stablelm", "qk_layernorm"), ("phi", "qk_layernorm"),
                                              ("cohere", "use_qk_norm")])
def test_per_head_layer_norms_of_queries_and_keys_are_refused(tmp_path, kind: str, option: str) -> None:
    folder, _ = save_tiny_model(tmp_path / kind, kind, with_tokenizer=False, **{option: True})
    with pytest.raises(ValueError, match=f"LayerNorms of each query and key head .*{option}.* are not supported"):
        _load(folder)


def test_opt_checkpoints_named_from_the_decoder_load(tmp_path) -> None:
    """OPT checkpoints saved from its decoder model (opt-125m's: "decoder.layers.0.fc1.weight", no "model." prefix, no
    LM head) load as transformers' own saves do."""
    from safetensors.torch import load_file, save_file

    folder, hf_model = save_tiny_model(tmp_path / "opt", "opt", with_tokenizer=False)
    weights = load_file(folder / "model.safetensors")
    save_file({name.removeprefix("model."): tensor for name, tensor in weights.items() if name != "lm_head.weight"},
              folder / "model.safetensors", metadata={"format": "pt"})
    assert "decoder.layers.0.fc1.weight" in load_file(folder / "model.safetensors")
    logits = SimplePagedRunner(_load(folder)).step({0: PROMPTS[0]})
    torch.testing.assert_close(logits[0], _hf_last_logits(hf_model, PROMPTS[0]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("overrides", [dict(do_layer_norm_before=False), dict(word_embed_proj_dim=32)])
def test_opt_350ms_layout_is_refused(tmp_path, overrides: dict) -> None:
    folder, _ = save_tiny_model(tmp_path / "opt", "opt", with_tokenizer=False, **overrides)
    with pytest.raises(ValueError, match="opt-350m's"):
        _load(folder)


def test_alibi_models_turn_no_values_and_bias_by_their_own_slopes(tmp_path) -> None:
    """BLOOM's, MPT's and Falcon-RW's layers have no rotary embedding; each attention holds its model's slopes:
    the paper's, MPT's of its alibi_bias_max (4 here: 2^-1, 2^-2, ... for 4 heads; transformers' MPT, the oracle of
    the other tests, takes 8 whatever the config says, as every MPT checkpoint has it, where MosaicML's code and vLLM
    read it), Falcon's divided by sqrt(head_dim)."""
    expected = {"bloom": [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8], "mpt": [2 ** -1, 2 ** -2, 2 ** -3, 2 ** -4],
                "falcon-rw": [2 ** -4, 2 ** -6, 2 ** -8, 2 ** -10]}
    for kind, slopes in expected.items():
        overrides = dict(attn_config=dict(alibi_bias_max=4)) if kind == "mpt" else {}
        model = _load(save_tiny_model(tmp_path / kind, kind, with_tokenizer=False, **overrides)[0])
        for layer in model.model.layers:
            assert layer.self_attn.rotary_emb.rotary_dim == 0
            assert layer.self_attn.alibi_slopes.tolist() == slopes


def test_bloom_checkpoints_named_from_its_body_load(tmp_path) -> None:
    """BLOOM checkpoints saved from its body (bloom-560m's: "h.0.input_layernorm.weight", "word_embeddings.weight",
    no "transformer." prefix) load as transformers' own saves do."""
    from safetensors.torch import load_file, save_file

    folder, hf_model = save_tiny_model(tmp_path / "bloom", "bloom", with_tokenizer=False)
    weights = load_file(folder / "model.safetensors")
    save_file({name.removeprefix("transformer."): tensor for name, tensor in weights.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    assert "word_embeddings_layernorm.weight" in load_file(folder / "model.safetensors")
    logits = SimplePagedRunner(_load(folder)).step({0: PROMPTS[0]})
    torch.testing.assert_close(logits[0], _hf_last_logits(hf_model, PROMPTS[0]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["bloom", "gpt-neox", "falcon-new"])
def test_zero_biases_of_fused_qkv_load(tmp_path, kind: str) -> None:
    """A fused query_key_value bias of zeros (a random initialisation's: `pagedllm bench random-model`) is the biased
    model's bias, split into q/k/v's like any other, not the zero bias a checkpoint stores for an unbiased module."""
    from tests.models.tiny import build_tiny_hf_model

    model = build_tiny_hf_model(kind)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("query_key_value.bias"):
                param.zero_()
    model.save_pretrained(tmp_path / kind)
    logits = SimplePagedRunner(_load(tmp_path / kind)).step({0: PROMPTS[0]})
    torch.testing.assert_close(logits[0], _hf_last_logits(model, PROMPTS[0]), atol=ATOL, rtol=0)


@pytest.mark.parametrize(("kind", "overrides", "refused"), [
    ("mpt", dict(attn_config=dict(qk_ln=True)), "MPT with qk_ln"),
    ("mpt", dict(no_bias=False), "MPT with no_bias=False"),
    ("bloom", dict(apply_residual_connection_post_layernorm=True), "apply_residual_connection_post_layernorm")])
def test_alibi_models_options_the_layers_do_not_take_are_refused(tmp_path, kind: str, overrides: dict,
                                                                 refused: str) -> None:
    folder, _ = save_tiny_model(tmp_path / kind, kind, with_tokenizer=False, **overrides)
    with pytest.raises(ValueError, match=f"{refused}.* not supported"):
        _load(folder)


def test_apertus_runs_its_xielu_in_the_modules(tmp_path) -> None:
    """Apertus's xIELU (two parameters a layer) is not the C++ stack's: the engine runs its layers as modules, with
    transformers' greedy tokens."""
    from pagedllm import LLM, SamplingParams
    from tests.models.tiny import hf_greedy

    folder, hf_model = save_tiny_model(tmp_path / "apertus", "apertus")
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=64)
    assert llm.engine.runner.model.model.stacks is None
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(hf_model, PROMPTS, 8)

