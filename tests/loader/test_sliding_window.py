"""Models whose layers attend over sliding windows (Mistral 7B v0.1; Qwen2 and Qwen3 with use_sliding_window) run
their whole context, each such layer reading its window of the cache, and answer as transformers does; a model whose
every layer has one frees each sequence's blocks behind it; with disable_sliding_window, their context is the window
and every layer attends over all of it."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.loader import max_model_len_of
from pagedllm.models.llama import kv_window, sliding_window_of_layer
from tests.models.tiny import hf_greedy, save_tiny_model, tiny_config


def test_each_layer_reads_its_window_from_the_config():
    mistral = tiny_config("mistral", sliding_window=64, num_hidden_layers=3)     # max_position_embeddings 256
    assert [sliding_window_of_layer(mistral, i) for i in range(3)] == [64, 64, 64]
    assert max_model_len_of(mistral, None) == 256                               # the window caps nothing
    assert sliding_window_of_layer(tiny_config("mistral", sliding_window=None), 0) == 0
    assert sliding_window_of_layer(tiny_config("mistral", sliding_window=256), 0) == 0   # the whole context
    # Qwen2 and Qwen3 slide only with use_sliding_window, in their layers from max_window_layers on
    qwen2 = tiny_config("qwen2", sliding_window=64, use_sliding_window=True, max_window_layers=1, num_hidden_layers=3)
    assert [sliding_window_of_layer(qwen2, i) for i in range(3)] == [0, 64, 64]
    assert sliding_window_of_layer(tiny_config("qwen2", sliding_window=64, use_sliding_window=False), 1) == 0
    qwen3 = tiny_config("qwen3", sliding_window=64, use_sliding_window=True, max_window_layers=1)
    assert [sliding_window_of_layer(qwen3, i) for i in range(2)] == [0, 64]
    # the cache frees blocks behind a window only where every layer has one
    assert kv_window(mistral) == 64
    assert kv_window(tiny_config("qwen2", sliding_window=64, use_sliding_window=True, max_window_layers=0)) == 64
    assert kv_window(qwen2) == kv_window(qwen3) == kv_window(tiny_config("gemma3")) == 0
    assert kv_window(tiny_config("mistral", sliding_window=None)) == 0
    # disable_sliding_window caps the context at the smallest window; one without a window is left as it is
    assert max_model_len_of(mistral, None, disable_sliding_window=True) == 64
    assert max_model_len_of(qwen2, 32, disable_sliding_window=True) == 32
    with pytest.raises(ValueError, match="larger than the model's sliding window"):
        max_model_len_of(mistral, 100, disable_sliding_window=True)
    assert max_model_len_of(tiny_config("mistral", sliding_window=None), None, disable_sliding_window=True) == 256


@pytest.mark.parametrize(("kind", "overrides"), [
    ("mistral", dict(sliding_window=16)),
    ("qwen2", dict(sliding_window=12, use_sliding_window=True, max_window_layers=1)),   # layer 0 sees everything
    ("gemma3", dict()),                                 # a local layer over 12 keys, a global one
    ("gemma2", dict()),                                 # the same, soft-capped scores and logits
])
@pytest.mark.parametrize("mode", ["kernels", "torch", "ngram"])
def test_a_sliding_window_model_answers_as_transformers_past_its_window(tmp_path, kind, overrides, mode, monkeypatch):
    """Prompts and answers several windows long, prefilled in chunks, the second prompt hitting the first's cached
    blocks; through the C++ kernels, the torch paths, and the kernels verifying n-gram drafts: pagedllm's greedy
    tokens are transformers' (whose masks hide the keys outside each window)."""
    if mode == "torch":
        monkeypatch.setenv("PAGEDLLM_DISABLE_KERNELS", "1")
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    folder, hf_model = save_tiny_model(tmp_path / "m", kind, **overrides)
    first = [3 + (7 * i) % 200 for i in range(45)]
    prompts = [first, first[:32] + [100, 101, 102, 103, 104]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
             enable_prefix_caching=True, speculative_config=speculative if mode == "ngram" else None) as llm:
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
        assert outs[1].num_cached_tokens >= 32
        if mode == "ngram":
            assert llm.engine.make_stats().spec_decoding.num_accepted_tokens > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf_model, prompts, 40)


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_disable_sliding_window_runs_the_window_with_every_layer_attending_over_it(tmp_path, kind):
    """vLLM's disable_sliding_window: the context is the window, every layer sees all of it, and the answers within
    it are transformers' (whose windows hide nothing there)."""
    folder, hf_model = save_tiny_model(tmp_path / "m", kind, **(dict(sliding_window=16) if kind == "mistral" else {}))
    window = 16 if kind == "mistral" else 12
    prompt = [3 + (7 * i) % 200 for i in range(window - 6)]
    with LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=4, disable_sliding_window=True) as llm:
        assert llm.engine.max_model_len == window
        assert all(getattr(m, "sliding_window", 0) == 0 for m in llm.engine.runner.model.modules())
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6,
                                                                          ignore_eos=True), use_tqdm=False)[0]
    assert [out.outputs[0].token_ids] == hf_greedy(hf_model, [prompt], 6)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_every_layer_sliding_frees_the_blocks_behind_the_window(tmp_path, preemption_mode):
    """Mistral over a 16-token window holds at most the blocks its window spans: four 60-token sequences, 60 blocks
    of context in all, run side by side in a pool of 23 with room to spare (a full-attention model's would be
    preempted), and answer as transformers does; in a pool of 13, where they must be preempted (by recompute or by
    swap, the freed blocks left behind; each admitted on its first chunk, not once all of it fits), they still do."""
    folder, hf_model = save_tiny_model(tmp_path / "m", "mistral", sliding_window=16)
    prompts = [[3 + (7 * i + j) % 200 for i in range(20)] for j in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = hf_greedy(hf_model, prompts, 40)
    for num_blocks, preempted in [(24, False), (14, True)]:
        with LLM(str(folder), dtype="float32", num_kv_blocks=num_blocks, block_size=4, max_num_batched_tokens=16,
                 preemption_mode=preemption_mode, swap_space=0.001, scheduler_reserve_full_isl=False) as llm:
            # a sequence holds at most the 5 blocks that 16 keys span
            assert llm.engine.kv_cache_manager.window == 16
            assert llm.engine.capacity.max_concurrent_seqs == (num_blocks - 1) / 5
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            stats = llm.engine.make_stats()
            assert bool(sum(stats.num_preemptions_total.values())) == preempted, stats.num_preemptions_total
            if preempted and preemption_mode == "swap":
                assert stats.num_preemptions_total.get("swap"), stats.num_preemptions_total
            llm.engine.kv_cache_manager.check_integrity()
            assert llm.engine.kv_cache_manager.num_free_blocks == num_blocks - 1
        assert [o.outputs[0].token_ids for o in outs] == expected


def test_a_sequence_longer_than_the_pool_runs_within_its_window(tmp_path):
    """A 48-token prompt needs 12 blocks of 4, more than a pool of 9 holds; over a 16-token window, computing at most
    16 tokens a step, it holds at most 9 at once, so it runs (vLLM sizes a sliding window's pool so) and answers as
    transformers does, where a model without a window is refused it."""
    prompt = [3 + (7 * i) % 200 for i in range(48)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for window in (16, None):
        folder, hf_model = save_tiny_model(tmp_path / f"m{window}", "mistral", sliding_window=window)
        with LLM(str(folder), dtype="float32", num_kv_blocks=10, block_size=4, max_num_batched_tokens=16) as llm:
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        if window:
            assert [out.token_ids] == hf_greedy(hf_model, [prompt], 16)
        else:
            assert out.finish_reason == "abort" and not out.token_ids
