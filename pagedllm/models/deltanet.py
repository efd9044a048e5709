"""Gated DeltaNet layers: the linear attention of Qwen3-Next (Qwen3-Next-80B-A3B) and Qwen3.5 (dense and MoE), three
of every four of their layers.

A layer's in_proj gives each token the convolution's input (q, k and v of its heads), a gate z for each value head's
output, and b and a for each value head; q, k and v go through a causal depthwise convolution over the token and the
`kernel_size - 1` before it (then SiLU), q and k are L2-normed per head (q then scaled by 1 / sqrt(key head size)),
and each value head h (reading key head h // (value heads / key heads)) runs the gated delta rule over its state S
(key head size x value head size):

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T
    o_t = S_t^T q_t

with beta_t = sigmoid(b_t) and g_t = -exp(A_log) softplus(a_t + dt_bias): the state decays, and what it predicts for
k_t is moved toward v_t by beta_t. Each head's o is RMS-normed, times the norm's weight, times SiLU(z)
(`HeadGatedNorm`), and projected back (o_proj, the checkpoint's out_proj). What a request carries from one step to the
next is its last convolution inputs and its S (pagedllm.models.recurrent's `RecurrentStates`).

On the CPU a step runs in one call of the kernels' `gated_delta_forward` (kernels/csrc/deltanet.cpp): the convolution,
the norms, the rule token by token with each (sequence, head)'s state in cache, the gated norm. Elsewhere it runs in
torch, the kernel's reference: a prompt's chunk through the rule in its chunked form (`delta_rule_chunked`: within
each chunk of `SCAN_CHUNK` tokens the updates are solved at once, a triangular system, as the DeltaNet paper's WY
form does; between chunks the state is passed on), a decode step's tokens through one step of it, all at once
(`delta_rule_step`).

Qwen3-Next's checkpoints hold q, k, v and z in one in_proj_qkvz and b and a in one in_proj_ba, by key head group;
`split_qwen3_next_projections` gives them Qwen3.5's separate layout, which `in_proj_qkvzba` fuses again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import kernels_for
from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.models.recurrent import RecurrentMixer, RecurrentStep, StepRows, convolve, decays, run_recurrence

if TYPE_CHECKING:
    from pagedllm.attention.metadata import AttentionMetadata
    from pagedllm.lora.runtime import LayerLoRA
    from pagedllm.runner.kv_tensors import KVCache

# Qwen3-Next's fused in_proj tensors, by the end of their names (`split_qwen3_next_projections`)
QWEN3_NEXT_FUSED = (".in_proj_qkvz.weight", ".in_proj_ba.weight")
# a prompt's tokens run in chunks of this many (the chunked form gives the same result at any size, as a float sum may)
SCAN_CHUNK = 64


def l2_normed(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (as the FLA library and transformers norm q and k)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def _by_value_head(heads: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[..., key heads, K] tensors with each key head's rows repeated for the value heads that read it."""
    return tuple(t.repeat_interleave(heads // t.shape[-2], dim=-2) for t in tensors)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of S sequences, in float32: q and k [S, key heads, K] (normed, q scaled), v [S, H, V], g and
    beta [S, H], state [S, H, K, V] -> (o [S, H, V], the new state)."""
    q, k = _by_value_head(v.shape[1], q, k)
    state = state.float() * g.exp()[..., None, None]
    delta = (v - (state * k.unsqueeze(-1)).sum(-2)) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(-2), state


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       initial: torch.Tensor | None, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens through the rule, in chunks, in float32: q and k [L, key heads, K], v [L, H, V], g and
    beta [L, H], initial [H, K, V] or None (zeros) -> (o [L, H, V], the final state [H, K, V]).

    Within a chunk (G_i the sum of its g up to token i, d(j -> i) = exp(G_i - G_j)), token i's update is
    beta_i (v_i - the prediction for k_i of the state just before it), which depends on the chunk's earlier updates:
    T = (I + L)^-1 with L_ij = beta_i (k_i . k_j) d(j -> i) below the diagonal solves them all at once, the part
    from the chunk's own tokens (U = T beta V) and the part from the state it starts at (W = T beta exp(G) K, so
    that the updates are U - W S). Each token's output is its query read from the decayed starting state plus its
    causal product with the chunk's updates; the state passed on is the starting one decayed over the chunk plus
    each update decayed to the chunk's end."""
    length = q.shape[0]
    q, k = _by_value_head(v.shape[1], q, k)
    pad = -length % chunk_size
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    q, k, v = (t.transpose(0, 1).unflatten(1, (-1, chunk_size)) for t in (q, k, v))     # [H, N, Q, D]
    g, beta = (t.t().unflatten(1, (-1, chunk_size)) for t in (g, beta))                   # [H, N, Q]
    cumulative = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    pairwise = decays(cumulative.unsqueeze(-1) - cumulative.unsqueeze(-2)).masked_fill_(~causal, 0)
    k_beta = k * beta.unsqueeze(-1)
    lower = ((k_beta @ k.transpose(-1, -2)) * pairwise).tril_(-1)
    updates = torch.linalg.solve_triangular(lower, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    from_state = torch.linalg.solve_triangular(lower, k_beta * decays(cumulative).unsqueeze(-1), upper=False,
                                               unitriangular=True)
    attention = (q @ k.transpose(-1, -2)) * pairwise
    q_decayed = q * decays(cumulative).unsqueeze(-1)
    k_to_end = (k * decays(cumulative[..., -1:] - cumulative).unsqueeze(-1)).transpose(-1, -2)
    chunk_decay = decays(cumulative[..., -1])[..., None, None]                            # [H, N, 1, 1]
    state = q.new_zeros(q.shape[0], q.shape[-1], v.shape[-1]) if initial is None else initial.float()
    out = torch.empty_like(v)
    for n in range(q.shape[1]):
        new = updates[:, n] - from_state[:, n] @ state
        out[:, n] = q_decayed[:, n] @ state + attention[:, n] @ new
        state = state * chunk_decay[:, n] + k_to_end[:, n] @ new
    return out.flatten(1, 2).transpose(0, 1)[:length], state


def split_qwen3_next_projections(config: Any, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Qwen3-Next's in_proj_qkvz [key heads x (q, k, then its value heads' v, then their z)] and in_proj_ba [key heads
    x (its value heads' b, then their a)] as Qwen3.5's in_proj_qkv (all q, all k, all v), in_proj_z, in_proj_b and
    in_proj_a (`QWEN3_NEXT_FUSED`: the names it takes)."""
    key_heads, key_dim = config.linear_num_key_heads, config.linear_key_head_dim
    per_key = config.linear_num_value_heads // key_heads
    if ".in_proj_qkvz." in name:
        width = per_key * config.linear_value_head_dim
        q, k, v, z = tensor.unflatten(0, (key_heads, -1)).split([key_dim, key_dim, width, width], dim=1)
        return [(name.replace(".in_proj_qkvz.", ".in_proj_qkv."), torch.cat([t.flatten(0, 1) for t in (q, k, v)])),
                (name.replace(".in_proj_qkvz.", ".in_proj_z."), z.flatten(0, 1))]
    b, a = tensor.unflatten(0, (key_heads, -1)).split([per_key, per_key], dim=1)
    return [(name.replace(".in_proj_ba.", ".in_proj_b."), b.flatten(0, 1)),
            (name.replace(".in_proj_ba.", ".in_proj_a."), a.flatten(0, 1))]


class HeadGatedNorm(nn.Module):
    """Each head's output RMS-normed in float32, times the weight in the model's dtype, times SiLU(gate) in float32
    (Qwen3-Next's RMSNormGated: the norm before the gate, unlike Mamba-2's)."""

    def __init__(self, head_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y32 = y.float()
        y32 = y32 * torch.rsqrt(y32.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * y32.to(y.dtype) * F.silu(gate.float())).to(y.dtype)


class GatedDeltaNet(RecurrentMixer):
    """A Gated DeltaNet layer in place of an attention (module docstring), its weights under Qwen3.5's checkpoint
    names (in_proj_qkv, in_proj_z, in_proj_b and in_proj_a fused in that order: `in_proj_qkvzba`) but out_proj
    (o_proj, as an attention's)."""

    def __init__(self, config: Any, dtype: torch.dtype, tp: tuple[int, int], index: int) -> None:
        super().__init__()
        if tp[1] > 1:
            raise ValueError("Gated DeltaNet layers run on one rank (tensor_parallel_size=1)")
        if config.hidden_act != "silu":
            raise ValueError(f"a Gated DeltaNet convolution's activation {config.hidden_act!r} is not supported "
                             "(only silu)")
        self.index = index      # the decoder layer's: its states' key in `RecurrentStates`
        self.key_heads, self.value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if self.value_heads % self.key_heads:
            raise ValueError(f"{self.value_heads} value heads are not a multiple of {self.key_heads} key heads")
        self.key_size, self.value_size = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.in_proj_qkvzba = MergedColumnParallelLinear(
            config.hidden_size, [self.conv_dim, self.value_size, self.value_heads, self.value_heads], dtype=dtype)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, config.linear_conv_kernel_dim, groups=self.conv_dim,
                                bias=False, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.zeros(self.value_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.value_heads, dtype=dtype), requires_grad=False)
        self.norm = HeadGatedNorm(self.value_dim, config.rms_norm_eps, dtype)
        self.o_proj = RowParallelLinear(self.value_size, config.hidden_size, dtype=dtype)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A request's (convolution inputs, delta rule state) shapes in this layer."""
        return (self.conv_dim, self.kernel_size - 1), (self.value_heads, self.key_dim, self.value_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: list[KVCache], meta: AttentionMetadata,
                lora: LayerLoRA | None = None) -> torch.Tensor:
        step = meta.recurrent if meta.recurrent is not None else RecurrentStep.from_start(meta)
        qkv, z, b, a = self.in_proj_qkvzba(x).split([self.conv_dim, self.value_size, self.value_heads,
                                                     self.value_heads], -1)
        kernels = kernels_for(x)
        if kernels is not None and step.states is not None:    # on the CPU: the step in one call
            out = torch.empty_like(z)
            kernels.gated_delta_forward(out, qkv, z, b, a, *step.states.pools[self.index], step.read_slots,
                                        step.write_slots, meta.query_start_loc, self.conv1d.weight.squeeze(1),
                                        self.dt_bias, self._decay_rate(), self.norm.weight, self.norm.eps,
                                        self.key_heads)
            return self.o_proj(out)
        conv_states, states = step.read(self, x.dtype)
        rows = StepRows.of(meta.query_start_loc_cpu, x.device)
        conv_out, new_conv = convolve(self, conv_states, qkv, rows)
        q, k, v, g, beta = self._rule_inputs(F.silu(conv_out), b, a)
        out = torch.empty(x.shape[0], self.value_heads, self.value_dim, dtype=torch.float32, device=x.device)
        new_states = run_recurrence(rows, step, states, (q, k, v, g, beta), delta_rule_step,
                                    lambda *inputs: delta_rule_chunked(*inputs, SCAN_CHUNK), out)
        step.write(self, new_conv, new_states)
        return self.o_proj(self.norm(out.to(x.dtype), z.unflatten(-1, (self.value_heads, -1))).flatten(1))

    def _decay_rate(self) -> torch.Tensor:
        """-exp(A_log) [value heads], float32: g = it times softplus(a + dt_bias)."""
        return -self.A_log.float().exp()

    def _rule_inputs(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output after its SiLU [n, conv_dim], b and a [n, value heads] -> the rule's q and k
        [n, key heads, K] (normed, q scaled), v [n, value heads, V], g and beta [n, value heads], in float32."""
        q, k, v = mixed.float().split([self.key_size, self.key_size, self.value_size], -1)
        q, k = (l2_normed(t.unflatten(-1, (self.key_heads, self.key_dim))) for t in (q, k))
        g = self._decay_rate() * F.softplus(a.float() + self.dt_bias.float())
        return q * self.key_dim ** -0.5, k, v.unflatten(-1, (self.value_heads, -1)), g, b.sigmoid().float()
