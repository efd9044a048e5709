"""Chained hashes of full KV blocks, for prefix caching.

Block i of a request is identified by its `BlockKey`: the hash of block i-1, its own tokens and extra keys (the
cache salt and the LoRA adapter's id, in block 0 only, and the pixel hash of each image whose placeholders start in
block i: the chain carries them into every later block). Only full blocks are hashed.

```
tokens:  [t0 t1 t2 t3][t4 t5 t6 t7][t8 t9]        block_size = 4
hashes:   h0 = H(None, (t0..t3), (salt,))
                       h1 = H(h0, (t4..t7), ())
                                    (partial: no hash)
```

The hash is xxh3_128 over a stable byte encoding of the key. A cached block also stores its key, so a lookup
compares keys, not just hashes: a hash collision can cost a cache hit but never give a wrong one.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", bytes)  # 16-byte xxh3_128 digest of a BlockKey
ExtraKey = str | int
ImageKey = tuple[int, str]  # an image's first placeholder position and its pixels' hash (`Request.image_keys`)


@dataclass(frozen=True, slots=True)
class BlockKey:
    """Exactly what a block hash stands for."""

    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[ExtraKey, ...] = ()


def _encode_extra_key(key: ExtraKey) -> bytes:
    if isinstance(key, str):
        data = key.encode("utf-8")
        return b"s" + struct.pack("<I", len(data)) + data
    return b"i" + struct.pack("<q", key)


def encode_block_key(key: BlockKey) -> bytes:
    """A byte string that is the same on every machine and run, and differs for different keys."""
    parent = b"\x01" + key.parent_hash if key.parent_hash is not None else b"\x00"
    tokens = struct.pack(f"<I{len(key.token_ids)}q", len(key.token_ids), *key.token_ids)
    extras = b"".join(_encode_extra_key(k) for k in key.extra_keys)
    return parent + tokens + extras


def hash_block_key(key: BlockKey) -> BlockHash:
    return BlockHash(xxhash.xxh3_128_digest(encode_block_key(key)))


def request_extra_keys(cache_salt: str | None, lora_int_id: int | None = None) -> tuple[ExtraKey, ...]:
    """A request's extra keys: its cache salt (a str) and its LoRA adapter's id (an int), where it has them. A
    block computed under one adapter holds K/V that another adapter, or the base model, would not compute."""
    return tuple(key for key in (cache_salt, lora_int_id) if key is not None)


def block_key(token_ids: Sequence[int], block_index: int, block_size: int, parent_hash: BlockHash | None,
              extra_keys: tuple[ExtraKey, ...], image_keys: tuple[ImageKey, ...] = ()) -> BlockKey:
    """The key of full block `block_index` of `token_ids`, given the hash of the block before it; the request's
    `extra_keys` (`Request.block_extra_keys`) go into block 0's, the hash of each of its images
    (`Request.image_keys`) into the block its placeholders start in."""
    start = block_index * block_size
    block_tokens = tuple(token_ids[start:start + block_size])
    assert len(block_tokens) == block_size, "only full blocks are hashed"
    images = tuple(h for offset, h in image_keys if start <= offset < start + block_size) if image_keys else ()
    return BlockKey(parent_hash, block_tokens, (extra_keys if block_index == 0 else ()) + images)


def extend_block_hashes(block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        extra_keys: tuple[ExtraKey, ...], image_keys: tuple[ImageKey, ...] = ()) -> None:
    """Append the hashes of the full blocks of `token_ids` that `block_hashes` does not have yet."""
    for index in range(len(block_hashes), len(token_ids) // block_size):
        parent = block_hashes[index - 1] if index > 0 else None
        block_hashes.append(hash_block_key(block_key(token_ids, index, block_size, parent, extra_keys,
                                                     image_keys)))
