"""The block pool: every KV block, their ref counts, the free queue and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedllm.core.kv_cache.block import FreeBlockQueue, KVCacheBlock
from pagedllm.core.kv_cache.hashing import BlockHash, BlockKey
from pagedllm.core.kv_cache.residency import ResidencyTracker


@dataclass(slots=True)
class PrefixCacheStats:
    """Running totals, in tokens, of prefix-cache lookups (for metrics)."""

    num_queries: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class BlockPool:
    """All `num_blocks` blocks, created once.

    Each usable block is in exactly one state:
      - free:   ref_cnt == 0, no hash, in the free queue;
      - cached: ref_cnt == 0, hashed, in the free queue and in the prefix-cache map (reusable until evicted);
      - used:   ref_cnt > 0, not in the free queue (hashed or not).

    Block 0 is the null block: never handed out, never freed. It gives padded block tables a valid block id to
    point at (the runner pads with 0), so nothing real is ever read or overwritten through padding, and stands in a
    table for the blocks freed behind a sliding window; `touch` and `free_blocks` pass it over.

    New blocks come from the head of the free queue and freed blocks join its tail, so cached blocks are
    evicted least recently freed first. Evicting a cached block drops its hash from the map.

    With a `residency` tracker, it hears of each block handed out and each reference taken (`touch`).
    """

    def __init__(self, num_blocks: int, enable_caching: bool, residency: ResidencyTracker | None = None) -> None:
        assert num_blocks >= 2, "need the null block and at least one usable block"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.null_block = self.blocks[0]
        self._free_queue = FreeBlockQueue(self.blocks[1:])
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.residency = residency

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `get_new_blocks` can hand out: free ones and cached ones not in use."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def cached_blocks(self) -> Iterable[KVCacheBlock]:
        """The blocks in the prefix-cache map, free or in use."""
        return self._cached.values()

    def free_block_ids(self) -> list[int]:
        """Ids in the free queue, in eviction order (for tests and debugging)."""
        return [block.block_id for block in self._free_queue]

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue, evicting their hashes; ref_cnt becomes 1."""
        assert num_blocks <= self.num_free_blocks, f"asked for {num_blocks} of {self.num_free_blocks} free blocks"
        blocks = [self._free_queue.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
            if self.residency is not None:
                self.residency.allocated(block.block_id)
        return blocks

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Take a block's hash out of the prefix-cache map (no-op for an unhashed block); the block stays as it is
        otherwise (used or free)."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.reset_hash()

    def get_cached_block(self, block_hash: BlockHash, key: BlockKey) -> KVCacheBlock | None:
        """The cached block with this hash whose key also matches exactly, or None."""
        block = self._cached.get(block_hash)
        return block if block is not None and block.block_key == key else None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to each block (a prefix hit); a free cached block leaves the free queue."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self._free_queue.remove(block)
            block.ref_cnt += 1
            if self.residency is not None:
                self.residency.read(block.block_id)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, key: BlockKey) -> bool:
        """Enter a full, used block in the prefix-cache map. False if its hash is already there (another block
        holds the same content, or a collision): the block then stays uncached."""
        assert block.ref_cnt > 0 and block is not self.null_block
        if not self.enable_caching or block_hash in self._cached:
            return False
        block.set_hash(block_hash, key)
        self._cached[block_hash] = block
        return True

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks reaching 0 join the free queue's tail in the given order,
        so the first ones given are evicted first."""
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue.append(block)

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        stats = self.prefix_cache_stats
        stats.num_queries += 1
        stats.num_query_tokens += num_query_tokens
        stats.num_hit_tokens += num_hit_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (False) while any block is in use: running requests would lose
        the hashes of blocks they still own."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self._cached.values():
            block.reset_hash()
        self._cached.clear()
        if self.residency is not None:
            self.residency.reset()
        return True

    def check_integrity(self) -> None:
        """Assert the state invariants: every usable block is free, cached or used, exactly once."""
        null = self.null_block
        assert null.ref_cnt == 0 and null.block_hash is None and not null.is_in_free_queue, "null block touched"
        queued_ids = self.free_block_ids()
        assert len(queued_ids) == len(self._free_queue) == len(set(queued_ids)), "free queue corrupt"
        queued = set(queued_ids)
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert (block.ref_cnt == 0) == (block.block_id in queued), f"block {block.block_id} free/used mismatch"
            assert (block.block_hash is None) == (block.block_key is None), f"block {block.block_id} half hashed"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, f"block {block.block_id} hashed, not mapped"
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"map entry for block {block.block_id} is stale"
        num_used = sum(1 for block in self.blocks[1:] if block.ref_cnt > 0)
        assert num_used + len(queued) == self.num_usable_blocks
