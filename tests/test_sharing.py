"""Sharing and memory pressure end to end, on a tiny random Llama (fast): prefix caching, parallel sampling with
copy-on-write, beam search (against Hugging Face transformers), swap / recompute / auto preemption, priorities."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.request import RequestStatus
from pagedllm.engine.beam_search import BeamSearchParams, beam_score
from tests.models.tiny import save_tiny_model

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, hf_model = save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa", seed=3)
    return str(folder), hf_model


def _llm(tiny, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 512)
    return LLM(model=tiny[0], dtype="float32", block_size=BLOCK_SIZE, **kw)


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 259, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(max_tokens: int = 10, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _run_checked(llm: LLM, max_steps: int = 5000) -> list:
    """Step the engine to the end, checking both pools' integrity (and shared ref counts) after every step."""
    engine, finished = llm.engine, []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        finished += [o for o in engine.step() if o.finished]
        engine.kv_cache_manager.check_integrity()
    raise AssertionError("did not finish")


# ---- prefix caching -------------------------------------------------------------------------------------------
SYSTEM = _prompt(0, 23)                                            # 5 full blocks + 3 tokens


def test_cache_on_and_off_give_the_same_tokens_greedy_and_seeded(tiny):
    prompts = [SYSTEM + _prompt(i, 3 + 5 * i) for i in range(1, 5)]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)
    results = []
    for caching in (True, False):
        llm = _llm(tiny, enable_prefix_caching=caching)
        llm.generate(SYSTEM + [5], _greedy(1), use_tqdm=False)      # warm the cache with the shared prefix
        results.append((_tokens(llm.generate(prompts, _greedy(), use_tqdm=False)),
                        _tokens(llm.generate(prompts, seeded, use_tqdm=False))))
        hits = llm.engine.prefix_cache_stats.num_hit_tokens
        assert (hits > 0) == caching
    assert results[0] == results[1]


def test_a_cascade_over_a_long_shared_prompt_gives_the_tokens_of_separate_attention(tiny, monkeypatch):
    """32 requests after a 130-token system prompt: with the cache their steps share its first 32 blocks, and
    attention runs as a cascade over 128 of them (the kernels' own test of the batch, on each step's metadata);
    without it nothing is shared, and with disable_cascade_attn no step runs one. Same greedy tokens."""
    import pagedllm.runner.model_runner as model_runner
    from pagedllm.attention.cpu import cascade_prefix_len

    system = _prompt(0, 130)
    prompts = [system + _prompt(i, 3 + i % 8) for i in range(32)]
    results, metas = [], []
    build = model_runner.build_model_inputs

    def recording_build(*args):
        inputs = build(*args)
        metas.append(inputs.meta)
        return inputs

    monkeypatch.setattr(model_runner, "build_model_inputs", recording_build)
    for caching, disable in ((True, False), (False, False), (True, True)):   # the CPU kernels' cascade, on the CPU
        llm = _llm(tiny, enable_prefix_caching=caching, disable_cascade_attn=disable, device="cpu")
        llm.generate(system + [5], _greedy(1), use_tqdm=False)
        metas.clear()
        results.append(_tokens(llm.generate(prompts, _greedy(), use_tqdm=False)))
        hf_config = tiny[1].config
        query = torch.zeros(1, hf_config.num_attention_heads, 16)
        k_cache = torch.zeros(1, BLOCK_SIZE, hf_config.num_key_value_heads, 16)
        cascades = [cascade_prefix_len(query, k_cache, meta) for meta in metas]
        assert (max(cascades) == 128) == (caching and not disable), cascades
    assert results[0] == results[1] == results[2]


