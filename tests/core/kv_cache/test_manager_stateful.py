"""Random allocate / decode / free / evict / reset sequences against the manager's invariants.

A model of the KV contents rides along: for each block, the token prefix whose K/V it holds. A prefix hit must
return blocks whose recorded prefix equals the request's, so a wrong hit is caught, not just a broken count.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 12

# A tiny alphabet and shared starts make prefix hits frequent.
tokens_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=24)


class ManagerMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.contents: dict[int, tuple[int, ...]] = {}  # block id -> token prefix whose K/V it holds
        self.live: dict[str, Request] = {}
        self.next_id = 0

    def _snapshot(self) -> tuple[list[int], list[int]]:
        return self.manager.pool.free_block_ids(), [b.ref_cnt for b in self.manager.pool.blocks]

    def _compute(self, request: Request, num_new_tokens: int) -> None:
        """Play the runner: write the new tokens' K/V, then advance the counter and cache full blocks."""
        table = self.manager.get_block_ids(request.request_id)
        end = request.num_computed_tokens + num_new_tokens
        for pos in range(request.num_computed_tokens, end):
            self.contents[table[pos // BLOCK_SIZE]] = tuple(request.all_token_ids[:pos + 1])
        request.num_computed_tokens = end
        self.manager.cache_full_blocks(request)

    @rule(target=requests, tokens=tokens_strategy, salt=st.sampled_from([None, "s"]))
    def start(self, tokens: list[int], salt: str | None) -> str:
        request = Request(f"r{self.next_id}", tokens, SamplingParams(), cache_salt=salt)
        self.next_id += 1
        computed = self.manager.get_computed_blocks(request)
        for index, block in enumerate(computed.blocks):
            prefix = tuple(tokens[:(index + 1) * BLOCK_SIZE])
            assert self.contents.get(block.block_id) == prefix, "prefix hit on a block with other content"
        assert computed.num_computed_tokens < request.num_tokens
        before = self._snapshot()
        num_new = request.num_tokens - computed.num_computed_tokens
        if self.manager.allocate_slots(request, num_new, computed) is None:
            assert self._snapshot() == before
            return request.request_id
        request.num_computed_tokens = computed.num_computed_tokens
        self.live[request.request_id] = request
        self._compute(request, num_new)
        return request.request_id

    @rule(request_id=requests, token=st.integers(0, 2))
    def decode(self, request_id: str, token: int) -> None:
        request = self.live.get(request_id)
        if request is None:
            return
        before = self._snapshot()
        if self.manager.allocate_slots(request, 1) is None:  # room for the token about to be appended
            assert self._snapshot() == before
            return
        request.append_output_token_ids(token)
        self._compute(request, 1)

    @rule(request_id=consumes(requests))
    def free(self, request_id: str) -> None:
        request = self.live.pop(request_id, None)
        if request is not None:
            self.manager.free(request)
            assert self.manager.get_block_ids(request_id) == []

    @rule()
    def reset(self) -> None:
        assert self.manager.reset_prefix_cache() == (not self.live)

    @invariant()
    def integrity(self) -> None:
        self.manager.check_integrity()
        used = {i for r in self.live.values() for i in self.manager.get_block_ids(r.request_id)}
        assert self.manager.num_free_blocks == NUM_BLOCKS - 1 - len(used)
        for request in self.live.values():
            assert len(self.manager.get_block_ids(request.request_id)) == -(-request.num_tokens // BLOCK_SIZE)


ManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestManagerMachine = ManagerMachine.TestCase
