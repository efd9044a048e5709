"""Gated DeltaNet layers (pagedllm.models.deltanet: Qwen3-Next's and Qwen3.5's) and the gated attention beside them: the
chunked rule against the rule token by token and against transformers' own, a released Qwen3.5 checkpoint's layout
(its language model beside a vision tower), a Qwen3-Next checkpoint of stacked experts, the kernel against the torch
layer, LoRA. Their logits against transformers, prefill in chunks and decode steps, run in test_llama_fidelity.py
(`qwen3.5`, `qwen3-next`, `qwen3.5-moe`); the recurrent states' bookkeeping, greedy tokens through chunks and
preemption, forks and bf16 in test_mamba.py, for both kinds of layer."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models import deltanet
from pagedllm.models.deltanet import delta_rule_chunked, delta_rule_step, l2_normed
from pagedllm.models.llama import LlamaForCausalLM
from tests.models.tiny import (
    _COMMON,
    TINY_MODELS,
    build_byte_tokenizer,
    hf_greedy,
    save_attention_adapter,
    save_tiny_model,
    tiny_config,
)

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [60, 61, 62, 63, 64], [200, 13, 9, 77, 150, 151, 40, 41, 42, 8] * 3,
           [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12, 13, 14]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _rule_inputs(length: int, start: str) -> tuple[torch.Tensor, ...]:
    """Random q and k of 2 key heads [L, 2, 8] (normed, q scaled), v of 4 value heads [L, 4, 6], g (<= 0), beta in
    (0, 1), and an initial state (None: zeros)."""
    torch.manual_seed(0)
    q, k = (l2_normed(torch.randn(length, 2, 8)) for _ in range(2))
    v, g, beta = torch.randn(length, 4, 6), -torch.rand(length, 4) * 2, torch.rand(length, 4)
    return q * 8 ** -0.5, k, v, g, beta, None if start == "zeros" else torch.randn(4, 8, 6)


@pytest.mark.parametrize("start", ["zeros", "a state"])
def test_the_chunked_rule_is_the_rule_token_by_token(start):
    """11 tokens in chunks of 4 (the last one padded), 4 value heads over 2 key heads: each token's output and the
    final state those of the rule run one token at a time."""
    q, k, v, g, beta, initial = _rule_inputs(11, start)
    out, final = delta_rule_chunked(q, k, v, g, beta, initial, chunk_size=4)
    state = torch.zeros(1, 4, 8, 6) if initial is None else initial.unsqueeze(0)
    for t in range(11):
        o, state = delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        torch.testing.assert_close(out[t], o[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, state[0], atol=1e-5, rtol=1e-5)


def test_the_chunked_rule_is_transformers():
    """`delta_rule_chunked` against transformers' own chunked rule (its reference of the FLA kernels), 70 tokens
    from a state: the outputs and the final state."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta, initial = _rule_inputs(70, "a state")
    out, final = delta_rule_chunked(q, k, v, g, beta, initial, chunk_size=16)
    expected, expected_final = torch_chunk_gated_delta_rule(
        (q * 8 ** 0.5).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
        initial_state=initial.unsqueeze(0), output_final_state=True)
    torch.testing.assert_close(out, expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, expected_final[0], atol=1e-4, rtol=1e-4)


def test_a_checkpoint_of_stacked_experts_loads(tmp_path):
    """Qwen3-Next in transformers 5's own layout (as its models hold it: each layer's experts stacked, gate_up_proj
    [E, 2I, H] and down_proj [E, H, I], beside the fused in_proj_qkvz and in_proj_ba): the greedy tokens transformers
    gives."""
    from safetensors.torch import save_file

    folder, hf_model = save_tiny_model(tmp_path / "m", "qwen3-next", seed=3)
    tensors = {name: t.contiguous() for name, t in hf_model.state_dict().items() if name != "lm_head.weight"}
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors
    (folder / "model.safetensors").unlink()
    save_file(tensors, str(folder / "model.safetensors"))
    with LLM(str(folder), dtype="float32", num_kv_blocks=64) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf_model, PROMPTS[:2], 12)


