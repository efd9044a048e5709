"""KV cache residency (vLLM's --kv-cache-metrics): a sampled block's life from its allocation to its memory's reuse,
its reads by prefix-cache hits, on a clock the test turns."""

from __future__ import annotations

import pytest

from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.kv_cache.residency import ResidencyTracker
from pagedllm.metrics.stats import BlockResidency
from tests.core.kv_cache.test_manager import _request, _start


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_block_lives_from_its_allocation_to_its_reuse_and_counts_its_reads() -> None:
    clock = Clock()
    manager = KVCacheManager(4, 4, residency=ResidencyTracker(1.0, clock=clock))    # three usable blocks
    _start(manager, a := _request("a", list(range(9))))         # at 100: blocks 1, 2 (full: cached) and 3
    manager.free(a)                                             # free queue: 3, 2, 1
    for clock.now in (101.0, 101.5):    # prefix hits on block 1, each taking the free queue's head for its tail
        _start(manager, hit := _request(f"hit{clock.now}", list(range(6))))
        manager.free(hit)
    ended = manager.take_residencies()  # blocks 3 and 2 reused, neither ever read
    assert ended == [BlockResidency(1.0, 1.0), BlockResidency(1.5, 1.5)] and manager.take_residencies() == []
    clock.now = 103.5
    _start(manager, _request("b", list(range(100, 109))))      # all three: 3 (since 101), 2 (since 101.5), 1
    assert manager.take_residencies() == [BlockResidency(2.5, 2.5), BlockResidency(2.0, 2.0),
                                          BlockResidency(3.5, 2.0, (0.5,))]    # 1: read at 101 and 101.5


def test_only_a_sample_is_followed_and_a_reset_forgets() -> None:
    tracker = ResidencyTracker(0.25, seed=3, clock=Clock())
    for _ in range(2):
        for block_id in range(2000):
            tracker.allocated(block_id)
    assert 350 < len(tracker.take_ended()) < 650         # a quarter of 2,000 lives ended by their second allocation
    tracker.reset()
    assert tracker.take_ended() == []
    for rate in (0.0, 1.5):
        with pytest.raises(ValueError, match="kv_cache_metrics_sample"):
            ResidencyTracker(rate)
