"""A reasoning model's thinking, split from its answer: the parsers of `--reasoning-parser` (vLLM's names), and
ReasoningStream, which turns a choice's text into the chat API's `reasoning` and `content`, whole or as deltas.

    deepseek_r1  <think> ... </think> then the answer (DeepSeek-R1 and its Qwen2 distills, QwQ); the chat template
                 may open the <think> itself, so a reply without </think> is all reasoning, as in vLLM
    qwen3        the same, but only a reply that opens with <think> reasons (Qwen3: with enable_thinking false its
                 template closes an empty think block in the prompt, and the reply is all answer)
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers import partial_marker_start

REASONING_PARSERS = ("deepseek_r1", "qwen3")


class ReasoningStream:
    """One choice's reasoning and content (`<think>` reasoning `</think>` content).

    Args:
        parser: a name of REASONING_PARSERS; "qwen3" reasons only in a reply that opens with <think>.
    """

    START, END = "<think>", "</think>"

    def __init__(self, parser: str = "deepseek_r1") -> None:
        self.must_open = parser == "qwen3"
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
