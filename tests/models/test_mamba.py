"""Mamba-2 layers (pagedllm.models.mamba: Granite 4's hybrid models) and the engine around recurrent states (theirs and
Gated DeltaNet's: greedy tokens through chunks and preemption, forks and bf16 for both kinds): the chunked scan
against the recurrence, the models' greedy tokens against transformers through prefill chunks, preemption and forks,
what the engine turns off for them and what it refuses. Their logits against transformers, prefill in chunks and
decode steps, run in test_llama_fidelity.py (`granite4-hybrid`, `granite4-hybrid-dense`)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.sched.output import ScheduledRequest
from pagedllm.models import deltanet, mamba
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.mamba import Mamba2Mixer, ssd_scan, ssd_step
from pagedllm.models.recurrent import RecurrentStates
from tests.models.tiny import clear_first_tokens, hf_greedy, save_attention_adapter, save_tiny_model, tiny_config

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [60, 61, 62, 63, 64], [200, 13, 9, 77, 150, 151, 40, 41, 42, 8] * 3,
           [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12, 13, 14]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _scan_inputs(length: int, head_dim: int, state: int, start: str) -> tuple[torch.Tensor, ...]:
    """Random x [L, 6, P], dt, a, b and c of 2 groups [L, 2, N], and an initial state (None: zeros)."""
    torch.manual_seed(0)
    x, b, c = torch.randn(length, 6, head_dim), torch.randn(length, 2, state), torch.randn(length, 2, state)
    dt, a = torch.rand(length, 6) * 0.5, -torch.rand(6) * 2
    return x, dt, a, b, c, None if start == "zeros" else torch.randn(6, head_dim, state)


@pytest.mark.parametrize("start", ["zeros", "a state"])
def test_the_chunked_scan_is_the_recurrence_token_by_token(start):
    """11 tokens in chunks of 4 (the last one padded), 6 heads in 2 groups: each token's output and the final state
    those of the recurrence run one token at a time."""
    length, heads, head_dim, state = 11, 6, 4, 5
    x, dt, a, b, c, initial = _scan_inputs(length, head_dim, state, start)
    y, final = ssd_scan(x, dt, a, b, c, initial, chunk_size=4)
    h = torch.zeros(1, heads, head_dim, state) if initial is None else initial.unsqueeze(0)
    for t in range(length):
        out, h = ssd_step(x[t:t + 1], dt[t:t + 1], a, b[t:t + 1], c[t:t + 1], h)
        torch.testing.assert_close(y[t], out[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, h[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("kind", ["granite4-hybrid", "granite4-hybrid-dense", "qwen3.5", "qwen3-next", "qwen3.5-moe"])
def test_greedy_tokens_match_transformers_through_chunks_and_preemption(tmp_path, kind, kernels, monkeypatch):
    """Four prompts batched in prefill chunks of 16 tokens (the 30-token one over two steps), in a pool of 24 blocks
    of 4 tokens that must preempt, through the kernels (mamba2_scan and mamba2_decode; gated_delta_forward) and
    through torch (the chunked forms in chunks of 4: a step's tokens over several, from where the last step
    stopped), Mamba-2 layers (Granite 4's) and Gated DeltaNet layers (Qwen3.5's, Qwen3-Next's, Qwen3.5-MoE's):
    transformers' greedy tokens, one prompt at a time; prefix caching is off (a block holds no state), so a prompt
    seen before runs again whole, to the same tokens."""
    if not kernels:
        monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
    monkeypatch.setattr(mamba, "SCAN_CHUNK", 4)
    monkeypatch.setattr(deltanet, "SCAN_CHUNK", 4)
    folder, hf_model = save_tiny_model(tmp_path / "m", kind, seed=3)
    expected = hf_greedy(hf_model, PROMPTS, 12)
    with LLM(str(folder), dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=16,
             max_num_seqs=4) as llm:
        assert not llm.engine.config.cache.enable_prefix_caching
        assert llm.engine.config.scheduler.preemption_mode == "recompute"
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert llm.engine.make_stats().num_preemptions_total["recompute"], "the pool was meant to force preemption"
        again = llm.generate([{"prompt_token_ids": PROMPTS[3]}], GREEDY, use_tqdm=False)[0]
        assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == expected[3]
        runner = llm.engine.runner     # (a request's last step's finish reaches the runner with the next step)
        assert set(runner.recurrent.pairs) <= set(runner.requests) and len(runner.recurrent.pairs) <= 1


@pytest.mark.parametrize("kind", ["granite4-hybrid", "qwen3-next"])
def test_parallel_samples_fork_the_prompts_state(tmp_path, kind):
    """n = 3 greedy samples of one prompt: the children fork off the request after its prompt, each with a copy of
    its recurrent states (Mamba-2's, Gated DeltaNet's), so each gives the prompt's greedy tokens."""
    folder, hf_model = save_tiny_model(tmp_path / "m", kind, seed=3)
    with LLM(str(folder), dtype="float32", block_size=4, num_kv_blocks=64) as llm:
        output = llm.generate([{"prompt_token_ids": PROMPTS[2]}],
                              SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in output.outputs] == hf_greedy(hf_model, PROMPTS[2:3], 8) * 3


