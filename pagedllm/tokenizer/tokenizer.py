"""Load a transformers tokenizer from a Hugging Face folder or a GGUF file.

Building a tokenizer from a GGUF file means converting its vocabulary (about 5 s for SmolLM2), so the result is
saved with `save_pretrained` under the cache directory and loaded from there next time (about 0.25 s). The cache
key is the GGUF file's resolved path, size and modification time plus the transformers version, so a changed
file or library gets a fresh conversion. `PAGEDLLM_CACHE_DIR` moves the cache (default `~/.cache/pagedllm`).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pagedllm.paths import cache_dir
from pagedllm.tokenizer.reasoning import marker_token_ids

if TYPE_CHECKING:
    from pagedllm.loader.resolve import ResolvedModel

logger = logging.getLogger(__name__)

_COMPLETE_MARKER = ".pagedllm-complete"


def think_token_ids(tokenizer: PreTrainedTokenizerBase | None) -> tuple[int, int] | None:
    """The ids of a reasoning model's thought markers, where each is one token of the vocabulary: <think> and
    </think> (Qwen3, DeepSeek-R1's distills, SmolLM3), else [THINK] and [/THINK] (Magistral), else <seed:think> and
    </seed:think> (Seed-OSS); None otherwise, or without a tokenizer."""
    return next(filter(None, (marker_token_ids(tokenizer, parser) for parser in ("deepseek_r1", "mistral",
                                                                                "seed_oss"))), None)


def load_tokenizer(path: str | Path, gguf_file: str | None = None,
                   chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a model.

    Args:
        path: a Hugging Face model folder, a folder holding `gguf_file`, or a `.gguf` file itself.
        gguf_file: name of the GGUF file inside `path`, if the tokenizer comes from a GGUF file.
        chat_template: a Jinja chat template (or the path of a file holding one) replacing the model's own.
    """
    path = Path(path)
    if gguf_file is None and path.suffix == ".gguf" and path.is_file():
        path, gguf_file = path.parent, path.name
    if gguf_file is not None:
        tokenizer = _load_gguf_tokenizer(path / gguf_file)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    if chat_template is not None:
        tokenizer.chat_template = _read_chat_template(chat_template)
    return tokenizer


def model_tokenizer(resolved: ResolvedModel, tokenizer: str | None = None,
                    chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer a model runs with: `tokenizer`'s (a tokenizer or model folder, or a .gguf file: vLLM's
    `tokenizer`, for a GGUF file whose vocabulary is missing or converts badly) if given, else the model's own."""
    if tokenizer is not None:
        return load_tokenizer(Path(tokenizer).expanduser(), chat_template=chat_template)
    return load_tokenizer(resolved.path, resolved.gguf_file, chat_template)


def _read_chat_template(chat_template: str) -> str:
    """vLLM's --chat-template takes either the template or a file holding it."""
    if "{" not in chat_template and len(chat_template) < 4096:
        candidate = Path(chat_template).expanduser()
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8")
        raise ValueError(f"chat_template {chat_template!r} is neither a Jinja template nor a readable file")
    return chat_template


def _load_gguf_tokenizer(gguf_path: Path) -> PreTrainedTokenizerBase:
    cached = _gguf_cache_path(gguf_path)
    if (cached / _COMPLETE_MARKER).is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as exc:  # a damaged cache entry: rebuild it
            logger.warning("ignoring unreadable tokenizer cache %s: %s", cached, exc)
    from pagedllm.loader.gguf import GGUFFile

    gguf = GGUFFile(gguf_path)
    if "tokenizer.ggml.tokens" not in gguf.metadata:
        raise ValueError(f"{gguf_path} holds no tokenizer (no tokenizer.ggml.tokens): name one with tokenizer= "
                         "(--tokenizer), a folder holding the model's tokenizer.json")
    # AutoTokenizer reads the file's config first, which transformers does not for every architecture (Phi-2's,
    # GPT-NeoX's): their tokenizers are built from the vocabulary alone, as transformers builds any file's
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    loader = AutoTokenizer if gguf.architecture in GGUF_SUPPORTED_ARCHITECTURES else PreTrainedTokenizerFast
    tokenizer = loader.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    _save_to_cache(tokenizer, cached)
    return tokenizer


def _gguf_cache_path(gguf_path: Path) -> Path:
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    key = f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}|transformers={transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return cache_dir() / "tokenizers" / digest


def _save_to_cache(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Save into a temporary sibling, then rename, so a concurrent reader never sees half a tokenizer."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        tokenizer.save_pretrained(str(tmp))
        (tmp / _COMPLETE_MARKER).touch()
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        logger.warning("could not cache the tokenizer in %s: %s", target, exc)

