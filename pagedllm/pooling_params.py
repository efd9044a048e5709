"""Pooling parameters: how a prompt becomes one vector, an embedding or a classification (vLLM's `PoolingParams`
for its "embed" and "classify" tasks). Pure Python: the core imports it."""

from __future__ import annotations

from dataclasses import dataclass

RUNNERS = ("auto", "generate", "pooling")     # vLLM's `runner` values one engine covers (vLLM also has "draft")
CONVERTS = ("auto", "none", "embed")          # and `convert` (vLLM also has "classify" and "reward")
TASKS = ("embed", "classify")
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolingParams:
    """A pooling request's parameters. Both tasks read the model's final hidden states (after its last norm): by
    default a causal LM's at the prompt's last token, vLLM's LAST pooling, its default for one (an encoder's
    classifier reads the first token's, CLS). The prompt runs through the
    paged cache like any other (its prefix-cache hits count), and the request ends there: no token is generated.

    Args:
        normalize: (embed) divide the embedding by its L2 norm (vLLM's default), so that dot products are cosines.
        use_activation: (classify) give probabilities, vLLM's default: the softmax of the logits, or the sigmoid of
            the one logit of a one-label head (a reranker's relevance); False gives the raw logits.
        pooling_type: (embed) "LAST", "MEAN" (the mean over the prompt's tokens) or "CLS" (its first token's); None
            takes the model's (its sentence-transformers config's pooling, else LAST; vLLM's `pooler_config`). MEAN
            and CLS need every prompt position computed: such a request reads nothing from the prefix cache.
            (classify) None, or the token the model's head reads: "LAST" (a decoder's) or "CLS" (an encoder's).
        task: "embed": that hidden state is the embedding (vLLM's default for a causal LM served as an embedding
            model, `--convert embed`). "classify": the checkpoint's classification head (a
            `*ForSequenceClassification` model) turns it into one logit per class.
        dimensions: (embed) keep the embedding's first `dimensions` values, then normalize: a Matryoshka model's
            shorter embedding (vLLM's; the engine checks that the model is one, `is_matryoshka` or
            `matryoshka_dimensions` in its config). None: the whole embedding.
        skip_reading_prefix_cache: compute the whole prompt, reading no block from the prefix cache (vLLM's).
    """

    normalize: bool = True
    use_activation: bool = True
    task: str = "embed"
    pooling_type: str | None = None
    dimensions: int | None = None
    skip_reading_prefix_cache: bool | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.pooling_type not in (None, *POOLING_TYPES):
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.task == "classify" and self.pooling_type == "MEAN":
            raise ValueError("a classification head reads one token (LAST or CLS pooling), not the mean")
        for name in ("normalize", "use_activation"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.dimensions is not None and (self.task != "embed" or isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions is an embedding's length, an int >= 1 (task 'embed'), got "
                             f"{self.dimensions!r} with task {self.task!r}")

    @property
    def needs_every_position(self) -> bool:
        """MEAN and CLS pooling read the hidden states of positions a prefix-cache hit would skip."""
        return self.pooling_type in ("MEAN", "CLS")


def check_runner(runner: str, convert: str) -> None:
    """vLLM's runner and convert values that one pagedllm engine serves as it is (it generates and pools)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}: pagedllm generates and embeds "
                         "with one engine, and has no draft runner")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}: pagedllm embeds (LAST "
                         "pooling), and classifies only with a checkpoint's own classification head "
                         "(*ForSequenceClassification), which needs no conversion")
