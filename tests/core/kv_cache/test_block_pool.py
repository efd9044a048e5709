from __future__ import annotations

import pytest

from pagedllm.core.kv_cache.block_pool import BlockPool
from pagedllm.core.kv_cache.hashing import BlockHash, BlockKey


def _key(token: int) -> BlockKey:
    return BlockKey(None, (token,))


def _hash(token: int) -> BlockHash:
    return BlockHash(bytes([token]) * 16)


def test_all_blocks_exist_and_block_0_is_null() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.free_block_ids() == [1, 2, 3, 4]
    assert pool.num_usable_blocks == 4 and pool.num_free_blocks == 4 and pool.usage == 0.0
    pool.check_integrity()


def test_get_and_free_blocks_order_and_ref_counts() -> None:
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3] and [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_block_ids() == [4] and pool.usage == 0.75
    pool.check_integrity()
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [4, 3, 2, 1]
    pool.check_integrity()
    with pytest.raises(AssertionError):
        pool.free_blocks([blocks[0]])  # ref count would go below zero


def test_cached_block_stays_findable_until_evicted_lru() -> None:
    pool = BlockPool(4, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    assert pool.cache_block(b1, _hash(1), _key(1)) and pool.cache_block(b2, _hash(2), _key(2))
    pool.free_blocks([b2, b1])  # free queue: 3, 2, 1
    pool.check_integrity()
    assert pool.get_cached_block(_hash(1), _key(1)) is b1
    assert pool.get_cached_block(_hash(1), _key(9)) is None  # same hash, other content: no hit
    pool.touch([b1])  # hit on a free cached block: it leaves the free queue
    assert b1.ref_cnt == 1 and pool.free_block_ids() == [3, 2]
    pool.check_integrity()
    (new,) = pool.get_new_blocks(1)
    assert new.block_id == 3 and b2.block_hash is not None
    (new,) = pool.get_new_blocks(1)  # evicts b2, the least recently freed cached block
    assert new is b2 and b2.block_hash is None and pool.get_cached_block(_hash(2), _key(2)) is None
    assert pool.num_cached_blocks == 1
    pool.check_integrity()


def test_cache_block_keeps_the_first_block_for_a_hash() -> None:
    pool = BlockPool(4, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    assert pool.cache_block(b1, _hash(1), _key(1))
    assert not pool.cache_block(b2, _hash(1), _key(1))
    assert b2.block_hash is None
    pool.check_integrity()


def test_caching_disabled_never_maps() -> None:
    pool = BlockPool(4, enable_caching=False)
    (b1,) = pool.get_new_blocks(1)
    assert not pool.cache_block(b1, _hash(1), _key(1)) and pool.get_cached_block(_hash(1), _key(1)) is None


def test_reset_prefix_cache_only_when_nothing_is_used() -> None:
    pool = BlockPool(4, enable_caching=True)
    (b1,) = pool.get_new_blocks(1)
    pool.cache_block(b1, _hash(1), _key(1))
    assert not pool.reset_prefix_cache() and b1.block_hash is not None
    pool.free_blocks([b1])
    assert pool.reset_prefix_cache()
    assert b1.block_hash is None and pool.num_cached_blocks == 0 and pool.free_block_ids() == [2, 3, 1]
    pool.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    pool = BlockPool(4, enable_caching=True)
    (b1,) = pool.get_new_blocks(1)
    b1.ref_cnt = 0  # used block lost its reference without joining the free queue
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_prefix_stats() -> None:
    pool = BlockPool(4, enable_caching=True)
    pool.record_prefix_query(10, 4)
    pool.record_prefix_query(6, 0)
    stats = pool.prefix_cache_stats
    assert (stats.num_queries, stats.num_query_tokens, stats.num_hit_tokens) == (2, 16, 4)
    assert stats.hit_rate == 0.25
