"""Sampling parameters, with vLLM's fields, defaults and validation. Pure Python: the core imports it."""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _normalise_logit_bias(logit_bias: dict) -> dict[int, float]:
    """Keys may arrive as strings (JSON objects); values as ints."""
    out = {}
    for key, value in logit_bias.items():
        try:
            token_id = int(key) if isinstance(key, str) or _is_int(key) else None
        except ValueError:
            token_id = None
        _check(token_id is not None, "logit_bias", "keyed by integer token ids", key)
        _check(_is_number(value), "logit_bias", "values in [-100, 100]", value)
        out[token_id] = float(value)
    return out


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output, with vLLM's names; set exactly one field.

    Args:
        json: a JSON schema (a dict, or its JSON text): the output is a JSON value that validates against it.
        regex: the output matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: a Lark grammar (llguidance's dialect, which also takes `%json { schema }` rules).
        json_object: True: the output is a JSON object, of any shape.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        _check(len(given) == 1, "structured_outputs", f"exactly one of {', '.join(_STRUCTURED_KINDS)}",
               given or None)
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json must be a JSON schema, got invalid JSON: {exc}") from None
            object.__setattr__(self, "json", schema)
        _check(self.json is None or isinstance(self.json, dict), "structured_outputs.json",
               "a JSON schema (an object)", self.json)
        _check(self.regex is None or (isinstance(self.regex, str) and self.regex), "structured_outputs.regex",
               "a non-empty string", self.regex)
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip()),
               "structured_outputs.grammar", "a non-empty Lark grammar", self.grammar)
        _check(self.choice is None or (isinstance(self.choice, (list, tuple)) and self.choice
                                       and all(isinstance(c, str) and c for c in self.choice)),
               "structured_outputs.choice", "a non-empty list of non-empty strings", self.choice)
        _check(self.json_object in (None, True, False), "structured_outputs.json_object", "a boolean",
               self.json_object)

    @property
    def kind(self) -> str:
        return next(name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints have equal keys, whatever their dict order."""
        value = getattr(self, self.kind)
        return self.kind, value if isinstance(value, str) else json.dumps(value, sort_keys=True)


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class RequestOutputKind(enum.Enum):
    """vLLM's kinds of streamed output (`SamplingParams.output_kind`): each output carries the whole completion so
    far, only what is new since the last, or there is one output, once the request has finished."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final"


@dataclass
class SamplingParams:
    """How to sample one prompt's completions.

    Args:
        n: completions per prompt.
        temperature: 0 is greedy; higher flattens the distribution.
        top_p, top_k, min_p: nucleus, top-k (0 or -1 = off) and min-p filters.
        presence_penalty, frequency_penalty: OpenAI penalties on generated tokens, in [-2, 2].
        repetition_penalty: multiplicative penalty on prompt and generated tokens, > 0 (1 = off).
        seed: per-request seed; the same seed gives the same tokens whatever the batch.
        stop: strings that end the completion (not included in the text unless include_stop_str_in_output).
        stop_token_ids: token ids that end the completion (kept in token_ids, not in the text).
        ignore_eos: keep generating past EOS.
        max_tokens: most generated tokens; None means up to the context length.
        min_tokens: EOS and stop_token_ids are suppressed until this many tokens are generated.
        logprobs: number of top log-probabilities returned per generated token (plus the sampled one).
        logprob_token_ids: token ids whose log-probabilities each generated token's entry also carries (vLLM's:
            a scoring task's label tokens, cheaper than every token's); with or without `logprobs`.
        prompt_logprobs: number of top log-probabilities returned per prompt token (plus the prompt token
            itself), in `RequestOutput.prompt_logprobs`. Such a request takes no prefix-cache hit: every prompt
            position must be computed to have logits.
        detokenize: False: no text at all (CompletionOutput.text stays "", log-probabilities carry no
            decoded_token), for callers that only want token ids; not with stop strings, which are searched in text.
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str_in_output: keep the matched stop string in the text.
        logit_bias: token id -> bias added to its logit, in [-100, 100].
        allowed_token_ids: the only tokens that may be generated (every other logit is set to -inf).
        bad_words: words never generated: each is tokenized as it stands and after a space, and the last token of
            such a sequence is banned wherever the output ends with the tokens before it (a one-token word:
            everywhere), as in vLLM. The engine resolves them with its tokenizer (resolve_bad_words).
        structured_outputs: a constraint every output follows (JSON schema, regex, choice, grammar); not with
            allowed_token_ids or bad_words, which could leave a grammar no token it allows.
        thinking_token_budget: the most tokens a reasoning model may think (vLLM's): once a completion has thought
            this many since its `<think>` (its own, or the one its chat template opened), its next token is
            `</think>` (or [/THINK], </seed:think>: `pagedllm.tokenizer.think_token_ids`) and it answers. None (or
            -1): no budget. The engine finds the model's think tokens
            (resolve_thinking); not with structured_outputs.
        extra_args: arguments for custom logits processors (vLLM's; pagedllm.sample.logits_processor), which read
            them from the params; pagedllm itself reads none.
        stream_interval: the most new tokens a streamed output waits for (vLLM's): with output_kind "delta" or
            "cumulative", an output goes out once that many tokens are new, the first and the last at once; raised
            to the engine's `SchedulerConfig.stream_interval`. None: the engine's.
        skip_reading_prefix_cache: compute the whole prompt, reading no block from the prefix cache (vLLM's; the
            request's own blocks are still cached for others). None or False: read it.
        output_kind: what each output carries (vLLM's RequestOutputKind, or its value): "cumulative" the whole
            completion so far, "delta" what is new, "final" one output once finished. None: the caller's default
            (LLM and LLMEngine: "final"; AsyncLLM: "cumulative", as vLLM's).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    thinking_token_budget: int | None = None
    stream_interval: int | None = None
    extra_args: dict[str, Any] | None = None
    skip_reading_prefix_cache: bool | None = None
    output_kind: str | RequestOutputKind | None = field(default=None, repr=False)
    # bad_words as token sequences, from resolve_bad_words
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False, compare=False)
    # the model's (<think>, </think>) token ids, from resolve_thinking
    thinking_token_ids: tuple[int, int] | None = field(default=None, init=False, repr=False, compare=False)
    # the (start, end) ids of the thought after which structured_outputs applies, from the engine (its
    # StructuredOutputsConfig.reasoning_parser); None: from the first token
    constrained_after: tuple[int, int] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.output_kind, RequestOutputKind):
            self.output_kind = self.output_kind.value
        _check(self.output_kind in (None, *(kind.value for kind in RequestOutputKind)), "output_kind",
               "'cumulative', 'delta', 'final' (a RequestOutputKind) or None", self.output_kind)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words or [])
        if self.logit_bias:
            self.logit_bias = _normalise_logit_bias(self.logit_bias)
        if self.thinking_token_budget == -1:     # vLLM's "unlimited"
            self.thinking_token_budget = None
        self._validate()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the filters have no effect, so normalise them away.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2.0 <= value <= 2.0, name, "in [-2, 2]", value)
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               "> 0", self.repetition_penalty)
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature", ">= 0",
               self.temperature)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k", "-1, 0 (off) or a positive integer",
               self.top_k)
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _check(self.seed is None or _is_int(self.seed), "seed", "an integer or None", self.seed)
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", "an integer >= 1 or None", self.max_tokens)
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "an integer >= 0",
               self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        _check(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0), "logprobs",
               "an integer >= 0 or None", self.logprobs)
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = list(self.logprob_token_ids)
            _check(bool(self.logprob_token_ids) and all(_is_int(t) and t >= 0 for t in self.logprob_token_ids),
                   "logprob_token_ids", "a non-empty list of token ids (integers >= 0) or None",
                   self.logprob_token_ids)
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
               "prompt_logprobs", "an integer >= 0 or None", self.prompt_logprobs)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "a list of non-empty strings",
               self.stop)
        _check(self.detokenize or not self.stop, "stop", "empty with detokenize=False (stop strings are searched in "
               "the text; stop_token_ids end a completion without it)", self.stop)
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "a list of non-negative integers", self.stop_token_ids)
        for token_id, bias in (self.logit_bias or {}).items():
            _check(token_id >= 0, "logit_bias", "keyed by non-negative token ids", token_id)
            _check(_is_number(bias) and -100 <= bias <= 100, "logit_bias", "values in [-100, 100]", bias)
        _check(self.allowed_token_ids is None or (len(self.allowed_token_ids) > 0 and all(
            _is_int(t) and t >= 0 for t in self.allowed_token_ids)), "allowed_token_ids",
            "None or a non-empty list of non-negative integers", self.allowed_token_ids)
        _check(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
               "a list of strings that are not blank", self.bad_words)
        _check(self.thinking_token_budget is None or (_is_int(self.thinking_token_budget)
                                                      and self.thinking_token_budget >= 0),
               "thinking_token_budget", "an integer >= 0, or -1 (or None) for no budget", self.thinking_token_budget)
        _check(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args", "a dict or None",
               self.extra_args)
        _check(self.stream_interval is None or (_is_int(self.stream_interval) and self.stream_interval >= 1),
               "stream_interval", "an integer >= 1 or None", self.stream_interval)
        self._validate_structured_outputs()

    def _validate_structured_outputs(self) -> None:
        if self.structured_outputs is None:
            return
        _check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
               "a StructuredOutputsParams", self.structured_outputs)
        # The grammar decides where the output ends: it allows EOS exactly when the output is complete.
        _check(not self.ignore_eos, "ignore_eos", "False with structured_outputs (the grammar ends the output)",
               self.ignore_eos)
        _check(self.min_tokens == 0, "min_tokens", "0 with structured_outputs (the grammar ends the output)",
               self.min_tokens)
        _check(self.allowed_token_ids is None, "allowed_token_ids",
               "None with structured_outputs (the grammar decides the tokens allowed)", self.allowed_token_ids)
        _check(not self.bad_words, "bad_words", "empty with structured_outputs (the grammar decides the tokens "
               "allowed)", self.bad_words)
        _check(self.thinking_token_budget is None, "thinking_token_budget", "None with structured_outputs (the "
               "grammar decides the tokens allowed, </think> among them)", self.thinking_token_budget)

    def resolve_bad_words(self, encode: Callable[[str], list[int]]) -> None:
        """Set bad_words_token_ids from bad_words with `encode` (text -> token ids, no special tokens), as vLLM's
        update_from_tokenizer does: each word as it stands (leading spaces dropped), and after a space when that
        makes another sequence of as many tokens (the word inside a text)."""
        sequences: list[list[int]] = []
        for word in self.bad_words:
            alone = encode(word.lstrip())
            after_space = encode(" " + word.lstrip())
            sequences.append(alone)
            if after_space[0] != alone[0] and len(after_space) == len(alone):
                sequences.append(after_space)
        self.bad_words_token_ids = sequences

    def resolve_thinking(self, think_token_ids: tuple[int, int] | None) -> None:
        """Set thinking_token_ids for the thinking_token_budget from the model's (<think>, </think>) ids
        (`pagedllm.tokenizer.think_token_ids`): ValueError for a model without them."""
        if think_token_ids is None:
            raise ValueError("thinking_token_budget needs a model that thinks between <think> and </think> tokens "
                             "(Qwen3, DeepSeek-R1's distills, SmolLM3, ...), or [THINK] and [/THINK] (Magistral), "
                             "or <seed:think> and </seed:think> (Seed-OSS); this model's vocabulary has none")
        self.thinking_token_ids = think_token_ids

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def max_stop_len(self) -> int:
        """Length of the longest stop string: how much streamed text must be held back."""
        return max((len(s) for s in self.stop), default=0)
