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
convolution inputs and its h, not a row a token: pagedllm.models.recurrent keeps them (`RecurrentStates`), as it
keeps Gated DeltaNet's.

A prompt's chunk runs the recurrence in its chunked form (`ssd_scan`: state space duality, the Mamba-2 paper's
algorithm: within each chunk of `SCAN_CHUNK` tokens an attention-like product under a decay mask, between chunks the
states passed on); a decode step's tokens run one step of it, all requests at once: on the CPU in the kernels'
`mamba2_decode` (kernels/csrc/mamba.cpp: each state row read once and written once), elsewhere in torch
(`Mamba2Mixer._decode_native`, its reference).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import kernels_for
from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.models.recurrent import (
    RecurrentMixer,
    RecurrentStep,
    StepRows,
    convolve,
    decays,
    run_recurrence,
)

if TYPE_CHECKING:
    from pagedllm.attention.metadata import AttentionMetadata
    from pagedllm.lora.runtime import LayerLoRA
    from pagedllm.runner.kv_tensors import KVCache

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
    decay = decays(cumulative.unsqueeze(-1) - cumulative.unsqueeze(-2)).masked_fill_(~causal, 0)
    y = ((c @ b.transpose(-1, -2)).unsqueeze(2) * decay) @ xdt                           # [K, G, h, Q, P]
    to_end = decays(cumulative[..., -1:] - cumulative).unsqueeze(-1)
    added = b.transpose(-1, -2) @ (xdt * to_end).transpose(2, 3).flatten(3)             # [K, G, N, h * P]
    chunk_decay = decays(cumulative[..., -1]).repeat_interleave(head_dim, dim=-1).unsqueeze(-2)
    state = torch.zeros_like(added[0]) if initial is None else \
        initial.float().unflatten(0, (groups, per_group)).permute(0, 3, 1, 2).flatten(2)  # [G, N, h * P]
    starts = []
    for k in range(chunks):
        starts.append(state)
        state = chunk_decay[k] * state + added[k]
    carried = (c @ torch.stack(starts)).unflatten(-1, (per_group, head_dim)).transpose(2, 3)
    y = y + carried * decays(cumulative).unsqueeze(-1)
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


class Mamba2Mixer(RecurrentMixer):
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
        self.dt_min, self.dt_max = config.time_step_limit or (0.0, float("inf"))
        self.inner = self.num_heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state_size
        self.in_proj = MergedColumnParallelLinear(config.hidden_size, [self.inner, self.conv_dim, self.num_heads],
                                                  bias=config.mamba_proj_bias, dtype=dtype)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, config.mamba_d_conv, groups=self.conv_dim,
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
        rows = StepRows.of(starts, x.device)
        conv_out, new_conv = convolve(self, conv_states, xbc, rows)
        xs, dts, b, c = self._ssm_inputs(conv_out, dt)
        y = torch.empty(x.shape[0], self.num_heads, self.head_dim, dtype=torch.float32, device=x.device)
        a = self._a()
        new_ssm = run_recurrence(rows, step, ssm_states, (xs, dts, b, c),
                                 lambda x_, dt_, b_, c_, state: ssd_step(x_, dt_, a, b_, c_, state),
                                 lambda x_, dt_, b_, c_, initial: self._scan(kernels, x_, dt_, b_, c_, initial), y)
        step.write(self, new_conv, new_ssm)
        y = y + self.D.float()[:, None] * xs
        return self.o_proj(self.norm(y.flatten(1), gate).to(x.dtype))

    def _decode_native(self, step: RecurrentStep, gate: torch.Tensor, xbc: torch.Tensor,
                       dt: torch.Tensor) -> torch.Tensor:
        """A decode step in torch (the kernels' mamba2_decode's reference): the convolution's and the recurrence's
        step for every sequence at once, the new states written to the step's slots -> the gated norm's [S, inner]."""
        conv_states, ssm_states = step.read(self, xbc.dtype)
        conv_out, new_conv = convolve(self, conv_states, xbc, StepRows.of(list(range(xbc.shape[0] + 1)), xbc.device))
        xs, dts, b, c = self._ssm_inputs(conv_out, dt)
        out, state = ssd_step(xs, dts, self._a(), b, c, ssm_states)
        step.write(self, new_conv, state.to(ssm_states.dtype))
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
        """The convolution's output [n, conv_dim] (before its SiLU) and dt [n, H] -> the recurrence's x [n, H, P], dt
        [n, H] (softplus, clamped), B and C [n, G, N], in float32."""
        conv_out = F.silu(conv_out).float()
        span = self.groups * self.state_size
        x = conv_out[:, :self.inner].unflatten(-1, (self.num_heads, self.head_dim))
        b, c = (conv_out[:, start:start + span].unflatten(-1, (self.groups, self.state_size))
                for start in (self.inner, self.inner + span))
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(self.dt_min, self.dt_max)
        return x, dt, b, c


