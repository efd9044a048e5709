"""What a request gives back, shaped like vLLM's outputs. Plain dataclasses, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """One token's log-probability.

    Args:
        logprob: natural log of the token's probability under the raw (unprocessed) logits.
        rank: 1-based rank of the token in the vocabulary (1 = most likely); None if not computed.
        decoded_token: the token's text, if the detokenizer filled it in.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: token id -> Logprob, holding the sampled token and the top-`logprobs` tokens.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: None for the first (nothing predicts it), then token id -> Logprob, holding the prompt token
# and the top-`prompt_logprobs` tokens at that position.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    Args:
        index: which of the prompt's `n` completions this is.
        text: generated text (without the matched stop string unless include_stop_str_in_output).
        token_ids: generated token ids, including a final EOS or stop token id.
        cumulative_logprob: sum of the sampled tokens' log-probabilities, when logprobs were requested.
        logprobs: per generated token, its top log-probabilities, when requested.
        finish_reason: None while running; then "stop" (EOS, stop string or stop token), "length" or "abort".
        stop_reason: the stop string or stop token id that ended it; None for EOS, length or abort.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A prompt and its completions, so far or final.

    Args:
        request_id: the engine's id for the request.
        prompt: the prompt text, if the request came as text.
        prompt_token_ids: the tokenized prompt.
        prompt_logprobs: per prompt token, its log-probabilities, when SamplingParams.prompt_logprobs asked for
            them (a streamed request gets them in its first output only).
        outputs: one CompletionOutput per completion (`n` of them).
        finished: True once every completion has finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: timing information, if the engine records it.
        error: set when the engine failed while running this request (it then finishes with "abort").
        embedding: a pooling request's (`PoolingParams`) vector, in its final output: the embedding, or for task
            "classify" the class probabilities (logits); such a request has no completions (`outputs` is empty).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: Any = None
    error: str | None = None
    embedding: list[float] | None = None


@dataclass
class PoolingOutput:
    """One prompt's pooled values as one tensor (vLLM's `PoolingOutput`, what `LLM.encode` gives).

    Args:
        data: a float32 tensor: the embedding ("embed"), or the class probabilities or logits ("classify").
    """

    data: Any


@dataclass
class PoolingRequestOutput:
    """What a pooling call returns per prompt (vLLM's `PoolingRequestOutput`): `LLM.encode`'s, and, as its kinds
    with their own `outputs`, `embed`'s and `classify`'s.

    Args:
        request_id: the engine's id for the request.
        outputs: the prompt's pooled values (a PoolingOutput; an EmbeddingOutput, a ClassificationOutput).
        prompt_token_ids: the tokenized prompt.
        num_cached_tokens: prompt tokens served from the prefix cache.
        finished: always True: pooled values come whole.
    """

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True

    @classmethod
    def of(cls, output: RequestOutput) -> PoolingRequestOutput:
        """A pooling request's engine output (its `embedding`), its values one float32 tensor (torch imported here:
        the outputs themselves need none)."""
        import torch

        return cls(output.request_id, PoolingOutput(torch.tensor(output.embedding, dtype=torch.float32)),
                   output.prompt_token_ids, output.num_cached_tokens)


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's `EmbeddingOutput`).

    Args:
        embedding: the vector, float32 values as Python floats (the model's hidden size of them).
    """

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    """What `LLM.embed` returns per prompt (vLLM's `EmbeddingRequestOutput`): `outputs` is its embedding."""

    outputs: EmbeddingOutput


@dataclass
class ClassificationOutput:
    """One prompt's classification (vLLM's `ClassificationOutput`).

    Args:
        probs: one value per class, in the head's order: probabilities, or the raw logits when
            `PoolingParams(use_activation=False)` asked for them.
    """

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    """What `LLM.classify` returns per prompt (vLLM's `ClassificationRequestOutput`): `outputs` is its
    classification."""

    outputs: ClassificationOutput


@dataclass
class ScoringOutput:
    """One pair's score (vLLM's `ScoringOutput`).

    Args:
        score: the cosine similarity of the two texts' embeddings, in [-1, 1]; with a cross-encoder (a one-label
            classifier), the probability it gives the pair, in [0, 1].
    """

    score: float


@dataclass
class ScoringRequestOutput:
    """What `LLM.score` returns per pair (vLLM's `ScoringRequestOutput`).

    Args:
        request_id: the engine's id for the pair (for embeddings: for its second text).
        outputs: the pair's score.
        prompt_token_ids: the two texts' tokens, the first's then the second's (a cross-encoder's: the pair as the
            tokenizer joins them).
        finished: always True: a score comes whole.
    """

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
