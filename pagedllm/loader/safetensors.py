"""(name, tensor) pairs from a Hugging Face folder's safetensors, sharded or not."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint files of a folder: the index's shards, else model.safetensors, else any *.safetensors."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {folder} (expected {SINGLE_FILE} or {INDEX_FILE})")
    return files


def iterate_safetensors(folder: Path, dtype: torch.dtype | None = None,
                        rename: Callable[[str], str | None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor in the folder's checkpoint, cast to `dtype` if given; with `rename`,
    under the name it gives, and not at all, unread, where it gives None."""
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                new_name = name if rename is None else rename(name)
                if new_name is None:
                    continue
                tensor = f.get_tensor(name)
                yield new_name, (tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype))
