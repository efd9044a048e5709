"""The KV cache manager: each request's block table, on top of the block pool.

Token i of a request lives in slot `i % block_size` of block `table[i // block_size]`:

```
tokens:  0 1 2 3 | 4 5 6 7 | 8 9 . .        block_size = 4, num_tokens = 10
table:   [  17   ,    4    ,   9   ]        3 blocks = cdiv(10, 4); block 9 has 2 free slots
```

Safe call order within one scheduling step: `get_computed_blocks(r)` then, with no other allocation in between,
`allocate_slots(r, n, computed)`: the hit blocks are only referenced by `allocate_slots`, so a `None` from it
leaves everything as it was.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pagedllm.core.kv_cache.block import KVCacheBlock
from pagedllm.core.kv_cache.block_pool import BlockPool, PrefixCacheStats
from pagedllm.core.kv_cache.hashing import BlockHash, block_key, extend_block_hashes
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """A prefix-cache hit: the leading blocks whose K/V are already computed, not yet referenced."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_computed_tokens: int = 0


class KVCacheManager:
    """Per-request block tables over one `BlockPool`.

    Args:
        num_blocks: blocks in the pool, the null block 0 included.
        block_size: tokens per block.
        enable_caching: reuse full blocks whose token chains match (prefix caching).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        # request id -> its block table. The one place a request's blocks are recorded, so that a fork can
        # later copy a table (sharing blocks) and a swap can replace one.
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many leading blocks of its table were already offered to the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.pool.prefix_cache_stats

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest chain of cached full blocks that prefixes the request's tokens.

        The hit never covers the last token: at least one token must be computed to get logits, so it stops
        at `num_tokens - 1` rounded down to a block. Takes no reference (see `allocate_slots`).
        """
        if not self.enable_caching:
            return ComputedBlocks()
        hashes = self._block_hashes(request)
        blocks: list[KVCacheBlock] = []
        for index in range((request.num_tokens - 1) // self.block_size):
            parent = hashes[index - 1] if index > 0 else None
            key = block_key(request.all_token_ids, index, self.block_size, parent, request.cache_salt)
            block = self.pool.get_cached_block(hashes[index], key)
            if block is None:
                break
            blocks.append(block)
        num_hit_tokens = len(blocks) * self.block_size
        self.pool.record_prefix_query(request.num_tokens, num_hit_tokens)
        return ComputedBlocks(blocks, num_hit_tokens)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks | None = None) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        Args:
            request: the request; its `num_computed_tokens` counts the tokens already in its blocks.
            num_new_tokens: tokens to compute this step.
            computed: a prefix hit from `get_computed_blocks`, for a request that has no blocks yet; its
                blocks are referenced and become the head of the table.

        Returns:
            The ids of the newly allocated blocks (maybe none), or None when there are not enough free blocks,
            in which case nothing changed.
        """
        table = self._req_blocks.get(request.request_id, [])
        hit = computed.blocks if computed is not None else []
        assert not (hit and table), "a prefix hit is only for a request without blocks"
        num_computed = computed.num_computed_tokens if computed is not None else request.num_computed_tokens
        num_needed = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - len(table) - len(hit))
        # Free cached hit blocks sit in the free queue; touching them takes them out of it.
        num_free_after_touch = self.pool.num_free_blocks - sum(1 for block in hit if block.ref_cnt == 0)
        if num_needed > num_free_after_touch:
            return None
        self.pool.touch(hit)
        new_blocks = self.pool.get_new_blocks(num_needed)
        if request.request_id not in self._req_blocks:
            self._req_blocks[request.request_id] = table
            self._num_cached_blocks[request.request_id] = len(hit)
        table.extend(hit)
        table.extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def cache_full_blocks(self, request: Request) -> None:
        """Offer the request's blocks that are full of computed tokens to the prefix cache.

        Call after `request.num_computed_tokens` advanced, i.e. once the step wrote their K/V, so that no
        other request can hit a block whose K/V is still being computed. Covers blocks filled by generated
        tokens too.
        """
        table = self._req_blocks.get(request.request_id)
        if not self.enable_caching or table is None:
            return
        start = self._num_cached_blocks[request.request_id]
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        for index in range(start, num_full):
            parent = hashes[index - 1] if index > 0 else None
            key = block_key(request.all_token_ids, index, self.block_size, parent, request.cache_salt)
            self.pool.cache_block(table[index], hashes[index], key)
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted before its first ones
        (which other requests are likelier to share). Hashed blocks stay findable until evicted."""
        table = self._req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(table))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False (and nothing done) while any block is in use."""
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Assert the pool's invariants, and that ref counts are exactly the number of tables holding a block."""
        self.pool.check_integrity()
        refs: Counter[int] = Counter()
        for request_id, table in self._req_blocks.items():
            ids = [block.block_id for block in table]
            assert len(set(ids)) == len(ids), f"request {request_id} holds a block twice"
            assert 0 not in ids, f"request {request_id} holds the null block"
            assert self._num_cached_blocks[request_id] <= len(table)
            refs.update(ids)
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == refs[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {refs[block.block_id]} tables")

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)
        return request.block_hashes
