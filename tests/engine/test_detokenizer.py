"""IncrementalDetokenizer with the SmolLM2 tokenizer: UTF-8-safe streaming, stop strings, special tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.engine.detokenizer import IncrementalDetokenizer, _decodes_in_rust
from pagedllm.loader.resolve import default_model_gguf
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer.tokenizer import load_tokenizer

MULTIBYTE = "Héllo wörld! 日本語のテキスト 🎉🚀 family 👨‍👩‍👧 naïve café — “quotes” Ελληνικά 한국어 ✓"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_gguf())


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")


def stream(tokenizer, prompt_ids: list[int], ids: list[int], params: SamplingParams, **kwargs):
    """Feed ids one at a time as the engine does; return (detokenizer, deltas, stop string, tokens consumed)."""
    detok = IncrementalDetokenizer(tokenizer, params, prompt_ids, **kwargs)
    deltas, stop = [], None
    for n, token_id in enumerate(ids, start=1):
        stop = detok.update([token_id])
        finished = stop is not None or n == len(ids)
        deltas.append(detok.get_next_output_text(finished=finished, delta=True))
        if stop is not None:
            break
    return detok, deltas, stop, n


def test_multibyte_stream_never_breaks_a_character(tokenizer, prompt_ids) -> None:
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert len(ids) > len(MULTIBYTE) // 3  # several characters span more than one token
    detok, deltas, stop, _ = stream(tokenizer, prompt_ids, ids, SamplingParams())
    assert stop is None
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE == tokenizer.decode(ids) == detok.output_text
    assert any(d == "" for d in deltas)  # some tokens held back half a character


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("aé日本🎉👍ü €\n.,") + ["ñ", "語", "🚀", "\t"]), min_size=1, max_size=40))
def test_any_text_streams_back_exactly(tokenizer, prompt_ids, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    _, deltas, _, _ = stream(tokenizer, prompt_ids, ids, SamplingParams())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=12), skip=st.booleans())
def test_the_rust_decode_is_transformers_decode(tokenizer, prompt_ids, ids: list[int], skip: bool) -> None:
    """The detokenizer calls the Rust tokenizer directly (`_decodes_in_rust`); it must give transformers' text for
    any ids, special ones included (ids 0-16 are SmolLM2's specials)."""
    assert _decodes_in_rust(tokenizer)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=skip), prompt_ids)
    assert detok._decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_work_per_token_is_bounded(tokenizer, prompt_ids, monkeypatch) -> None:
    ids = tokenizer.encode(MULTIBYTE * 20, add_special_tokens=False)
    lengths = []
    original = IncrementalDetokenizer._decode

    def counting_decode(self, token_ids):
        lengths.append(len(token_ids))
        return original(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "_decode", counting_decode)
    detok, _, _, _ = stream(tokenizer, prompt_ids, ids, SamplingParams())
    assert detok.output_text == MULTIBYTE * 20
    assert len(lengths) <= 2 * len(ids) and max(lengths) <= 12


def _boundary_stop(tokenizer, ids: list[int], at: int) -> tuple[str, int]:
    """A stop string made of the end of token `at` and the start of token `at + 1`, and where it starts."""
    before = tokenizer.decode(ids[:at + 1])
    after = tokenizer.decode(ids[:at + 2])
    stop = before[-2:] + after[len(before):][:2]
    return stop, len(before) - 2


@pytest.mark.parametrize("at", [3, 6, 10])
def test_stop_string_across_tokens_is_cut_and_never_streamed(tokenizer, prompt_ids, at: int) -> None:
    text = "The quick brown fox jumps over the lazy dog, and then it runs away."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop, index = _boundary_stop(tokenizer, ids, at)
    assert text.find(stop) == index
    params = SamplingParams(stop=["never-there", stop])
    detok, deltas, found, consumed = stream(tokenizer, prompt_ids, ids, params)
    assert found == stop and consumed == at + 2  # hit on the token that completes it
    assert detok.output_text == text[:index]
    assert "".join(deltas) == text[:index]
    assert all(stop not in d for d in deltas)
    assert detok.update([ids[-1]]) == stop and detok.output_text == text[:index]  # finished: nothing more


def test_stream_holds_back_a_possible_stop_prefix(tokenizer, prompt_ids) -> None:
    ids = tokenizer.encode("abc STOP", add_special_tokens=False)
    params = SamplingParams(stop=["STOPPED"])
    detok = IncrementalDetokenizer(tokenizer, params, prompt_ids)
    assert detok.update(ids) is None
    assert detok.get_next_output_text(finished=False, delta=True) == "ab"  # 6 characters held back
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=False, delta=False) == "ab"
    assert detok.get_next_output_text(finished=True, delta=True) == "c STOP"
    assert detok.get_next_output_text(finished=True, delta=False) == "abc STOP"


def test_include_stop_str_in_output(tokenizer, prompt_ids) -> None:
    text = "one two three four five"
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=["thr", "e f"], include_stop_str_in_output=True)
    detok, deltas, found, _ = stream(tokenizer, prompt_ids, ids, params)
    assert found == "thr"
    assert detok.output_text == "one two thr" == "".join(deltas)


def test_earliest_stop_string_wins(tokenizer, prompt_ids) -> None:
    ids = tokenizer.encode("xyzabc", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["abc", "zab"]), prompt_ids)
    assert detok.update(ids) == "zab" and detok.output_text == "xy"


def test_eos_and_stop_token_ids_stay_out_of_the_text(tokenizer, prompt_ids) -> None:
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    shown = SamplingParams(skip_special_tokens=False)
    assert stream(tokenizer, prompt_ids, ids + [eos], shown)[0].output_text == "Hi there"
    ignored = SamplingParams(skip_special_tokens=False, ignore_eos=True)
    assert stream(tokenizer, prompt_ids, ids + [eos], ignored)[0].output_text == "Hi there<|im_end|>"
    stop_id = ids[-1]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop_token_ids=[stop_id]), prompt_ids)
    assert detok.update(ids + ids) is None
    assert detok.output_text == tokenizer.decode(ids[:-1])


def test_skip_special_tokens(tokenizer, prompt_ids) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nok", add_special_tokens=False)
    assert stream(tokenizer, prompt_ids, ids, SamplingParams())[0].output_text == "assistant\nok"
    kept = stream(tokenizer, prompt_ids, ids, SamplingParams(skip_special_tokens=False))[0]
    assert kept.output_text == "<|im_start|>assistant\nok"


def test_first_token_keeps_its_leading_space(tokenizer) -> None:
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    ids = tokenizer.encode("Hello world", add_special_tokens=False)[len(prompt):]
    assert stream(tokenizer, prompt, ids, SamplingParams())[0].output_text == " world"
    assert stream(tokenizer, [], ids, SamplingParams())[0].output_text == " world"
