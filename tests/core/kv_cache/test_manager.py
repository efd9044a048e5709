from __future__ import annotations

import pytest

from pagedllm.core.kv_cache import hashing
from pagedllm.core.kv_cache.hashing import BlockHash, BlockKey
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _request(request_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id, tokens, SamplingParams(), cache_salt=cache_salt)


def _start(manager: KVCacheManager, request: Request) -> list[int] | None:
    """Admit a request the way the scheduler does, compute its whole prompt and cache its full blocks."""
    computed = manager.get_computed_blocks(request)
    new_ids = manager.allocate_slots(request, request.num_tokens - computed.num_computed_tokens, computed)
    if new_ids is not None:
        request.num_computed_tokens = request.num_tokens
        manager.cache_full_blocks(request)
    manager.check_integrity()
    return new_ids


def _decode(manager: KVCacheManager, request: Request, token: int) -> list[int] | None:
    """Append one generated token and compute it."""
    request.append_output_token_ids(token)
    new_ids = manager.allocate_slots(request, 1)
    if new_ids is not None:
        request.num_computed_tokens += 1
        manager.cache_full_blocks(request)
    manager.check_integrity()
    return new_ids


def _refs(manager: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [manager.pool.blocks[i].ref_cnt for i in block_ids]


def test_allocate_append_free_exact_blocks() -> None:
    manager = KVCacheManager(10, BLOCK_SIZE)
    a = _request("a", list(range(10)))
    assert _start(manager, a) == [1, 2, 3]
    assert manager.get_block_ids("a") == [1, 2, 3] and _refs(manager, [1, 2, 3]) == [1, 1, 1]
    assert manager.pool.free_block_ids() == [4, 5, 6, 7, 8, 9]
    assert [b.block_hash is not None for b in manager.pool.blocks[1:4]] == [True, True, False]
    assert _decode(manager, a, 10) == []  # token 10 fits in block 3
    assert _decode(manager, a, 11) == []  # token 11 fills block 3, which gets hashed
    assert manager.pool.blocks[3].block_hash is not None
    assert _decode(manager, a, 12) == [4]  # token 12 needs a new block
    assert manager.get_block_ids("a") == [1, 2, 3, 4] and manager.num_free_blocks == 5
    manager.free(a)
    manager.check_integrity()
    assert manager.pool.free_block_ids() == [5, 6, 7, 8, 9, 4, 3, 2, 1]  # tail first
    assert manager.get_block_ids("a") == [] and manager.usage == 0.0


def test_prefix_hit_touches_and_never_covers_the_last_token() -> None:
    manager = KVCacheManager(10, BLOCK_SIZE)
    a = _request("a", list(range(12)))
    _start(manager, a)
    manager.free(a)  # free queue: 4..9, 3, 2, 1
    b = _request("b", list(range(12)))
    computed = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in computed.blocks] == [1, 2] and computed.num_computed_tokens == 8
    assert manager.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 3, 2, 1]  # lookup alone takes nothing
    assert manager.allocate_slots(b, 4, computed) == [4]
    assert manager.get_block_ids("b") == [1, 2, 4] and _refs(manager, [1, 2, 4]) == [1, 1, 1]
    assert manager.pool.free_block_ids() == [5, 6, 7, 8, 9, 3]
    manager.check_integrity()
    c = _request("c", list(range(9)))  # shares blocks 1 and 2 with b, which is running
    computed = manager.get_computed_blocks(c)
    assert computed.num_computed_tokens == 8
    assert manager.allocate_slots(c, 1, computed) == [5]
    assert _refs(manager, [1, 2]) == [2, 2]
    manager.check_integrity()
    stats = manager.prefix_cache_stats
    assert (stats.num_queries, stats.num_query_tokens, stats.num_hit_tokens) == (3, 12 + 12 + 9, 16)


def test_lru_eviction_order() -> None:
    manager = KVCacheManager(6, BLOCK_SIZE)  # usable blocks 1..5
    a = _request("a", list(range(100, 108)) + [0])
    b = _request("b", list(range(200, 208)) + [0])
    _start(manager, a)  # blocks 1, 2, 3
    manager.free(a)  # free queue: 4, 5, 3, 2, 1
    _start(manager, b)  # takes 4, 5, 3 (block 3 was a's unhashed tail)
    assert manager.get_block_ids("b") == [4, 5, 3]
    manager.free(b)  # free queue: 2, 1, 3, 5, 4
    assert manager.pool.free_block_ids() == [2, 1, 3, 5, 4]
    big = _request("big", list(range(300, 308)))  # 2 blocks: evicts a's blocks, the least recently freed
    assert _start(manager, big) == [2, 1]
    assert manager.get_computed_blocks(_request("a2", a.all_token_ids)).num_computed_tokens == 0
    assert manager.get_computed_blocks(_request("b2", b.all_token_ids)).num_computed_tokens == 8


