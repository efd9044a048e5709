"""What the benchmarks measure besides time: FLOPs of the useful work, the bf16 GEMM peak, KV waste, peak RSS."""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass

import psutil

from pagedllm.bench.datasets import BenchRequest


def peak_rss_mib() -> float:
    """The process's peak resident set size so far.

    Linux's VmHWM, not ru_maxrss: ru_maxrss survives execve, so a child started from a large process (the peer)
    would report its parent's peak.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB on Linux, bytes on macOS
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def seconds_since_process_start() -> float:
    return time.time() - psutil.Process(os.getpid()).create_time()


# ---- FLOPs -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelDims:
    """A model's sizes for its FLOPs: per layer, its attention's weights (`attention_params`) and the widths its
    heads multiply over each key they attend to (`key_width`: every head's q . k width plus its p . v width)."""

    num_layers: int
    hidden_size: int
    attention_params: int
    key_width: int
    intermediate_size: int
    vocab_size: int
    mlp_matrices: int = 3   # a gated MLP's gate, up and down; an ungated one's 2

    @classmethod
    def from_hf_config(cls, config) -> ModelDims:
        """The dims of a config: q/k/v/o over heads of head_dim, or DeepSeek's latent attention's projections (its
        queries, straight or through their latent, the shared latent and rotary key, kv_b_proj, o_proj; each head
        multiplying qk_nope + qk_rope values with a key and v_head_dim with a value, as unabsorbed); a hybrid's
        recurrent layers (Mamba-2's, Gated DeltaNet's) counted by their projections, their recurrence's FLOPs left out
        (per layer, the mean over its layers); Qwen3.5's attention output gate as a projection; a mixture of experts'
        `intermediate_size` is what a token runs through: its top-k experts' and its shared expert's (every layer
        counted as sparse)."""
        from pagedllm.models.llama import (
            dense_mlp_shape,
            expert_intermediate_size,
            gates_attention_output,
            num_experts,
            shared_expert_size,
        )
        from pagedllm.models.mla import is_mla
        from pagedllm.models.recurrent import recurrent_layer_kind

        hidden, heads = config.hidden_size, config.num_attention_heads
        if is_mla(config):
            qk, v, latent = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank
            q_rank = config.q_lora_rank
            queries = hidden * heads * qk if not q_rank else hidden * q_rank + q_rank * heads * qk
            attention = queries + hidden * (latent + config.qk_rope_head_dim) + \
                latent * heads * (config.qk_nope_head_dim + v) + heads * v * hidden
            key_width = heads * (qk + v)
        else:
            head_dim = getattr(config, "head_dim", None) or hidden // heads
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            attention, key_width = hidden * head_dim * (2 * heads + 2 * kv_heads), 2 * heads * head_dim
            if gates_attention_output(config):  # Qwen3-Next's and Qwen3.5's output gate: as wide as the queries
                attention += hidden * heads * head_dim
        kinds = [recurrent_layer_kind(config, index) for index in range(config.num_hidden_layers)]
        recurrent = sum(kind is not None for kind in kinds)
        if recurrent:   # hybrids: a recurrent layer's in_proj and out_proj, no keys (a layer's mean of both)
            if "mamba2" in kinds:   # Granite 4's
                inner, span = config.mamba_n_heads * config.mamba_d_head, config.mamba_n_groups * config.mamba_d_state
                mixer = hidden * (2 * inner + 2 * span + config.mamba_n_heads) + inner * hidden
            else:                   # Qwen3-Next's, Qwen3.5's Gated DeltaNet
                keys = config.linear_num_key_heads * config.linear_key_head_dim
                values, value_heads = config.linear_num_value_heads * config.linear_value_head_dim, \
                    config.linear_num_value_heads
                mixer = hidden * (2 * keys + 2 * values + 2 * value_heads) + values * hidden
            layers = config.num_hidden_layers
            attention = (attention * (layers - recurrent) + mixer * recurrent) // layers
            key_width = key_width * (layers - recurrent) // layers
        intermediate, matrices = dense_mlp_shape(config)
        if num_experts(config):
            intermediate = config.num_experts_per_tok * expert_intermediate_size(config) + shared_expert_size(config)
        return cls(config.num_hidden_layers, hidden, attention, key_width, intermediate, config.vocab_size, matrices)

    @property
    def num_layer_params(self) -> int:
        """Weights of the transformer layers a token runs through (q, k, v, o, gate, up, down; a mixture of experts'
        chosen experts); no embedding, no lm_head, no norms."""
        return self.num_layers * (self.attention_params + self.mlp_matrices * self.hidden_size * self.intermediate_size)


def useful_flops(dims: ModelDims, requests: list[BenchRequest]) -> float:
    """FLOPs of the work every system must do for `requests`, whatever it wastes on top.

    Per request of prompt P and output O: the layers see P + O - 1 tokens (the last sampled token is never fed
    back), at 2 FLOPs per weight each; the lm_head runs once per output token (2 x hidden x vocab); and the token
    at position p attends to p + 1 keys, costing 2 x layers x key_width FLOPs per key (QK^T and PV: 4 x layers x
    heads x head_dim where q, k and v are heads of head_dim).
    """
    per_key = 2 * dims.num_layers * dims.key_width
    total = 0.0
    for request in requests:
        num_fed = request.prompt_len + request.output_len - 1
        total += 2 * dims.num_layer_params * num_fed
        total += 2 * dims.hidden_size * dims.vocab_size * request.output_len
        total += per_key * num_fed * (num_fed + 1) / 2
    return total


def gemm_peak_gflops(size: int = 2048, repeats: int = 5) -> tuple[str, float]:
    """(dtype, GFLOP/s): the best of `repeats` [size x size] @ [size x size] matmuls on the CPU, in the dtype torch
    multiplies fastest here: bfloat16 where oneDNN has bf16 instructions, float32 elsewhere (bf16 is emulated)."""
    import torch

    from pagedllm.cpu import torch_bf16_is_native

    dtype = torch.bfloat16 if torch_bf16_is_native() else torch.float32
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.matmul(a, b)   # warm-up: thread pool, kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return str(dtype).removeprefix("torch."), 2 * size**3 / best / 1e9


# ---- KV waste ----------------------------------------------------------------------------------------------------
@dataclass
class KVWaste:
    """Allocated KV slots that hold no token, sampled after each step.

    A running request holding `b` blocks with `c` computed tokens wastes `b * block_size - c` slots: the unused
    tail of its last block (plus anything reserved ahead). Summed over the running requests, averaged over steps.
    """

    num_steps: int = 0
    total_waste_slots: int = 0
    total_allocated_slots: int = 0

    def add(self, waste_slots: int, allocated_slots: int) -> None:
        self.num_steps += 1
        self.total_waste_slots += waste_slots
        self.total_allocated_slots += allocated_slots

    @property
    def mean_waste_slots(self) -> float:
        return self.total_waste_slots / self.num_steps if self.num_steps else 0.0

    @property
    def mean_allocated_slots(self) -> float:
        return self.total_allocated_slots / self.num_steps if self.num_steps else 0.0

    @property
    def waste_pct(self) -> float:
        return 100 * self.total_waste_slots / self.total_allocated_slots if self.total_allocated_slots else 0.0


def sample_engine_kv(engine, waste: KVWaste) -> None:
    """One KVWaste sample: the slots of the running requests' blocks that hold no computed token."""
    stats = engine.make_stats()
    waste.add(stats.num_kv_slots_running - stats.num_kv_slots_filled, stats.num_kv_slots_running)


def static_batch_kv_waste(requests: list[BenchRequest], batch_size: int) -> KVWaste:
    """KV waste of left-padded static batches (the Hugging Face peer), from the batch shapes.

    After decode step t (t = 1..T, T = the batch's longest output) the cache holds B x (P_max + t) slots, of
    which request i fills P_i + min(t, O_i): padding and tokens past a request's own output_len are waste.
    """
    waste = KVWaste()
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        max_prompt = max(r.prompt_len for r in batch)
        max_output = max(r.output_len for r in batch)
        for t in range(1, max_output + 1):
            allocated = len(batch) * (max_prompt + t)
            held = sum(r.prompt_len + min(t, r.output_len) for r in batch)
            waste.add(allocated - held, allocated)
    return waste
