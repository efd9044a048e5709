"""How reasoning models mark their thought in a reply: the formats of `--reasoning-parser` (vLLM's names). The
server splits a reply by them (pagedllm.entrypoints.openai.reasoning_parsers, whose docstring says which model writes
which); the engine finds their markers' token ids, where a constraint applies after the thought
(`StructuredOutputsConfig.reasoning_parser`).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class ReasoningFormat(NamedTuple):
    """How a model marks its thinking: between one of `starts` and one of `ends` (a marker's spellings);
    `must_open`: only a reply that opens with a start reasons (else the chat template may have opened it);
    `keeps_special_tokens`: the markers are special tokens, which the reply's text must keep for the parser to
    see; `answer_opens`: a header the answer may open with, not part of it (gpt-oss's final channel's)."""

    starts: tuple[str, ...]
    ends: tuple[str, ...]
    must_open: bool = False
    keeps_special_tokens: bool = False
    answer_opens: tuple[str, ...] = ()


_THINK = (("<think>",), ("</think>",))
_GRANITE = (("Here is my thought process:", "Here's my thought process:"),
            ("Here is my response:", "Here's my response:"))
REASONING_FORMATS = {"deepseek_r1": ReasoningFormat(*_THINK),
                     "qwen3": ReasoningFormat(*_THINK, must_open=True),
                     "olmo3": ReasoningFormat(*_THINK),
                     "mistral": ReasoningFormat(("[THINK]",), ("[/THINK]",), must_open=True,
                                                keeps_special_tokens=True),
                     "seed_oss": ReasoningFormat(("<seed:think>",), ("</seed:think>",), must_open=True,
                                                 keeps_special_tokens=True),
                     "granite": ReasoningFormat(*_GRANITE, must_open=True),
                     # gpt-oss's harmony channels: its analysis, then (after <|end|>) its final answer's message
                     "openai_gptoss": ReasoningFormat(("<|channel|>analysis<|message|>",), ("<|end|>",),
                                                      must_open=True, keeps_special_tokens=True, answer_opens=(
                                                          "<|start|>assistant<|channel|>final<|message|>",
                                                          "<|channel|>final<|message|>"))}
REASONING_PARSERS = tuple(REASONING_FORMATS)


def marker_token_ids(tokenizer: Any, parser: str) -> tuple[int, int] | None:
    """The ids of the format's (first) start and end markers where each is one token of the tokenizer's vocabulary;
    None otherwise (granite's plain text), or without a tokenizer."""
    if tokenizer is None:
        return None
    form = REASONING_FORMATS[parser]
    ids = []
    for marker in (form.starts[0], form.ends[0]):
        token_id = tokenizer.convert_tokens_to_ids(marker)
        if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != marker:
            return None
        ids.append(token_id)
    return ids[0], ids[1]
