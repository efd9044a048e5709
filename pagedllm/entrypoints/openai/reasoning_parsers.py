"""A reasoning model's thinking, split from its answer: the parsers of `--reasoning-parser` (vLLM's names), and
ReasoningStream, which turns a choice's text into the chat API's `reasoning` and `content`, whole or as deltas.

    deepseek_r1  <think> ... </think> then the answer (DeepSeek-R1 and its Qwen2 distills, QwQ); the chat template
                 may open the <think> itself, so a reply without </think> is all reasoning, as in vLLM
    qwen3        the same, but only a reply that opens with <think> reasons (Qwen3: with enable_thinking false its
                 template closes an empty think block in the prompt, and the reply is all answer)
    mistral      [THINK] ... [/THINK] then the answer (Magistral, Ministral 3's reasoning models); only a reply that
                 opens with [THINK] reasons; the markers are special tokens, which such replies keep
    olmo3        as deepseek_r1 (OLMo 3 Think, whose template opens the <think>; its markers are plain text)
    seed_oss     <seed:think> ... </seed:think> then the answer (Seed-OSS); only a reply that opens with it reasons
    granite      "Here is my thought process:" ... "Here is my response:" (or "Here's"), plain text (Granite 3.2 and
                 3.3 with thinking on); only a reply that opens with the first reasons
    openai_gptoss  gpt-oss's harmony channels, special tokens: <|channel|>analysis<|message|> ... <|end|>, then the
                 answer after its header, <|start|>assistant<|channel|>final<|message|> (without it where the reply
                 opens with the final channel); only a reply that opens with the analysis channel reasons
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers import partial_marker_start
from pagedllm.tokenizer.reasoning import REASONING_FORMATS, REASONING_PARSERS

__all__ = ["REASONING_FORMATS", "REASONING_PARSERS", "ReasoningStream"]


def _opening(text: str, markers: tuple[str, ...]) -> str:
    """The marker `text` opens with ("" for none)."""
    return next((marker for marker in markers if text.startswith(marker)), "")


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(where, which) of the first of `markers` in `text`; (-1, "") when none is."""
    found = [(index, marker) for marker in markers if (index := text.find(marker)) >= 0]
    return min(found) if found else (-1, "")


class ReasoningStream:
    """One choice's reasoning and content (START reasoning END content).

    Args:
        parser: a name of REASONING_PARSERS.
    """

    def __init__(self, parser: str = "deepseek_r1") -> None:
        self.starts, self.ends, self.must_open, _, self.answer_opens = REASONING_FORMATS[parser]
        self.text = ""
        self.num_reasoning_sent = 0     # of the reasoning (the text less a leading <think>)
        self.answering = False          # </think> seen (or, qwen3, no <think> first): the rest is content
        self.answer_head: str | None = "" if self.answer_opens else None    # the answer so far, until its header
                                                                            # is known (None: known, or none)

    def final(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply; None for an empty part."""
        start = _opening(text, self.starts)
        if self.must_open and not start:
            return None, self._unheaded(text) or None
        body = text[len(start):]
        end, marker = _first(body, self.ends)
        if end < 0:
            return body or None, None
        return body[:end] or None, self._unheaded(body[end + len(marker):]) or None

    def _unheaded(self, answer: str) -> str:
        """The answer without the header it opens with (`answer_opens`), if any."""
        return answer[len(_opening(answer, self.answer_opens)):]

    def _answer(self, text: str, finished: bool) -> str:
        """This much more of the answer, its header left out: held back while what came so far may be one."""
        if self.answer_head is None:
            return text
        self.answer_head += text
        if not finished and any(header.startswith(self.answer_head) and header != self.answer_head
                                for header in self.answer_opens):
            return ""
        answer, self.answer_head = self._unheaded(self.answer_head), None
        return answer

    def delta(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of this much new text (`finished`: the reply's last). A part of a tag that may be
        completing is held back until the next text says."""
        if self.answering:
            return "", self._answer(text, finished)
        self.text += text
        start = _opening(self.text, self.starts)
        if not finished and not start and any(marker.startswith(self.text) for marker in self.starts):
            return "", ""           # maybe the opening tag, in the making
        if self.must_open and not start:
            self.answering = True   # no <think> first: all of it is the answer
            return "", self._answer(self.text, finished)
        body = self.text[len(start):]
        end, marker = _first(body, self.ends)
        if end >= 0:
            self.answering = True
            reasoning, self.num_reasoning_sent = body[self.num_reasoning_sent:end], end
            return reasoning, self._answer(body[end + len(marker):], finished)
        held = None if finished else min((index for marker in self.ends
                                          if (index := partial_marker_start(body, marker)) is not None), default=None)
        upto = len(body) if held is None else held
        reasoning = body[self.num_reasoning_sent:upto]
        self.num_reasoning_sent = max(upto, self.num_reasoning_sent)
        return reasoning, ""
