"""KV cache blocks and the free-block queue that links them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from pagedllm.core.kv_cache.hashing import BlockHash, BlockKey


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of `block_size` token slots in the KV pool.

    `block_hash` and `block_key` are set together when the block is full and enters the prefix cache, and
    cleared when the block is evicted for reuse. `prev_free` / `next_free` are the block's links in the
    `FreeBlockQueue`; both are None exactly when the block is not in the queue.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    block_key: BlockKey | None = field(default=None, repr=False)
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)

    def set_hash(self, block_hash: BlockHash, key: BlockKey) -> None:
        assert self.block_hash is None, f"block {self.block_id} already has a hash"
        self.block_hash, self.block_key = block_hash, key

    def reset_hash(self) -> None:
        self.block_hash, self.block_key = None, None

    @property
    def is_in_free_queue(self) -> bool:
        return self.prev_free is not None


class FreeBlockQueue:
    """The free blocks, in eviction order: an intrusive doubly linked list through the blocks themselves.

    Why not a `deque`: a prefix-cache hit must take a free cached block out of the *middle* of the queue, which
    a deque does in O(n). Here the links live in the blocks, so popleft, append and remove are all O(1) and
    nothing is allocated. Two sentinels make every real block have both neighbours:

        head <-> b3 <-> b7 <-> b1 <-> tail      popleft() takes b3 (least recently freed) first
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("popleft from an empty FreeBlockQueue")
        self.remove(first)
        return first

    def append(self, block: KVCacheBlock) -> None:
        assert not block.is_in_free_queue, f"block {block.block_id} is already free"
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self._len += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self._len -= 1
