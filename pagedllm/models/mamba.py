"""Mamba-2 layers (Granite 4's hybrid models: granite-4.0-h-*) and the recurrent state each request keeps in them.

A Mamba-2 mixer stands where an attention would (the layer's `self_attn`): in_proj gives each token a gate z, the
convolution's input xBC and a time step dt per head; xBC goes through a causal depthwise convolution over the token
and the `d_conv - 1` before it (then SiLU) and splits into x (heads x head_dim), B and C (groups x d_state); then each
head runs the selective state space recurrence

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        (h: head_dim x d_state)
    y_t = h_t C_t + D x_t

with dt_t = softplus(dt + dt_bias) clamped to time_step_limit and A = -exp(A_log); y times SiLU(z) is RMS-normed by
group (`GatedRMSNorm`) and projected back (o_proj, the checkpoint's out_proj).

Unlike K/V, what a request carries from one step to the next is a state of fixed size, its last `d_conv - 1`
convolution inputs and its h, not a row a token: `RecurrentStates` keeps two slots a running request in every mixer's
pools. A step reads each request's states from the slot they are in (zeros for a request whose chunk starts at token
0) and writes the new ones to the other (`RecurrentStep`); the runner commits the step, swapping the two, only once it
has sampled, so a step that raised may run again (the engine's reruns). A parallel-sampling request's children get a
copy of its state when they fork. What a state cannot do, the engine turns off for these models: prefix caching (a
cached block holds no state), swapping (preemption recomputes), speculative decoding (a rejected draft would have to be
taken out of h) and beam search (its beams fork between steps).

A prompt's chunk runs the recurrence in its chunked form (`ssd_scan`: state space duality, the Mamba-2 paper's
algorithm: within each chunk of `SCAN_CHUNK` tokens an attention-like product under a decay mask, between chunks the
states passed on); a decode step's tokens run one step of it, all requests at once: on the CPU in the kernels'
`mamba2_decode` (kernels/csrc/mamba.cpp: each state row read once and written once), elsewhere in torch
(`Mamba2Mixer._decode_native`, its reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import kernels_for
from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from pagedllm.attention.metadata import AttentionMetadata
    from pagedllm.core.sched.output import ScheduledRequest
    from pagedllm.lora.runtime import LayerLoRA
    from pagedllm.runner.kv_tensors import KVCache

# transformers' layer_types entry of a Mamba-2 layer (config.json's "mamba")
MAMBA_LAYER_TYPES = ("mamba", "linear_attention")


def is_mamba_layer(config: Any, index: int) -> bool:
    layer_types = getattr(config, "layer_types", None)
    return config.model_type == "granitemoehybrid" and layer_types is not None and \
        layer_types[index] in MAMBA_LAYER_TYPES


def has_mamba_layers(config: Any) -> bool:
    """Whether any decoder layer is a Mamba-2 mixer, whose requests keep a recurrent state (`RecurrentStates`)."""
    return any(is_mamba_layer(config, index) for index in range(config.num_hidden_layers))


class GatedRMSNorm(nn.Module):
    """weight * RMSNorm(y * SiLU(z)) over each group of `group_size` values, in float32 (Mamba-2's norm)."""

    def __init__(self, size: int, group_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = y.float() * F.silu(gate.float())
        groups = y.unflatten(-1, (-1, self.group_size))
        groups = groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * groups.flatten(-2).to(self.weight.dtype)


# the recurrence's chunk on a CPU: a prompt's tokens run in chunks of this many whatever the config's (its
# mamba_chunk_size is for GPU kernels; the chunked form gives the same result at any size, as a float sum may):
# 300 tokens through granite-4.0-h-350m's layer shapes took 14 ms in chunks of 64, 25 ms of 128 (Zen 4, float32)
SCAN_CHUNK = 64


# exp(x) of a log decay x <= 0 is taken at x >= -60 at least: exp(-60) ~ 9e-27 is nothing beside the float32 terms it
# decays, and an exp whose result is denormal (x below ~-87) ran 8x slower (denormal results, Zen 4)
_LOG_DECAY_FLOOR = -60.0


def _decays(log_decays: torch.Tensor) -> torch.Tensor:
    return log_decays.clamp(min=_LOG_DECAY_FLOOR).exp()


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             initial: torch.Tensor | None, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens through the recurrence, in chunks, in float32: x [L, H, P], dt [L, H] (after softplus
    and clamp), a [H] (A, negative), b and c [L, G, N] (each group's, shared by its H / G heads), initial [H, P, N]
    or None (zeros) -> (y [L, H, P] without the D term, the final state [H, P, N]).

    Within a chunk, token t's output is sum_{s <= t} (c_t . b_s) decay(s -> t) dt_s x_s plus c_t times the state the
    chunk started from, decayed to t; each chunk's own tokens add (b_s decay(s -> end) dt_s x_s) to the state it
    passes on, decayed by the whole chunk. A group's heads share its b and c, so their products are one matmul."""
    length, heads, head_dim = x.shape
    groups = b.shape[1]
    per_group = heads // groups
    xdt = x * dt.unsqueeze(-1)
    pad = -length % chunk_size
    if pad:
        xdt, dt, b, c = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (xdt, dt, b, c))
    chunks = xdt.shape[0] // chunk_size
    b, c = (t.unflatten(0, (chunks, chunk_size)).transpose(1, 2) for t in (b, c))      # [K, G, Q, N]
    xdt = xdt.unflatten(0, (chunks, chunk_size)).unflatten(2, (groups, per_group)).permute(0, 2, 3, 1, 4)
    cumulative = (dt * a).unflatten(0, (chunks, chunk_size)).unflatten(2, (groups, per_group)) \
        .permute(0, 2, 3, 1).cumsum(-1)                                                   # [K, G, h, Q] log decays
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay = _decays(cumulative.unsqueeze(-1) - cumulative.unsqueeze(-2)).masked_fill_(~causal, 0)
    y = ((c @ b.transpose(-1, -2)).unsqueeze(2) * decay) @ xdt                           # [K, G, h, Q, P]
    to_end = _decays(cumulative[..., -1:] - cumulative).unsqueeze(-1)
    added = b.transpose(-1, -2) @ (xdt * to_end).transpose(2, 3).flatten(3)             # [K, G, N, h * P]
    chunk_decay = _decays(cumulative[..., -1]).repeat_interleave(head_dim, dim=-1).unsqueeze(-2)
    state = torch.zeros_like(added[0]) if initial is None else \
        initial.float().unflatten(0, (groups, per_group)).permute(0, 3, 1, 2).flatten(2)  # [G, N, h * P]
    starts = []
    for k in range(chunks):
        starts.append(state)
        state = chunk_decay[k] * state + added[k]
    carried = (c @ torch.stack(starts)).unflatten(-1, (per_group, head_dim)).transpose(2, 3)
    y = y + carried * _decays(cumulative).unsqueeze(-1)
    y = y.permute(0, 3, 1, 2, 4).flatten(0, 1).flatten(1, 2)[:length]
    return y, state.unflatten(-1, (per_group, head_dim)).permute(0, 2, 3, 1).flatten(0, 1)


def ssd_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of S sequences: x [S, H, P], dt [S, H], b and c [S, G, N], state [S, H, P, N] -> (y
    [S, H, P] without the D term, the new state), in float32."""
    groups = b.shape[1]
    state = state.float() * (dt * a).exp()[..., None, None] + \
        (dt.unsqueeze(-1) * x).unsqueeze(-1) * b.repeat_interleave(x.shape[1] // groups, dim=1).unsqueeze(-2)
    y = state.unflatten(1, (groups, -1)).flatten(2, 3) @ c.unsqueeze(-1)               # [S, G, h * P, 1]
    return y.view(x.shape), state


class Mamba2Mixer(nn.Module):
    """A Mamba-2 layer in place of an attention (module docstring), its weights under the checkpoint's names but
    out_proj (o_proj, where Granite's residual multiplier is folded in as into an attention's)."""

    def __init__(self, config: Any, dtype: torch.dtype, tp: tuple[int, int], index: int) -> None:
        super().__init__()
        if tp[1] > 1:
            raise ValueError("Mamba-2 layers run on one rank (tensor_parallel_size=1)")
        if config.hidden_act != "silu":
            raise ValueError(f"a Mamba-2 convolution's activation {config.hidden_act!r} is not supported (only silu)")
        self.index = index      # the decoder layer's: its states' key in `RecurrentStates`
        self.num_heads, self.head_dim = config.mamba_n_heads, config.mamba_d_head
        self.groups, self.state_size = config.mamba_n_groups, config.mamba_d_state
        self.kernel_size = config.mamba_d_conv
        self.dt_min, self.dt_max = config.time_step_limit or (0.0, float("inf"))
        self.inner = self.num_heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state_size
        self.in_proj = MergedColumnParallelLinear(config.hidden_size, [self.inner, self.conv_dim, self.num_heads],
                                                  bias=config.mamba_proj_bias, dtype=dtype)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel_size, groups=self.conv_dim,
                                bias=config.mamba_conv_bias, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads, dtype=dtype), requires_grad=False)
        self.D = nn.Parameter(torch.ones(self.num_heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(self.inner, self.inner // self.groups, config.rms_norm_eps, dtype)
        self.o_proj = RowParallelLinear(self.inner, config.hidden_size, bias=config.mamba_proj_bias, dtype=dtype)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A request's (convolution inputs, SSM state) shapes in this layer."""
        return (self.conv_dim, self.kernel_size - 1), (self.num_heads, self.head_dim, self.state_size)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: list[KVCache], meta: AttentionMetadata,
                lora: LayerLoRA | None = None) -> torch.Tensor:
        step = meta.recurrent if meta.recurrent is not None else RecurrentStep.from_start(meta)
        gate, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.num_heads], -1)
        starts, kernels = meta.query_start_loc_cpu, kernels_for(x)
        if len(starts) - 1 == x.shape[0]:      # a decode step: one token each, one step of the recurrence for all
            if kernels is None or step.states is None:
                return self.o_proj(self._decode_native(step, gate, xbc, dt))
            out = torch.empty_like(gate)
            kernels.mamba2_decode(out, xbc, dt, gate, *step.states.pools[self.index], step.read_slots,
                                  step.write_slots, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.dt_bias,
                                  self._a(), self.D, self.norm.weight, self.norm.eps, self.groups, self.dt_min,
                                  self.dt_max)
            return self.o_proj(out)
        conv_states, ssm_states = step.read(self, x.dtype)
        lengths = [end - start for start, end in zip(starts, starts[1:])]
        weight = self.conv1d.weight.squeeze(1)      # [conv_dim, d_conv]
        y = torch.empty(x.shape[0], self.num_heads, self.head_dim, dtype=torch.float32, device=x.device)
        new_conv, new_ssm = torch.empty_like(conv_states), torch.empty_like(ssm_states)
        decodes = [i for i, n in enumerate(lengths) if n == 1]
        if decodes:     # one token each: one step of the convolution and of the recurrence, all at once
            seqs = torch.tensor(decodes, device=x.device)
            rows = torch.tensor([starts[i] for i in decodes], device=x.device)
            window = torch.cat([conv_states[seqs], xbc[rows].unsqueeze(-1).to(conv_states.dtype)], dim=-1)
            new_conv[seqs] = window[..., 1:]
            xs, dts, b, c = self._ssm_inputs((window.to(x.dtype) * weight).sum(-1), dt[rows])
            out, state = ssd_step(xs, dts, self._a(), b, c, ssm_states[seqs])
            y[rows], new_ssm[seqs] = out + self.D.float()[:, None] * xs, state.to(new_ssm.dtype)
        for i, n in enumerate(lengths):     # a prompt's chunk: the convolution over it, the recurrence in chunks
            if n == 1:
                continue
            rows = slice(starts[i], starts[i + 1])
            window = torch.cat([conv_states[i], xbc[rows].t().to(conv_states.dtype)], dim=-1)   # [conv_dim, k-1+n]
            new_conv[i] = window[:, window.shape[1] - (self.kernel_size - 1):]
            conv_out = F.conv1d(window.to(x.dtype).unsqueeze(0), weight.unsqueeze(1), groups=self.conv_dim)[0]
            xs, dts, b, c = self._ssm_inputs(conv_out.t(), dt[rows])
            out, state = self._scan(kernels, xs, dts, b, c, None if step.fresh[i] else ssm_states[i])
            y[rows], new_ssm[i] = out + self.D.float()[:, None] * xs, state.to(new_ssm.dtype)
        step.write(self, new_conv, new_ssm)
        return self.o_proj(self.norm(y.flatten(1), gate).to(x.dtype))

    def _decode_native(self, step: RecurrentStep, gate: torch.Tensor, xbc: torch.Tensor,
                       dt: torch.Tensor) -> torch.Tensor:
        """A decode step in torch (the kernels' mamba2_decode's reference): the convolution's and the recurrence's
        step for every sequence at once, the new states written to the step's slots -> the gated norm's [S, inner]."""
        conv_states, ssm_states = step.read(self, xbc.dtype)
        window = torch.cat([conv_states, xbc.unsqueeze(-1).to(conv_states.dtype)], dim=-1)
        xs, dts, b, c = self._ssm_inputs((window.to(xbc.dtype) * self.conv1d.weight.squeeze(1)).sum(-1), dt)
        out, state = ssd_step(xs, dts, self._a(), b, c, ssm_states)
        step.write(self, window[..., 1:], state.to(ssm_states.dtype))
        return self.norm((out + self.D.float()[:, None] * xs).flatten(1), gate).to(xbc.dtype)

    def _scan(self, kernels: Any, xs: torch.Tensor, dts: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
              initial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A prompt's chunk through the recurrence: token by token in the kernels' mamba2_scan on the CPU (each head's
        state in cache: 0.1 us a token a head), else in torch's chunked form (`ssd_scan`, its reference)."""
        if kernels is None:
            return ssd_scan(xs, dts, self._a(), b, c, initial, SCAN_CHUNK)
        y, state = torch.empty(xs.shape), torch.empty(self.state_shapes()[1])
        kernels.mamba2_scan(y, state, xs.contiguous(), dts.contiguous(), self._a(), b.contiguous(), c.contiguous(),
                            None if initial is None else initial.float().contiguous())
        return y, state

    def _a(self) -> torch.Tensor:
        return -self.A_log.float().exp()

    def _ssm_inputs(self, conv_out: torch.Tensor, dt: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [n, conv_dim] (before its bias and SiLU) and dt [n, H] -> the recurrence's x
        [n, H, P], dt [n, H] (softplus, clamped), B and C [n, G, N], in float32."""
        if self.conv1d.bias is not None:
            conv_out = conv_out + self.conv1d.bias
        conv_out = F.silu(conv_out).float()
        span = self.groups * self.state_size
        x = conv_out[:, :self.inner].unflatten(-1, (self.num_heads, self.head_dim))
        b, c = (conv_out[:, start:start + span].unflatten(-1, (self.groups, self.state_size))
                for start in (self.inner, self.inner + span))
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(self.dt_min, self.dt_max)
        return x, dt, b, c


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
            raise RuntimeError("Mamba-2 layers run without their requests' states start every sequence at its first "
                               "token")
        none = torch.full((len(lengths),), -1, dtype=torch.long)
        return cls(None, [], none, none, [True] * len(lengths), list(lengths))

    def read(self, mixer: Mamba2Mixer, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's requests' states before it in `mixer`: [S, conv_dim, d_conv - 1] and [S, H, P, N]."""
        if self.states is None:
            return tuple(torch.zeros(len(self.fresh), *shape, dtype=dtype,   # type: ignore[return-value]
                                     device=mixer.dt_bias.device) for shape in mixer.state_shapes())
        conv, ssm = (pool.index_select(0, self.read_slots.clamp(min=0)) for pool in self.states.pools[mixer.index])
        if not any(self.fresh):
            return conv, ssm
        fresh = torch.tensor(self.fresh, device=conv.device)
        return conv.masked_fill_(fresh[:, None, None], 0), ssm.masked_fill_(fresh[:, None, None, None], 0)

    def write(self, mixer: Mamba2Mixer, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """The step's requests' new states in `mixer`, into their write slots (nothing without states)."""
        if self.states is not None:
            conv_pool, ssm_pool = self.states.pools[mixer.index]
            conv_pool.index_copy_(0, self.write_slots, conv)
            ssm_pool.index_copy_(0, self.write_slots, ssm)


class RecurrentStates:
    """Each running request's Mamba-2 states: two slots a request in every mixer's two pools ([2 x requests,
    conv_dim, d_conv - 1] convolution inputs, [2 x requests, H, P, N] SSM states, in the model's dtype), the one its
    states are in and the one a step writes their next ones to; a commit swaps them. A request takes its pair when it
    first runs and gives it back when it finishes or is preempted (it starts again from its first token)."""

    def __init__(self, mixers: list[Mamba2Mixer], num_requests: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.pools = {m.index: tuple(torch.zeros(2 * num_requests, *shape, dtype=dtype, device=device)
                                     for shape in m.state_shapes()) for m in mixers}
        self.device = device
        self.free = list(range(num_requests - 1, -1, -1))
        self.pairs: dict[str, int] = {}
        self.current: dict[str, int] = {}      # which of its pair's two slots holds a request's states
        self.lengths: dict[str, int] = {}      # how many of a request's tokens its states have taken in

    @staticmethod
    def bytes_per_request(mixers: list[Mamba2Mixer], dtype: torch.dtype) -> int:
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
                raise RuntimeError(f"request {request_id}'s Mamba-2 states cover {self.lengths.get(request_id, 0)} "
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
                raise RuntimeError("no Mamba-2 state slots left: more running requests than max_num_seqs")
            self.pairs[request_id], self.current[request_id] = self.free.pop(), 0
        return self.pairs[request_id]
