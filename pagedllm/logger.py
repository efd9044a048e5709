"""The `pagedllm` logger: INFO to stderr by default, like vLLM; PAGEDLLM_LOGGING_LEVEL changes the level."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def init_logger(name: str) -> logging.Logger:
    """A child of the `pagedllm` logger, which gets its handler the first time this is called."""
    root = logging.getLogger("pagedllm")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper())
        root.propagate = False
    return logging.getLogger(name)
