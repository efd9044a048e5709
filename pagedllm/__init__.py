"""pagedllm: a PagedAttention LLM inference and serving engine.

The public names are imported lazily, so that `import pagedllm.core` (the pure-Python bookkeeping) needs no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagedllm.entrypoints.llm",
    "SamplingParams": "pagedllm.sampling_params",
    "StructuredOutputsParams": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "BeamSearchParams": "pagedllm.engine.beam_search",
    "PoolingParams": "pagedllm.pooling_params",
    "EmbeddingRequestOutput": "pagedllm.outputs",
    "ScoringRequestOutput": "pagedllm.outputs",
    "ClassificationRequestOutput": "pagedllm.outputs",
    "EmbeddingOutput": "pagedllm.outputs",
    "ScoringOutput": "pagedllm.outputs",
    "ClassificationOutput": "pagedllm.outputs",
    "PoolingOutput": "pagedllm.outputs",
    "PoolingRequestOutput": "pagedllm.outputs",
    "PromptType": "pagedllm.inputs",
    "TextPrompt": "pagedllm.inputs",
    "TokensPrompt": "pagedllm.inputs",
    "EmbedsPrompt": "pagedllm.inputs",
    "EngineArgs": "pagedllm.engine.arg_utils",
    "AsyncEngineArgs": "pagedllm.engine.arg_utils",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "AsyncLLM": "pagedllm.engine.async_llm",
    "AsyncLLMEngine": "pagedllm.engine.async_llm",
}
# vLLM's top-level names where pagedllm has them (`from vllm import LLM, SamplingParams, TokensPrompt` becomes
# `from pagedllm import ...`), and pagedllm's own (StructuredOutputsParams, BeamSearchParams, EmbedsPrompt).
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "BeamSearchParams", "PoolingParams", "EmbeddingRequestOutput", "ScoringRequestOutput",
           "ClassificationRequestOutput", "EmbeddingOutput", "ScoringOutput", "ClassificationOutput", "PoolingOutput",
           "PoolingRequestOutput", "PromptType", "TextPrompt", "TokensPrompt", "EmbedsPrompt", "EngineArgs",
           "AsyncEngineArgs", "LLMEngine", "AsyncLLM", "AsyncLLMEngine"]

if TYPE_CHECKING:
    from pagedllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM, AsyncLLMEngine
    from pagedllm.engine.beam_search import BeamSearchParams
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.inputs import EmbedsPrompt, PromptType, TextPrompt, TokensPrompt
    from pagedllm.outputs import (
        ClassificationOutput,
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        PoolingOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    from pagedllm.heap import import_static

    return getattr(import_static(_EXPORTS[name]), name)   # torch and transformers, imported here: pagedllm.heap
