"""Sampling: the batch's per-row parameters as tensors (metadata.py), the Sampler (sampler.py) and its tensor
ops (ops.py)."""
