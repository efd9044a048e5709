"""The dashboard's snapshot of the KV pools: exact block states and tables for free, cached, used, shared and
swapped blocks."""

from __future__ import annotations

from pagedllm.core.kv_cache.block_map import BlockState, RequestBlocks, encode_states
from pagedllm.core.kv_cache.manager import KVCacheManager
from tests.core.kv_cache.test_manager import BLOCK_SIZE, _decode, _request, _start

N, F, C, U, S = BlockState.NULL, BlockState.FREE, BlockState.CACHED, BlockState.USED, BlockState.SHARED


def test_states_and_tables_of_shared_cached_and_swapped_blocks() -> None:
    manager = KVCacheManager(10, BLOCK_SIZE, num_swap_blocks=4)
    a, b, c, d = (_request("a", list(range(10))), _request("b", [*range(8), 50, 51]),
                  _request("c", list(range(100, 105))), _request("d", list(range(200, 206))))
    _start(manager, a)                  # 1, 2 (full: cached) and 3
    _start(manager, b)                  # hits 1 and 2 (now shared), then 4
    b.num_cached_tokens = 8             # as the scheduler records the hit
    _decode(manager, b, 52)             # a generated token in 4
    _start(manager, c)                  # 5 (full: cached) and 6
    manager.free(c)                     # 6 free, 5 free but still cached
    _start(manager, d)                  # 7 (full: cached) and 8
    manager.swap_out(d)                 # to swap blocks 1 and 2; 7 stays cached, 8 is free
    block_map = manager.make_block_map([a, b, c, d])
    assert block_map.states == bytes([N, S, S, U, U, C, F, C, F, F])
    assert block_map.swap_states == bytes([N, U, U, F])
    assert (block_map.count(F), block_map.count(C), block_map.count(U), block_map.count(S)) == (3, 2, 2, 2)
    assert block_map.requests == (                  # c holds nothing any more: no table
        RequestBlocks("a", "WAITING", 10, 10, 10, 0, (1, 2, 3), ()),
        RequestBlocks("b", "WAITING", 10, 11, 11, 8, (1, 2, 4), ()),
        RequestBlocks("d", "WAITING", 6, 6, 6, 0, (), (1, 2)),
    )
    assert (block_map.num_blocks_swapped_out, block_map.num_blocks_swapped_in) == (2, 0)
    manager.swap_in(d)
    assert manager.make_block_map([d]).num_blocks_swapped_in == 2


def test_a_pool_without_swap_and_a_cached_block_in_use() -> None:
    manager = KVCacheManager(4, BLOCK_SIZE)
    a = _request("a", list(range(5)))
    _start(manager, a)                  # 1 is full and cached, and used by a
    block_map = manager.make_block_map([a])
    assert block_map.states == bytes([N, U, U, F]) and block_map.swap_states == b""
    assert encode_states(0, (), ()) == b""


def test_blocks_freed_behind_a_sliding_window() -> None:
    """The null block stands in a table for those freed behind the window: they show as cached (or free), and a
    swap moves only the others."""
    manager = KVCacheManager(6, BLOCK_SIZE, num_swap_blocks=4, window=6)
    a = _request("a", list(range(10)))
    _start(manager, a)                  # 1, 2 (full: cached) and 3
    _decode(manager, a, 10)             # token 10 reads keys 5 on: block 1 (tokens 0-3) is freed, still cached
    block_map = manager.make_block_map([a])
    assert block_map.states == bytes([N, C, U, U, F, F]) and block_map.requests[0].block_ids == (0, 2, 3)
    assert manager.swap_out(a) == [(2, 1), (3, 2)]
    block_map = manager.make_block_map([a])
    assert block_map.swap_states == bytes([N, U, U, F]) and block_map.requests[0].swap_block_ids == (0, 1, 2)
    assert block_map.num_blocks_swapped_out == 2
    assert manager.swap_in(a) == [(1, 4), (2, 5)] and manager.get_block_ids("a") == [0, 4, 5]
    manager.check_integrity()
