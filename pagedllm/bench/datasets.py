"""Benchmark workloads: lists of (prompt token ids, output length), deterministic and download-free.

- `mixed`: "the same 50 requests" — chat prompts of about 30 to 600 tokens (through the model's chat template)
  of varied English text built from word lists and sentence templates, with output lengths from 16 to 256.
- `random`: random token ids of a fixed length (vLLM's random dataset).
- `jsonl`: one JSON object a line, {"prompt": str | [int], "output_len": int (optional)}.
- `shared-prefix`: one long system prompt followed by different short questions (the prefix-cache bench).
- `grounded`: input-grounded chats: copy-edit a given text, the output about as long as the text (where
  speculative decoding's n-gram prompt lookup pays).

Every request is run with ignore_eos=True, so every system generates exactly `output_len` tokens.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # transformers is slow to import; the CLI imports this module to build its parser
    from transformers import PreTrainedTokenizerBase

MIXED_NUM_PROMPTS = 50
MIXED_PROMPT_LEN = (30, 600)
MIXED_OUTPUT_LEN = (16, 256)
_GOLDEN = 0.6180339887498949    # steps of the two length sequences: irrational, and unlike each other,
_PLASTIC = 0.7548776662466927   # so that prompt and output lengths are not correlated


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


# ---- the text generator ------------------------------------------------------------------------------------------
_SUBJECTS = ["the engineer", "our team", "the committee", "a small bakery", "the city council", "my neighbour",
             "the research group", "a travelling musician", "the school library", "the harbour master",
             "an old farmer", "the night shift", "the museum curator", "a young pilot", "the orchestra",
             "the football club", "a quiet student", "the hospital", "the weather service", "the garden club"]
_VERBS = ["planned", "repaired", "described", "questioned", "painted", "measured", "delivered", "rebuilt",
          "studied", "celebrated", "postponed", "organised", "translated", "tested", "photographed", "sold",
          "rescued", "designed", "explained", "inspected"]
_OBJECTS = ["a wooden bridge", "the annual report", "three new bicycles", "a map of the valley", "the broken clock",
            "a long letter", "the spring festival", "a recipe for bread", "the old lighthouse", "a solar panel",
            "the river path", "a set of drawings", "the village well", "a budget for next year", "a train timetable",
            "the stone wall", "a cup of tea", "the radio antenna", "a field of sunflowers", "the winter coats"]
_PLACES = ["near the station", "in the mountains", "by the sea", "in a crowded market", "behind the town hall",
           "at the edge of the forest", "in a small workshop", "on the third floor", "across the river",
           "in the main square", "under the old oak tree", "inside the greenhouse"]
_TIMES = ["last Tuesday", "early in the morning", "after a long storm", "during the holidays", "before sunrise",
          "late at night", "in the middle of winter", "on a rainy afternoon", "two weeks ago", "every summer"]
_ADJECTIVES = ["careful", "surprising", "patient", "noisy", "elegant", "practical", "generous", "curious",
               "difficult", "cheerful", "ambitious", "modest"]
_CONNECTIVES = ["Meanwhile,", "However,", "As a result,", "Later,", "In the end,", "Surprisingly,", "At first,",
                "For this reason,", "Even so,", "Afterwards,"]
_SENTENCES = [
    "{S} {V} {O} {P} {T}.",
    "{C} {s} {V} {O}, which everyone agreed was {A}.",
    "It was a {A} day when {s} {V} {O} {P}.",
    "Nobody expected that {s} would have {V} {O} {T}.",
    "{C} the {A} work of {s} {P} was noticed by many visitors.",
    "According to the notes, {s} {V} {O} {T}, and the result was {A}.",
    "Why {s} {V} {O} {P} is still a {A} question.",
]
_TASKS = ["Summarise these notes in a few sentences.", "List the main events described above.",
          "Write a short reply to the author of these notes.", "What is the most surprising detail here, and why?",
          "Rewrite the notes as a short story for children.", "Turn these notes into a to-do list.",
          "Explain what probably happened next.", "Give these notes a title and a one-line description."]


def _sentence(rng: random.Random) -> str:
    template = rng.choice(_SENTENCES)
    subject = rng.choice(_SUBJECTS)
    return template.format(S=subject[0].upper() + subject[1:], s=subject, V=rng.choice(_VERBS),
                           O=rng.choice(_OBJECTS), P=rng.choice(_PLACES), T=rng.choice(_TIMES),
                           A=rng.choice(_ADJECTIVES), C=rng.choice(_CONNECTIVES))


def _log_spread(u: float, low: int, high: int) -> int:
    """u in [0, 1) -> an integer in [low, high], evenly spread on a log scale."""
    return int(round(math.exp(math.log(low) + u * (math.log(high) - math.log(low)))))


def _spread(i: int, step: float) -> float:
    """The i-th point of an additive-recurrence sequence: any first n points cover [0, 1) evenly."""
    return (0.5 + i * step) % 1.0


def _chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        from pagedllm.tokenizer.chat_template import apply_chat_template

        return apply_chat_template(tokenizer, messages)
    # A tokenizer without a template (e.g. a test's tiny model): the message contents, one per line.
    return tokenizer.encode("\n".join(m["content"] for m in messages))


def _grow_to_length(tokenizer: PreTrainedTokenizerBase, rng: random.Random, target_len: int,
                    build: Callable[[str], list[dict[str, str]]]) -> list[int]:
    """Add generated sentences to `build(text)`'s messages until its chat tokens reach `target_len` (at least one
    sentence, so that no two prompts are the same)."""
    sentences = [_sentence(rng)]
    token_ids = _chat_ids(tokenizer, build(sentences[0]))
    while len(token_ids) < target_len:
        sentences.append(_sentence(rng))
        token_ids = _chat_ids(tokenizer, build(" ".join(sentences)))
    return token_ids


# ---- the datasets --------------------------------------------------------------------------------------------------
def mixed_requests(tokenizer: PreTrainedTokenizerBase, num_prompts: int = MIXED_NUM_PROMPTS,
                   seed: int = 0) -> list[BenchRequest]:
    """The built-in chat workload; the first n requests are the same whatever num_prompts is.

    Prompt and output lengths are spread evenly on a log scale over their ranges (a low-discrepancy sequence, so
    even a few requests cover the range), and short chats outnumber long ones. A chat template's own tokens
    (SmolLM2's adds a default system prompt) set the shortest prompt.
    """
    rng = random.Random(seed)
    requests = []
    for i in range(num_prompts):
        target_len = _log_spread(_spread(i, _GOLDEN), *MIXED_PROMPT_LEN)
        output_len = _log_spread(_spread(i, _PLASTIC), *MIXED_OUTPUT_LEN)
        task = rng.choice(_TASKS)
        token_ids = _grow_to_length(tokenizer, rng, target_len, lambda notes, task=task: [
            {"role": "user", "content": f"Notes: {notes}\n\n{task}"}])
        requests.append(BenchRequest(token_ids, output_len))
    return requests


def random_requests(tokenizer: PreTrainedTokenizerBase, num_prompts: int, input_len: int, output_len: int,
                    seed: int = 0) -> list[BenchRequest]:
    """Random ordinary (non-special) token ids, `input_len` of them per prompt."""
    rng = random.Random(seed)
    special_ids = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special_ids]
    return [BenchRequest([rng.choice(vocab) for _ in range(input_len)], output_len) for _ in range(num_prompts)]


def jsonl_requests(tokenizer: PreTrainedTokenizerBase, path: str | Path, num_prompts: int | None,
                   default_output_len: int) -> list[BenchRequest]:
    """Lines of {"prompt": text or token ids, "output_len": int}; text is tokenized as is (no chat template)."""
    requests = []
    for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if "prompt" not in record:
            raise ValueError(f"{path}:{line_no}: each line needs a \"prompt\"")
        prompt = record["prompt"]
        token_ids = list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)
        requests.append(BenchRequest(token_ids, int(record.get("output_len", default_output_len))))
        if num_prompts is not None and len(requests) == num_prompts:
            break
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests


def shared_prefix_requests(tokenizer: PreTrainedTokenizerBase, num_prompts: int, prefix_len: int,
                           output_len: int, seed: int = 0) -> list[BenchRequest]:
    """One system prompt of about `prefix_len` tokens, then a different short question for each request."""
    rng = random.Random(seed)
    system = " ".join(_sentence(rng) for _ in range(max(1, prefix_len // 12)))
    system_ids = tokenizer.encode(system, add_special_tokens=False)[:prefix_len]
    system = "You are the archive assistant. Background: " + tokenizer.decode(system_ids)
    requests = []
    for i in range(num_prompts):
        question = f"Question {i}: {_sentence(rng)} {rng.choice(_TASKS)}"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        requests.append(BenchRequest(_chat_ids(tokenizer, messages), output_len))
    return requests


GROUNDED_TEXT_LEN = (60, 240)


def grounded_requests(tokenizer: PreTrainedTokenizerBase, num_prompts: int, seed: int = 0) -> list[BenchRequest]:
    """Chats asking to copy-edit a text of 60 to 240 tokens (spread on a log scale); each output is as long as
    the text, since a faithful edit mostly copies it."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_prompts):
        target_len = _log_spread(_spread(i, _GOLDEN), *GROUNDED_TEXT_LEN)
        sentences = [_sentence(rng)]
        while len(tokenizer.encode(" ".join(sentences), add_special_tokens=False)) < target_len:
            sentences.append(_sentence(rng))
        text = " ".join(sentences)
        messages = [{"role": "user", "content": "Fix the punctuation of this text and return it otherwise "
                                                f"unchanged:\n\n{text}"}]
        requests.append(BenchRequest(_chat_ids(tokenizer, messages),
                                     len(tokenizer.encode(text, add_special_tokens=False))))
    return requests


def load_requests(tokenizer: PreTrainedTokenizerBase, dataset: str, *, num_prompts: int | None = None,
                  input_len: int = 256, output_len: int = 128, dataset_path: str | None = None,
                  seed: int = 0) -> list[BenchRequest]:
    """The requests of a named dataset (see the module docstring)."""
    if dataset == "mixed":
        return mixed_requests(tokenizer, num_prompts or MIXED_NUM_PROMPTS, seed)
    if dataset == "random":
        return random_requests(tokenizer, num_prompts or 100, input_len, output_len, seed)
    if dataset == "jsonl":
        if dataset_path is None:
            raise ValueError("--dataset jsonl needs --dataset-path FILE")
        return jsonl_requests(tokenizer, dataset_path, num_prompts, output_len)
    if dataset == "shared-prefix":
        return shared_prefix_requests(tokenizer, num_prompts or 32, input_len, output_len, seed)
    if dataset == "grounded":
        return grounded_requests(tokenizer, num_prompts or 32, seed)
    raise ValueError(f"unknown dataset {dataset!r}; expected mixed, random, jsonl, shared-prefix or grounded")