@pytest.mark.parametrize("kind", ["granite4-hybrid", "qwen3-next"])
def test_a_bfloat16_hybrid_model_runs_close_to_float32(tmp_path, kind):
    """bf16 weights and states: each prompt's first greedy token float32's, where float32's top two logits are not a
    near tie and transformers' own model in bf16 keeps its token."""
    folder, hf_model = save_tiny_model(tmp_path / "m", kind, seed=3)
    tokens, clear = clear_first_tokens(hf_model, PROMPTS)
    with LLM(str(folder), dtype="bfloat16", block_size=4, num_kv_blocks=64) as llm:
        assert llm.engine.runner.recurrent.pools[0][1].dtype == torch.bfloat16
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=1),
                               use_tqdm=False)
    for i in clear:
        assert outputs[i].outputs[0].token_ids == [tokens[i]]


def test_the_states_take_their_share_of_the_kv_budget(tmp_path):
    """Each running request's states (and a step's new ones) come out of the KV budget, at most half of it:
    max_num_seqs is lowered to what fits."""
    folder, _ = save_tiny_model(tmp_path / "m", "granite4-hybrid-dense", seed=3, with_tokenizer=False)
    budget = 1 << 20
    with LLM(str(folder), dtype="float32", kv_cache_memory=budget, max_num_seqs=256, skip_tokenizer_init=True) as llm:
        per_request = llm.engine.runner.recurrent_bytes_per_request
        assert llm.engine.config.scheduler.max_num_seqs == budget // 2 // per_request < 256
        assert len(llm.engine.runner.recurrent.free) == llm.engine.config.scheduler.max_num_seqs


def test_what_a_hybrid_model_refuses(tmp_path):
    """Speculative decoding (a rejected draft cannot be taken out of a state), beam search (its beams fork between
    steps), a rank's slice of a Mamba-2 layer."""
    from pagedllm import BeamSearchParams

    folder, _ = save_tiny_model(tmp_path / "m", "granite4-hybrid-dense", seed=3, with_tokenizer=False)
    with pytest.raises(ValueError, match="speculative decoding is not supported with recurrent layers"):
        LLM(str(folder), dtype="float32", skip_tokenizer_init=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with LLM(str(folder), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64) as llm, \
            pytest.raises(ValueError, match="beam search is not supported with .* recurrent layers"):
        llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match="Mamba-2 layers run on one rank"):
        LlamaForCausalLM(tiny_config("granite4-hybrid-dense"), tp_rank=0, tp_size=2)


def test_a_step_that_raised_leaves_the_states_as_they_were():
    """`RecurrentStates` changes a request's states only on commit: a step begun and not committed (it raised) is
    begun again from the same states; a chunk that starts where no state stopped is a RuntimeError."""
    mixer = Mamba2Mixer(tiny_config("granite4-hybrid-dense"), torch.float32, (0, 1), 0)
    states = RecurrentStates([mixer], 2, torch.float32, torch.device("cpu"))
    first = states.begin([ScheduledRequest("a", [], 0, [1, 2, 3], True)])
    assert first.read_slots.tolist() == [-1] and torch.equal(first.read(mixer, torch.float32)[1],
                                                              torch.zeros(1, *mixer.state_shapes()[1]))
    conv, ssm = (torch.ones(1, *shape) for shape in mixer.state_shapes())
    first.write(mixer, conv, ssm)
    states.commit(first, {})
    assert states.lengths == {"a": 3}
    second = states.begin([ScheduledRequest("a", [], 3, [4], True)])
    assert second.read_slots.tolist() == first.write_slots.tolist() != second.write_slots.tolist()
    second.write(mixer, conv * 2, ssm * 2)      # (never committed: the step raised)
    again = states.begin([ScheduledRequest("a", [], 3, [4], True)])
    assert torch.equal(again.read(mixer, torch.float32)[1], ssm) and states.lengths == {"a": 3}
    with pytest.raises(RuntimeError, match="states cover 3 tokens, its chunk starts at 5"):
        states.begin([ScheduledRequest("a", [], 5, [6], True)])
    states.release("a")
    assert states.free == [1, 0] and not states.lengths


