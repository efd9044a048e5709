"""Benchmarks: `pagedllm bench throughput|serve|prefix` (see docs/benchmarks.md)."""