def test_allocate_failure_changes_nothing() -> None:
    manager = KVCacheManager(5, BLOCK_SIZE)  # 4 usable blocks
    a = _request("a", list(range(8)) + [0])
    _start(manager, a)
    manager.free(a)
    free_before = manager.pool.free_block_ids()
    b = _request("b", list(range(8)) + list(range(50, 62)))  # hit on 2 blocks, needs 3 more: 5 > 4
    computed = manager.get_computed_blocks(b)
    assert computed.num_computed_tokens == 8
    assert manager.allocate_slots(b, b.num_tokens - 8, computed) is None
    assert manager.pool.free_block_ids() == free_before and manager.get_block_ids("b") == []
    assert all(blk.ref_cnt == 0 for blk in manager.pool.blocks)
    manager.check_integrity()


def test_hit_blocks_are_not_counted_as_free_for_the_new_ones() -> None:
    manager = KVCacheManager(4, BLOCK_SIZE)  # 3 usable blocks
    a = _request("a", list(range(8)) + [0])
    _start(manager, a)
    manager.free(a)  # all 3 free; blocks 1, 2 cached
    b = _request("b", list(range(8)) + list(range(50, 58)))  # hit 2 blocks, needs 2 more: only 1 left after
    computed = manager.get_computed_blocks(b)
    assert manager.allocate_slots(b, b.num_tokens - 8, computed) is None
    manager.check_integrity()


def test_cache_salt_separates_requests() -> None:
    manager = KVCacheManager(20, BLOCK_SIZE)
    tokens = list(range(9))
    for request_id, salt in [("x", "alice"), ("y", None)]:
        request = _request(request_id, tokens, salt)
        _start(manager, request)
        manager.free(request)
    assert manager.get_computed_blocks(_request("p", tokens, "alice")).num_computed_tokens == 8
    assert manager.get_computed_blocks(_request("q", tokens, None)).num_computed_tokens == 8
    assert manager.get_computed_blocks(_request("r", tokens, "bob")).num_computed_tokens == 0


