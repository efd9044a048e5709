"""KV cache residency (vLLM's `--kv-cache-metrics`): how a sample of the pool's blocks live.

A sampled block's life runs from its allocation until the pool hands its memory out again; on the way, every
reference a prefix-cache hit (or a fork) takes to it is a read. When the life ends, it becomes a `BlockResidency`:
its lifetime, how long it sat unread before the end, and the gaps between its last few reads. Long idle times with
short reuse gaps say the pool evicts blocks that would have been read again (it is too small for the traffic);
lifetimes near the requests' own say cached blocks are rarely read at all. Only `sample_rate` of the allocations are
followed, so the cost is a dictionary lookup on each allocation and read.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable

from pagedllm.metrics.stats import BlockResidency

_READS_KEPT = 4     # the reads whose gaps a life reports (vLLM's)


class _Life:
    __slots__ = ("born", "last_read", "reads")

    def __init__(self, now: float) -> None:
        self.born = self.last_read = now
        self.reads: deque[float] = deque(maxlen=_READS_KEPT)


class ResidencyTracker:
    """The lives of a sample of the pool's blocks, by block id (`BlockPool` reports allocations and reads).

    Args:
        sample_rate: the fraction of allocations followed, in (0, 1].
        seed: the sampling's random seed.
        clock: seconds, monotonic (tests give their own).
    """

    def __init__(self, sample_rate: float, seed: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"kv_cache_metrics_sample must be in (0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self._random = random.Random(seed)
        self._clock = clock
        self._lives: dict[int, _Life] = {}
        self._ended: list[BlockResidency] = []

    def allocated(self, block_id: int) -> None:
        """The block's memory was handed out: its last life (if followed) ends, a new one starts (if sampled)."""
        now = self._clock()
        life = self._lives.pop(block_id, None)
        if life is not None:
            reads = list(life.reads)
            self._ended.append(BlockResidency(now - life.born, now - life.last_read,
                                              tuple(b - a for a, b in zip(reads, reads[1:]))))
        if self._random.random() < self.sample_rate:
            self._lives[block_id] = _Life(now)

    def read(self, block_id: int) -> None:
        """A reference was taken to the block (a prefix-cache hit, a fork)."""
        life = self._lives.get(block_id)
        if life is not None:
            life.last_read = self._clock()
            life.reads.append(life.last_read)

    def take_ended(self) -> list[BlockResidency]:
        """The lives ended since the last call."""
        ended, self._ended = self._ended, []
        return ended

    def reset(self) -> None:
        """Forget every life (the prefix cache was reset: the blocks' contents no longer matter)."""
        self._lives.clear()
        self._ended.clear()
