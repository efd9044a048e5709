"""Benchmarks: `pagedllm bench throughput|serve|prefix|dashboard` (see docs/benchmarks.md)."""
