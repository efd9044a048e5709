"""Random allocate / decode / fork / swap / free / evict / reset sequences against the manager's invariants.

A model of the KV contents rides along: for each block (of both pools), the token prefix whose K/V it holds;
copy-on-write copies and swaps move it as the runner would. A prefix hit must return blocks whose recorded
prefix equals the request's, and every live request's blocks must hold its own tokens, so a wrong hit, a
missed copy or a lost swap is caught, not just a broken count. The same machine runs with a sliding window, where
each request's blocks wholly behind its window must be freed, and every block a query may still read kept.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 12
NUM_SWAP_BLOCKS = 8

# A tiny alphabet and shared starts make prefix hits frequent.
tokens_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=24)


class ManagerMachine(RuleBasedStateMachine):
    requests = Bundle("requests")
    WINDOW = 0

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, num_swap_blocks=NUM_SWAP_BLOCKS, window=self.WINDOW)
        self.contents: dict[int, tuple[int, ...]] = {}  # block id -> token prefix whose K/V it holds
        self.swap_contents: dict[int, tuple[int, ...]] = {}
        self.live: dict[str, Request] = {}
        self.swapped: set[str] = set()
        self.next_id = 0

    def _snapshot(self) -> tuple[list[int], list[int]] | None:
        """The pool's state, which a failed allocation leaves as it was (None with a window: it frees what fell
        behind the window in any case)."""
        if self.WINDOW:
            return None
        return self.manager.pool.free_block_ids(), [b.ref_cnt for b in self.manager.pool.blocks]

    def _num_behind(self, num_computed: int) -> int:
        """The blocks wholly behind the window of a query at position `num_computed`: no query reads them again."""
        return max(0, num_computed - self.WINDOW + 1) // BLOCK_SIZE if self.WINDOW else 0

    def _compute(self, request: Request, num_new_tokens: int) -> None:
        """Play the runner: apply the copies, write the new tokens' K/V, advance the counter, cache full blocks."""
        for src, dst in self.manager.take_blocks_to_copy():
            self.contents[dst] = self.contents[src]
        table = self.manager.get_block_ids(request.request_id)
        end = request.num_computed_tokens + num_new_tokens
        assert table[:self._num_behind(request.num_computed_tokens)] == [0] * self._num_behind(
            request.num_computed_tokens), "a block behind the window kept"
        for pos in range(request.num_computed_tokens, end):
            assert table[pos // BLOCK_SIZE] != 0, "a write into the null block"
            self.contents[table[pos // BLOCK_SIZE]] = tuple(request.all_token_ids[:pos + 1])
        request.num_computed_tokens = end
        self.manager.cache_full_blocks(request)

    @rule(target=requests, tokens=tokens_strategy, salt=st.sampled_from([None, "s"]))
    def start(self, tokens: list[int], salt: str | None) -> str:
        request = Request(f"r{self.next_id}", tokens, SamplingParams(), cache_salt=salt)
        self.next_id += 1
        computed = self.manager.get_computed_blocks(request)
        behind = self._num_behind(computed.num_computed_tokens)
        for index, block in enumerate(computed.blocks):
            if block.block_id == 0:     # behind the window of the hit's next token: it reads none of its keys
                assert index < behind, "a null block in a hit where its next token's window reads"
                continue
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
        if request is None or request_id in self.swapped:
            return
        before = self._snapshot()
        if self.manager.allocate_slots(request, 1) is None:  # room for the token about to be appended
            assert self._snapshot() == before
            return
        request.append_output_token_ids(token)
        self._compute(request, 1)

    @rule(target=requests, request_id=requests)
    def fork(self, request_id: str):
        parent = self.live.get(request_id)
        if parent is None or request_id in self.swapped:
            return multiple()
        child = parent.fork(f"r{self.next_id}", index=1)
        self.next_id += 1
        self.manager.fork(parent, child)
        self.live[child.request_id] = child
        return child.request_id

    @rule(request_id=requests)
    def swap_out(self, request_id: str) -> None:
        request = self.live.get(request_id)
        if request is None or request_id in self.swapped or not self.manager.can_swap_out(request):
            return
        for device, swap in self.manager.swap_out(request):
            self.swap_contents[swap] = self.contents[device]
        self.swapped.add(request_id)

    @rule(request_id=requests)
    def swap_in(self, request_id: str) -> None:
        request = self.live.get(request_id)
        if request is None or request_id not in self.swapped or not self.manager.can_swap_in(request, 1):
            return
        for swap, device in self.manager.swap_in(request):
            self.contents[device] = self.swap_contents[swap]
        self.swapped.discard(request_id)

    @rule(request_id=consumes(requests))
    def free(self, request_id: str) -> None:
        request = self.live.pop(request_id, None)
        if request is not None:
            self.manager.free(request)
            self.swapped.discard(request_id)
            assert self.manager.get_block_ids(request_id) == [] == self.manager.get_swapped_block_ids(request_id)

    @rule()
    def reset(self) -> None:
        # Swapped-out requests hold no device block: they do not stand in the way.
        assert self.manager.reset_prefix_cache() == (not self.live.keys() - self.swapped)

    @invariant()
    def integrity(self) -> None:
        self.manager.check_integrity()
        used = {i for r in self.live.values() for i in self.manager.get_block_ids(r.request_id)} - {0}
        assert self.manager.num_free_blocks == NUM_BLOCKS - 1 - len(used)
        for request in self.live.values():
            request_id = request.request_id
            if request_id in self.swapped:
                table, contents = self.manager.get_swapped_block_ids(request_id), self.swap_contents
                assert len(table) == -(-request.num_computed_tokens // BLOCK_SIZE)
            else:
                table, contents = self.manager.get_block_ids(request_id), self.contents
                assert len(table) == -(-request.num_tokens // BLOCK_SIZE)
            num_computed = request.num_computed_tokens
            # those behind the window, freed at the latest allocation: never one whose keys a query still reads
            behind = [i for i, block_id in enumerate(table) if block_id == 0]
            assert behind == list(range(len(behind))) and len(behind) <= self._num_behind(num_computed)
            for index, block_id in enumerate(table[len(behind):-(-num_computed // BLOCK_SIZE)], len(behind)):
                end = min((index + 1) * BLOCK_SIZE, request.num_computed_tokens)
                assert contents[block_id][:end] == tuple(request.all_token_ids[:end]), "a block lost its K/V"


class WindowMachine(ManagerMachine):
    WINDOW = 6


ManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
WindowMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestManagerMachine = ManagerMachine.TestCase
TestWindowMachine = WindowMachine.TestCase
