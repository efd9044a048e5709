"""The server's two ways to ask for structured outputs -> one StructuredOutputsParams.

    response_format: {"type": "text"} | {"type": "json_object"}
                     | {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
    structured_outputs (vLLM's extra body): {"json": ...} | {"regex": ...} | {"choice": [...]} | {"grammar": ...}
                     | {"json_object": true}
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.protocol import OpenAIError
from pagedllm.sampling_params import StructuredOutputsParams


def structured_outputs_from(response_format: dict[str, Any] | None,
                            structured_outputs: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """The request's constraint, or None; 400 naming the field at fault."""
    from_format = _from_response_format(response_format) if response_format is not None else None
    if structured_outputs is None:
        return from_format
    if from_format is not None:
        raise OpenAIError("give either response_format or structured_outputs, not both", param="structured_outputs")
    try:
        return StructuredOutputsParams(**structured_outputs)
    except (TypeError, ValueError) as exc:
        raise OpenAIError(f"invalid structured_outputs: {exc}", param="structured_outputs") from exc


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise OpenAIError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          param="response_format")
    schema = (response_format.get("json_schema") or {}).get("schema")
    if not isinstance(schema, dict):
        raise OpenAIError("response_format.json_schema.schema must be a JSON schema (an object)",
                          param="response_format")
    return StructuredOutputsParams(json=schema)
