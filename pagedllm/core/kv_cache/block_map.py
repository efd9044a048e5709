"""A snapshot of the KV pools for the dashboard: one byte per block, and each request's block table.

```
states:  [ 0 | 3 | 3 | 4 | 2 | 1 | 1 | ... ]     block id = index; 0 is the null block
           null used used shared cached free free
```
Made by `KVCacheManager.make_block_map` on the thread that steps the engine, only when someone asks for it, and
immutable once made, so another thread may read it freely. The encoding is compact on purpose: a pool of tens of
thousands of blocks is tens of kilobytes, and the page works out each block's owners from the tables.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from pagedllm.core.kv_cache.block import KVCacheBlock
from pagedllm.core.request import Request


class BlockState(enum.IntEnum):
    """What one block holds, as the dashboard colours it."""

    NULL = 0        # block 0: padding target, never handed out
    FREE = 1        # ref_cnt 0, no hash
    CACHED = 2      # ref_cnt 0, hashed: a prefix-cache hit can revive it until it is evicted
    USED = 3        # ref_cnt 1
    SHARED = 4      # ref_cnt > 1 (a prefix hit or a fork shares it)


@dataclass(frozen=True, slots=True)
class RequestBlocks:
    """One request's tables. Block i of `block_ids` holds tokens [i * block_size, (i + 1) * block_size); its
    first `num_prompt_tokens` tokens are the prompt's, and the first `num_cached_tokens` came from the prefix
    cache at the request's first scheduling."""

    request_id: str
    status: str                         # RequestStatus name: RUNNING, SWAPPED, ...
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int
    block_ids: tuple[int, ...]          # device pool
    swap_block_ids: tuple[int, ...]     # swap pool, while swapped out

    @classmethod
    def of(cls, request: Request, block_ids: tuple[int, ...], swap_block_ids: tuple[int, ...]) -> RequestBlocks:
        return cls(request.request_id, request.status.name, request.num_prompt_tokens, request.num_tokens,
                   request.num_computed_tokens, request.num_cached_tokens, block_ids, swap_block_ids)


@dataclass(frozen=True, slots=True)
class BlockMap:
    """Both pools' block states and the tables of the requests holding blocks."""

    block_size: int
    states: bytes                       # one BlockState per device block
    swap_states: bytes                  # one BlockState per swap block (empty without a swap pool)
    requests: tuple[RequestBlocks, ...]
    num_blocks_swapped_out: int         # since start-up: swap traffic, in blocks
    num_blocks_swapped_in: int

    def count(self, state: BlockState) -> int:
        """Device blocks in `state`."""
        return self.states.count(state)


def encode_states(num_blocks: int, cached_blocks: Iterable[KVCacheBlock],
                  tables: Iterable[list[KVCacheBlock]]) -> bytes:
    """One BlockState per block of a pool of `num_blocks`, given its cached blocks and every table holding
    blocks (each used block is in at least one). Costs O(cached + used blocks), not O(num_blocks) Python steps."""
    if num_blocks == 0:
        return b""
    states = bytearray([BlockState.FREE]) * num_blocks
    states[0] = BlockState.NULL
    for block in cached_blocks:
        states[block.block_id] = BlockState.CACHED     # a used one is overwritten below
    for table in tables:
        for block in table:
            if block.block_id == 0:
                continue    # freed behind a sliding window
            states[block.block_id] = BlockState.USED if block.ref_cnt == 1 else BlockState.SHARED
    return bytes(states)
