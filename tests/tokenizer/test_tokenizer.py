"""load_tokenizer on the embedded SmolLM2 GGUF and its on-disk cache."""

from __future__ import annotations

import time

import pytest

from pagedllm.loader.resolve import default_model_gguf as smol_gguf_path
from pagedllm.tokenizer.tokenizer import _gguf_cache_path, load_tokenizer

TEXTS = ["Hello, world!", "héllo 日本語 🎉 naïve café", "<|im_start|>user\nhi<|im_end|>\n", "  two  spaces\n\ttab"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(smol_gguf_path())


def test_gguf_tokenizer_basics(tokenizer) -> None:
    assert len(tokenizer) == 49152
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_folder_and_file_forms_give_the_same_tokenizer(tokenizer) -> None:
    path = smol_gguf_path()
    other = load_tokenizer(path.parent, gguf_file=path.name)
    assert [other.encode(t) for t in TEXTS] == [tokenizer.encode(t) for t in TEXTS]


def test_cache_entry_is_used(tokenizer) -> None:
    cached = _gguf_cache_path(smol_gguf_path())
    assert (cached / "tokenizer.json").is_file()
    start = time.perf_counter()
    load_tokenizer(smol_gguf_path())
    assert time.perf_counter() - start < 3.0  # the conversion takes about 5 s, a cache hit well under 1 s


@pytest.mark.slow
def test_cached_tokenizer_equals_converted_one(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    converted = load_tokenizer(smol_gguf_path())         # converts the GGUF vocabulary and saves it
    entries = list((tmp_path / "tokenizers").iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(".tmp")
    cached = load_tokenizer(smol_gguf_path())            # loads the saved copy
    assert [cached.encode(t) for t in TEXTS] == [converted.encode(t) for t in TEXTS]
    assert cached.chat_template == converted.chat_template
    assert cached.all_special_tokens == converted.all_special_tokens
    assert (cached.eos_token_id, cached.bos_token_id) == (converted.eos_token_id, converted.bos_token_id)
    ids = list(range(0, 49152, 97))
    assert cached.decode(ids) == converted.decode(ids)


def test_chat_template_override(tokenizer, tmp_path) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    assert load_tokenizer(smol_gguf_path(), chat_template=template).chat_template == template
    file = tmp_path / "template.jinja"
    file.write_text(template)
    assert load_tokenizer(smol_gguf_path(), chat_template=str(file)).chat_template == template
    with pytest.raises(ValueError, match="neither"):
        load_tokenizer(smol_gguf_path(), chat_template=str(tmp_path / "missing.jinja"))

