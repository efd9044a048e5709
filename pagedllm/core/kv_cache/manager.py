"""The KV cache manager: each request's block table, on top of the block pool.

Token i of a request lives in slot `i % block_size` of block `table[i // block_size]`:

```
tokens:  0 1 2 3 | 4 5 6 7 | 8 9 . .        block_size = 4, num_tokens = 10
table:   [  17   ,    4    ,   9   ]        3 blocks = cdiv(10, 4); block 9 has 2 free slots
```

Safe call order within one scheduling step: `get_computed_blocks(r)` then, with no other allocation in between,
`allocate_slots(r, n, computed)`: the hit blocks are only referenced by `allocate_slots`, so a `None` from it
leaves everything as it was.

Sharing (copy-on-write). `fork(parent, child)` gives the child the parent's table; every block's ref_cnt rises.
Full blocks are never written again, so they stay shared for good. The first write into a shared, partly
filled last block copies it: `allocate_slots` gives the writer a fresh block and records `(src, dst)`, which
the scheduler drains with `take_blocks_to_copy()` into `SchedulerOutput.blocks_to_copy`:

```
parent  [ 17 | 4 | 9:ab.. ]      fork       parent [ 17 | 4 | 9:ab.. ]   ref_cnt 17, 4, 9: 2
                                 ------>    child  [ 17 | 4 | 9:ab.. ]
child writes token c at slot 2:  child [ 17 | 4 | 21:abc. ]  blocks_to_copy += (9, 21); ref_cnt 9: 1
```

Blocks cached ahead. A block is offered to the prefix cache once it is full of computed tokens (`cache_full_blocks`,
after the step that wrote it) or, for the requests a step schedules, as soon as that step is planned
(`cache_blocks_ahead`): a request admitted later in the same step then hits it and reads its K/V in the same forward
pass, which writes a layer's K/V before any of that layer's attention reads (vLLM caches at allocation too). Should
the step fail, `undo_blocks_ahead` takes those hashes out again and names the requests that hit them, whose reads
were not sure.

A sliding window (`window`: a model whose every layer attends within one, `kv_window`). No query reads a key more
than `window - 1` positions behind it, so before a step computes a request's tokens from `num_computed_tokens` on, the
blocks wholly before `num_computed_tokens - window + 1` are freed (their hashes stay cached until evicted) and the
null block stands in their place, as in vLLM's sliding-window manager; the null entries are always a leading run:

```
window = 6, block_size = 4, num_computed_tokens = 13: keys 8.. are still read
table:   [  17   ,    4    ,   9   ,  21 ]   ->   [ 0 | 0 | 9 | 21 ]    17 and 4 freed, tail first
```

A prefix hit needs only the blocks its next token's window reads cached (vLLM's sliding-window hit): the longest
hit is found from the right, the null block standing in for its blocks behind the window, cached or evicted; it takes
no reference on those behind its window either way.

Swap. A second, uncached `BlockPool` (`num_swap_blocks`, 0 for none) holds the computed blocks of swapped-out
requests. `swap_out` moves a request's computed blocks there (a shared block is copied; the others keep
using the device block), `swap_in` brings them back into fresh device blocks; both return `(src, dst)` pairs
for the runner. A swapped-out request holds no device block.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pagedllm.core.kv_cache.block import KVCacheBlock
from pagedllm.core.kv_cache.block_map import BlockMap, RequestBlocks, encode_states
from pagedllm.core.kv_cache.block_pool import BlockPool, PrefixCacheStats
from pagedllm.core.kv_cache.hashing import BlockHash, block_key, extend_block_hashes
from pagedllm.core.kv_cache.residency import ResidencyTracker
from pagedllm.core.request import Request
from pagedllm.metrics.stats import BlockResidency


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
        num_swap_blocks: blocks in the swap pool, its null block included (0: no swap pool).
        window: the sliding window every layer of the model attends within (0: none); blocks behind it are freed.
        residency: follows a sample of the device pool's blocks (KV cache residency metrics); None: none.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_swap_blocks: int = 0, window: int = 0, residency: ResidencyTracker | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.window = window
        self.pool = BlockPool(num_blocks, enable_caching, residency)
        # The swap pool's block 0 is a null block too, so that block ids mean the same in both pools' tensors.
        self.swap_pool = BlockPool(num_swap_blocks, enable_caching=False) if num_swap_blocks >= 2 else None
        # request id -> its blocks in the swap pool, while it is swapped out.
        self._swapped_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> copy-on-write (src, dst) pairs made since the last take_blocks_to_copy().
        self._pending_copies: dict[str, list[tuple[int, int]]] = {}
        # request id -> its block table. The one place a request's blocks are recorded, so that a fork can
        # later copy a table (sharing blocks) and a swap can replace one.
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many leading blocks of its table were already offered to the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        # This step's blocks cached ahead (block id -> the block, its request, that request's count of cached
        # blocks before), and the requests that hit one of them.
        self._ahead: dict[int, tuple[KVCacheBlock, str, int]] = {}
        self._ahead_readers: set[str] = set()
        # Swap traffic since start-up, in blocks (metrics).
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def take_residencies(self) -> list[BlockResidency] | None:
        """The sampled blocks' lives ended since the last call; None without residency metrics."""
        return None if self.pool.residency is None else self.pool.residency.take_ended()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.pool.prefix_cache_stats

    @property
    def num_free_swap_blocks(self) -> int:
        return self.swap_pool.num_free_blocks if self.swap_pool is not None else 0

    @property
    def num_usable_swap_blocks(self) -> int:
        return self.swap_pool.num_usable_blocks if self.swap_pool is not None else 0

    def _most_blocks_held(self, num_tokens: int, num_step_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once, computing at most `num_step_tokens` in a
        step: all of its blocks, or, with a window, at most those the window's keys and a step's tokens span."""
        num_blocks = cdiv(num_tokens, self.block_size)
        if not self.window:
            return num_blocks
        return min(num_blocks, cdiv(self.window - 1 + num_step_tokens, self.block_size) + 1)

    def fits(self, num_tokens: int, num_step_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens, computing at most `num_step_tokens` a step, fits in the pool
        run alone (with a window, one longer than the pool may: it holds only its window's blocks)."""
        return self._most_blocks_held(num_tokens, num_step_tokens) <= self.num_usable_blocks

    def has_room_to_admit(self, computed: ComputedBlocks, num_tokens: int, num_step_tokens: int,
                          num_reserved: int = 0) -> bool:
        """Whether the free blocks hold, beyond `num_reserved` (a watermark), what a request of `num_tokens` tokens
        takes after its prefix hit `computed`: the blocks it holds at once (`fits`), less the hit's blocks that other
        requests hold and it keeps (not those behind its window), which cost no free block."""
        kept = computed.blocks[self._num_behind(computed.num_computed_tokens):]
        num_needed = self._most_blocks_held(num_tokens, num_step_tokens) - sum(1 for block in kept if block.ref_cnt > 0)
        return num_needed + num_reserved <= self.num_free_blocks

    def _num_behind(self, num_computed: int) -> int:
        """The leading blocks no query from `num_computed` on reads: those wholly behind the window (0 without)."""
        return max(0, num_computed - self.window + 1) // self.block_size if self.window else 0

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._req_blocks.get(request_id, ())]

    def num_blocks_held(self, request_id: str) -> int:
        """The length of the request's device block table (0 without one), without building the id list."""
        return len(self._req_blocks.get(request_id, ()))

    def get_swapped_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._swapped_blocks.get(request_id, ())]

    def get_ref_counts(self, request_id: str) -> list[int]:
        """The ref_cnt of each block in the request's device table (for tests and debugging)."""
        return [block.ref_cnt for block in self._req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest chain of cached full blocks that prefixes the request's tokens.

        The hit never covers the last token: at least one token must be computed to get logits, so it stops
        at `num_tokens - 1` rounded down to a block. Takes no reference and counts no query (see `allocate_slots`).
        A request that wants prompt logprobs gets no hit (as in vLLM): the logits of every prompt position must be
        computed; nor does an embedding that pools over every position (MEAN, CLS), nor a request that asks to
        skip reading the cache (`skip_reading_prefix_cache`).
        """
        if (not self.enable_caching or request.sampling_params.prompt_logprobs is not None
                or request.sampling_params.skip_reading_prefix_cache
                or (request.pooling_params is not None and (request.pooling_params.needs_every_position
                                                            or request.pooling_params.skip_reading_prefix_cache))):
            return ComputedBlocks()
        hashes = self._block_hashes(request)
        extra_keys, image_keys = request.block_extra_keys, request.image_keys

        def cached(index: int) -> KVCacheBlock | None:
            parent = hashes[index - 1] if index > 0 else None
            key = block_key(request.all_token_ids, index, self.block_size, parent, extra_keys, image_keys)
            return self.pool.get_cached_block(hashes[index], key)

        num_full = (request.num_tokens - 1) // self.block_size
        if self.window:
            return self._window_hit(num_full, cached)
        blocks: list[KVCacheBlock] = []
        for index in range(num_full):
            block = cached(index)
            if block is None:
                break
            blocks.append(block)
        return ComputedBlocks(blocks, len(blocks) * self.block_size)

    def _window_hit(self, num_full: int, cached: Callable[[int], KVCacheBlock | None]) -> ComputedBlocks:
        """The longest hit of at most `num_full` blocks whose blocks the next token's window reads are all cached:
        from the right, each candidate end checked down to its window's first block, a miss at block j leaving ends
        at j or before (so each block is looked up once at most); the null block for those behind the window."""
        end = num_full
        while end > 0:
            behind = self._num_behind(end * self.block_size)
            blocks = []
            for index in range(end - 1, behind - 1, -1):
                block = cached(index)
                if block is None:
                    end = index
                    break
                blocks.append(block)
            else:
                return ComputedBlocks([self.pool.null_block] * behind + blocks[::-1], end * self.block_size)
        return ComputedBlocks()

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks | None = None) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        Args:
            request: the request; its `num_computed_tokens` counts the tokens already in its blocks.
            num_new_tokens: tokens to compute this step.
            computed: a prefix hit from `get_computed_blocks`, for a request that has no blocks yet; its
                blocks are referenced and become the head of the table. The first such admission is when the
                query counts in `prefix_cache_stats`: once per request, since a failed attempt (None) counts
                nothing, and a re-admission (after a recompute preemption, which mostly finds its own freed
                blocks, or a failed step that sent it back to wait) is left out, as vLLM leaves the preempted
                out of its hit rate.

        Returns:
            The ids of the newly allocated blocks (maybe none, and not counting a copy-on-write copy), or None
            when there are not enough free blocks, in which case nothing changed but that blocks behind a sliding
            window were freed (as they would be in any case).

        When the first new token lands in a block shared with another table (after a fork), that block is
        copied first: the request gets a fresh block in its place, the pair is recorded for
        `take_blocks_to_copy()`, and the shared block loses one reference.
        """
        table = self._req_blocks.get(request.request_id, [])
        hit = computed.blocks if computed is not None else []
        assert not (hit and table), "a prefix hit is only for a request without blocks"
        assert request.request_id not in self._swapped_blocks, "swap the request in first"
        num_computed = computed.num_computed_tokens if computed is not None else request.num_computed_tokens
        if self.window:
            num_behind = self._num_behind(num_computed)
            self._free_behind_window(table, num_behind)
            hit = [self.pool.null_block] * min(num_behind, len(hit)) + hit[num_behind:]
        num_needed = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - len(table) - len(hit))
        write_index = num_computed // self.block_size
        copy_on_write = num_new_tokens > 0 and write_index < len(table) and table[write_index].ref_cnt > 1
        assert all(block.ref_cnt == 1 for block in table[write_index + 1:]), "a shared block past the write point"
        # Free cached hit blocks sit in the free queue; touching them takes them out of it.
        num_free_after_touch = self.pool.num_free_blocks - sum(
            1 for block in hit if block.ref_cnt == 0 and block is not self.pool.null_block)
        if num_needed + copy_on_write > num_free_after_touch:
            return None
        if copy_on_write:
            self._copy_on_write(request.request_id, table, write_index)
        self.pool.touch(hit)
        if any(block.block_id in self._ahead for block in hit):
            self._ahead_readers.add(request.request_id)
        if computed is not None and self.enable_caching and not request.prefix_query_counted:
            self.pool.record_prefix_query(request.num_tokens, computed.num_computed_tokens)
            request.prefix_query_counted = True
        new_blocks = self.pool.get_new_blocks(num_needed)
        if request.request_id not in self._req_blocks:
            self._req_blocks[request.request_id] = table
            self._num_cached_blocks[request.request_id] = len(hit)
        table.extend(hit)
        table.extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def _free_behind_window(self, table: list[KVCacheBlock], num_behind: int) -> None:
        """Free the table's blocks before index `num_behind` that it still holds, the null block in their place."""
        end = min(num_behind, len(table))
        start = end
        while start > 0 and table[start - 1] is not self.pool.null_block:
            start -= 1
        if start < end:
            self.pool.free_blocks(reversed(table[start:end]))
            table[start:end] = [self.pool.null_block] * (end - start)

    def _copy_on_write(self, request_id: str, table: list[KVCacheBlock], index: int) -> None:
        shared = table[index]
        (copy,) = self.pool.get_new_blocks(1)
        table[index] = copy
        self.pool.free_blocks([shared])  # still held by another table
        self._pending_copies.setdefault(request_id, []).append((shared.block_id, copy.block_id))

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """The copy-on-write pairs made since the last call, for this step's `SchedulerOutput.blocks_to_copy`."""
        pairs = [pair for pairs in self._pending_copies.values() for pair in pairs]
        self._pending_copies.clear()
        return pairs

    def has_pending_copy(self, request_id: str) -> bool:
        """True if the request got a copy-on-write block this step: that block's K/V is not there yet."""
        return request_id in self._pending_copies

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's block table: the blocks are shared, each ref_cnt rises by one.

        Call between steps (the parent's pending copies, if any, already drained). Nothing is copied now;
        the first write into a shared, partly filled block copies it (see `allocate_slots`).
        """
        assert child.request_id not in self._req_blocks and child.request_id not in self._swapped_blocks
        assert not self.has_pending_copy(parent.request_id), "fork after the step's copies were taken"
        table = list(self._req_blocks.get(parent.request_id, []))
        self.pool.touch(table)
        self._req_blocks[child.request_id] = table
        self._num_cached_blocks[child.request_id] = self._num_cached_blocks.get(parent.request_id, 0)

    def cache_full_blocks(self, request: Request) -> None:
        """Offer the request's blocks that are full of computed tokens to the prefix cache: after a step, once
        `request.num_computed_tokens` advanced over the K/V it wrote. Covers blocks filled by generated tokens
        too."""
        self._cache_blocks(request, request.num_computed_tokens // self.block_size)

    def cache_blocks_ahead(self, request: Request, num_new_tokens: int) -> None:
        """Offer the blocks that the step being planned fills (with the request's next `num_new_tokens` tokens)
        to the prefix cache now, so that a request admitted later in the same step can hit them (see the module
        docstring); `undo_blocks_ahead` takes them back if the step fails."""
        before = self._num_cached_blocks.get(request.request_id, 0)
        for block in self._cache_blocks(request, (request.num_computed_tokens + num_new_tokens) // self.block_size):
            self._ahead[block.block_id] = (block, request.request_id, before)

    def _cache_blocks(self, request: Request, num_full: int) -> list[KVCacheBlock]:
        """Enter the request's blocks before `num_full` in the prefix-cache map; returns those it entered."""
        table = self._req_blocks.get(request.request_id)
        if not self.enable_caching or table is None:
            return []
        start = self._num_cached_blocks[request.request_id]
        if num_full <= start:
            return []
        hashes = self._block_hashes(request)
        extra_keys, image_keys = request.block_extra_keys, request.image_keys
        entered = []
        for index in range(start, num_full):
            if table[index] is self.pool.null_block:
                continue    # freed behind the window, offered before it was
            parent = hashes[index - 1] if index > 0 else None
            key = block_key(request.all_token_ids, index, self.block_size, parent, extra_keys, image_keys)
            if self.pool.cache_block(table[index], hashes[index], key):
                entered.append(table[index])
        self._num_cached_blocks[request.request_id] = num_full
        return entered

    def start_step(self) -> None:
        """A new step is being planned: the last one's blocks cached ahead were computed (or undone)."""
        self._ahead.clear()
        self._ahead_readers.clear()

    def undo_blocks_ahead(self) -> set[str]:
        """The step failed: its blocks cached ahead may hold no K/V, or part of it. Take their hashes out of the
        prefix cache (their requests offer them again once computed) and return the ids of the requests that hit
        them, whose reads are not sure."""
        for block, request_id, before in self._ahead.values():
            self.pool.uncache_block(block)
            if request_id in self._num_cached_blocks:
                self._num_cached_blocks[request_id] = min(self._num_cached_blocks[request_id], before)
        readers, self._ahead_readers = self._ahead_readers, set()
        self._ahead.clear()
        return readers

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted before its first ones
        (which other requests are likelier to share). Hashed blocks stay findable until evicted."""
        table = self._req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self._pending_copies.pop(request.request_id, None)  # its copy's destination is free again
        self.pool.free_blocks(reversed(table))
        swapped = self._swapped_blocks.pop(request.request_id, [])
        if swapped:
            assert self.swap_pool is not None
            self.swap_pool.free_blocks(reversed(swapped))

    # ---- swap -------------------------------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        """True if the swap pool has room for the request's computed blocks, and none of them is a copy
        made this step (its K/V would only be there after the step's copies, which run after swap-outs)."""
        table = self._req_blocks.get(request.request_id)
        num_blocks = cdiv(request.num_computed_tokens, self.block_size)
        return (self.swap_pool is not None and table is not None and num_blocks > 0
                and num_blocks - _num_behind_window(table) <= self.swap_pool.num_free_blocks
                and not self.has_pending_copy(request.request_id))

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's computed blocks to the swap pool; returns (device id, swap id) pairs to copy.

        Blocks past the computed tokens (allocated for this step) are just freed. The device blocks are freed
        tail first and keep their hashes; a shared one stays in use by its other tables. Those behind a sliding
        window are the swap pool's null block in the swapped table.
        """
        assert self.can_swap_out(request) and self.swap_pool is not None
        table = self._req_blocks.pop(request.request_id)
        self._num_cached_blocks.pop(request.request_id)
        behind = _num_behind_window(table)
        swap_blocks = [self.swap_pool.null_block] * behind + self.swap_pool.get_new_blocks(
            cdiv(request.num_computed_tokens, self.block_size) - behind)
        self._swapped_blocks[request.request_id] = swap_blocks
        self.pool.free_blocks(reversed(table))
        self.num_blocks_swapped_out += len(swap_blocks) - behind
        return [(device.block_id, swap.block_id) for device, swap in zip(table[behind:], swap_blocks[behind:])]

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """True if the device pool has room for the swapped blocks and the next `num_new_tokens` tokens."""
        swapped = self._swapped_blocks[request.request_id]
        num_needed = max(len(swapped), cdiv(request.num_computed_tokens + num_new_tokens, self.block_size))
        return num_needed - _num_behind_window(swapped) <= self.pool.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped-out request's blocks back into fresh device blocks; returns (swap id, device id)
        pairs to copy. Its full blocks are offered to the prefix cache again after the step."""
        assert self.swap_pool is not None
        swap_blocks = self._swapped_blocks.pop(request.request_id)
        behind = _num_behind_window(swap_blocks)
        device_blocks = [self.pool.null_block] * behind + self.pool.get_new_blocks(len(swap_blocks) - behind)
        self._req_blocks[request.request_id] = device_blocks
        self._num_cached_blocks[request.request_id] = 0
        self.swap_pool.free_blocks(reversed(swap_blocks))
        self.num_blocks_swapped_in += len(swap_blocks) - behind
        return [(swap.block_id, device.block_id) for swap, device in zip(swap_blocks[behind:], device_blocks[behind:])]

    def make_block_map(self, requests: Iterable[Request]) -> BlockMap:
        """A snapshot of both pools, with the tables of those of `requests` that hold blocks (the dashboard)."""
        tables = []
        for request in requests:
            block_ids = tuple(self.get_block_ids(request.request_id))
            swap_block_ids = tuple(self.get_swapped_block_ids(request.request_id))
            if block_ids or swap_block_ids:
                tables.append(RequestBlocks.of(request, block_ids, swap_block_ids))
        states = encode_states(self.pool.num_blocks, self.pool.cached_blocks(), self._req_blocks.values())
        swap_states = b"" if self.swap_pool is None else \
            encode_states(self.swap_pool.num_blocks, (), self._swapped_blocks.values())
        return BlockMap(self.block_size, states, swap_states, tuple(tables), self.num_blocks_swapped_out,
                        self.num_blocks_swapped_in)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False (and nothing done) while any block is in use."""
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Assert both pools' invariants, and that each block's ref_cnt is exactly the number of tables
        holding it (shared blocks included)."""
        assert self._req_blocks.keys().isdisjoint(self._swapped_blocks), "a request in both pools"
        assert self._pending_copies.keys() <= self._req_blocks.keys(), "a copy for a request without blocks"
        for request_id in self._req_blocks:
            assert self._num_cached_blocks[request_id] <= len(self._req_blocks[request_id])
        _check_tables(self.pool, self._req_blocks)
        if self.swap_pool is not None:
            _check_tables(self.swap_pool, self._swapped_blocks)
        else:
            assert not self._swapped_blocks

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            request.block_extra_keys, request.image_keys)
        return request.block_hashes


def _num_behind_window(table: list[KVCacheBlock]) -> int:
    """How many of the table's blocks were freed behind a sliding window: its leading null blocks (block id 0)."""
    count = 0
    while count < len(table) and table[count].block_id == 0:
        count += 1
    return count


def _check_tables(pool: BlockPool, tables: dict[str, list[KVCacheBlock]]) -> None:
    pool.check_integrity()
    refs: Counter[int] = Counter()
    for request_id, full_table in tables.items():
        table = full_table[_num_behind_window(full_table):]
        ids = [block.block_id for block in table]
        assert len(set(ids)) == len(ids), f"request {request_id} holds a block twice"
        assert 0 not in ids, f"request {request_id} holds the null block past its window's start"
        assert all(pool.blocks[i] is block for i, block in zip(ids, table)), f"{request_id}: block of another pool"
        refs.update(ids)
    for block in pool.blocks[1:]:
        assert block.ref_cnt == refs[block.block_id], (
            f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {refs[block.block_id]} tables")
