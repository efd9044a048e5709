"""Pooling parameters: how a prompt becomes one embedding (vLLM's `PoolingParams` for its "embed" task). Pure
Python: the core imports it."""

from __future__ import annotations

from dataclasses import dataclass

RUNNERS = ("auto", "generate", "pooling")     # vLLM's `runner` values one engine covers (vLLM also has "draft")
CONVERTS = ("auto", "none", "embed")          # and `convert` (vLLM also has "classify" and "reward")


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


def check_runner(runner: str, convert: str) -> None:
    """vLLM's runner and convert values that one pagedllm engine serves as it is (it generates and embeds)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}: pagedllm generates and embeds "
                         "with one engine, and has no draft runner")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}: pagedllm embeds (LAST "
                         "pooling) and has no classification or reward heads")
