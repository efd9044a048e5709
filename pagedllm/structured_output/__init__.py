"""Structured outputs with llguidance: grammars compiled once per constraint, a matcher per request, and each
step's token bitmask (see docs/structured-outputs.md)."""

from pagedllm.structured_output.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager"]
