"""A reasoning model's thinking, split from its answer: the parsers of `--reasoning-parser` (vLLM's names), and
ReasoningStream, which turns a choice's text into the chat API's `reasoning` and `content`, whole or as deltas.

    deepseek_r1  <think> ... </think> then the answer (DeepSeek-R1 and its Qwen2 distills, QwQ); the chat template
                 may open the <think> itself, so a reply without </think> is all reasoning, as in vLLM
    qwen3        the same, but only a reply that opens with <think> reasons (Qwen3: with enable_thinking false its
                 template closes an empty think block in the prompt, and the reply is all answer)
    mistral      [THINK] ... [/THINK] then the answer (Magistral, Ministral 3's reasoning models); only a reply that
                 opens with [THINK] reasons; the markers are special tokens, which such replies keep
"""

from __future__ import annotations

from typing import NamedTuple

from pagedllm.entrypoints.openai.tool_parsers import partial_marker_start


class ReasoningFormat(NamedTuple):
    """How a model marks its thinking: between `start` and `end`; `must_open`: only a reply that opens with `start`
    reasons (else the chat template may have opened it); `keeps_special_tokens`: the markers are special tokens,
    which the reply's text must keep for the parser to see."""

    start: str
    end: str
    must_open: bool = False
    keeps_special_tokens: bool = False


REASONING_FORMATS = {"deepseek_r1": ReasoningFormat("<think>", "</think>"),
                     "qwen3": ReasoningFormat("<think>", "</think>", must_open=True),
                     "mistral": ReasoningFormat("[THINK]", "[/THINK]", must_open=True, keeps_special_tokens=True)}
REASONING_PARSERS = tuple(REASONING_FORMATS)


class ReasoningStream:
    """One choice's reasoning and content (START reasoning END content).

    Args:
        parser: a name of REASONING_PARSERS.
    """

    def __init__(self, parser: str = "deepseek_r1") -> None:
        self.START, self.END, self.must_open, _ = REASONING_FORMATS[parser]
        self.text = ""
        self.num_reasoning_sent = 0     # of the reasoning (the text less a leading <think>)
        self.answering = False          # </think> seen (or, qwen3, no <think> first): the rest is content

    def final(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply; None for an empty part."""
        if self.must_open and not text.startswith(self.START):
            return None, text or None
        body = text.removeprefix(self.START)
        reasoning, ended, content = body.partition(self.END)
        return reasoning or None, (content or None) if ended else None

    def delta(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of this much new text (`finished`: the reply's last). A part of a tag that may be
        completing is held back until the next text says."""
        if self.answering:
            return "", text
        self.text += text
        if not finished and self.START.startswith(self.text) and self.text != self.START:
            return "", ""           # maybe the opening tag, in the making
        if self.must_open and not self.text.startswith(self.START):
            self.answering = True   # no <think> first: all of it is the answer
            return "", self.text
        body = self.text.removeprefix(self.START)
        end = body.find(self.END)
        if end >= 0:
            self.answering = True
            reasoning, self.num_reasoning_sent = body[self.num_reasoning_sent:end], end
            return reasoning, body[end + len(self.END):]
        held = None if finished else partial_marker_start(body, self.END)
        upto = len(body) if held is None else held
        reasoning = body[self.num_reasoning_sent:upto]
        self.num_reasoning_sent = max(upto, self.num_reasoning_sent)
        return reasoning, ""
