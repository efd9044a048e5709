"""Layers whose requests each keep a state of fixed size instead of a K/V row a token (`RecurrentMixer`): Mamba-2's
(pagedllm.models.mamba: Granite 4's hybrids) and Gated DeltaNet's (pagedllm.models.deltanet: Qwen3-Next's and
Qwen3.5's), and those states (`RecurrentStates`).

Each such layer runs a short causal depthwise convolution over its input channels (`convolve`: the token and the
`kernel_size - 1` before it), then a recurrence over a state per head; what a request carries from one step to the
next is its last `kernel_size - 1` convolution inputs and that state. `RecurrentStates` keeps two slots a running
request in every mixer's pools. A step reads each request's states from the slot they are in (zeros for a request
whose chunk starts at token 0) and writes the new ones to the other (`RecurrentStep`); the runner commits the step,
swapping the two, only once it has sampled, so a step that raised may run again (the engine's reruns). A
parallel-sampling request's children get a copy of its state when they fork. What a state cannot do, the engine turns
off for these models: prefix caching (a cached block holds no state), swapping (preemption recomputes), speculative
decoding (a rejected draft would have to be taken out of the state) and beam search (its beams fork between steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagedllm.attention.metadata import AttentionMetadata
    from pagedllm.core.sched.output import ScheduledRequest

# Qwen3-Next's and Qwen3.5's (dense and MoE) language models: Gated DeltaNet layers among gated attention ones
GATED_DELTANET_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# the model types whose `layer_types` name recurrent layers: entry -> the layer's kind
_RECURRENT_LAYER_TYPES = {"granitemoehybrid": {"mamba": "mamba2", "linear_attention": "mamba2"},
                          **{t: {"linear_attention": "gated_deltanet"} for t in GATED_DELTANET_MODEL_TYPES}}


def recurrent_layer_kind(config: Any, index: int) -> str | None:
    """Decoder layer `index`'s kind of recurrent layer ("mamba2", "gated_deltanet"); None for an attention."""
    layer_types = getattr(config, "layer_types", None)
    kinds = _RECURRENT_LAYER_TYPES.get(config.model_type)
    return None if layer_types is None or kinds is None else kinds.get(layer_types[index])


def has_recurrent_layers(config: Any) -> bool:
    """Whether any decoder layer is a recurrent one, whose requests keep a state (`RecurrentStates`)."""
    return any(recurrent_layer_kind(config, index) for index in range(config.num_hidden_layers))


# exp(x) of a log decay x <= 0 is taken at x >= -60 at least: exp(-60) ~ 9e-27 is nothing beside the float32 terms it
# decays, and an exp whose result is denormal (x below ~-87) ran 8x slower (denormal results, Zen 4)
_LOG_DECAY_FLOOR = -60.0


def decays(log_decays: torch.Tensor) -> torch.Tensor:
    """exp of log decays (<= 0), floored at exp(-60)."""
    return log_decays.clamp(min=_LOG_DECAY_FLOOR).exp()


class RecurrentMixer(nn.Module):
    """A recurrent layer in an attention's place (the decoder layer's `self_attn`): `index` is the decoder layer's,
    its states' key in `RecurrentStates`; `state_shapes` a request's states in it (its convolution inputs, then its
    recurrence's state); `conv1d` its depthwise convolution."""

    index: int
    conv1d: nn.Conv1d

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        raise NotImplementedError

    @property
    def kernel_size(self) -> int:
        return self.conv1d.kernel_size[0]


@dataclass
class StepRows:
    """A step's sequences by kind: those of one token (decode steps': their indices and rows), which run a step of
    the recurrence all at once, and prompts' chunks (index, rows), each run through it on its own."""

    singles: torch.Tensor | None            # [n] int64, None for none
    single_rows: torch.Tensor | None        # [n] int64
    chunks: list[tuple[int, slice]]

    @classmethod
    def of(cls, starts: list[int], device: torch.device) -> StepRows:
        singles = [i for i, (start, end) in enumerate(zip(starts, starts[1:])) if end - start == 1]
        chunks = [(i, slice(start, end)) for i, (start, end) in enumerate(zip(starts, starts[1:])) if end - start != 1]
        if not singles:
            return cls(None, None, chunks)
        return cls(torch.tensor(singles, device=device), torch.tensor([starts[i] for i in singles], device=device),
                   chunks)


