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
convolution inputs and its h, not a row a token: `RecurrentStates` keeps one slot a running request in every mixer's
pools. A step reads its requests' slots (zeros for a request whose chunk starts at token 0), the mixers compute the
new states beside them (`RecurrentStep`), and the runner commits them only once the step has sampled, so a step that
raised may run again (the engine's reruns). A parallel-sampling request's children get a copy of its state when they
fork. What a state cannot do, the engine turns off for these models: prefix caching (a cached block holds no state),
swapping (preemption recomputes), speculative decoding (a rejected draft would have to be taken out of h).

A prompt's chunk runs the recurrence in its chunked form (`ssd_scan`: state space duality, the Mamba-2 paper's
algorithm: within each chunk of `chunk_size` tokens an attention-like product under a decay mask, between chunks the
states passed on); a decode step's tokens run one step of it, all requests at once (`ssd_step`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

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


def _decay_mask(log_decays: torch.Tensor) -> torch.Tensor:
    """[..., L] log decays a_1..a_L -> [..., L, L]: at (t, s) the sum a_{s+1} + ... + a_t for s <= t (0 on the
    diagonal), -inf above it, so that its exp is the decay from position s to position t."""
    length = log_decays.shape[-1]
    below = torch.ones(length, length, dtype=torch.bool, device=log_decays.device).tril(-1)
    sums = log_decays.unsqueeze(-1).expand(*log_decays.shape, length).masked_fill(~below, 0).cumsum(-2)
    return sums.masked_fill(~below.logical_or(torch.eye(length, dtype=torch.bool, device=below.device)),
                            float("-inf"))


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             initial: torch.Tensor | None, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens through the recurrence, in chunks (float32 throughout).

    x [L, H, P], dt [L, H] (after softplus and clamp), a [H] (A, negative), b and c [L, H, N] (each head's group's),
    initial [H, P, N] or None (zeros) -> (y [L, H, P] without the D term, the final state [H, P, N])."""
    length, heads, _ = x.shape
    pad = -length % chunk_size
    if pad:
        x, dt, b, c = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, dt, b, c))
    chunks = x.shape[0] // chunk_size
    x, b, c = (t.unflatten(0, (chunks, chunk_size)) for t in (x * dt.unsqueeze(-1), b, c))  # [K, Q, H, .]
    log_decay = (dt * a).unflatten(0, (chunks, chunk_size)).permute(2, 0, 1)                 # [H, K, Q]
    cumulative = log_decay.cumsum(-1)
    # within each chunk: y_t = sum_{s<=t} (c_t . b_s) decay(s -> t) x_s
    scores = torch.einsum("kthn,kshn->hkts", c, b) * _decay_mask(log_decay).exp()
    y = torch.einsum("hkts,kshp->kthp", scores, x)
    # each chunk's own contribution to the state at its end, and the states passed from chunk to chunk
    to_end = (cumulative[..., -1:] - cumulative).exp()                                      # [H, K, Q]
    chunk_states = torch.einsum("kshn,hks,kshp->khpn", b, to_end, x)
    start = torch.zeros_like(chunk_states[:1]) if initial is None else initial.float().unsqueeze(0)
    chunk_states = torch.cat([start, chunk_states])                                         # [K + 1, H, P, N]
    between = _decay_mask(F.pad(cumulative[..., -1], (1, 0))).exp()                         # [H, K + 1, K + 1]
    states = torch.einsum("hzs,shpn->zhpn", between, chunk_states)                          # at each chunk's start
    # the state each chunk starts from, decayed to each of its positions
    y = y + torch.einsum("kthn,khpn,hkt->kthp", c, states[:-1], cumulative.exp())
    return y.flatten(0, 1)[:length], states[-1]


def ssd_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of S sequences: x [S, H, P], dt [S, H], b and c [S, H, N], state [S, H, P, N] -> (y
    [S, H, P] without the D term, the new state), in float32."""
    state = state.float() * (dt * a).exp()[..., None, None] + \
        (dt.unsqueeze(-1) * x.float()).unsqueeze(-1) * b.unsqueeze(-2)
    return torch.einsum("shpn,shn->shp", state, c), state


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
        self.kernel_size, self.chunk_size = config.mamba_d_conv, config.mamba_chunk_size
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
        conv_states, ssm_states = step.read(self, x.dtype)
        starts = meta.query_start_loc_cpu
        lengths = [end - start for start, end in zip(starts, starts[1:])]
        y = torch.empty(x.shape[0], self.num_heads, self.head_dim, dtype=torch.float32, device=x.device)
        new_conv, new_ssm = torch.empty_like(conv_states), torch.empty_like(ssm_states)
        weight = self.conv1d.weight.squeeze(1)      # [conv_dim, d_conv]
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
            out, state = ssd_scan(xs, dts, self._a(), b, c, None if step.fresh[i] else ssm_states[i],
                                  self.chunk_size)
            y[rows], new_ssm[i] = out + self.D.float()[:, None] * xs, state.to(new_ssm.dtype)
        step.write(self, new_conv, new_ssm)
        return self.o_proj(self.norm(y.flatten(1), gate).to(x.dtype))

    def _a(self) -> torch.Tensor:
        return -self.A_log.float().exp()

    def _ssm_inputs(self, conv_out: torch.Tensor, dt: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [n, conv_dim] (before its bias and SiLU) and dt [n, H] -> the recurrence's x
        [n, H, P], dt [n, H] (softplus, clamped), B and C [n, H, N] (each head its group's), in float32."""
        if self.conv1d.bias is not None:
            conv_out = conv_out + self.conv1d.bias
        conv_out = F.silu(conv_out).float()
        span = self.groups * self.state_size
        x = conv_out[:, :self.inner].unflatten(-1, (self.num_heads, self.head_dim))
        b, c = (conv_out[:, start:start + span].unflatten(-1, (self.groups, self.state_size))
                .repeat_interleave(self.num_heads // self.groups, dim=1) for start in (self.inner, self.inner + span))
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(self.dt_min, self.dt_max)
        return x, dt, b, c


@dataclass
class RecurrentStep:
    """One step's view of `RecurrentStates` for its requests, in batch order: each request's slot, whether its chunk
    starts at token 0 (its states then start at zero) and how many tokens its states will have taken in; what the
    mixers read, and the new states they write, committed by `RecurrentStates.commit` once the step has sampled."""

    states: RecurrentStates | None
    request_ids: list[str]
    slots: torch.Tensor                 # [S] int64
    fresh: list[bool]
    lengths: list[int]
    new: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def from_start(cls, meta: AttentionMetadata) -> RecurrentStep:
        """A pass with no requests behind it (a profile run, a test's runner), every sequence from its first
        token: its states start at zero and are dropped."""
        starts, lengths = meta.query_start_loc_cpu, meta.seq_lens_cpu
        if any(end - start != length for start, end, length in zip(starts, starts[1:], lengths)):
            raise RuntimeError("Mamba-2 layers run without their requests' states start every sequence at its first "
                               "token")
        return cls(None, [], torch.zeros(len(lengths), dtype=torch.long), [True] * len(lengths), list(lengths))

    def read(self, mixer: Mamba2Mixer, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's requests' states before it in `mixer`: [S, conv_dim, d_conv - 1] and [S, H, P, N]."""
        if self.states is None:
            return tuple(torch.zeros(len(self.fresh), *shape, dtype=dtype,   # type: ignore[return-value]
                                     device=mixer.dt_bias.device) for shape in mixer.state_shapes())
        conv, ssm = (pool.index_select(0, self.slots) for pool in self.states.pools[mixer.index])
        fresh = torch.tensor(self.fresh, device=conv.device)
        return conv.masked_fill_(fresh[:, None, None], 0), ssm.masked_fill_(fresh[:, None, None, None], 0)

    def write(self, mixer: Mamba2Mixer, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        self.new[mixer.index] = (conv, ssm)


class RecurrentStates:
    """Each running request's Mamba-2 states: one slot a request in every mixer's two pools ([slots, conv_dim,
    d_conv - 1] convolution inputs, [slots, H, P, N] SSM states, in the model's dtype), taken when a request first
    runs and given back when it finishes or is preempted (a preempted request starts again from its first token)."""

    def __init__(self, mixers: list[Mamba2Mixer], num_slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.pools = {m.index: tuple(torch.zeros(num_slots, *shape, dtype=dtype, device=device)
                                     for shape in m.state_shapes()) for m in mixers}
        self.free = list(range(num_slots - 1, -1, -1))
        self.slots: dict[str, int] = {}
        self.lengths: dict[str, int] = {}      # how many of a request's tokens its states have taken in

    @staticmethod
    def bytes_per_request(mixers: list[Mamba2Mixer], dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return sum(element * torch.Size(shape).numel() for m in mixers for shape in m.state_shapes())

    def release(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        self.lengths.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)

    def begin(self, scheduled: list[ScheduledRequest]) -> RecurrentStep:
        """The step of these requests (batch order), a slot taken for each that has none. Each chunk starts at its
        request's first token or where its states stopped (RuntimeError otherwise: a chunk after tokens no state
        took in, which the engine never schedules for these models)."""
        slots, fresh, lengths = [], [], []
        for request in scheduled:
            start = request.num_computed_tokens
            if start and self.lengths.get(request.request_id) != start:
                raise RuntimeError(f"request {request.request_id}'s Mamba-2 states cover "
                                   f"{self.lengths.get(request.request_id, 0)} tokens, its chunk starts at {start}")
            slots.append(self._slot(request.request_id))
            fresh.append(start == 0)
            lengths.append(start + request.num_new_tokens)
        device = next(iter(self.pools.values()))[0].device
        return RecurrentStep(self, [r.request_id for r in scheduled], torch.tensor(slots, device=device), fresh,
                             lengths)

    def commit(self, step: RecurrentStep, children: dict[str, list[str]]) -> None:
        """The step's new states into its requests' slots, once it has sampled; a forking request's children (its
        first sampled token's, n > 1) get a copy of its states."""
        for index, (conv, ssm) in step.new.items():
            conv_pool, ssm_pool = self.pools[index]
            conv_pool.index_copy_(0, step.slots, conv)
            ssm_pool.index_copy_(0, step.slots, ssm)
        self.lengths.update(zip(step.request_ids, step.lengths))
        for parent, kids in children.items():
            for kid in kids:
                slot = self._slot(kid)
                for pool in (p for pools in self.pools.values() for p in pools):
                    pool[slot] = pool[self.slots[parent]]
                self.lengths[kid] = self.lengths[parent]

    def _slot(self, request_id: str) -> int:
        if request_id not in self.slots:
            if not self.free:
                raise RuntimeError("no Mamba-2 state slot left: more running requests than max_num_seqs")
            self.slots[request_id] = self.free.pop()
        return self.slots[request_id]