def test_a_shared_system_prompt_reuses_exactly_its_full_blocks(tiny):
    llm = _llm(tiny)
    first = llm.generate(SYSTEM + [7, 8], _greedy(2), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    stats = llm.engine.prefix_cache_stats
    hits_before, queries_before = stats.num_hit_tokens, stats.num_query_tokens
    prompts = [SYSTEM + _prompt(i, 6) for i in range(10, 14)]
    outs = llm.generate(prompts, _greedy(2), use_tqdm=False)
    full_prefix = len(SYSTEM) // BLOCK_SIZE * BLOCK_SIZE
    assert [o.num_cached_tokens for o in outs] == [full_prefix] * 4
    assert stats.num_hit_tokens - hits_before == 4 * full_prefix
    assert stats.num_query_tokens - queries_before == sum(len(p) for p in prompts)
    assert llm.reset_prefix_cache()
    assert llm.generate(prompts[0], _greedy(2), use_tqdm=False)[0].num_cached_tokens == 0


def test_a_cold_batch_shares_its_system_prompt_within_the_first_step(tiny):
    """Nothing cached yet: the prompts admitted in the first step hit the blocks of the system prompt that step
    computes (cached when planned, as vLLM does) and read them in the same forward pass: the tokens of the
    prompts run alone, and every prompt after the first reuses the prefix's full blocks."""
    prompts = [SYSTEM + _prompt(i, 6) for i in range(20, 24)]
    alone = [_tokens(_llm(tiny).generate(p, _greedy(), use_tqdm=False))[0] for p in prompts]
    llm = _llm(tiny)
    for prompt in prompts:
        llm.engine.add_request(f"r{len(llm.engine._tracked)}", {"prompt_token_ids": prompt}, _greedy())
    first_step = llm.engine.scheduler.schedule
    sizes = []

    def schedule():
        out = first_step()
        sizes.append(len(out.scheduled))
        return out
    llm.engine.scheduler.schedule = schedule
    outs = sorted(_run_checked(llm), key=lambda o: o.request_id)
    assert sizes[0] == len(prompts)                                 # all four in the first step
    assert _tokens(outs) == alone
    full_prefix = len(SYSTEM) // BLOCK_SIZE * BLOCK_SIZE
    assert [o.num_cached_tokens for o in outs] == [0] + [full_prefix] * 3


# ---- parallel sampling ------------------------------------------------------------------------------------------
def test_n4_shares_the_prompt_blocks_and_copies_the_partial_one_bit_for_bit(tiny):
    llm = _llm(tiny)
    engine, manager = llm.engine, llm.engine.kv_cache_manager
    prompt = _prompt(1, 50)                                        # 12 full blocks + 2 tokens
    engine.add_request("p", prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))
    out = engine.scheduler.schedule()
    engine.scheduler.update_from_output(out, engine.runner.execute(out))
    ids = ["p", "p#1", "p#2", "p#3"]
    tables = [manager.get_block_ids(i) for i in ids]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 13
    assert manager.get_ref_counts("p") == [4] * 13
    assert manager.num_usable_blocks - manager.num_free_blocks == 13  # the prompt's blocks, once
    manager.check_integrity()

    # Next step: three sequences copy the shared partial block (the fourth writes in place) before the forward.
    out = engine.scheduler.schedule()
    shared = tables[0][12]
    assert sorted(src for src, _ in out.blocks_to_copy) == [shared] * 3
    kv = engine.runner.kv
    before = kv[:, :, shared, :2].clone()                          # the 2 prompt tokens' K/V in that block
    engine.scheduler.update_from_output(out, engine.runner.execute(out))
    for _, dst in out.blocks_to_copy:
        assert torch.equal(kv[:, :, dst, :2], before)              # bit for bit
    assert torch.equal(kv[:, :, shared, :2], before)
    assert [manager.get_block_ids(i)[:12] for i in ids] == [tables[0][:12]] * 4
    assert manager.get_ref_counts("p")[:12] == [4] * 12
    assert manager.num_usable_blocks - manager.num_free_blocks == 12 + 4  # shared prefix + one own block each
    outputs = _run_checked(llm)
    assert [c.index for c in outputs[0].outputs] == [0, 1, 2, 3]
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_n_completions_are_reproducible_whatever_the_batch(tiny):
    llm = _llm(tiny)
    prompt = _prompt(2, 30)
    params = SamplingParams(n=4, temperature=1.0, seed=123, max_tokens=8, ignore_eos=True)
    alone = llm.generate(prompt, params, use_tqdm=False)[0]
    assert alone.finished and len(alone.outputs) == 4
    completions = [c.token_ids for c in alone.outputs]
    assert len({tuple(c) for c in completions}) == 4               # independent streams
    others = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    batch = llm.generate([_prompt(3, 9), prompt, _prompt(4, 40)], [others, params, others], use_tqdm=False)
    assert [c.token_ids for c in batch[1].outputs] == completions
    single = SamplingParams(n=1, temperature=1.0, seed=123, max_tokens=8, ignore_eos=True)
    assert llm.generate(prompt, single, use_tqdm=False)[0].outputs[0].token_ids == completions[0]
    greedy = llm.generate(prompt, _greedy(8, n=3), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1


# ---- beam search ------------------------------------------------------------------------------------------------
def test_beam_width_one_is_greedy(tiny):
    llm = _llm(tiny)
    prompts = [_prompt(5, 12), _prompt(6, 21)]
    beams = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    greedy = _tokens(llm.generate(prompts, _greedy(8), use_tqdm=False))
    assert [b.sequences[0].output_token_ids for b in beams] == greedy
    assert all(len(b.sequences) == 1 for b in beams)


@pytest.mark.parametrize("beam_width", [2, 4])
def test_beam_search_matches_transformers_without_eos(tiny, beam_width):
    llm = _llm(tiny)
    hf_model = tiny[1]
    prompt = _prompt(7, 10)
    ours = llm.beam_search([prompt], BeamSearchParams(beam_width=beam_width, max_tokens=7, ignore_eos=True))[0]
    with torch.inference_mode():
        hf = hf_model.generate(torch.tensor([prompt]), num_beams=beam_width, num_return_sequences=beam_width,
                               do_sample=False, max_new_tokens=7, eos_token_id=None, pad_token_id=0,
                               length_penalty=1.0, early_stopping=False, output_scores=True,
                               return_dict_in_generate=True)
    hf_tokens = [row[len(prompt):].tolist() for row in hf.sequences]
    assert [s.output_token_ids for s in ours.sequences] == hf_tokens
    # transformers reports cum_logprob / generated_len ** length_penalty
    assert [s.cum_logprob / 7 for s in ours.sequences] == pytest.approx(hf.sequences_scores.tolist(), abs=1e-4)
    assert all(s.tokens[:len(prompt)] == prompt and s.finish_reason == "length" for s in ours.sequences)


def test_beams_share_blocks_and_free_them(tiny):
    llm = _llm(tiny)
    engine, manager = llm.engine, llm.engine.kv_cache_manager
    engine.add_beam_search("g", _prompt(8, 37), BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True))
    saw_sharing = False
    while engine.has_unfinished_requests():
        engine.step()
        manager.check_integrity()
        beams = [r for r in engine.scheduler.requests.values() if r.status is RequestStatus.RUNNING]
        tables = [manager.get_block_ids(r.request_id) for r in beams]
        distinct = {block_id for table in tables for block_id in table}
        held = sum(len(t) for t in tables)
        # Each distinct block is stored once, however many beams hold it: its ref count says how many.
        assert sum(manager.pool.blocks[b].ref_cnt for b in distinct) == held
        assert manager.num_usable_blocks - manager.num_free_blocks == len(distinct)
        saw_sharing |= len(beams) > 1 and len(distinct) < held
    assert saw_sharing
    output = engine.pop_beam_search_output("g")
    assert output is not None and len(output.sequences) == 4
    scores = [s.cum_logprob for s in output.sequences]
    assert scores == sorted(scores, reverse=True)
    assert manager.num_free_blocks == manager.num_usable_blocks