def convolve(mixer: RecurrentMixer, conv_states: torch.Tensor, x: torch.Tensor,
             rows: StepRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's rows of x [T, C] through the mixer's causal depthwise convolution, after its earlier inputs
    conv_states [S, C, k - 1]: (the outputs [T, C], with the convolution's bias and before its activation, in x's
    dtype; each sequence's new states [S, C, k - 1]). The sequences of one token at once, a prompt's chunk each
    through F.conv1d."""
    weight = mixer.conv1d.weight.squeeze(1)      # [C, k]
    out, new_states = torch.empty_like(x), torch.empty_like(conv_states)
    if rows.singles is not None:
        window = torch.cat([conv_states[rows.singles], x[rows.single_rows].unsqueeze(-1).to(conv_states.dtype)],
                           dim=-1)
        new_states[rows.singles] = window[..., 1:]
        out[rows.single_rows] = (window.to(x.dtype) * weight).sum(-1)
    for i, chunk in rows.chunks:
        window = torch.cat([conv_states[i], x[chunk].t().to(conv_states.dtype)], dim=-1)     # [C, k - 1 + n]
        new_states[i] = window[:, window.shape[1] - (mixer.kernel_size - 1):]
        out[chunk] = F.conv1d(window.to(x.dtype).unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0].t()
    if mixer.conv1d.bias is not None:
        out = out + mixer.conv1d.bias
    return out, new_states


def run_recurrence(rows: StepRows, step: RecurrentStep, states: torch.Tensor, inputs: tuple[torch.Tensor, ...],
                   one_step: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                   chunked: Callable[..., tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor) -> torch.Tensor:
    """A step's sequences through a layer's recurrence, from their states before it [S, *shape]: the one-token
    sequences' rows of `inputs` (per-token tensors) at once through `one_step(*inputs, states)`, each prompt's chunk
    through `chunked(*inputs, initial)` (initial None for a chunk from the first token); each writes its rows of
    `out` -> the sequences' new states, in the states' dtype."""
    new_states = torch.empty_like(states)
    if rows.singles is not None:
        one = rows.single_rows
        out[one], state = one_step(*(t[one] for t in inputs), states[rows.singles])
        new_states[rows.singles] = state.to(new_states.dtype)
    for i, chunk in rows.chunks:
        out[chunk], state = chunked(*(t[chunk] for t in inputs), None if step.fresh[i] else states[i])
        new_states[i] = state.to(new_states.dtype)
    return new_states


@dataclass
class RecurrentStep:
    """One step's view of `RecurrentStates` for its requests, in batch order: the slot each request's states are read
    from (-1: its chunk starts at token 0, its states at zero) and the slot its new ones are written to, and how many
    tokens they will have taken in; `RecurrentStates.commit` makes the written slots the requests' once the step has
    sampled."""

    states: RecurrentStates | None
    request_ids: list[str]
    read_slots: torch.Tensor            # [S] int64
    write_slots: torch.Tensor           # [S] int64
    fresh: list[bool]
    lengths: list[int]

    @classmethod
    def from_start(cls, meta: AttentionMetadata) -> RecurrentStep:
        """A pass with no requests behind it (a profile run, a test's runner), every sequence from its first
        token: its states start at zero and are dropped."""
        starts, lengths = meta.query_start_loc_cpu, meta.seq_lens_cpu
        if any(end - start != length for start, end, length in zip(starts, starts[1:], lengths)):
            raise RuntimeError("recurrent layers run without their requests' states start every sequence at its "
                               "first token")
        none = torch.full((len(lengths),), -1, dtype=torch.long)
        return cls(None, [], none, none, [True] * len(lengths), list(lengths))

    def read(self, mixer: RecurrentMixer, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's requests' states before it in `mixer`: [S, *shape] for each of its state shapes."""
        if self.states is None:
            device = mixer.conv1d.weight.device
            return tuple(torch.zeros(len(self.fresh), *shape, dtype=dtype,   # type: ignore[return-value]
                                     device=device) for shape in mixer.state_shapes())
        conv, state = (pool.index_select(0, self.read_slots.clamp(min=0)) for pool in self.states.pools[mixer.index])
        if not any(self.fresh):
            return conv, state
        fresh = torch.tensor(self.fresh, device=conv.device)
        return conv.masked_fill_(fresh[:, None, None], 0), \
            state.masked_fill_(fresh.view(-1, *[1] * (state.dim() - 1)), 0)

    def write(self, mixer: RecurrentMixer, conv: torch.Tensor, state: torch.Tensor) -> None:
        """The step's requests' new states in `mixer`, into their write slots (nothing without states)."""
        if self.states is not None:
            conv_pool, state_pool = self.states.pools[mixer.index]
            conv_pool.index_copy_(0, self.write_slots, conv)
            state_pool.index_copy_(0, self.write_slots, state)


class RecurrentStates:
    """Each running request's states: two slots a request in every mixer's two pools ([2 x requests, *shape] for
    its convolution inputs and its recurrence's state, in the model's dtype), the one its states are in and the one a
    step writes their next ones to; a commit swaps them. A request takes its pair when it first runs and gives it
    back when it finishes or is preempted (it starts again from its first token)."""

    def __init__(self, mixers: list[RecurrentMixer], num_requests: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.pools = {m.index: tuple(torch.zeros(2 * num_requests, *shape, dtype=dtype, device=device)
                                     for shape in m.state_shapes()) for m in mixers}
        self.device = device
        self.free = list(range(num_requests - 1, -1, -1))
        self.pairs: dict[str, int] = {}
        self.current: dict[str, int] = {}      # which of its pair's two slots holds a request's states
        self.lengths: dict[str, int] = {}      # how many of a request's tokens its states have taken in

    @staticmethod
    def bytes_per_request(mixers: list[RecurrentMixer], dtype: torch.dtype) -> int:
        """A request's two slots in every mixer."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * sum(element * torch.Size(shape).numel() for m in mixers for shape in m.state_shapes())

    def release(self, request_id: str) -> None:
        pair = self.pairs.pop(request_id, None)
        self.current.pop(request_id, None)
        self.lengths.pop(request_id, None)
        if pair is not None:
            self.free.append(pair)

    def slot(self, request_id: str) -> int:
        """The slot a request's states are in."""
        return 2 * self.pairs[request_id] + self.current[request_id]

    def begin(self, scheduled: list[ScheduledRequest]) -> RecurrentStep:
        """The step of these requests (batch order), a pair of slots taken for each that has none. Each chunk starts at
        its request's first token or where its states stopped (RuntimeError otherwise: a chunk after tokens no state
        took in, which the engine never schedules for these models)."""
        reads, writes, fresh, lengths = [], [], [], []
        for request in scheduled:
            start, request_id = request.num_computed_tokens, request.request_id
            if start and self.lengths.get(request_id) != start:
                raise RuntimeError(f"request {request_id}'s recurrent states cover {self.lengths.get(request_id, 0)} "
                                   f"tokens, its chunk starts at {start}")
            pair = self._pair(request_id)
            reads.append(self.slot(request_id) if start else -1)
            writes.append(2 * pair + 1 - self.current[request_id])
            fresh.append(start == 0)
            lengths.append(start + request.num_new_tokens)
        return RecurrentStep(self, [r.request_id for r in scheduled], torch.tensor(reads, device=self.device),
                             torch.tensor(writes, device=self.device), fresh, lengths)

    def commit(self, step: RecurrentStep, children: dict[str, list[str]]) -> None:
        """The step's written slots become its requests' states, once it has sampled; a forking request's children
        (its first sampled token's, n > 1) get a copy of its states."""
        for request_id, length in zip(step.request_ids, step.lengths):
            self.current[request_id] ^= 1
            self.lengths[request_id] = length
        for parent, kids in children.items():
            source = self.slot(parent)
            for kid in kids:
                self._pair(kid)
                for pool in (p for pools in self.pools.values() for p in pools):
                    pool[self.slot(kid)] = pool[source]
                self.lengths[kid] = self.lengths[parent]

    def _pair(self, request_id: str) -> int:
        if request_id not in self.pairs:
            if not self.free:
                raise RuntimeError("no recurrent state slots left: more running requests than max_num_seqs")
            self.pairs[request_id], self.current[request_id] = self.free.pop(), 0
        return self.pairs[request_id]
