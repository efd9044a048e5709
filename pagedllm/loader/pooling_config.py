"""The pooling an embedding model was trained with: vLLM's `pooler_config` when given, else the model folder's
sentence-transformers config (modules.json and its Pooling module's config.json), else LAST (`PoolingParams`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedllm.logger import init_logger

logger = init_logger(__name__)

# sentence-transformers' pooling modes -> the pooling types pagedllm runs
_MODES = {"lasttoken": "LAST", "mean_tokens": "MEAN", "cls_token": "CLS"}


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


def model_pooling_type(folder: Path, pooler_config: dict[str, Any] | None = None) -> str:
    """LAST, MEAN or CLS: `pooler_config`'s pooling_type (vLLM's), else the sentence-transformers config's, else
    LAST (vLLM's default for a causal LM). A mode pagedllm does not run is warned of, and LAST taken."""
    if pooler_config is not None:       # checked by ModelConfig
        return pooler_config["pooling_type"]
    modes = sentence_transformers_pooling(folder) if folder.is_dir() else None
    if modes is None:
        return "LAST"
    if modes not in _MODES:
        logger.warning("this model's sentence-transformers config pools by %s, which pagedllm does not run; it "
                       "embeds by the last token (LAST pooling), so its embeddings will differ from the model's own",
                       modes)
        return "LAST"
    logger.info("embeddings pool by %s, as the model's sentence-transformers config says", _MODES[modes])
    return _MODES[modes]
