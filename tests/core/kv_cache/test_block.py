from __future__ import annotations

import pytest

from pagedllm.core.kv_cache.block import FreeBlockQueue, KVCacheBlock


def _ids(queue: FreeBlockQueue) -> list[int]:
    return [block.block_id for block in queue]


def test_free_queue_popleft_append_remove() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert _ids(queue) == [0, 1, 2, 3, 4] and len(queue) == 5
    assert queue.popleft() is blocks[0]
    assert not blocks[0].is_in_free_queue
    queue.remove(blocks[2])  # from the middle
    assert _ids(queue) == [1, 3, 4] and len(queue) == 3
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert _ids(queue) == [1, 3, 4, 2, 0]
    queue.remove(blocks[0])  # the tail
    queue.remove(blocks[1])  # the head
    assert _ids(queue) == [3, 4, 2] and len(queue) == 3


def test_free_queue_rejects_misuse() -> None:
    block = KVCacheBlock(0)
    queue = FreeBlockQueue([block])
    with pytest.raises(AssertionError):
        queue.append(block)
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(AssertionError):
        queue.remove(block)


def test_block_hash_is_set_once() -> None:
    from pagedllm.core.kv_cache.hashing import BlockHash, BlockKey
    block = KVCacheBlock(3)
    block.set_hash(BlockHash(b"h"), BlockKey(None, (1,)))
    with pytest.raises(AssertionError):
        block.set_hash(BlockHash(b"g"), BlockKey(None, (2,)))
    block.reset_hash()
    assert block.block_hash is None and block.block_key is None
    assert "prev_free" not in repr(block)
