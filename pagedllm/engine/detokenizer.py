"""Incremental detokenization: token ids -> text, one token at a time, safe for streaming.

Each new token costs two decodes of a short window, not a decode of the whole sequence (vLLM's
`detokenize_incrementally`). The window is ids[prefix_offset:], and read_offset marks where the text already
emitted ends:

    ids:   ... | prefix_offset ... | read_offset ... new |
                 already emitted     not yet emitted
    delta = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

Decoding from a few tokens back keeps the spacing right (a SentencePiece token drops its leading space when it
starts the decoded text), and a window whose text ends in U+FFFD (half of a multi-byte character) is held until
the next token completes it.

Stop strings: the text is searched after each token; on a match it is cut at the stop string (or just after it
with include_stop_str_in_output) and update() returns the string, so the engine finishes the request. Streaming
holds back the last max_stop_len - 1 characters until the request finishes, so a stop string's prefix never
reaches a client.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from pagedllm.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the first generated one, for its leading space.
_INITIAL_PREFIX_TOKENS = 5
# Drop ids before prefix_offset once this many have piled up, so memory stays bounded too.
_TRIM_AT = 256
_REPLACEMENT_CHAR = "\ufffd"


@functools.cache
def _decodes_in_rust_type(tokenizer_type: type) -> bool:
    return getattr(tokenizer_type, "_decode", None) is TokenizersBackend._decode


def _decodes_in_rust(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `tokenizer.decode(ids, skip_special_tokens=s, clean_up_tokenization_spaces=False)` is exactly its
    Rust tokenizer's `decode(ids, skip_special_tokens=s)`: a fast tokenizer whose class keeps transformers' own
    `_decode`. Then the engine calls the Rust one directly: transformers' `decode` first walks the ids in Python
    to normalise their types, which cost ~3x the decode itself, twice per generated token."""
    return _decodes_in_rust_type(type(tokenizer))


class IncrementalDetokenizer:
    """One completion's text, built token by token.

    Args:
        tokenizer: the model's tokenizer.
        params: the request's sampling parameters (stop, include_stop_str_in_output, skip_special_tokens, ...).
        prompt_token_ids: the prompt; its last tokens give the first generated token its context.
        eos_token_id: the EOS id (default: the tokenizer's); like stop_token_ids, it ends the completion and is
            left out of the text, even with skip_special_tokens=False (unless params.ignore_eos).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, params: SamplingParams,
                 prompt_token_ids: Sequence[int], eos_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self._stop_strings: list[str] = list(params.stop or [])
        self._stop_token_ids = set(params.stop_token_ids or [])
        if eos_token_id is None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if eos_token_id is not None and not params.ignore_eos:
            self._stop_token_ids.add(eos_token_id)
        self.stop_buffer_length = (params.max_stop_len() - 1
                                   if self._stop_strings and not params.include_stop_str_in_output else 0)
        self._ids: list[int] = list(prompt_token_ids[-_INITIAL_PREFIX_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None
        self._text = ""
        self._last_output_offset = 0
        self.stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        """All text so far (the stop string removed unless include_stop_str_in_output)."""
        return self._text

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Add generated tokens; return the stop string if one was hit (the engine then finishes the request).

        A stop token id (or EOS) ends the text and is not decoded; tokens after a stop are ignored.
        """
        if self.stop_reason is not None:
            return self.stop_reason
        if not self.params.detokenize:
            return None
        for token_id in new_token_ids:
            if token_id in self._stop_token_ids:
                break
            self._ids.append(token_id)
            delta = self._decode_next()
            if delta:
                self._text += delta
                self.stop_reason = self._check_stop_strings(len(delta))
                if self.stop_reason is not None:
                    return self.stop_reason
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to send now: the new part (delta=True) or all of it, minus what must be held back.

        Until `finished`, the last stop_buffer_length characters are held back: they may be the start of a
        stop string.
        """
        held_back = 0 if finished else self.stop_buffer_length
        length = max(len(self._text) - held_back, 0)
        if not delta:
            return self._text[:length]
        start = self._last_output_offset
        if start >= length:
            return ""
        self._last_output_offset = length
        return self._text[start:length]

    def _decode(self, ids: list[int]) -> str:
        if _decodes_in_rust(self.tokenizer):
            return self.tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _decode_next(self) -> str:
        """The text the newest token completes, or "" if it completes nothing yet (see the module docstring)."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def _check_stop_strings(self, num_new_chars: int) -> str | None:
        """Find the earliest stop string that the newest characters complete, and cut the text there."""
        best: tuple[int, str] | None = None
        for stop in self._stop_strings:
            start = max(len(self._text) - num_new_chars - len(stop) + 1, 0)
            index = self._text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self._text = self._text[:index + len(stop) if self.params.include_stop_str_in_output else index]
        return stop