# (prompt seed, EOS token, length penalty): EOS tokens the beams produce early, so that finished (EOS) and
# live (length) hypotheses of different lengths compete for the final ranking. In each case, leaving the EOS
# out of the length (as vLLM does) would rank the returned beams in another order than transformers does.
EOS_CASES = [(8, 29, 0.5), (21, 247, 0.5), (14, 163, 1.0), (24, 69, 1.0)]


@pytest.mark.parametrize("prompt_seed, eos, length_penalty", EOS_CASES)
@pytest.mark.parametrize("whose", ["tokenizer", "generation_config"])
def test_beam_search_with_eos_matches_transformers(tiny, prompt_seed, eos, length_penalty, whose):
    """The EOS is the tokenizer's, or one of the generation config's others (LLMEngine.eos_stop_token_ids)."""
    llm, hf_model, prompt = _llm(tiny), tiny[1], _prompt(prompt_seed, 8)
    tokenizer = llm.engine.tokenizer
    if whose == "tokenizer":
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
        assert tokenizer.eos_token_id == eos
    else:
        assert tokenizer.eos_token_id != eos
        llm.engine.eos_stop_token_ids = [eos]
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=length_penalty)
    ours = llm.beam_search([prompt], params)[0]
    with torch.inference_mode():
        # early_stopping="never": like us, transformers then keeps searching while a live beam could still win.
        hf = hf_model.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                               max_new_tokens=6, eos_token_id=eos, pad_token_id=0, length_penalty=length_penalty,
                               early_stopping="never", output_scores=True, return_dict_in_generate=True)
    hf_tokens = [_until_eos(row[len(prompt):].tolist(), eos) for row in hf.sequences]
    assert [s.output_token_ids for s in ours.sequences] == hf_tokens                     # the beams, in order
    assert [s.finish_reason for s in ours.sequences] == ["stop" if t[-1] == eos else "length" for t in hf_tokens]
    scores = [beam_score(len(s.output_token_ids), s.cum_logprob, length_penalty) for s in ours.sequences]
    assert scores == pytest.approx(hf.sequences_scores.tolist(), abs=1e-4)
    assert scores == sorted(scores, reverse=True)
    assert "stop" in [s.finish_reason for s in ours.sequences]      # EOS really ended a returned beam


