"""Which data-parallel replica runs a request: prefix-aware (SGLang's "cache-aware" policy) or round robin.

Each replica has its own KV pool, so a prompt's prefix-cache hits come only from the replica that ran its prefix
before. The prefix-aware router remembers, for the full blocks of the prompts it routed, which replicas got them,
and sends a prompt to the replica holding the longest chain of its leading blocks, if that chain is at least
`cache_threshold` of the prompt's full blocks:

```
block hashes (the prefix cache's own chain, cache_salt in block 0):
  prompt A:  h0 h1 h2 h3          -> no replica knows h0: the least loaded one, say 1; remember h0..h3 -> {1}
  prompt B:  h0 h1 h2 h7 h8       -> replica 1 holds h0 h1 h2 (3 blocks): replica 1; h7 h8 -> {1}
  prompt C:  h9 ...               -> nobody: the least loaded replica
  prompt D:  h0 h5 h6 h10 h11 h12 -> 1 block of 6 on replica 1: too little, the least loaded replica
```
The map is bounded (least recently used hashes go first) and is the router's belief, not the pools' state: a
replica may have evicted a block since. When the replica holding the prefix has more than `balance_threshold`
unfinished requests beyond the least loaded one, the least loaded one gets the request anyway, so that one hot
prefix cannot pile every request onto one replica. Among equally loaded replicas the turn goes round robin.
Pure Python, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from pagedllm.config import DataParallelRouterPolicy
from pagedllm.core.kv_cache.hashing import BlockHash, extend_block_hashes, request_extra_keys


class DataParallelRouter:
    """Chooses a replica for each request.

    Args:
        num_replicas: how many replicas there are (>= 1).
        block_size: tokens per KV block, as the replicas' prefix caches hash them.
        policy: "prefix_aware" (the default) or "round_robin" (the comparison).
        max_blocks: most block hashes remembered (least recently used forgotten first); about what the replicas'
            pools hold together.
        balance_threshold: how many more unfinished requests than the least loaded replica the prefix's holder may
            have and still get the request.
        cache_threshold: the least share of the prompt's full blocks that must match for the holder to get the
            request (SGLang's `cache_threshold`); below it the request balances like an unrelated one. Chat
            prompts share their template's first block or two, which is no reason to pile them on one replica.
    """

    def __init__(self, num_replicas: int, block_size: int, policy: DataParallelRouterPolicy = "prefix_aware",
                 max_blocks: int = 65536, balance_threshold: int = 16, cache_threshold: float = 0.5) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if policy not in ("prefix_aware", "round_robin"):
            raise ValueError(f"data_parallel_router must be 'prefix_aware' or 'round_robin', got {policy!r}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.num_replicas, self.block_size, self.policy = num_replicas, block_size, policy
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.max_blocks, self.balance_threshold, self.cache_threshold = max_blocks, balance_threshold, cache_threshold
        self._holders: OrderedDict[BlockHash, set[int]] = OrderedDict()  # oldest first
        self._next = 0  # round robin's turn, and the first in line when loads tie

    @property
    def num_blocks_known(self) -> int:
        return len(self._holders)

    def route(self, prompt_token_ids: Sequence[int], cache_salt: str | None, loads: Sequence[int]) -> int:
        """The replica for a prompt, given each replica's unfinished requests (`loads`); remembers the choice."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"loads has {len(loads)} entries for {self.num_replicas} replicas")
        if self.policy == "round_robin":
            replica, self._next = self._next, (self._next + 1) % self.num_replicas
            return replica
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, prompt_token_ids, self.block_size, request_extra_keys(cache_salt))
        replica = self._choose(hashes, loads)
        self._remember(hashes, replica)
        return replica

    def matched_blocks(self, block_hashes: Sequence[BlockHash]) -> tuple[int, set[int]]:
        """How many leading blocks some replica holds, and which replicas hold all of them (every replica for 0)."""
        candidates = set(range(self.num_replicas))
        num_matched = 0
        for block_hash in block_hashes:
            holders = self._holders.get(block_hash, set()) & candidates
            if not holders:
                break
            candidates, num_matched = holders, num_matched + 1
        return num_matched, candidates

    def forget(self) -> None:
        """Forget every block (the replicas' prefix caches were reset)."""
        self._holders.clear()

    def _choose(self, block_hashes: list[BlockHash], loads: Sequence[int]) -> int:
        least_loaded = self._least_loaded(range(self.num_replicas), loads)
        num_matched, holders = self.matched_blocks(block_hashes)
        if num_matched == 0 or num_matched < self.cache_threshold * len(block_hashes):
            return least_loaded
        best = self._least_loaded(holders, loads)
        return best if loads[best] - loads[least_loaded] <= self.balance_threshold else least_loaded

    def _least_loaded(self, replicas: Iterable[int], loads: Sequence[int]) -> int:
        """The least loaded replica; ties go round robin, so that an idle server spreads new prefixes too."""
        start = self._next
        chosen = min(replicas, key=lambda r: (loads[r], (r - start) % self.num_replicas))
        self._next = (chosen + 1) % self.num_replicas
        return chosen

    def _remember(self, block_hashes: list[BlockHash], replica: int) -> None:
        for block_hash in block_hashes:
            holders = self._holders.pop(block_hash, None) or set()
            holders.add(replica)
            self._holders[block_hash] = holders     # now the most recently used
        while len(self._holders) > self.max_blocks:
            self._holders.popitem(last=False)
