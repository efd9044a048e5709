"""Driving an engine step by step for the speculative-decoding tests, checking the KV manager after every step."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams


def generate_checked(llm: LLM, prompts: list[str], params: SamplingParams) -> list[list[list[int]]]:
    """Each prompt's completions' token ids (n of them), stepping the engine and checking the block pool's
    integrity after each step."""
    engine, outputs = llm.engine, []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
        engine.kv_cache_manager.check_integrity()
    outputs.sort(key=lambda o: int(o.request_id))
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_same_tokens_and_logprobs(plain: LLM, spec: LLM, prompts: list[str], params: SamplingParams) -> None:
    """`spec` generates `plain`'s tokens, with the same top logprobs (ranks included) within 1e-4."""
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for e_pos, g_pos in zip(e.outputs[0].logprobs, g.outputs[0].logprobs):
            assert e_pos.keys() == g_pos.keys()
            assert all(abs(e_pos[t].logprob - g_pos[t].logprob) < 1e-4 and e_pos[t].rank == g_pos[t].rank
                       for t in e_pos)