def _until_eos(token_ids: list[int], eos: int) -> list[int]:
    """transformers pads a beam that ended early: cut after its EOS."""
    return token_ids[:token_ids.index(eos) + 1] if eos in token_ids else token_ids


# ---- preemption ------------------------------------------------------------------------------------------------
PRESSURE_PROMPTS = [_prompt(20 + i, 6 + 7 * i) for i in range(8)]   # up to 55 prompt tokens + 24 generated


@pytest.fixture(scope="module")
def roomy_tokens(tiny):
    return _tokens(_llm(tiny).generate(PRESSURE_PROMPTS, _greedy(24), use_tqdm=False))


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_preemption_in_a_tiny_pool_gives_the_same_tokens(tiny, roomy_tokens, mode):
    # 24 blocks of 4 tokens hold 92 tokens; the 8 requests want over 500. The swap pool holds 40 blocks.
    llm = _llm(tiny, num_kv_blocks=24, swap_space=40 * 2048 / 2**30, preemption_mode=mode,
               max_num_batched_tokens=32)
    engine = llm.engine
    assert engine.config.cache.num_swap_blocks == 40
    if engine.runner.device.type == "cpu":
        # auto keeps the engine's cost model: on a CPU, moving 2 KiB blocks is far cheaper than recomputing them
        # (on a GPU, by its defaults, recomputing the tiny model's tokens is the cheaper).
        assert engine.scheduler.config.swap_seconds_per_block < engine.scheduler.config.recompute_seconds_per_token
    for i, prompt in enumerate(PRESSURE_PROMPTS):
        engine.add_request(str(i), prompt, _greedy(24))
    outputs = {o.request_id: o.outputs[0].token_ids for o in _run_checked(llm)}
    assert [outputs[str(i)] for i in range(8)] == roomy_tokens
    by_mode = engine.scheduler.num_preemptions_by_mode
    assert engine.scheduler.num_preemptions == sum(by_mode.values()) > 0
    if mode != "recompute":
        assert by_mode["swap"] > 0
    else:
        assert by_mode["swap"] == 0
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert manager.num_free_swap_blocks == manager.num_usable_swap_blocks
    assert engine.scheduler.num_swapped == 0


def test_n_and_beams_survive_preemption(tiny):
    reference = _llm(tiny)
    prompt = _prompt(30, 26)
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=20, ignore_eos=True)
    beam = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    expected = [c.token_ids for c in reference.generate(prompt, params, use_tqdm=False)[0].outputs]
    expected_beams = reference.beam_search([prompt], beam)[0]
    squeezed = _llm(tiny, num_kv_blocks=20, swap_space=16 * 2048 / 2**30, preemption_mode="swap")
    squeezed.engine.add_request("other", _prompt(31, 30), _greedy(20))
    got = squeezed.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in got.outputs] == expected
    got_beams = squeezed.beam_search([prompt, _prompt(32, 20)], beam)[0]
    assert [s.tokens for s in got_beams.sequences] == [s.tokens for s in expected_beams.sequences]
    assert squeezed.engine.scheduler.num_preemptions > 0
    squeezed.engine.kv_cache_manager.check_integrity()


def test_priorities_run_lower_first(tiny):
    llm = _llm(tiny, max_num_seqs=1, scheduling_policy="priority")
    prompts = [_prompt(40 + i, 5) for i in range(4)]
    engine = llm.engine
    for i, (prompt, priority) in enumerate(zip(prompts, [3, 1, 2, 0])):
        engine.add_request(str(i), prompt, _greedy(3), priority=priority, arrival_time=float(i))
    order = [o.request_id for o in _run_checked(llm)]
    assert order == ["3", "1", "2", "0"]
    outs = llm.generate(prompts, _greedy(3), use_tqdm=False, priority=[3, 1, 2, 0])
    assert [o.outputs[0].token_ids for o in outs] == _tokens(llm.generate(prompts, _greedy(3), use_tqdm=False))