def test_lora_adapts_the_attention_layers_and_refuses_a_mamba_layer(tmp_path):
    """A PEFT adapter of the attention's q/v/o_proj (the hybrid's one attention layer, its second): the adapted
    model's greedy tokens; one naming layer 0's (a Mamba-2 layer's) o_proj is refused, saying so."""
    import json

    from safetensors.torch import save_file

    from pagedllm.lora.request import LoRARequest

    pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[dev]')")
    folder, hf_model = save_tiny_model(tmp_path / "m", "granite4-hybrid-dense", seed=3)
    model = save_attention_adapter(hf_model, tmp_path / "attn")
    (tmp_path / "mamba").mkdir()
    config = json.loads((tmp_path / "attn" / "adapter_config.json").read_text())
    (tmp_path / "mamba" / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["o_proj"]}))
    save_file({"base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight": torch.zeros(4, 128),
               "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight": torch.zeros(64, 4)},
              str(tmp_path / "mamba" / "adapter_model.safetensors"))
    with LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=4, enable_lora=True) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY, use_tqdm=False,
                               lora_request=[LoRARequest("attn", 1, str(tmp_path / "attn")), None])
        assert [o.outputs[0].token_ids for o in outputs] == \
            [hf_greedy(model, PROMPTS[:1], 12)[0], hf_greedy(hf_model, PROMPTS[1:2], 12)[0]]
        with pytest.raises(ValueError, match="layer 0 is no attention"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("mamba", 2, str(tmp_path / "mamba")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_kernel_is_the_torch_step(dtype, isa_level):
    """kernels.mamba2_decode against `Mamba2Mixer._decode_native` (its torch reference) on random weights: three
    sequences, one starting at zero (read slot -1), 6 heads in 2 groups, a conv bias; the output, and the states
    each writes to its write slot (the read slots left as they were), in float32 within float rounding, in bf16
    within its rounding."""
    from pagedllm.kernels import cpu_kernels

    config = tiny_config("granite4-hybrid", mamba_n_heads=6, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=16,
                         hidden_size=48, mamba_expand=1)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(config, dtype, (0, 1), 0)
    with torch.no_grad():
        for param in (mixer.conv1d.weight, mixer.conv1d.bias, mixer.dt_bias, mixer.A_log, mixer.D, mixer.norm.weight):
            param.copy_(torch.randn_like(param) * 0.5 + (1.0 if param is mixer.norm.weight else 0.0))
    states = RecurrentStates([mixer], 4, dtype, torch.device("cpu"))
    for pool in states.pools[0]:
        pool.copy_(torch.randn_like(pool.float()).to(dtype))
    scheduled = [ScheduledRequest(name, [], start, [1], True) for name, start in (("a", 5), ("b", 0), ("c", 9))]
    states.lengths.update(a=5, c=9)
    step = states.begin(scheduled)
    assert step.read_slots.tolist()[1] == -1
    xbc, dt, gate = (torch.randn(3, n).to(dtype) for n in (mixer.conv_dim, mixer.num_heads, mixer.inner))
    before = [pool.clone() for pool in states.pools[0]]
    expected = mixer._decode_native(step, gate, xbc, dt)
    expected_pools = [pool.clone() for pool in states.pools[0]]
    for pool, saved in zip(states.pools[0], before):
        pool.copy_(saved)
    out = torch.empty_like(gate)
    cpu_kernels().mamba2_decode(out, xbc, dt, gate, *states.pools[0], step.read_slots, step.write_slots,
                                mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.dt_bias, mixer._a(), mixer.D,
                                mixer.norm.weight, mixer.norm.eps, mixer.groups, mixer.dt_min, mixer.dt_max)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out, expected, **tolerance)
    for pool, reference, saved in zip(states.pools[0], expected_pools, before):
        torch.testing.assert_close(pool, reference, **tolerance)
        reads = step.read_slots[step.read_slots >= 0]
        assert torch.equal(pool[reads], saved[reads])


@pytest.mark.parametrize("start", ["zeros", "a state"])
def test_the_scan_kernel_is_the_chunked_scan(start, isa_level):
    """kernels.mamba2_scan (token by token) against `ssd_scan` (torch's chunked form, its reference): 70 tokens, 6
    heads in 2 groups, from zeros or from a state; the outputs and the final state within float rounding."""
    from pagedllm.kernels import cpu_kernels

    x, dt, a, b, c, initial = _scan_inputs(70, 8, 16, start)
    expected_y, expected_state = ssd_scan(x, dt, a, b, c, initial, chunk_size=16)
    y, final = torch.empty_like(x), torch.empty(6, 8, 16)
    cpu_kernels().mamba2_scan(y, final, x, dt, a, b, c, initial)
    torch.testing.assert_close(y, expected_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, expected_state, atol=1e-4, rtol=1e-4)

