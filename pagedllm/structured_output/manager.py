"""StructuredOutputManager: compiles constraints into llguidance matchers, caches them by constraint, and fills
the token bitmask of a batch.

```
 add time (any thread)                      step (engine thread)
 ---------------------                      --------------------
 compile(constraint) -> cached LLMatcher    new_matcher(constraint) -> a deep copy of the cached one, per request
                                            fill_bitmask_async([matcher per sampled row])  (filled beside the model)
                                            matcher.consume_token(sampled token)
```
Compiling is the slow part (milliseconds to seconds for large schemas); callers do it before the request reaches
the step loop (the async engine in its executor, the offline engine at add_request), so a step only copies.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.hf
import torch

from pagedllm.config import StructuredOutputsConfig
from pagedllm.sampling_params import StructuredOutputsParams

_MAX_CACHED_GRAMMARS = 256


def grammar_text(constraint: StructuredOutputsParams, config: StructuredOutputsConfig | None = None) -> str:
    """The llguidance grammar of a constraint (not yet checked: LLMatcher does that), JSON as `config` says:
    compact unless its disable_any_whitespace is False (so that a model cannot spend its tokens on blank space; a
    schema's "x-guidance" options can turn whitespace back on), and without additional properties where its
    disable_additional_properties asks."""
    config = config or StructuredOutputsConfig()
    defaults = {"whitespace_flexible": config.disable_any_whitespace is False}
    kind, text = constraint.key()
    if kind == "json":
        if config.disable_additional_properties:
            text = json.dumps(_closed_objects(json.loads(text)))
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=defaults)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=defaults)
    return llguidance.grammar_from(kind, text)


def _closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on each object schema in it that leaves it unsaid."""
    if isinstance(schema, list):
        return [_closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed_objects(value) for key, value in schema.items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


class StructuredOutputManager:
    """Compiles and caches grammars for one tokenizer and vocabulary; thread-safe.

    Args:
        tokenizer: a fast Hugging Face tokenizer (llguidance reads its vocabulary).
        vocab_size: the model's vocabulary (logits width); ids past the tokenizer's are never allowed.
        config: how JSON compiles (`grammar_text`); None: the defaults.
    """

    def __init__(self, tokenizer, vocab_size: int, config: StructuredOutputsConfig | None = None) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = config
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None
        self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-bitmask")

    def _tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (about a second for a 50k vocabulary), under the lock."""
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
        return self._ll_tokenizer

    def compile(self, constraint: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The constraint's pristine matcher, from the cache or compiled now.

        Raises:
            ValueError: the schema, regex or grammar is invalid (llguidance's message says where).
        """
        key = constraint.key()
        with self._lock:
            matcher = self._cache.get(key)
            if matcher is not None:
                self._cache.move_to_end(key)
                return matcher
            tokenizer = self._tokenizer()
        try:
            matcher = llguidance.LLMatcher(tokenizer, grammar_text(constraint, self.config), log_level=0)
        except ValueError as exc:     # llguidance raises for text that is not JSON at all
            raise ValueError(f"invalid structured_outputs.{key[0]}: {exc}") from None
        if matcher.is_error():
            raise ValueError(f"invalid structured_outputs.{key[0]}: {matcher.get_error()}")
        with self._lock:
            self._cache[key] = matcher
            if len(self._cache) > _MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return matcher

    def new_matcher(self, constraint: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for one request (a copy: matchers hold the request's parse state)."""
        return self.compile(constraint).deep_copy()

    def fill_bitmask_async(self, matchers: list[llguidance.LLMatcher]) -> Future[torch.Tensor]:
        """[len(matchers), ceil(V / 32)] int32, filled in a background thread (llguidance drops the GIL, so it runs
        beside the model forward): bit j of word w allows token 32 * w + j for that row.

        The tensor is made here, on the caller's thread (the engine's): a torch op on the fill thread, such as
        this fill of ~77k values for 50 rows, would start a second OpenMP team there (engine_thread.py says what
        that costs every kernel call).
        """
        bitmask = torch.full((len(matchers), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        return self._fill_thread.submit(self._fill_bitmask, matchers, bitmask)

    def _fill_bitmask(self, matchers: list[llguidance.LLMatcher], bitmask: torch.Tensor) -> torch.Tensor:
        """llguidance's executor writes the rows in parallel, straight into the tensor's memory (what
        `llguidance.torch.fill_next_token_bitmask_par` does; that module is not imported because importing it
        runs torch.compile, seconds of start-up for a CPU engine)."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                               row_bytes, len(matchers))
        return bitmask
