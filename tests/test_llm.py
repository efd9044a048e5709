"""The offline API end to end on the embedded SmolLM2 model: batching invariance, stops, bad input. (Its greedy
chat tokens against transformers' generate: tests/models/test_smollm2_gguf.py, which loads that oracle.)"""

from __future__ import annotations

import io

import pytest
from tqdm import tqdm

from pagedllm import LLM, SamplingParams
from pagedllm.cpu import cpu_info

pytestmark = pytest.mark.slow

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge every boxing match "
         "near an old harbour where ships unload grain tea silk and copper before the winter storms").split()


def _mixed_prompts(count: int) -> list[str]:
    """Deterministic prompts from 3 to about 150 words, so the batch is ragged and crosses many blocks."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + (i * 37) % 150)) for i in range(count)]


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_chat_gives_the_template_typed_parts_with_the_openai_content_format(smol_llm):
    template = "{% for m in messages %}{% if m['content'] is string %}S:{{ m['content'] }}{% else %}" \
               "P:{{ m['content'][0]['text'] }}{% endif %}{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    tokenizer = smol_llm.get_tokenizer()
    for content_format, text in (("auto", "S:hi"), ("string", "S:hi"), ("openai", "P:hi")):
        (out,) = smol_llm.chat(messages, _greedy(1), chat_template=template,
                               chat_template_content_format=content_format)
        assert tokenizer.decode(out.prompt_token_ids) == text


def test_outputs_come_back_in_input_order_with_their_prompts(smol_llm):
    prompts = _mixed_prompts(5)
    outs = smol_llm.generate(prompts, _greedy(4), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert all(o.finished and len(o.outputs[0].token_ids) == 4 for o in outs)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_batching_and_preemption_change_no_greedy_token(smol_llm):
    prompts = _mixed_prompts(12)
    params = _greedy(12, ignore_eos=True)
    alone = [smol_llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:6]]
    batched = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params, use_tqdm=False)]
    assert batched[:6] == alone

    # A pool of 40 blocks of 8 tokens cannot hold 12 prompts of up to ~200 tokens: requests are preempted and
    # recomputed, and small token budgets split prefills into chunks.
    tiny = LLM(dtype="float32", num_kv_blocks=40, max_num_batched_tokens=96, max_num_seqs=12)
    squeezed = [o.outputs[0].token_ids for o in tiny.generate(prompts, params, use_tqdm=False)]
    assert tiny.engine.scheduler.num_preemptions > 0
    assert squeezed == batched
    tiny.engine.kv_cache_manager.check_integrity()
    assert tiny.engine.kv_cache_manager.num_free_blocks == 40 - 1   # all but the null block


def test_stop_strings_and_stop_tokens(smol_llm):
    full = smol_llm.generate("Count: one, two, three,", _greedy(16, ignore_eos=True), use_tqdm=False)[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = smol_llm.generate("Count: one, two, three,", _greedy(16, ignore_eos=True, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    first = full.outputs[0].token_ids[0]
    by_token = smol_llm.generate("Count: one, two, three,", _greedy(16, stop_token_ids=[first]),
                                 use_tqdm=False)[0].outputs[0]
    assert by_token.token_ids == [first] and by_token.finish_reason == "stop" and by_token.stop_reason == first


def test_progress_bar_only_for_several_prompts(smol_llm, capsys):
    smol_llm.generate(["a", "b"], _greedy(2))
    assert "Processed prompts" in capsys.readouterr().err
    smol_llm.generate("a", _greedy(2))
    assert "Processed prompts" not in capsys.readouterr().err
    # vLLM's use_tqdm may be a callable that makes the bar from tqdm's arguments
    made = []
    smol_llm.generate(["a", "b", "c"], _greedy(2), use_tqdm=lambda **kwargs: made.append(kwargs) or
                      tqdm(**kwargs | {"file": io.StringIO()}))
    smol_llm.generate("a", _greedy(2), use_tqdm=lambda **kwargs: made.append(kwargs) or tqdm(**kwargs))
    assert [(m["total"], m["desc"], m["disable"]) for m in made] == [(3, "Processed prompts", False)]
    assert "Processed prompts" not in capsys.readouterr().err


def test_bad_input_is_a_clear_error_and_nothing_runs(smol_llm):
    with pytest.raises(ValueError, match="empty"):
        smol_llm.generate("", _greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        smol_llm.generate([], _greedy(2), use_tqdm=False)
    too_long = [1] * 2048
    with pytest.raises(ValueError, match="max_model_len is 2048"):
        smol_llm.generate(["fine", too_long], _greedy(2), use_tqdm=False)
    assert not smol_llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=r"\[0, 49152\)"):
        smol_llm.generate([[5, 49152]], _greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match="2 entries for 1 prompts"):
        smol_llm.generate(["x"], [_greedy(2), _greedy(2)], use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        smol_llm.generate("x", SamplingParams(temperature=-1), use_tqdm=False)


def test_an_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises((ValueError, FileNotFoundError), match="no_such_model"):
        LLM(model=str(tmp_path / "no_such_model"))


def test_default_model_answers_the_readme_example():
    llm = LLM()
    # The default model is a .gguf file: its blocks kept packed (implied_gguf) on a CPU with VNNI; dequantised to
    # bf16 weights on one without it (Zen 3: faster in a batch) and on a GPU, where "auto" puts it.
    packed = llm.engine.runner.device.type == "cpu" and cpu_info().int8_dot_products
    assert llm.engine.quantization == ("gguf" if packed else None)
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in outs[0].outputs[0].text
    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}])[0].outputs[0].text
    assert "Paris" in reply


def test_a_seeded_request_gives_the_same_tokens_whatever_the_batch(smol_llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = smol_llm.generate("Once upon a time", seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = smol_llm.generate(["Hello", "Once upon a time", "Tell me a joke"], [others, seeded, others],
                              use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
