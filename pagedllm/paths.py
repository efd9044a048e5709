"""Where pagedllm keeps what it derives once and reuses: converted tokenizers, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of pagedllm's on-disk cache: $PAGEDLLM_CACHE_DIR, else ~/.cache/pagedllm."""
    return Path(os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm")
