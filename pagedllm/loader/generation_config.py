"""A model's generation config, as vLLM's `--generation-config` reads it: the sampling defaults its authors chose
(for requests that set none) and the token ids that end its replies besides the tokenizer's EOS.

    "auto":  the model folder's generation_config.json (for a model without one, the eos_token_id of its config)
    "vllm":  none: SamplingParams' own defaults, and the tokenizer's EOS alone
    FOLDER:  the generation_config.json in that folder

Only the fields vLLM takes are used, where the file sets them: temperature, top_p, top_k, min_p,
repetition_penalty, presence_penalty, frequency_penalty, and max_new_tokens as max_tokens (vLLM reads
GenerationConfig.to_diff_dict(), which under transformers 5, whose defaults are all None, is what the file sets).
vLLM's `--override-generation-config` sets some of them over the source's (alone under "vllm").
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.loader.resolve import ResolvedModel

logger = logging.getLogger(__name__)

# generation_config.json's name -> SamplingParams' name
_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                    "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    """sampling: SamplingParams field -> the model's default; eos_token_ids: every id the config says ends a reply."""

    sampling: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()


def read_generation_config(source: str, resolved: ResolvedModel, hf_config: Any,
                           overrides: dict[str, Any] | None = None) -> GenerationDefaults:
    """The defaults `source` ("auto", "vllm" or a folder) gives the model, `overrides` (generation_config.json's
    names) over them; ValueError for a folder without the file, or an override of another field."""
    unknown = set(overrides or {}) - set(_SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"override_generation_config sets {sorted(unknown)}; it takes {', '.join(_SAMPLING_FIELDS)}")
    path = (resolved.path if source == "auto" else Path(source)) / "generation_config.json"
    if source == "vllm":
        values = {}
    elif path.is_file():
        values = json.loads(path.read_text())
    elif source == "auto":
        values = {"eos_token_id": getattr(hf_config, "eos_token_id", None)}
    else:
        raise ValueError(f"generation_config {source!r}: no generation_config.json there")
    values |= overrides or {}
    sampling = {name: values[key] for key, name in _SAMPLING_FIELDS.items() if values.get(key) is not None}
    if sampling:
        logger.info("default sampling parameters from the model's generation config: %s (generation_config='vllm' "
                    "keeps pagedllm's own)", sampling)
    eos = values.get("eos_token_id")
    return GenerationDefaults(sampling, tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]))
