"""Pooling parameters: how a prompt becomes one embedding (vLLM's `PoolingParams` for its "embed" task). Pure
Python: the core imports it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request's parameters. The embedding is the model's final hidden state (after its last norm) at
    the prompt's last token: vLLM's LAST pooling, its default for a causal LM served as an embedding model
    (`--convert embed`). The prompt runs through the paged cache like any other (its prefix-cache hits count), and
    the request ends there: no token is generated.

    Args:
        normalize: divide the embedding by its L2 norm (vLLM's default), so that dot products are cosines.
    """

    normalize: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
