"""Custom logits processors, with vLLM's interface (`vllm.v1.sample.logits_processor`): a processor written for vLLM
runs here once its imports name pagedllm.

A processor is a class the engine builds once, `cls(config, device, is_pin_memory)` (the engine's `EngineConfig`
where vLLM passes its VllmConfig), and drives each step that samples:

    update_state(batch_update)      the requests that left the batch (removed), came into it (added, with their
                                    params, prompt ids and a live reference to their output ids) and moved in it;
                                    None when nothing changed
    apply(logits)                   [batch, vocab] -> the same, row i being the request at batch index i

A request keeps its index while it samples every step; the engine removes one that ends or pauses (preempted, or a
prompt chunk that samples nothing), adds a new one at the lowest free index, and then moves the last ones into the
gaps, so that the indices stay 0..batch_size-1: apply the changes as vLLM says, removed, then added, then moved. A
processor whose `is_argmax_invariant()` is True cannot change a greedy row's token, and runs on the random rows'
logits after their temperature (as vLLM's do); the others run on every row after the built-in processing (bias,
banned tokens, penalties). `validate_params(params)` refuses a request's SamplingParams (its `extra_args` hold what
a processor reads) with a ValueError. `AdapterLogitsProcessor` wraps a per-request function of the output ids
(or of the prompt ids and the output ids) and a row's logits.
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()     # the request at index 1 goes to index 2 (what was there is gone)
    SWAP = auto()               # the requests at the two indices trade places


RemovedRequest = int
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]   # index, params, prompt ids, output ids
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last step: apply `removed`, then `added`, then `moved`. An added request's
    output ids are a reference to the list the engine appends its tokens to."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """A custom logits processor (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError for a request this processor cannot take; by default it takes any."""
        del sampling_params

    @abstractmethod
    def __init__(self, config: EngineConfig, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """[batch, vocab] -> the processed logits (this tensor changed in place, or another)."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if it never changes which token has the largest logit."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Before each `apply`: the batch's changes since the last step (None: none)."""
        raise NotImplementedError


RequestLogitsProcessor = Callable[..., torch.Tensor]    # (output ids, row) or (prompt ids, output ids, row)


class AdapterLogitsProcessor(LogitsProcessor):
    """A per-request function as a processor: subclass it, implement `is_argmax_invariant` and
    `new_req_logits_processor(params)` (the function for a request, or None to leave it alone)."""

    def __init__(self, config: EngineConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, partial[torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        raise NotImplementedError

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.req_info.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            function = self.new_req_logits_processor(params)
            if function is None:
                self.req_info.pop(index, None)
            elif len(inspect.signature(function).parameters) == 3:
                self.req_info[index] = partial(function, prompt_ids, output_ids)
            else:
                self.req_info[index] = partial(function, output_ids)
        for first, second, direction in batch_update.moved:
            a, b = self.req_info.pop(first, None), self.req_info.pop(second, None)
            if a is not None:
                self.req_info[second] = a
            if b is not None and direction == MoveDirectionality.SWAP:
                self.req_info[first] = b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, function in self.req_info.items():
            logits[index] = function(logits[index])
        return logits


def load_logits_processors(specs: Sequence[str | type]) -> list[type[LogitsProcessor]]:
    """Processor classes from classes or import paths ("package.module.Class" or "package.module:Class"); a
    ValueError names one that is not found or not a LogitsProcessor."""
    classes = []
    for spec in specs:
        found: Any = spec
        if isinstance(spec, str):
            module_name, _, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
            try:
                found = getattr(importlib.import_module(module_name), name)
            except (ImportError, AttributeError, ValueError) as exc:
                raise ValueError(f"logits processor {spec!r} is not found: {exc}") from exc
        if not (inspect.isclass(found) and issubclass(found, LogitsProcessor)):
            raise ValueError(f"logits processor {spec!r} is not a subclass of "
                             "pagedllm.sample.logits_processor.LogitsProcessor")
        classes.append(found)
    return classes


class CustomLogits:
    """The engine's processors over its sampling batches: each step, `arrange` keeps each request at its index,
    tells the processors what changed, and gives the order of the step's rows by index; the sampler then runs
    `apply_full` on every row and `apply_invariant` on the random rows after their temperature."""

    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.full = [p for p in processors if not p.is_argmax_invariant()]
        self.invariant = [p for p in processors if p.is_argmax_invariant()]
        self._index: dict[str, int] = {}        # request id -> its index in the batch
        self.num_changes = 0                    # batch updates given so far (tests)

    def arrange(self, request_ids: Sequence[str], requests: Sequence[tuple[SamplingParams, list[int], list[int]]]
                ) -> list[int]:
        """This step's rows (`request_ids`, each with its params, prompt ids and output ids) by batch index: the
        permutation of the rows that puts row i at index i. Tells the processors what changed first."""
        rows = {request_id: row for row, request_id in enumerate(request_ids)}
        removed = [index for request_id, index in self._index.items() if request_id not in rows]
        for request_id in [r for r in self._index if r not in rows]:
            del self._index[request_id]
        taken = set(self._index.values())
        free = (index for index in range(len(request_ids) + len(removed)) if index not in taken)
        added = []
        for request_id, row in rows.items():
            if request_id not in self._index:
                self._index[request_id] = index = next(free)
                added.append((index, *requests[row]))
        moved = self._condense(len(request_ids))
        update = BatchUpdate(len(request_ids), removed, added, moved) if removed or added else None
        for processor in self.full + self.invariant:
            processor.update_state(update)
        self.num_changes += update is not None
        by_index = sorted(self._index.items(), key=lambda item: item[1])
        return [rows[request_id] for request_id, _ in by_index]

    def _condense(self, batch_size: int) -> list[MovedRequest]:
        """Move the requests past the batch's size into its gaps, the last first."""
        gaps = sorted(set(range(batch_size)) - set(self._index.values()))
        beyond = sorted(((index, r) for r, index in self._index.items() if index >= batch_size), reverse=True)
        moved = []
        for gap, (index, request_id) in zip(gaps, beyond, strict=True):
            self._index[request_id] = gap
            moved.append((index, gap, MoveDirectionality.UNIDIRECTIONAL))
        return moved

    def apply_full(self, logits: torch.Tensor) -> torch.Tensor:
        for processor in self.full:
            logits = processor.apply(logits)
        return logits

    def apply_invariant(self, logits: torch.Tensor) -> torch.Tensor:
        for processor in self.invariant:
            logits = processor.apply(logits)
        return logits
