"""A sentence-transformers model folder's pooling (modules.json and its Pooling module's config.json), read to warn
when it is not the last token's, the only pooling pagedllm runs (`PoolingParams`)."""

from __future__ import annotations

import json
from pathlib import Path

from pagedllm.logger import init_logger

logger = init_logger(__name__)


def sentence_transformers_pooling(folder: Path) -> str | None:
    """The pooling modes a sentence-transformers folder turns on ("lasttoken", "mean_tokens", "cls_token", ...,
    joined by "+"), or None for a folder without such a config."""
    modules = folder / "modules.json"
    if not modules.is_file():
        return None
    for module in json.loads(modules.read_text()):
        config = folder / module.get("path", "") / "config.json"
        if str(module.get("type", "")).endswith("Pooling") and config.is_file():
            modes = [key.removeprefix("pooling_mode_") for key, on in json.loads(config.read_text()).items()
                     if key.startswith("pooling_mode_") and on is True]
            return "+".join(modes) or None
    return None


def warn_unless_last_token_pooling(folder: Path) -> None:
    """Log a warning when the model's own sentence-transformers pooling is not the last token's."""
    pooling = sentence_transformers_pooling(folder) if folder.is_dir() else None
    if pooling is not None and pooling != "lasttoken":
        logger.warning("this model's sentence-transformers config pools by %s; pagedllm embeds by the last token "
                       "(LAST pooling), so its embeddings will differ from the model's own", pooling)
