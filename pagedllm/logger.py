"""The `pagedllm` logger: INFO to stderr by default, like vLLM; PAGEDLLM_LOGGING_LEVEL changes the level."""

from __future__ import annotations

import json
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


class JsonFormatter(logging.Formatter):
    """One JSON object a line for each record (vLLM's logging formatter "json", for log collectors): its time, level,
    logger and message, and its exception's traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)
