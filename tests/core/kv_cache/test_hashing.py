from __future__ import annotations

from pagedllm.core.kv_cache.hashing import (
    BlockHash,
    BlockKey,
    block_key,
    encode_block_key,
    extend_block_hashes,
    hash_block_key,
)


def test_only_full_blocks_are_hashed_incrementally() -> None:
    hashes: list[BlockHash] = []
    tokens = list(range(10))
    extend_block_hashes(hashes, tokens, 4, ())
    assert len(hashes) == 2 and all(len(h) == 16 for h in hashes)
    first = list(hashes)
    tokens += [10, 11]
    extend_block_hashes(hashes, tokens, 4, ())
    assert hashes[:2] == first and len(hashes) == 3


def test_hash_is_chained() -> None:
    a: list[BlockHash] = []
    b: list[BlockHash] = []
    extend_block_hashes(a, [1, 2, 3, 4, 5, 6, 7, 8], 4, ())
    extend_block_hashes(b, [9, 9, 9, 9, 5, 6, 7, 8], 4, ())
    assert a[1] != b[1]  # same block tokens, different parents


def test_salt_is_in_the_first_block_and_carried_by_the_chain() -> None:
    tokens = list(range(8))
    assert block_key(tokens, 0, 4, None, ("s",)).extra_keys == ("s",)
    assert block_key(tokens, 1, 4, None, ("s",)).extra_keys == ()
    salted: list[BlockHash] = []
    plain: list[BlockHash] = []
    extend_block_hashes(salted, tokens, 4, ("s",))
    extend_block_hashes(plain, tokens, 4, ())
    assert salted[0] != plain[0] and salted[1] != plain[1]


def test_encoding_is_stable_and_unambiguous() -> None:
    key = BlockKey(None, (1, 2), ("a",))
    assert encode_block_key(key) == b"\x00" + bytes([2, 0, 0, 0]) + (1).to_bytes(8, "little") + \
        (2).to_bytes(8, "little") + b"s" + bytes([1, 0, 0, 0]) + b"a"
    assert hash_block_key(BlockKey(None, (1,), ("1",))) != hash_block_key(BlockKey(None, (1,), (1,)))
    assert hash_block_key(BlockKey(None, (1, 2))) != hash_block_key(BlockKey(None, (1,), (2,)))
    assert hash_block_key(key) == hash_block_key(BlockKey(None, (1, 2), ("a",)))