@pytest.mark.parametrize(("model_type", "kind"), [("qwen3_5", "qwen3.5"), ("qwen3_5_moe", "qwen3.5-moe")])
def test_a_released_checkpoints_language_model(tmp_path, model_type, kind):
    """Qwen3.5 is released as Qwen3_5ForConditionalGeneration (a vision tower beside the language model, under
    model.language_model.*, its rope M-RoPE's, interleaved): its text is served, the greedy tokens transformers'
    whole model gives."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = {**_COMMON, **TINY_MODELS[kind][1],
            "rope_parameters": dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                    mrope_section=[2, 1, 1], mrope_interleaved=True)}
    config = AutoConfig.for_model(model_type, text_config=text, tie_word_embeddings=True, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64))
    torch.manual_seed(0)
    hf_model = AutoModelForImageTextToText.from_config(config).eval()
    hf_model.save_pretrained(tmp_path)
    build_byte_tokenizer().save_pretrained(tmp_path)
    with LLM(str(tmp_path), dtype="float32", num_kv_blocks=64) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf_model, PROMPTS[:2], 12)


def test_lora_adapts_the_gated_attention_but_its_q_proj(tmp_path):
    """A PEFT adapter of the attention's k/v/o_proj (the one attention layer's): transformers' adapted model's greedy
    tokens; one of q_proj, whose rows hold each head's output gate too, is refused, saying so."""
    from pagedllm.lora.request import LoRARequest

    pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[dev]')")
    folder, hf_model = save_tiny_model(tmp_path / "m", "qwen3.5", seed=3)
    adapted = save_attention_adapter(hf_model, tmp_path / "kvo", modules=("k_proj", "v_proj", "o_proj"))
    save_attention_adapter(hf_model, tmp_path / "q", modules=("q_proj",))
    with LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=4, enable_lora=True) as llm:
        output = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                              lora_request=LoRARequest("kvo", 1, str(tmp_path / "kvo")))[0]
        assert output.outputs[0].token_ids == hf_greedy(adapted, PROMPTS[:1], 12)[0]
        with pytest.raises(ValueError, match="q_proj also gives each head's output gate"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("q", 2, str(tmp_path / "q")))


def test_what_the_layers_refuse():
    """A rank's slice of a Gated DeltaNet layer; value heads that are not a multiple of the key heads."""
    with pytest.raises(ValueError, match="Gated DeltaNet layers run on one rank"):
        LlamaForCausalLM(tiny_config("qwen3.5"), tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="3 value heads are not a multiple of 2 key heads"):
        LlamaForCausalLM(tiny_config("qwen3.5", linear_num_value_heads=3))


@pytest.mark.parametrize(("dtype", "value_dim"), [(torch.float32, 16), (torch.bfloat16, 16), (torch.float32, 64)])
def test_the_kernel_is_the_torch_layer(dtype, value_dim, isa_level, monkeypatch):
    """kernels.gated_delta_forward against the layer's torch path on random weights, one step of four sequences: a
    decode step from a state, a prompt's first chunk of 7 tokens, a chunk of 2 tokens from a state (fewer than the
    convolution's 3 inputs kept), a prompt of one token; 2 key heads each read by 2 value heads, of 16 values (part
    of a task's 32 columns) or 64 (two whole blocks, whose decode rows go to the write slot by `stream_lines`, at
    each ISA level its own stores). The output, and the states each writes to its write slot (the read slots left as
    they were), in float32 within float rounding (the rule token by token against its chunked form), in bf16 within
    its rounding. (Heads of 64 in bf16 are left out: there a few outputs of a near-zero head RMS move by a quarter
    through bf16's roundings, torch's own bf16 path 0.09 from float32, the kernel's 0.12, the same before the
    streamed rows; the rows' stores are the same code for every dtype.)"""
    from pagedllm.attention.metadata import AttentionMetadata
    from pagedllm.core.sched.output import ScheduledRequest
    from pagedllm.kernels import cpu_kernels
    from pagedllm.models.recurrent import RecurrentStates

    torch.manual_seed(0)
    mixer = deltanet.GatedDeltaNet(tiny_config("qwen3.5", linear_value_head_dim=value_dim), dtype, (0, 1), 0)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn_like(param.float()).to(dtype) * (0.2 if param.dim() == 2 else 0.5)
                        + (1.0 if param is mixer.norm.weight else 0.0))
    states = RecurrentStates([mixer], 4, dtype, torch.device("cpu"))
    for pool in states.pools[0]:
        pool.copy_(torch.randn_like(pool.float()).to(dtype) * 0.5)
    states.lengths.update(a=5, c=9)
    chunks = (("a", 5, 1), ("b", 0, 7), ("c", 9, 2), ("d", 0, 1))
    step = states.begin([ScheduledRequest(name, [], start, [1] * n, True) for name, start, n in chunks])
    assert step.read_slots.tolist() == [step.read_slots[0], -1, step.read_slots[2], -1]
    starts = torch.tensor([0, 1, 8, 10, 11], dtype=torch.int32)
    meta = AttentionMetadata(torch.zeros(11, dtype=torch.long), starts, torch.tensor([6, 7, 11, 1], dtype=torch.int32),
                             torch.zeros(4, 1, dtype=torch.int32), 7, 11, recurrent=step)
    x = torch.randn(11, 64).to(dtype)
    before = [pool.clone() for pool in states.pools[0]]
    monkeypatch.setattr(deltanet, "kernels_for", lambda _: None)
    monkeypatch.setattr(deltanet, "SCAN_CHUNK", 4)
    expected = mixer(torch.zeros(11, dtype=torch.long), x, [], meta)
    expected_pools = [pool.clone() for pool in states.pools[0]]
    for pool, saved in zip(states.pools[0], before):
        pool.copy_(saved)
    monkeypatch.setattr(deltanet, "kernels_for", lambda _: cpu_kernels())
    out = mixer(torch.zeros(11, dtype=torch.long), x, [], meta)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out, expected, **tolerance)
    for pool, reference, saved in zip(states.pools[0], expected_pools, before):
        torch.testing.assert_close(pool, reference, **tolerance)
        reads = step.read_slots[step.read_slots >= 0]
        assert torch.equal(pool[reads], saved[reads])
