"""Mixture-of-experts routing and expert dispatch (Mixtral, Qwen2-MoE, Qwen3-MoE, ERNIE 4.5 MoE, LFM2-MoE, gpt-oss).

A sparse MLP sends each token to `top_k` of its experts, chosen by a router (a linear layer over the token's hidden
state: one logit per expert), and sums their outputs weighted by the router's probabilities:

    weights, ids = route(x W_router^T, routing)     # [T, k] each: the k most probable experts of each token
    out[t] = sum_j weights[t, j] * expert[ids[t, j]](x[t])

`run_experts` computes that sum with each expert run once, on the rows routed to it (a decode step of 8 tokens with
Qwen3-MoE's 8 of 128 experts runs at most 64 experts, not 128 x 8 rows), as vLLM's CPU path and transformers do;
`experts_reference` is the plain dense reference: every expert on every row, mixed by a [T, E] weight matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Expert = Callable[[torch.Tensor], torch.Tensor]     # x: [N, hidden] -> [N, hidden]


@dataclass(frozen=True)
class Routing:
    """How a router's logits [T, E] choose and weigh each token's experts (`route`): the softmax over all experts
    (each logit's sigmoid with `sigmoid`: LFM2-MoE's), kept at its `top_k` largest; with `renormalize` (Mixtral;
    Qwen's `norm_topk_prob`) divided by their sum, or by `norm_min` where the sum is smaller (ERNIE 4.5's
    moe_norm_min), plus `norm_eps` (LFM2-MoE's 1e-6), so that each token's weights sum to 1; times `scale` (a
    routed_scaling_factor). With `groups` > `kept_groups` (DeepSeek-V2's and V3's n_group, topk_group), the experts
    come in that many equal groups and each token chooses among those of its `kept_groups` best groups only, a
    group scored by its best expert (V2's group_limited_greedy) or with `group_top2` by its best two's sum (V3's)."""

    top_k: int
    renormalize: bool = False
    norm_min: float = 0.0
    sigmoid: bool = False
    norm_eps: float = 0.0
    scale: float = 1.0
    groups: int = 1
    kept_groups: int = 1
    group_top2: bool = False

    @classmethod
    def of(cls, config: Any) -> Routing:
        """A model's routing, from its config (Granite MoE's and gpt-oss's softmax over their top-k logits is the
        renormalised top-k of the softmax over all)."""
        ernie, lfm2 = config.model_type == "ernie4_5_moe", config.model_type == "lfm2_moe"
        v3 = config.model_type == "deepseek_v3"     # sigmoid scores, their sum plus 1e-20; always in groups
        renormalize = config.model_type in ("mixtral", "granitemoe", "granitemoeshared", "granitemoehybrid",
                                            "granitemoe_swa", "gpt_oss", "qwen3_5_moe_text") or ernie or \
            bool(getattr(config, "norm_topk_prob", False))
        grouped = v3 or (config.model_type == "deepseek_v2" and config.topk_method == "group_limited_greedy")
        groups, kept = (int(config.n_group), int(config.topk_group)) if grouped else (1, 1)
        if grouped:
            experts = config.n_routed_experts
            if experts % groups or not 1 <= kept <= groups or config.num_experts_per_tok > kept * experts // groups:
                raise ValueError(f"{experts} experts in {groups} groups, {kept} kept, cannot give a token "
                                 f"{config.num_experts_per_tok} experts")
        return cls(config.num_experts_per_tok, renormalize, norm_min=float(config.moe_norm_min) if ernie else 0.0,
                   sigmoid=lfm2 or v3, norm_eps=1e-6 if lfm2 else 1e-20 if v3 else 0.0,
                   scale=float(getattr(config, "routed_scaling_factor", None) or 1.0),
                   groups=groups, kept_groups=kept, group_top2=v3)


def route(logits: torch.Tensor, routing: Routing,
          selection_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, top_k], expert ids int64 [T, top_k]), as `routing` says, in
    float32 (ties broken as torch.topk breaks them, so as transformers).

    `selection_bias` [E] (ERNIE 4.5's e_score_correction_bias, LFM2-MoE's expert_bias, float32) is added to the
    probabilities to choose the experts only: the weights are the chosen experts' probabilities without it."""
    r = routing
    probs = torch.sigmoid(logits.float()) if r.sigmoid else torch.softmax(logits.float(), dim=-1)
    choice = probs if selection_bias is None else probs + selection_bias
    if r.kept_groups < r.groups:
        choice = choice.masked_fill(~_kept_groups(choice, r), float("-inf"))
    if choice is probs:
        weights, ids = torch.topk(probs, r.top_k, dim=-1)
    else:
        ids = torch.topk(choice, r.top_k, dim=-1).indices
        weights = probs.gather(-1, ids)
    if r.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True).clamp(min=r.norm_min) + r.norm_eps)
    if r.scale != 1.0:
        weights = weights * r.scale
    return weights, ids


def _kept_groups(choice: torch.Tensor, routing: Routing) -> torch.Tensor:
    """[T, E] bool: the experts of each token's `kept_groups` best groups (`Routing`), by `choice`'s scores."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, routing.groups, experts // routing.groups)
    scores = grouped.topk(2, dim=-1).values.sum(dim=-1) if routing.group_top2 else grouped.amax(dim=-1)
    kept = torch.topk(scores, routing.kept_groups, dim=-1).indices
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, kept, True)
    return mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)


def run_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Sequence[Expert]) -> torch.Tensor:
    """sum_j weights[t, j] * experts[ids[t, j]](x[t]) for every row t of x [T, H] -> [T, H] in x's dtype.

    Each expert runs once, on the rows routed to it, experts in ascending id order; each row's terms are added in
    that order too (a row's weights are rounded to x's dtype first, as transformers' Qwen-MoE rounds them), so a
    row's sum is `experts_reference`'s wherever an expert gives a row the same bits alone as in a batch."""
    top_k = ids.shape[1]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)                 # routed slots, grouped by expert
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    rows = order // top_k                                    # the token of each grouped slot
    slot_weights = weights.flatten()[order].to(x.dtype)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in zip(experts, counts, strict=True):
        if count:
            tokens = rows[start:start + count]
            out.index_add_(0, tokens, expert(x[tokens]) * slot_weights[start:start + count, None])
            start += count
    return out


def experts_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      experts: Sequence[Expert]) -> torch.Tensor:
    """`run_experts` in plain torch, densely: every expert on every row, times its column of the [T, E] routing
    weights (zero where a token did not choose it), summed over the experts in id order."""
    dense = torch.zeros(ids.shape[0], len(experts), dtype=weights.dtype).scatter_(1, ids, weights).to(x.dtype)
    out = torch.zeros_like(x)
    for index, expert in enumerate(experts):
        out += expert(x) * dense[:, index, None]
    return out
