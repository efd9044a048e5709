"""ALiBi (Press et al., "Train Short, Test Long", 2022): in place of a rotary embedding, head h's score of a key k
positions before its query is lowered by slope_h x k (`paged_attention_ref`'s `alibi_slopes`). Two models' slopes:

    geometric_slopes(8) = 2^-1, 2^-2, ..., 2^-8          (the paper's, BLOOM's and Falcon's: 2^(-8 i / n))
    geometric_slopes(12): those of 8 heads, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (every other of 16 heads')
    mpt_slopes(12, 8):    2^-(8 i / 16) for i = 2, 4, ..., 16, then i = 1, 3, 5, 7 (MPT's order: even i first)
"""

from __future__ import annotations

import math

import torch


def geometric_slopes(num_heads: int) -> torch.Tensor:
    """The paper's slopes (transformers' BLOOM and Falcon): for n a power of two, 2^(-8 i / n), i = 1..n; otherwise
    those of the power of two below n, then every other of twice that's, the odd ones, until n. [num_heads] float32,
    computed as transformers computes them (powers of a float32 base), so with their bits."""
    below = 2 ** math.floor(math.log2(num_heads))
    slopes = _powers(below, torch.arange(1, below + 1))
    extra = _powers(2 * below, torch.arange(1, 1 + 2 * (num_heads - below), 2))
    return torch.cat([slopes, extra])


def _powers(n: int, exponents: torch.Tensor) -> torch.Tensor:
    """(2^(-8 / n))^exponents in float32."""
    return torch.pow(torch.tensor(2 ** (-(2 ** -(math.log2(n) - 3))), dtype=torch.float32), exponents.to(torch.int32))


def mpt_slopes(num_heads: int, bias_max: float) -> torch.Tensor:
    """MPT's slopes (`alibi_bias_max`, 8 in its checkpoints): 2^(-bias_max i / m), i = 1..m, for m the power of two at
    or above n; where m > n, those of even i then those of odd i, the first n of them. [num_heads] float32."""
    above = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / torch.pow(2, torch.arange(1, above + 1).float() * (bias_max / above))
    if above != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes
