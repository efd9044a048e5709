"""The engine on a CUDA device: fidelity against Hugging Face transformers, prefix sharing, both preemption modes,
the server, the start-up profile run, and decode steps replayed from CUDA graphs against eager ones. Marked `gpu`:
skipped, with the reason, where torch sees no CUDA device.

Each test compares CUDA's tokens with the CPU's (or transformers') on the same float32 weights: the Triton kernel
multiplies float32 in IEEE precision, so greedy tokens agree over these short generations."""

from __future__ import annotations

import logging

import httpx
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention import triton_attention
from tests.entrypoints.server_utils import start_server
from tests.models.test_smollm2_gguf import QUESTIONS
from tests.runner.test_cuda_graphs import MAX_NUM_SEQS, greedy_with_logprobs
from tests.test_sharing import PRESSURE_PROMPTS, SYSTEM, _greedy, _prompt, _tokens

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture(scope="module")
def tiny_cpu_tokens(tiny):
    """The tiny model's greedy tokens for PRESSURE_PROMPTS on the CPU, in a roomy pool."""
    llm = LLM(model=tiny[0], dtype="float32", block_size=4, num_kv_blocks=512, device="cpu")
    return _tokens(llm.generate(PRESSURE_PROMPTS, _greedy(24), use_tqdm=False))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.models.tiny import save_tiny_model

    folder, hf_model = save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa", seed=3)
    return str(folder), hf_model


def _cuda_llm(model: str | None, **kw) -> LLM:
    return LLM(model=model, dtype="float32", device="cuda", **kw)


def test_greedy_chat_tokens_on_cuda_match_transformers(smol_hf, caplog):
    hf_model, hf_tokenizer = smol_hf
    pagedllm_logger = logging.getLogger("pagedllm")     # it does not propagate to the root, where caplog listens
    pagedllm_logger.addHandler(caplog.handler)
    try:
        llm = _cuda_llm(None, gpu_memory_utilization=0.5, max_model_len=2048)
    finally:
        pagedllm_logger.removeHandler(caplog.handler)
    assert "device cuda:" in caplog.text and "profile run:" in caplog.text and "KV cache:" in caplog.text
    layer = llm.engine.runner.model.model.layers[0].self_attn
    assert layer.attn_backend is triton_attention.paged_attention
    conversations = [[{"role": "user", "content": c}] for c in QUESTIONS]
    ours = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for conversation, out in zip(conversations, ours):
        ids = hf_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
        with torch.inference_mode():
            hf_out = hf_model.generate(ids, max_new_tokens=24, do_sample=False)
        assert out.outputs[0].token_ids == hf_out[0, ids.shape[1]:].tolist(), conversation


def test_prefix_sharing_on_cuda_changes_no_token(tiny):
    prompts = [SYSTEM + _prompt(40 + i, 5 + i) for i in range(4)]
    on = _cuda_llm(tiny[0], block_size=4, num_kv_blocks=256)
    off = _cuda_llm(tiny[0], block_size=4, num_kv_blocks=256, enable_prefix_caching=False)
    on.generate(SYSTEM + [5], _greedy(1), use_tqdm=False)        # the shared prefix cached before the batch
    assert _tokens(on.generate(prompts, _greedy(), use_tqdm=False)) == \
        _tokens(off.generate(prompts, _greedy(), use_tqdm=False))
    assert on.engine.prefix_cache_stats.num_hit_tokens > 0
    forked = on.generate(SYSTEM, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=8), use_tqdm=False)
    assert len(forked[0].outputs) == 4


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_on_cuda_gives_the_cpus_tokens(tiny, tiny_cpu_tokens, mode):
    llm = _cuda_llm(tiny[0], block_size=4, num_kv_blocks=24, swap_space=40 * 2048 / 2**30, preemption_mode=mode,
                    max_num_batched_tokens=32)
    assert llm.engine.runner.swap is not None and llm.engine.runner.swap.kv.is_pinned()
    assert _tokens(llm.generate(PRESSURE_PROMPTS, _greedy(24), use_tqdm=False)) == tiny_cpu_tokens
    assert llm.engine.scheduler.num_preemptions_by_mode[mode] > 0


def test_swapped_blocks_survive_the_step_that_writes_into_them():
    """A swap-out's copy to the host runs on a stream of its own under the next step: the step writing into the
    freed blocks at once must not reach the swapped rows, and a swap-in's rows are there before the step reads."""
    from pagedllm.runner.kv_tensors import KVLayout, SwapSpace, allocate_kv

    cuda = torch.device("cuda")
    layout = KVLayout(num_layers=8, num_kv_heads=4, head_dim=128, dtype=torch.float16)
    kv, pool = allocate_kv(layout, 256, 16, cuda).normal_(), SwapSpace(layout, 64, 16, cuda)
    going_out = kv[:, :, [5, 9, 2, *range(100, 140)]].clone()
    pool.move(kv, [(5, 0), (9, 63), (2, 7), *((b, b - 90) for b in range(100, 140))], [])
    kv.fill_(7)                                           # the step writes everywhere, the freed blocks too
    pool.move(kv, [], [(63, 200), (0, 201), (7, 202), *((b - 90, b + 110) for b in range(100, 140))])
    assert torch.equal(kv[:, :, [201, 200, 202, *range(210, 250)]], going_out)


def test_the_server_answers_on_cuda(tiny):
    llm = _cuda_llm(tiny[0], block_size=4, num_kv_blocks=256)
    running = start_server(llm.engine)
    try:
        reply = httpx.post(f"{running.base_url}/v1/completions", headers=running.headers, timeout=60,
                           json={"model": running.model_name, "prompt": [3, 4, 5, 6], "max_tokens": 5,
                                 "temperature": 0})
        assert reply.status_code == 200
        assert reply.json()["usage"]["completion_tokens"] == 5
    finally:
        running.stop()


def test_cuda_graphs_give_the_eager_tokens(tiny):
    graphs = _cuda_llm(tiny[0], block_size=4, num_kv_blocks=256, max_num_seqs=MAX_NUM_SEQS)
    eager = _cuda_llm(tiny[0], block_size=4, num_kv_blocks=256, max_num_seqs=MAX_NUM_SEQS, enforce_eager=True)
    assert graphs.engine.runner.decode_graphs.sizes == [1, 2, 4, 8] and eager.engine.runner.decode_graphs is None
    (tokens, logprobs), (eager_tokens, eager_logprobs) = greedy_with_logprobs(graphs), greedy_with_logprobs(eager)
    assert tokens == eager_tokens
    torch.testing.assert_close(logprobs, eager_logprobs, rtol=0, atol=1e-4)
