from __future__ import annotations

import json

import pytest

from pagedllm.bench.datasets import (
    BenchRequest,
    jsonl_requests,
    load_requests,
    mixed_requests,
    random_requests,
    shared_prefix_requests,
)
from pagedllm.bench.prefix import ideal_hit_rate, shared_prefix_len


def test_mixed_is_deterministic_and_in_range(tiny_tokenizer):
    requests = mixed_requests(tiny_tokenizer)
    assert len(requests) == 50
    assert requests == mixed_requests(tiny_tokenizer)
    assert mixed_requests(tiny_tokenizer, 5) == requests[:5]
    assert all(30 <= r.prompt_len <= 700 for r in requests)
    assert all(16 <= r.output_len <= 256 for r in requests)
    assert len({tuple(r.prompt_token_ids) for r in requests}) == 50
    assert len({r.output_len for r in requests}) > 20


def test_mixed_prompts_are_chat_prompts(tiny_tokenizer):
    text = tiny_tokenizer.decode(mixed_requests(tiny_tokenizer, 1)[0].prompt_token_ids)
    assert text.startswith("<|im_start|>user\nNotes: ") and text.endswith("<|im_start|>assistant\n")


def test_random_requests(tiny_tokenizer):
    requests = random_requests(tiny_tokenizer, 4, input_len=10, output_len=3, seed=1)
    assert requests == random_requests(tiny_tokenizer, 4, input_len=10, output_len=3, seed=1)
    assert [(r.prompt_len, r.output_len) for r in requests] == [(10, 3)] * 4
    special = set(tiny_tokenizer.all_special_ids)
    assert not special & {t for r in requests for t in r.prompt_token_ids}


def test_jsonl_requests(tiny_tokenizer, tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "output_len": 7}) + "\n\n" + json.dumps({"prompt": [5, 6, 7]}) + "\n")
    requests = jsonl_requests(tiny_tokenizer, path, None, default_output_len=4)
    assert requests == [BenchRequest(tiny_tokenizer.encode("hi"), 7), BenchRequest([5, 6, 7], 4)]
    assert jsonl_requests(tiny_tokenizer, path, 1, 4) == requests[:1]
    with pytest.raises(ValueError, match="dataset-path"):
        load_requests(tiny_tokenizer, "jsonl")


def test_shared_prefix_requests(tiny_tokenizer):
    requests = shared_prefix_requests(tiny_tokenizer, 6, prefix_len=200, output_len=5)
    shared = shared_prefix_len(requests)
    assert shared >= 200
    assert all(r.prompt_len > shared and r.output_len == 5 for r in requests)
    assert ideal_hit_rate(requests, 16) == pytest.approx(shared // 16 * 16 * 6 / sum(r.prompt_len for r in requests))


def test_grounded_requests_ask_to_edit_a_text_as_long_as_the_output(tiny_tokenizer):
    requests = load_requests(tiny_tokenizer, "grounded", num_prompts=6)
    assert requests == load_requests(tiny_tokenizer, "grounded", num_prompts=6)
    assert len(requests) == 6 and all(60 <= r.output_len <= 400 for r in requests)
    for request in requests:
        text = tiny_tokenizer.decode(request.prompt_token_ids)
        assert "return it otherwise unchanged" in text and request.prompt_len > request.output_len
