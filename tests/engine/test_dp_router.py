"""The data-parallel router (pure Python): shared prefixes go where they were sent before, unrelated prompts
balance, cache_salt separates, and the map of remembered blocks stays within its bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.kv_cache.hashing import extend_block_hashes
from pagedllm.engine.dp_router import DataParallelRouter

BLOCK = 4


def _prompt(head: int, num_blocks: int, tail: list[int] = ()) -> list[int]:
    """`num_blocks` full blocks of tokens that depend on `head`, then `tail`."""
    return [head * 1000 + i for i in range(num_blocks * BLOCK)] + list(tail)


def test_shared_prefix_goes_to_the_replica_that_got_it_first():
    router = DataParallelRouter(2, BLOCK)
    loads = [0, 0]
    first = router.route(_prompt(1, 3, [7]), None, loads)
    loads[first] += 1
    other = router.route(_prompt(2, 3), None, loads)            # unrelated: the least loaded replica
    assert other != first
    loads[other] += 1
    for tail in ([8], [9, 9], [5, 6, 7, 8, 9]):                 # same three blocks, other questions
        assert router.route(_prompt(1, 3, tail), None, loads) == first
    assert router.route(_prompt(2, 3, [1]), None, loads) == other


def test_longest_matching_chain_wins():
    router = DataParallelRouter(3, BLOCK)
    assert router.route(_prompt(1, 1), None, [0, 0, 0]) == 0
    assert router.route(_prompt(1, 3), None, [100, 0, 0]) == 1     # replica 0 far too busy: block 0 on both now
    assert router.route(_prompt(1, 3, [5]), None, [0, 5, 0]) == 1  # 3 blocks on replica 1, 1 on replica 0
    assert router.route(_prompt(1, 1, [5]), None, [0, 5, 0]) == 0  # 1 block on both: the less loaded


def test_unrelated_prompts_balance_on_load():
    router = DataParallelRouter(3, BLOCK)
    assert [router.route(_prompt(i, 2), None, loads) for i, loads in
            enumerate([[0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1], [2, 1, 1]])] == [0, 1, 2, 0, 1]


def test_a_holder_far_busier_than_the_least_loaded_replica_is_passed_over():
    router = DataParallelRouter(2, BLOCK, balance_threshold=3)
    assert router.route(_prompt(1, 2), None, [0, 0]) == 0
    assert router.route(_prompt(1, 2, [1]), None, [3, 0]) == 0       # 3 more: still within the threshold
    assert router.route(_prompt(1, 2, [2]), None, [4, 0]) == 1       # 4 more: the least loaded one
    # Now both hold the prefix: the less loaded of the two.
    assert router.route(_prompt(1, 2, [3]), None, [2, 1]) == 1
    assert router.route(_prompt(1, 2, [4]), None, [1, 2]) == 0


def test_cache_salt_separates_tenants():
    router = DataParallelRouter(2, BLOCK)
    assert router.route(_prompt(1, 2), "tenant-a", [0, 0]) == 0
    # The same tokens under another salt (or none) are other blocks: they balance like unrelated prompts.
    assert router.route(_prompt(1, 2), "tenant-b", [1, 0]) == 1
    assert router.route(_prompt(1, 2), None, [1, 1]) == 0
    assert router.route(_prompt(1, 2, [3]), "tenant-b", [0, 0]) == 1      # tenant b's own replica
    hashes: list = []
    extend_block_hashes(hashes, _prompt(1, 2), BLOCK, ("tenant-a",))
    assert router.matched_blocks(hashes) == (2, {0})


def test_round_robin_ignores_prefixes_and_loads():
    router = DataParallelRouter(3, BLOCK, policy="round_robin")
    assert [router.route(_prompt(1, 2), None, [9, 0, 0]) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert router.num_blocks_known == 0


def test_forget_clears_the_map():
    router = DataParallelRouter(2, BLOCK)
    router.route(_prompt(1, 2), None, [0, 0])
    router.forget()
    assert router.num_blocks_known == 0
    assert router.route(_prompt(1, 2), None, [1, 0]) == 1


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_replicas=0), "num_replicas"), (dict(policy="random"), "data_parallel_router"),
    (dict(max_blocks=0), "max_blocks"), (dict(cache_threshold=1.5), "cache_threshold")])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DataParallelRouter(**({"num_replicas": 2, "block_size": BLOCK} | kwargs))


def test_loads_must_cover_every_replica():
    with pytest.raises(ValueError, match="loads"):
        DataParallelRouter(2, BLOCK).route([1, 2, 3, 4], None, [0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4), st.lists(st.integers(0, 3), max_size=3)),
                min_size=1, max_size=40),
       st.integers(1, 12))
def test_the_lru_bound_holds_and_the_newest_prefix_is_remembered(requests, max_blocks):
    """Any sequence of prompts: the map never exceeds max_blocks, every route is a valid replica, and right after
    a prompt is routed its own last blocks (up to the bound) are matched to the replica it went to."""
    router = DataParallelRouter(3, BLOCK, max_blocks=max_blocks, balance_threshold=1_000)
    loads = [0, 0, 0]
    for head, num_blocks, tail in requests:
        prompt = _prompt(head, num_blocks, tail)
        replica = router.route(prompt, None, loads)
        assert 0 <= replica < 3
        loads[replica] += 1
        assert router.num_blocks_known <= max_blocks
        hashes: list = []
        extend_block_hashes(hashes, prompt, BLOCK, ())
        if hashes and len(hashes) <= max_blocks:
            num_matched, holders = router.matched_blocks(hashes)
            assert num_matched == len(hashes) and replica in holders


def test_a_short_common_head_does_not_pull_a_prompt_to_its_holder():
    """Chat prompts share their template's first block: below cache_threshold of the prompt's blocks, a match
    counts for nothing and the request balances."""
    router = DataParallelRouter(2, BLOCK)
    head = _prompt(9, 1)
    assert router.route(head + _prompt(1, 3), None, [0, 0]) == 0
    assert router.route(head + _prompt(2, 3), None, [1, 0]) == 1          # 1 block of 4 matched: balance
    assert router.route(head + _prompt(1, 3, [5]), None, [1, 1]) == 0     # 4 of 4 on replica 0
    assert router.route(head + _prompt(1, 1), None, [5, 0]) == 0          # 2 of 2: replica 0, within the threshold
    strict = DataParallelRouter(2, BLOCK, cache_threshold=1.0)
    strict.route(_prompt(1, 2), None, [0, 0])
    assert strict.route(_prompt(1, 2) + _prompt(3, 1), None, [1, 0]) == 1  # 2 of 3 is not all
