"""vLLM's AsyncLLM (pagedllm/engine/async_llm.py) on a tiny random Llama: built from AsyncEngineArgs, it streams
cumulative outputs by default (deltas or one final output when asked), pools, aborts with a last output, and takes
the controls; its tokens are the offline engine's."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm import LLM, AsyncEngineArgs, AsyncLLM, AsyncLLMEngine, PoolingParams, SamplingParams
from pagedllm.engine.async_engine import EngineDeadError
from pagedllm.sampling_params import RequestOutputKind

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


def test_it_streams_the_offline_engines_tokens_as_vllms_does(tiny_llama_dir):
    offline = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    expected = offline.generate("hello", SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    embedding = offline.encode("hello", pooling_task="embed", use_tqdm=False)[0].outputs.data
    assert AsyncLLMEngine is AsyncLLM

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64))
        try:
            streamed = [o async for o in engine.generate("hello", SamplingParams(**GREEDY), "cumulative")]
            tokens = [o.outputs[0].token_ids for o in streamed]
            assert len(streamed) == GREEDY["max_tokens"], "an output a token: the completion so far"
            assert all(a == b[:len(a)] for a, b in zip(tokens, tokens[1:], strict=False))
            assert tokens[-1] == expected and streamed[-1].finished and not streamed[0].finished
            deltas = [o async for o in engine.generate(
                "hello", SamplingParams(**GREEDY, output_kind=RequestOutputKind.DELTA), "delta")]
            assert [t for o in deltas for t in o.outputs[0].token_ids] == expected
            (final,) = [o async for o in engine.generate("hello", SamplingParams(**GREEDY, output_kind="final"),
                                                         "final")]
            assert final.outputs[0].token_ids == expected
            cut = [o async for o in engine.generate("hello", SamplingParams(**GREEDY, output_kind="final"), "cut-2",
                                                    tokenization_kwargs={"truncate_prompt_tokens": 2})]
            assert cut[0].prompt_token_ids == engine.get_tokenizer().encode("hello")[:2]
            with pytest.raises(ValueError, match="tokenization_kwargs takes"):
                await anext(engine.generate("hello", SamplingParams(**GREEDY), "bad", tokenization_kwargs={"x": 1}))
            (pooled,) = [o async for o in engine.encode("hello", PoolingParams(), "pooled")]
            assert pooled.finished and pooled.outputs.data.tolist() == pytest.approx(embedding.tolist(), abs=1e-5)
            # an abort ends its stream with a last output, finish_reason "abort"
            stream = engine.generate("hello", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), "cut")
            first = await anext(stream)
            await engine.abort("cut")
            rest = [o async for o in stream]
            assert not first.finished and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
            # the controls, as vLLM's
            await engine.pause_generation(mode="keep")
            assert await engine.is_paused()
            await engine.resume_generation()
            assert not await engine.is_paused() and await engine.reset_prefix_cache()
            assert await engine.collective_rpc("weight_bytes") == [engine.engine.engine.runner.weight_bytes()]
            await engine.check_health()
            assert engine.get_tokenizer() is engine.tokenizer and engine.get_num_unfinished_requests() == 0
            assert await engine.get_supported_tasks() == ("generate", "embed")
        finally:
            engine.shutdown()
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await anext(engine.generate("hello", SamplingParams(**GREEDY), "late"))
    asyncio.run(run())


def test_a_bad_output_kind_is_refused():
    with pytest.raises(ValueError, match="output_kind must be 'cumulative', 'delta', 'final'"):
        SamplingParams(output_kind="streaming")