@pytest.mark.parametrize("fake_hash", ["constant", "ignores_parent"])
def test_hash_collisions_never_give_a_false_hit(monkeypatch: pytest.MonkeyPatch, fake_hash: str) -> None:
    def colliding_hash(key: BlockKey) -> BlockHash:
        if fake_hash == "constant":
            return BlockHash(b"\x00" * 16)
        return BlockHash(bytes(t % 256 for t in key.token_ids).ljust(16, b"\x00"))

    monkeypatch.setattr(hashing, "hash_block_key", colliding_hash)
    manager = KVCacheManager(20, BLOCK_SIZE)
    a = _request("a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    _start(manager, a)
    manager.free(a)
    # Same block tokens at another position or after another prefix: same (fake) hash, different content.
    assert manager.get_computed_blocks(_request("b", [1, 2, 3, 4, 1, 2, 3, 4, 0])).num_computed_tokens == 4
    assert manager.get_computed_blocks(_request("c", [5, 6, 7, 8, 0])).num_computed_tokens == 0
    assert manager.get_computed_blocks(_request("d", [9, 9, 9, 9, 5, 6, 7, 8, 0])).num_computed_tokens == 0
    expected = 4 if fake_hash == "constant" else 8  # with a constant hash only the first block was cached
    assert manager.get_computed_blocks(_request("e", a.all_token_ids)).num_computed_tokens == expected


def test_reset_prefix_cache() -> None:
    manager = KVCacheManager(10, BLOCK_SIZE)
    a = _request("a", list(range(9)))
    _start(manager, a)
    assert not manager.reset_prefix_cache()
    manager.free(a)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(_request("b", list(range(9)))).num_computed_tokens == 0
    manager.check_integrity()


def test_caching_disabled() -> None:
    manager = KVCacheManager(10, BLOCK_SIZE, enable_caching=False)
    a = _request("a", list(range(9)))
    _start(manager, a)
    manager.free(a)
    assert manager.get_computed_blocks(_request("b", list(range(9)))).num_computed_tokens == 0
    assert all(block.block_hash is None for block in manager.pool.blocks)
    assert manager.prefix_cache_stats.num_queries == 0


def test_what_fits_and_what_an_admission_takes() -> None:
    """A 60-token request needs 15 blocks of 4; over a 16-token window, computing 16 tokens a step, it holds at most 9
    at once. An admission takes the blocks it holds, less its hit's blocks another request holds, beyond a
    reserve."""
    plain, windowed = KVCacheManager(11, BLOCK_SIZE), KVCacheManager(11, BLOCK_SIZE, window=16)
    assert (plain.fits(40, 16), plain.fits(60, 16), windowed.fits(60, 16)) == (True, False, True)
    a = _request("a", list(range(9)))
    _start(plain, a)                                    # blocks 1, 2 (full: cached and held) and 3
    b = _request("b", list(range(20)))                  # hits 1 and 2: 5 blocks, 3 of them new
    hit = plain.get_computed_blocks(b)
    assert len(hit.blocks) == 2 and plain.num_free_blocks == 7
    assert plain.has_room_to_admit(hit, 20, 16, num_reserved=4)
    assert not plain.has_room_to_admit(hit, 20, 16, num_reserved=5)
    assert not plain.has_room_to_admit(plain.get_computed_blocks(_request("c", list(range(100, 130)))), 30, 16)


def test_a_window_hit_needs_only_the_blocks_its_window_reads() -> None:
    """Over an 8-token window, a 32-token request's first blocks were freed as it decoded, and another request's
    allocation then evicted the first two: a request of those 32 tokens and one more still hits all 8 blocks (32
    tokens), its next token reading keys 25.. alone (blocks 6 and 7, still cached), the null block for the 6 behind
    its window; without a window the same pool's hit would stop at the evicted first block."""
    manager = KVCacheManager(12, BLOCK_SIZE, window=8)
    tokens = list(range(100, 132))
    a = _request("a", tokens[:8])
    _start(manager, a)
    for token in tokens[8:]:
        assert _decode(manager, a, token) is not None
    manager.free(a)
    assert _start(manager, _request("c", list(range(20)))) is not None     # 5 blocks: evicts a's first two
    b = _request("b", tokens + [7])
    hit = manager.get_computed_blocks(b)
    assert hit.num_computed_tokens == 32
    assert [block.block_id == 0 for block in hit.blocks] == [True] * 6 + [False] * 2
    assert manager.allocate_slots(b, 1, hit) is not None
    manager.check_integrity()
    assert manager.get_ref_counts("b")[6:] == [1, 1, 1]
    evicted = KVCacheManager(12, BLOCK_SIZE)
    a = _request("a", tokens)
    _start(evicted, a)
    evicted.free(a)
    _start(evicted, _request("c", list(range(44))))     # 11 blocks: every block of a's evicted, the first too
    assert evicted.get_computed_blocks(_request("b", tokens + [7])).num_computed_tokens == 0


def test_a_window_hit_ends_before_a_miss_inside_its_window() -> None:
    """The longest hit whose window's blocks are all cached: with block 6 of 8 evicted, a hit of 8 blocks would read
    it; a hit of 6 blocks reads blocks 4 and 5 (keys 17..), cached."""
    manager = KVCacheManager(20, BLOCK_SIZE, window=8)
    tokens = list(range(100, 132))
    _start(manager, _request("a", tokens))
    block_6 = manager.get_computed_blocks(_request("probe", tokens + [7])).blocks[6]
    manager.pool.uncache_block(block_6)
    hit = manager.get_computed_blocks(_request("b", tokens + [7]))
    assert hit.num_computed_tokens == 24
    assert [block.block_id == 0 for block in hit.blocks] == [True] * 4 + [False] * 2


def test_an_admission_behind_a_window_counts_only_the_hit_blocks_it_keeps() -> None:
    """A 44-token request hits 6 blocks of another's 24 tokens over a 16-token window: it keeps only the last 4 (the
    first 2, which a third request holds, are behind its window), so it takes 9 - 4 = 5 free blocks, not 9 - 6."""
    manager = KVCacheManager(12, BLOCK_SIZE, window=16)
    tokens = list(range(44))
    _start(manager, _request("a", tokens[:24]))         # 6 blocks
    _start(manager, _request("c", tokens[:9]))          # hits a's first 2 (now held twice), 1 more block
    hit = manager.get_computed_blocks(_request("b", tokens))
    assert len(hit.blocks) == 6 and manager.num_free_blocks == 4
    assert [block.block_id == 0 for block in hit.blocks] == [True] * 2 + [False] * 4     # (behind: not looked up)
    assert all(block.ref_cnt > 0 for block in hit.blocks[2:])
    assert not manager.has_room_to_admit(hit, 44, 16)
    assert manager.has_room_to_admit(hit, 40, 16) is False and manager.fits(44, 16)
