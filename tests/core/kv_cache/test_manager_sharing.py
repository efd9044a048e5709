"""Forks, copy-on-write and swap in the KV cache manager: exact block ids, ref counts and pairs."""

from __future__ import annotations

from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _computed(manager: KVCacheManager, request_id: str, tokens: list[int]) -> Request:
    """A request whose `tokens` are all computed (blocks allocated, counter advanced, full blocks cached)."""
    request = Request(request_id, tokens, SamplingParams())
    assert manager.allocate_slots(request, len(tokens)) is not None
    request.num_computed_tokens = len(tokens)
    manager.cache_full_blocks(request)
    return request


def _fork(manager: KVCacheManager, parent: Request, child_id: str) -> Request:
    child = parent.fork(child_id, index=1)
    manager.fork(parent, child)
    return child


def test_fork_shares_every_block_and_raises_ref_counts() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE)
    parent = _computed(manager, "p", list(range(10)))              # blocks 1, 2 full; 3 holds 2 tokens
    free_before = manager.num_free_blocks
    children = [_fork(manager, parent, f"p#{i}") for i in (1, 2, 3)]
    assert all(manager.get_block_ids(c.request_id) == manager.get_block_ids("p") == [1, 2, 3] for c in children)
    assert manager.get_ref_counts("p") == [4, 4, 4]
    assert manager.num_free_blocks == free_before                    # nothing allocated by a fork
    manager.check_integrity()


def test_first_write_into_a_shared_partial_block_copies_it_once() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE)
    parent = _computed(manager, "p", list(range(10)))
    child = _fork(manager, parent, "p#1")
    child.append_output_token_ids(7)
    assert manager.allocate_slots(child, 1) == []                  # no new block: the copy is not "new"
    assert manager.get_block_ids("p#1") == [1, 2, 4]
    assert manager.take_blocks_to_copy() == [(3, 4)] and manager.take_blocks_to_copy() == []
    assert manager.get_ref_counts("p") == [2, 2, 1] and manager.get_ref_counts("p#1") == [2, 2, 1]
    # The parent is now the only holder of block 3: it writes in place, no copy.
    parent.append_output_token_ids(8)
    assert manager.allocate_slots(parent, 1) == [] and manager.take_blocks_to_copy() == []
    assert manager.get_block_ids("p") == [1, 2, 3]
    manager.check_integrity()


def test_full_shared_blocks_are_never_copied() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE)
    parent = _computed(manager, "p", list(range(8)))               # two full blocks
    child = _fork(manager, parent, "p#1")
    child.append_output_token_ids(7)
    assert manager.allocate_slots(child, 1) == [3]                 # a fresh third block, nothing copied
    assert manager.take_blocks_to_copy() == []
    assert manager.get_block_ids("p#1") == [1, 2, 3] and manager.get_ref_counts("p#1") == [2, 2, 1]
    manager.check_integrity()


def test_copy_on_write_fails_cleanly_without_a_free_block() -> None:
    manager = KVCacheManager(4, BLOCK_SIZE)                        # 3 usable blocks
    parent = _computed(manager, "p", list(range(10)))              # uses all 3
    child = _fork(manager, parent, "p#1")
    child.append_output_token_ids(7)
    assert manager.allocate_slots(child, 1) is None
    assert manager.get_ref_counts("p#1") == [2, 2, 2] and manager.take_blocks_to_copy() == []
    manager.check_integrity()


def test_freeing_forked_sequences_keeps_ref_counts_right() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE)
    parent = _computed(manager, "p", list(range(10)))
    child = _fork(manager, parent, "p#1")
    manager.free(parent)
    assert manager.get_ref_counts("p#1") == [1, 1, 1]
    manager.check_integrity()
    manager.free(child)
    assert manager.num_free_blocks == manager.num_usable_blocks
    manager.check_integrity()


def test_a_copy_made_this_step_is_dropped_when_its_request_is_freed() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE)
    parent = _computed(manager, "p", list(range(10)))
    child = _fork(manager, parent, "p#1")
    child.append_output_token_ids(7)
    manager.allocate_slots(child, 1)
    assert manager.has_pending_copy("p#1") and not manager.can_swap_out(child)
    manager.free(child)
    assert manager.take_blocks_to_copy() == []
    manager.check_integrity()


def test_swap_out_and_in_move_the_computed_blocks() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, num_swap_blocks=6)
    request = _computed(manager, "r", list(range(9)))              # blocks 1, 2, 3 (one token in 3)
    request.append_output_token_ids(5)
    manager.allocate_slots(request, 1)
    assert manager.can_swap_out(request)
    assert manager.swap_out(request) == [(1, 1), (2, 2), (3, 3)]
    assert manager.get_block_ids("r") == [] and manager.get_swapped_block_ids("r") == [1, 2, 3]
    assert manager.num_free_blocks == manager.num_usable_blocks and manager.num_free_swap_blocks == 2
    manager.check_integrity()
    # Cached blocks 1 and 2 were freed tail first: fresh blocks come before them.
    assert manager.can_swap_in(request, 1)
    assert manager.swap_in(request) == [(1, 4), (2, 5), (3, 6)]
    assert manager.get_block_ids("r") == [4, 5, 6] and manager.num_free_swap_blocks == 5
    manager.check_integrity()
    manager.free(request)
    assert manager.num_free_blocks == manager.num_usable_blocks
    manager.check_integrity()


def test_swapping_out_a_forked_sequence_copies_shared_blocks_and_keeps_them_for_the_sibling() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, num_swap_blocks=8)
    parent = _computed(manager, "p", list(range(6)))
    child = _fork(manager, parent, "p#1")
    assert manager.swap_out(child) == [(1, 1), (2, 2)]
    assert manager.get_ref_counts("p") == [1, 1]
    manager.check_integrity()
    manager.free(child)                                            # aborted while swapped out
    assert manager.num_free_swap_blocks == manager.num_usable_swap_blocks
    manager.check_integrity()


def test_swap_out_needs_room_in_the_swap_pool() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, num_swap_blocks=3)     # 2 usable swap blocks
    request = _computed(manager, "r", list(range(9)))
    assert not manager.can_swap_out(request)
    assert not KVCacheManager(8, BLOCK_SIZE).can_swap_out(request)  # no swap pool at all
